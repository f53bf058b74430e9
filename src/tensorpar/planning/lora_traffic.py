"""LoRA's tensor-parallel collectives, for `tensorpar.planning.communication.model_collectives`.

The adapters (`tensorpar.tensor_parallel.lora`) add, per layer and micro-batch, T the micro-batch's tokens on this
CP rank, r the rank, n the adapters of a group of column-parallel linears sharing an input (q/k/v, gate/up):

=================  ===============================================  =============================================
adapters on        forward                                          backward
=================  ===============================================  =============================================
column (a group)   none / SP: all-gather [T, n r] (the entry)       all-reduce [T, n r] / SP: reduce-scatter
                                                                    [T, n r], and each A's gradient [r, h]
                                                                    all-reduced
row (o, down)      all-reduce [T, r] / SP: reduce-scatter [T, r]    none / SP: all-gather [T, r], and B's
                   (`region.reduce` of the down-projection)         gradient [h, r] all-reduced
=================  ===============================================  =============================================

the activations in the matmul dtype, the gradients in the gradient dtype; with KV heads replicated on several TP
ranks, a K or V adapter's B gradient is summed over the copies (one buffer with a slot per KV head, as the base
weight's). Full recomputation repeats each adapter's forward collective inside backward, and the base MLP's exit
before a down adapter (`recomputed_mlp_exit`).

The frozen base runs fewer collectives: no parameter's gradient is summed over TP (the norms', biases', replicated
K/V heads', the router's: `model_collectives` leaves them out, and `step_collectives` the tied embedding's
between the pipeline's ends), and on the first stage nothing before the first
layer needs a gradient (the embedding is frozen), so that layer's attention computes no input gradient (its
entry's backward collective does not run, nor its fp8 GEMMs' backward amax all-reduce), nor does its MLP unless the
attention has an adapter; under SP neither
row-parallel exit gathers its output gradient unless an adapter precedes it (`first_layer_input_gradients`).
"""

from __future__ import annotations

import dataclasses

from tensorpar.planning.collective_cost import Collective, add_collective
from tensorpar.planning.fp8_traffic import ENTRY_GRADIENT_AMAXES
from tensorpar.tensor_parallel.lora import LoraSpec

ATTENTION_COLUMNS, MLP_COLUMNS, ROWS = ("q", "k", "v"), ("gate", "up"), ("o", "down")


def adapted(cfg, lora: LoraSpec, names: tuple[str, ...]) -> list[str]:
    """The linears of `names` that carry an adapter (a plain MLP has no gate)."""
    return [t for t in names if t in lora.targets and (t != "gate" or cfg.gated_mlp)]


def adapter_collectives(cfg, layout, lora: LoraSpec, n_layers: int, tokens: int, mm: int,
                        grad_bytes: int) -> list[Collective]:
    """The TP collectives of the adapters of `n_layers` layers for one micro-batch of `tokens` tokens (the module
    docstring's table); full recomputation repeats the forward ones."""
    again = 1 if layout.recompute == "full" else 0
    out: list[Collective] = []
    for group in (ATTENTION_COLUMNS, MLP_COLUMNS):
        out += _column_adapters(cfg, layout, lora, adapted(cfg, lora, group), n_layers, tokens, mm, grad_bytes,
                                again)
    out += _row_adapters(cfg, layout, len(adapted(cfg, lora, ROWS)), n_layers, tokens, lora.rank, mm, grad_bytes,
                         again)
    return out


def _column_adapters(cfg, layout, lora: LoraSpec, names: list[str], n_layers: int, tokens: int, mm: int,
                     grad_bytes: int, again: int) -> list[Collective]:
    """One group of column adapters sharing an input: their r-wide down-projections entering the TP region
    together, A's gradients summed under SP (each rank saw its sequence shard), and the B gradients of adapters on
    replicated KV heads summed over the copies."""
    n, r, L = len(names), lora.rank, n_layers
    if not n:
        return []
    entered = tokens * n * r * mm
    out = []
    if layout.sequence_parallel:
        out.append(Collective("all_gather", "tp", entered, L, "forward", "LoRA down-projections (SP gather)"))
        add_collective(out, "all_gather", entered, again * L, "backward",
                       "recomputed LoRA down-projections (SP gather)")
        out.append(Collective("reduce_scatter", "tp", entered, L, "backward", "LoRA down-projection gradients"))
        out.append(Collective("all_reduce", "tp", r * cfg.hidden_size * grad_bytes, n * L, "backward",
                              "LoRA A gradients (column, SP)"))
    else:
        out.append(Collective("all_reduce", "tp", entered, L, "backward", "LoRA down-projection gradients"))
    kv = [t for t in names if t in ("k", "v")]
    if kv and cfg.kv_heads < layout.tp:
        add_collective(out, "all_reduce", cfg.kv_heads * cfg.head_dim * r * grad_bytes, len(kv) * L, "backward",
                       "LoRA B gradients of replicated K/V heads")
    return out


