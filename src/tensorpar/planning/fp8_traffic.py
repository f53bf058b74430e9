"""The collectives tensorpar's fp8 GEMMs add to a training step, for `communication.step_collectives`.

- TP (`tensorpar.tensor_parallel.fp8_linear`): the amaxes a TP split cuts, all-reduced (max) in fp32 once per
  GEMM group: tensorwise, the column-parallel weights' amaxes in the forward and the output gradients' in the
  backward, the row-parallel input's and weight's in the forward; rowwise, the row-parallel input's per token and
  weight's per output feature in the forward, the column-parallel output gradients' per token and weights' per
  input feature in the backward. Full recomputation repeats the forward ones.
- ZeRO-3 (`tensorpar.data_parallel.fully_sharded`, tensorwise only): each block's column/row-parallel weights are
  a unit of their own, gathered in fp8 (1 byte per element) after one all-reduce (max) of their amaxes over the
  shards and one over TP; the block's other parameters stay a unit gathered in the parameters' dtype. LoRA's
  frozen base is gathered in the parameters' dtype too (only trained weights are fp8 units).

And what they change in a layer's saved inputs, for `memory.tensorpar_layer_activations` (`fp8_input_bytes`).
"""

from __future__ import annotations

import math
from collections import defaultdict

from tensorpar.planning.collective_cost import Collective
from tensorpar.planning.params import is_expert

AMAXES = "fp8 amaxes"
# The backward's all-reduces of the attention's and the MLP's column-parallel GEMMs (q/k/v, gate/up): an entry
# that computes no gradient (LoRA's first layer, `lora_traffic.first_layer_input_gradients`) runs none.
ENTRY_GRADIENT_AMAXES = ("fp8 amaxes (attention entry gradients)", "fp8 amaxes (MLP entry gradients)")

FP8_GEMM_WEIGHTS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight",
                    "up_proj.weight", "down_proj.weight")


def is_fp8_gathered(name: str) -> bool:
    """Whether ZeRO-3 gathers this parameter in fp8 (a block's column/row-parallel weight; not a routed expert's)."""
    return name.startswith("layers.") and name.endswith(FP8_GEMM_WEIGHTS) and not is_expert(name)


def fp8_tp_collectives(cfg, layout, b: int, s: int, n_layers: int, recipe: str) -> list[Collective]:
    """One micro-batch's fp8 amax all-reduces over TP for `n_layers` layers (b sequences of s tokens each)."""
    if layout.tp == 1 or not recipe or n_layers == 0:
        return []
    rows, h, n_up = b * s, cfg.hidden_size, 2 if cfg.gated_mlp else 1
    if recipe == "tensorwise":
        forward = [3, 2, n_up, 2]  # q/k/v's weights, o's input and weight, gate/up's weights, down's
        backward = [3, n_up]  # the column-parallel output gradients
    else:
        forward = [rows + h, rows + h]  # o and down: the input per token, the weight per output feature
        backward = [3 * (rows + h), n_up * (rows + h)]  # per token and per input feature
    full = layout.recompute == "full"
    counts: dict[tuple[int, str, str], int] = defaultdict(int)
    for n in forward:
        counts[(n, "forward", AMAXES)] += n_layers
        if full:
            counts[(n, "backward", AMAXES)] += n_layers
    for n, entry in zip(backward, ENTRY_GRADIENT_AMAXES):
        counts[(n, "backward", entry)] += n_layers
    return [Collective("all_reduce", "tp", 4 * n, calls, phase, what) for (n, phase, what), calls in counts.items()]


def fp8_units(params: list[tuple[str, int, int]], shards: int) -> list[tuple[int, int]]:
    """ZeRO-3's fp8 units of a stage's (name, numel, ndim) parameters, one per block in block order: (elements
    padded to a multiple of `shards`, how many weights)."""
    blocks: dict[str, list[int]] = {}
    for name, n, _ in params:
        if is_fp8_gathered(name):
            blocks.setdefault(name.split(".")[1], []).append(n)
    return [(math.ceil(sum(numels) / shards) * shards, len(numels)) for numels in blocks.values()]


def fp8_zero3_traffic(params: list[tuple[str, int, int]], layout, grads: str, m: int, grad_bytes: int,
                      reshard_after_forward: bool) -> list[Collective]:
    """The fp8 units' traffic over the step's `m` micro-batches: per block, its fp8 weights gathered in every
    forward (and again in the backward when resharded, but for the last block), each gather after the all-reduces
    of their amaxes, and their gradients reduce-scattered."""
    units = fp8_units(params, layout.shards)
    out = []
    for i, (padded, weights) in enumerate(units):
        gathers = m * (1 + (reshard_after_forward and i != len(units) - 1))
        out.append(Collective("all_gather", grads, padded, gathers, "forward", "ZeRO-3 fp8 block gathers"))
        out.append(Collective("all_reduce", grads, 4 * weights, gathers, "forward", "fp8 gather amaxes"))
        if layout.tp > 1:
            out.append(Collective("all_reduce", "tp", 4 * weights, gathers, "forward", "fp8 gather amaxes"))
        out.append(Collective("reduce_scatter", grads, padded * grad_bytes, m, "backward", "ZeRO-3 fp8 block "
                                                                                         "gradients"))
    return out


def fp8_input_bytes(cfg, fp8: str, recompute: str, b: int, s: int, t: int, moe: bool) -> int:
    """What tensorwise fp8 GEMMs change in a layer's saved inputs (bf16 parameters): the q/k/v, MLP-up and
    down-projection inputs are kept in fp8 in place of bf16 (1 byte less per element); the output projection's
    fp8 input is one byte more where the attention core keeps its bf16 output too (no recomputation), one less
    where it does not. Rowwise keeps the bf16 inputs (the weight gradient's GEMM runs in bf16): no change."""
    if fp8 != "tensorwise":
        return 0
    local = b * s * (cfg.num_heads // t) * cfg.head_dim
    out_proj = local if recompute == "none" else -local
    mlp = 0 if moe else b * s * cfg.hidden_size + b * s * (cfg.ffn_hidden_size // t)
    return out_proj - b * s * cfg.hidden_size - mlp
