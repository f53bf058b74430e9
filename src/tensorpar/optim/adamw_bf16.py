"""AdamW with its moments stored in bf16 (`--optimizer-state-dtype bf16`): half the state memory, fp32 weights.

Each step widens the moments to fp32, updates them and the fp32 (master) weights with torch's AdamW arithmetic
(decoupled weight decay, bias corrections, eps outside the square root), and stores them back rounded to nearest
(even). Rounding to nearest rather than stochastically: it is deterministic and elementwise, so every layout (TP,
ZeRO) rounds every element alike and the layouts keep reproducing one another; and with the betas tensorpar
trains with (0.9, 0.95) a step moves each moment by at least 5% of (g^2 - v) (10% of (g - m)), so only changes
below half a bf16 unit (2^-9 relative) are lost, where the moment already sits within ~8% of its target. With
beta2 = 0.999 the second moment would freeze on updates under 0.2% per step: stochastic rounding (Megatron's and
torchao's choice for bf16 *weights*) is then the remedy. The update itself uses the fp32 moments before rounding.
"""

from __future__ import annotations

import math

import torch


@torch.no_grad()
def adamw_bf16_states(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                      exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], *, beta1: float, beta2: float,
                      lr: float, weight_decay: float, eps: float) -> None:
    """One AdamW step of fp32 `params` whose moments `exp_avgs` / `exp_avg_sqs` are bf16 (updated in place, as are
    the `steps` counts)."""
    for p, g, m_low, v_low, step in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
        step += 1
        t = step.item()
        g = g.float()
        m, v = m_low.float(), v_low.float()
        p.mul_(1 - lr * weight_decay)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v.sqrt() / math.sqrt(1 - beta2**t)).add_(eps)
        p.addcdiv_(m, denom, value=-lr / (1 - beta1**t))
        m_low.copy_(m)
        v_low.copy_(v)
