"""Training utilities: the dense-model gradient norm and clipping, AdamW groups, the LR schedule."""

from tensorpar.training.grad_norm import clip_grad_norm_, global_grad_norm
from tensorpar.training.optimizer import build_optimizer
from tensorpar.training.schedule import lr_at, set_lr

__all__ = ["global_grad_norm", "clip_grad_norm_", "build_optimizer", "lr_at", "set_lr"]
