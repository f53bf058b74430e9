"""The optimizer side of training: AdamW parameter groups, the LR schedule, the dense gradient norm
and clipping, fp16's loss scale."""

from tensorpar.optim.adamw import build_optimizer, takes_weight_decay
from tensorpar.optim.grad_norm import clip_grad_norm_, global_grad_norm
from tensorpar.optim.lr_schedule import lr_at, set_lr

__all__ = ["build_optimizer", "takes_weight_decay", "clip_grad_norm_", "global_grad_norm", "lr_at", "set_lr"]