def _row_adapters(cfg, layout, n: int, n_layers: int, tokens: int, r: int, mm: int, grad_bytes: int,
                  again: int) -> list[Collective]:
    """The `n` row adapters of each layer: each rank's partial down-projection summed over TP (`region.reduce`),
    and under SP B's gradient summed (each rank saw its sequence shard)."""
    if not n:
        return []
    L, partial = n_layers, tokens * r * mm
    reduce = "reduce_scatter" if layout.sequence_parallel else "all_reduce"
    out = [Collective(reduce, "tp", partial, n * L, "forward", "LoRA row down-projections (partial sums)")]
    add_collective(out, reduce, partial, again * n * L, "backward", "recomputed LoRA row down-projections")
    if layout.sequence_parallel:
        out.append(Collective("all_gather", "tp", partial, n * L, "backward", "LoRA row down-projection gradients"))
        out.append(Collective("all_reduce", "tp", cfg.hidden_size * r * grad_bytes, n * L, "backward",
                              "LoRA B gradients (row, SP)"))
    return out


def first_layer_input_gradients(cfg, lora: LoraSpec) -> tuple[int, int]:
    """(entries, exits) of the first stage's first layer that compute no gradient with the base frozen: the
    attention's entry always (its input comes from the frozen embedding), the MLP's unless the attention has an
    adapter; a row-parallel exit's when neither its input's layer nor anything before has an adapter."""
    attention_in = bool(adapted(cfg, lora, ATTENTION_COLUMNS))
    mlp_in = attention_in or "o" in lora.targets
    entries = 1 + (not mlp_in)
    exits = (not attention_in) + (not (mlp_in or adapted(cfg, lora, MLP_COLUMNS)))
    return entries, exits


def without_first_layer_gradients(out: list[Collective], cfg, lora: LoraSpec) -> list[Collective]:
    """`out`, the first stage's collectives, less the backward collectives its first layer skips
    (`first_layer_input_gradients`): one call fewer of the entries' input gradients and of the SP exits' output
    gradients for each."""
    entries, exits = first_layer_input_gradients(cfg, lora)
    fewer = {"attention / MLP input gradient": entries, "attention / MLP output gradient": exits,
             # fp8 GEMMs whose input and weights need no gradient run no backward (`fp8_linear.fp8_linears`)
             ENTRY_GRADIENT_AMAXES[0]: 1, ENTRY_GRADIENT_AMAXES[1]: entries - 1}
    return [dataclasses.replace(c, calls=c.calls - fewer[c.what]) if c.group == "tp" and c.what in fewer else c
            for c in out]


def lora_collectives(cfg, layout, lora: LoraSpec | None, out: list[Collective], first: bool, n_layers: int,
                     tokens: int, mm: int, grad_bytes: int) -> list[Collective]:
    """`out`, the collectives of one micro-batch with the base's frozen parameters' gradients left out, changed for
    LoRA over TP: the first layer's skipped input gradients (first stage), the adapters' own collectives and the
    MLP exit recomputation repeats for a down adapter. `out` itself without `lora` or without TP."""
    if lora is None or layout.tp == 1:
        return out
    if first:
        out = without_first_layer_gradients(out, cfg, lora)
    out = out + adapter_collectives(cfg, layout, lora, n_layers, tokens, mm, grad_bytes)
    return out + recomputed_mlp_exit(cfg, layout, lora, n_layers, tokens, mm)


def recomputed_mlp_exit(cfg, layout, lora: LoraSpec, n_layers: int, tokens: int, mm: int) -> list[Collective]:
    """The base MLP's exit that full recomputation repeats because of a down adapter: without dropout
    `model_collectives` counts it once (nothing saves its output, so torch's non-reentrant checkpoint stops
    before it), but the down adapter's product, which backward saves, comes after it."""
    if layout.recompute != "full" or cfg.dropout > 0 or "down" not in lora.targets:
        return []
    op = "reduce_scatter" if layout.sequence_parallel else "all_reduce"
    return [Collective(op, "tp", tokens * cfg.hidden_size * mm, n_layers, "backward",
                       "recomputed MLP output (before its down adapter)")]
