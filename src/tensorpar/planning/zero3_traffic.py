"""ZeRO-3's traffic: the units `tensorpar.data_parallel.FullyShardedOptimizer` gathers (the stage's root and each
block, padded to a multiple of the shards) and the collectives it runs on them in a step; with LoRA, the frozen
base's units beside the trained ones."""

from __future__ import annotations

import math
from collections import Counter

from tensorpar.planning.collective_cost import Collective
from tensorpar.planning.params import is_expert


# id(params) -> (params, its units): a search asks again and again for the units of the same parameter lists (those
# `layout_parameters` caches, never changed); holding a list keeps its id from being reused while its entry stands.
_UNITS: dict[int, tuple[list, tuple]] = {}


def block_units(params: list[tuple[str, int, int]]) -> tuple[int, list[int], list[int]]:
    """(the root's elements, each block's dense elements, each block's routed experts' elements) of a stage's
    (name, numel, ndim) parameters, the blocks (`layers.N.`: the decoder layers, then the MTP modules) in order: what
    `FullyShardedOptimizer` gathers as one unit each, a block's routed experts a unit of their own beside it. The
    lists returned are shared: not to be changed."""
    hit = _UNITS.get(id(params))
    if hit is None or hit[0] is not params:
        if len(_UNITS) >= 512:
            _UNITS.clear()
        hit = _UNITS[id(params)] = (params, _block_units(params))
    return hit[1]


def _block_units(params: list[tuple[str, int, int]]) -> tuple[int, list[int], list[int]]:
    root, blocks = 0, {}
    for name, n, _ in params:
        if name.startswith("layers."):
            blocks.setdefault(int(name.split(".")[1]), [0, 0])[is_expert(name)] += n
        else:
            root += n
    order = sorted(blocks)
    return root, [blocks[b][0] for b in order], [blocks[b][1] for b in order]


def zero3_units(params: list[tuple[str, int, int]], dp: int) -> tuple[int, dict[int, int], int]:
    """ZeRO-3's gather units of a stage's (name, numel, ndim) parameters, each padded to a multiple of dp:
    (elements of the root unit, {elements of a block unit: how many blocks}, elements of the last block)."""
    root, dense, experts = block_units(params)
    blocks = [math.ceil((d + e) / dp) * dp for d, e in zip(dense, experts)]
    return math.ceil(root / dp) * dp, dict(Counter(blocks)), blocks[-1] if blocks else 0


def zero3_traffic(root: int, layers: dict[int, int], last: int, grads: str, m: int, grad_bytes: int,
                  param_bytes: int, reshard_after_forward: bool) -> list[Collective]:
    """FullyShardedOptimizer's collectives over `grads` for the units `zero3_units` returns: the root gathered and
    its gradient reduce-scattered once per step, each block gathered in every micro-batch's forward (and again in
    its backward when resharded after the forward, but for the last block) and its gradient reduce-scattered. No
    root unit (LoRA's adapters are all in the blocks): none of its collectives."""
    out = [Collective("all_gather", grads, root * param_bytes, 1, "forward", "ZeRO-3 root gather"),
           Collective("reduce_scatter", grads, root * grad_bytes, 1, "step", "ZeRO-3 root gradients")] if root else []
    for n, k in layers.items():
        out.append(Collective("all_gather", grads, n * param_bytes, k * m, "forward", "ZeRO-3 block gathers"))
        again = (k - (n == last)) * m if reshard_after_forward else 0  # the last block is kept
        if again:
            out.append(Collective("all_gather", grads, n * param_bytes, again, "backward",
                                  "ZeRO-3 block gathers for the backward"))
        out.append(Collective("reduce_scatter", grads, n * grad_bytes, k * m, "backward", "ZeRO-3 block gradients"))
    return out


def frozen_zero3_traffic(frozen: list[tuple[str, int, int]], shards: int, grads: str, m: int, param_bytes: int,
                         reshard_after_forward: bool) -> list[Collective]:
    """The gathers of the frozen parameters' units (LoRA's base), never reduced: the root's once, each block's as a
    trained block's (`zero3_traffic`), but the first block's kept from one micro-batch's backward to the next one's
    forward (a block's frozen unit is freed when the backward leaves the block before it, which the first has not)."""
    root, layers, last = zero3_units(frozen, shards)
    first = _first_block(frozen, shards)
    out = [Collective("all_gather", grads, root * param_bytes, 1, "forward", "ZeRO-3 frozen root gather")]
    out = out if root else []
    for n, k in layers.items():
        calls = k * m - (m - 1 if n == first else 0)
        out.append(Collective("all_gather", grads, n * param_bytes, calls, "forward", "ZeRO-3 frozen block gathers"))
        again = (k - (n == last)) * m if reshard_after_forward else 0
        if again:
            out.append(Collective("all_gather", grads, n * param_bytes, again, "backward",
                                  "ZeRO-3 frozen block gathers for the backward"))
    return out


def _first_block(params: list[tuple[str, int, int]], shards: int) -> int:
    """Elements of the stage's first block's unit (padded to `shards`), 0 without blocks."""
    blocks = [name.split(".")[1] for name, _, _ in params if name.startswith("layers.")]
    if not blocks:
        return 0
    n = sum(numel for name, numel, _ in params if name.startswith(f"layers.{blocks[0]}."))
    return math.ceil(n / shards) * shards
