"""Dynamic loss scaling for fp16 training (Micikevicius et al. 2018; torch.amp.GradScaler's policy).

fp16 represents magnitudes down to ~6e-8 (subnormals) and up to 65504: small gradients underflow to zero.
The loss is multiplied by a scale S before the backward pass, so every gradient is S times larger; the
optimizer divides them by S again (in fp32) before clipping and stepping. When a gradient overflowed (an inf
or a nan anywhere in the model: the global gradient norm is not finite, and every rank sees the same norm),
the step is skipped and S halved; after `growth_interval` steps in a row without overflow, S doubles.
"""

from __future__ import annotations

import math


class DynamicLossScaler:
    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 1000, min_scale: float = 2.0**-14):
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.min_scale = growth_interval, min_scale
        self.good_steps = 0

    def update(self, grad_norm: float) -> bool:
        """After a step's gradients were unscaled: True if the step must be skipped (they overflowed)."""
        if not math.isfinite(grad_norm):
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.good_steps = 0
            return True
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0
        return False

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
