"""Dropout whose masks are a pure function of a seed, so that they are reproducible and recomputable.

Every dropout call site derives its own seed from (the micro-batch's dropout seed, layer, site,
shard). Outside tensor-parallel regions the activations are replicated on the TP ranks and the
shard is the same everywhere, so the masks agree; inside TP regions (attention heads), and on
sequence shards under sequence parallelism, the TP rank is part of the seed, so masks differ.
Activation recomputation replays the same call with the same seed and gets the same mask,
without having to save and restore RNG states.
"""

from __future__ import annotations

import numpy as np
import torch


def mix_seed(*parts: int) -> int:
    """A 63-bit seed from non-negative integers (a hash; changing any part changes the result)."""
    state = np.random.SeedSequence([int(p) & 0xFFFFFFFFFFFFFFFF for p in parts]).generate_state(2, np.uint32)
    return int((int(state[0]) << 31) ^ int(state[1])) & (2**63 - 1)


def seeded_dropout(x: torch.Tensor, p: float, seed: int | None, training: bool) -> torch.Tensor:
    """Inverted dropout with a mask drawn from a generator seeded by `seed`."""
    if not training or p == 0.0:
        return x
    if seed is None:
        raise ValueError("dropout is on but no dropout seed was given to the forward pass")
    generator = torch.Generator(device=x.device).manual_seed(seed)
    keep = torch.empty(x.shape, device=x.device, dtype=torch.float32).uniform_(generator=generator) >= p
    return x * keep.to(x.dtype) / (1.0 - p)


def fork_rng_seeded(seed: int, device: torch.device):
    """A context in which torch's global RNG (for `device`) is seeded with `seed`, restored afterwards.

    For ops that only draw from the global RNG, such as scaled_dot_product_attention's dropout.
    """
    devices = [device] if device.type == "cuda" else []

    class _Ctx:
        def __enter__(self):
            self._fork = torch.random.fork_rng(devices=devices)
            self._fork.__enter__()
            torch.manual_seed(seed)

        def __exit__(self, *exc):
            return self._fork.__exit__(*exc)

    return _Ctx()
