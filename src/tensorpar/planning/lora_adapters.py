"""LoRA fine-tuning for the planner: the adapters one rank holds, the models LoRA refuses, the adapters' GEMMs.

The adapters are `tensorpar.tensor_parallel.lora`'s, sharded as their base layer (r the rank, h the hidden size):

=================================  =======================  ==========================
adapted linear                     A                        B
=================================  =======================  ==========================
column-parallel (q, k, v, gate,    [r, h] replicated        [out / tp, r], as W's rows
up)                                                         (a replicated KV head's too)
row-parallel (o, down)             [r, in / tp], as W's     [h, r] replicated
                                   columns
=================================  =======================  ==========================

Each sits right after its linear's weight (and bias) in `named_parameters()`, in the run's parameter dtype; every
other parameter is frozen. What a model cannot carry is refused by the trainer's own check
(`tensorpar.checkpoints.peft_adapter.check_lora_model`: latent attention, routed experts' MLPs, fused projections,
GPT-2's Conv1D), so that `plan` and `train` refuse the same model for the same reason.
"""

from __future__ import annotations

from tensorpar.checkpoints.peft_adapter import check_lora_model
from tensorpar.errors import TensorparError
from tensorpar.tensor_parallel.lora import LoraSpec, is_adapter

COLUMN_TARGETS = ("q", "k", "v", "gate", "up")  # the rest, o and down, are row-parallel
_MODULES = {t: f"{'attn' if t in ('q', 'k', 'v', 'o') else 'mlp'}.{t}_proj" for t in ("q", "k", "v", "o", "gate",
                                                                                     "up", "down")}


def check_lora(cfg, lora: LoraSpec | None, prec=None) -> None:
    """Refuse adapters `cfg` cannot carry, with the trainer's reason (nothing without `lora`), and, given the
    precision `prec` of a plan, what the planner does not model: the adapters' dropout (a masked copy of each adapter's input), and LoRA in the Playbook's
    precisions (Megatron / NeMo runs, whose PEFT the planner does not describe)."""
    if lora is None:
        return
    check_lora_model(cfg, lora)
    if prec is None:  # the bytes of states alone (the dry run's): the dropout and the precision change none
        return
    if lora.dropout:
        raise TensorparError(f"the planner does not model --lora-dropout {lora.dropout:g} (each adapter's masked "
                             f"copy of its input): plan with --lora-dropout 0")
    if prec.activations != "tensorpar":
        raise TensorparError(f"the planner models LoRA as tensorpar trains it: use a tensorpar-* precision, not "
                             f"{prec.name}")


def _target_of(name: str, lora: LoraSpec) -> str | None:
    """The target whose adapter sits on the linear whose weight is `name` (a decoder block's), or None."""
    for t in lora.targets:
        if name.endswith(f".{_MODULES[t]}.weight") and ".experts." not in name:
            return t
    return None


def with_adapters(cfg, params: list[tuple[str, int, int]], lora: LoraSpec | None) -> list[tuple[str, int, int]]:
    """`params` ((name, numel, ndim) of one rank, `named_parameters()` order) with the adapters' factors `lora` puts
    on them, each after its linear's weight and bias (the table above)."""
    if lora is None:
        return params
    h, r = cfg.hidden_size, lora.rank
    out: list[tuple[str, int, int]] = []
    pending, bias = [], None  # the last adapted linear's factors, placed after its bias if it has one
    for name, numel, ndim in params:
        if pending and name != bias:
            out, pending = out + pending, []
        out.append((name, numel, ndim))
        if pending:  # its bias
            out, pending = out + pending, []
        target = _target_of(name, lora)
        if target is not None:
            module = name[: -len(".weight")]
            a, b = (r * h, numel // h * r) if target in COLUMN_TARGETS else (r * (numel // h), h * r)
            pending, bias = [(f"{module}.lora_A.weight", a, 2), (f"{module}.lora_B.weight", b, 2)], f"{module}.bias"
    return out + pending


def trained(params: list[tuple[str, int, int]], lora: LoraSpec | None) -> list[tuple[str, int, int]]:
    """The parameters of `params` that train: all of them, or with `lora` the adapters' factors alone."""
    return params if lora is None else [p for p in params if is_adapter(p[0])]


def frozen(params: list[tuple[str, int, int]], lora: LoraSpec | None) -> list[tuple[str, int, int]]:
    """The parameters of `params` that do not train (the rest of `trained`): none, or with `lora` the base."""
    return [] if lora is None else [p for p in params if not is_adapter(p[0])]


def adapter_gemms(cfg, tp: int, tokens: int, lora: LoraSpec | None) -> list[tuple[float, float, float, int]]:
    """One layer's adapter GEMMs as forward (m, n, k, count) on one rank for `tokens` rows: a column adapter's
    down-projection (tokens, r, h) and up-projection (tokens, out / tp, r), a row adapter's (tokens, r, in / tp) and
    (tokens, h, r)."""
    if lora is None:
        return []
    h, r, hd = cfg.hidden_size, lora.rank, cfg.head_dim
    out_rows = {"q": cfg.num_heads * hd // tp, "k": max(cfg.kv_heads // tp, 1) * hd,
                "v": max(cfg.kv_heads // tp, 1) * hd, "gate": cfg.ffn_hidden_size // tp,
                "up": cfg.ffn_hidden_size // tp}
    in_cols = {"o": cfg.num_heads * hd // tp, "down": cfg.ffn_hidden_size // tp}
    gemms = []
    for t in lora.targets:
        if t == "gate" and not cfg.gated_mlp:
            continue
        if t in COLUMN_TARGETS:
            gemms += [(tokens, r, h, 1), (tokens, out_rows[t], r, 1)]
        else:
            gemms += [(tokens, r, in_cols[t], 1), (tokens, h, r, 1)]
    return gemms


def _norms(cfg) -> int:
    """Norms per layer."""
    return 2 * (cfg.norm_placement in ("pre", "sandwich")) + 2 * (cfg.norm_placement in ("sandwich", "post"))


def _normalised_bytes(cfg, act_bytes: int, tokens: int) -> int:
    """What an RMSNorm saves only for its weight's gradient (its normalised output): nothing when frozen."""
    return (4 if act_bytes == 4 else 2) * tokens * cfg.hidden_size if cfg.norm == "rmsnorm" else 0


def lora_layer_activations(cfg, layout, b: int, s: int, mode: str, prec, lora: LoraSpec | None,
                           tp_overlap: bool = True) -> int:
    """Bytes one layer saves for one micro-batch with `lora`, less what it saves when every weight trains (a
    negative number: `tensorpar_layer_activations` plus this is the layer's). The frozen base saves nothing for its
    weights' gradients: no RMSNorm's normalised output; no input of a linear without an adapter (but the
    attention output, which the attention core saves); the q/k/v (gate/up) input only as the adapters' down-
    projections take it, before the TP region's entry (this rank's sequence shard under SP; one bf16 copy per
    adapter under autocast). The adapters add their r-wide down-projections: [b s, n r] entered per group of
    column adapters sharing an input, [b s, r] (a sequence shard under SP) per row adapter."""
    if lora is None or mode == "full":
        return 0
    t, sp, A = layout.tp, layout.sequence_parallel, prec.act_bytes
    M = 2 if prec.autocast or A == 2 else 4
    h, f, r = cfg.hidden_size, cfg.ffn_hidden_size // t, lora.rank
    sn = s // t if sp else s
    delta = -_norms(cfg) * _normalised_bytes(cfg, A, b * sn)
    shared = tp_overlap and t > 1
    for group, base_copies in ((("q", "k", "v"), 1 if shared else 3),
                               (("gate", "up") if cfg.gated_mlp else ("up",), 1 if shared or not cfg.gated_mlp else 2)):
        n = sum(x in lora.targets for x in group)
        if prec.autocast:
            delta += n * 2 * b * sn * h - base_copies * 2 * b * s * h
        else:
            delta += (A * b * sn * h if n else 0) - A * b * s * h
        delta += M * b * s * r * n
    heads, kv = cfg.num_heads // t, max(cfg.kv_heads // t, 1)
    qk = b * s * (heads + kv) * cfg.head_dim  # the q / k norms' normalised outputs (over the projection: fp32)
    delta -= {"none": 0, "head": M * qk, "projection": 4 * qk}[cfg.qk_norm]
    if mode == "selective" and "o" not in lora.targets:
        delta -= M * b * s * heads * cfg.head_dim  # the attention's output: recomputed, saved only for o's weight
    if "down" not in lora.targets and (cfg.gated_mlp or cfg.activation != "relu"):
        delta -= M * b * s * f  # the MLP's product, saved only for down's weight gradient
    delta += M * b * sn * r * sum(x in lora.targets for x in ("o", "down"))
    return delta


def lora_outer_activations(cfg, layout, b: int, s: int, mode: str, prec, lora: LoraSpec | None, first: bool,
                           last: bool) -> int:
    """Bytes the stage's ends save with `lora`, less what they save when every weight trains (negative): the frozen
    embedding keeps no token ids (nor its vocabulary mask), the first layer's first norm nothing (its input needs
    no gradient), the final RMSNorm no normalised output."""
    if lora is None:
        return 0
    sn = s // layout.tp if layout.sequence_parallel else s
    delta = 0
    if first:
        delta -= 8 * b * s + (b * s if layout.tp > 1 else 0)
        if mode != "full" and cfg.norm_placement in ("pre", "sandwich"):
            stats = 4 * b * sn * (cfg.hidden_size + 1) if cfg.norm == "rmsnorm" else 8 * b * sn
            delta -= prec.act_bytes * b * sn * cfg.hidden_size + stats - _normalised_bytes(cfg, prec.act_bytes, b * sn)
    if last:
        delta -= _normalised_bytes(cfg, prec.act_bytes, b * sn)
    return delta


def lora_weight_copies(cfg, layout, prec, lora: LoraSpec | None, first: bool) -> int:
    """Autocast's bf16 weight copies with `lora`, less those kept when every weight trains: the first layer's q/k/v
    (their input needs no gradient, their weights none)."""
    if lora is None or not prec.autocast or not first or layout.recompute == "full" or cfg.is_mla:
        return 0
    t, hd = layout.tp, cfg.head_dim
    return -2 * cfg.hidden_size * hd * (cfg.num_heads // t + 2 * max(cfg.kv_heads // t, 1))


def gradient_arrival_order(params: list[tuple[str, int, int]]) -> list[str]:
    """The adapters' names in the order their gradients arrive in a backward: the reverse of `params`' order, but
    the column-parallel adapters that share an input (q, k, v; gate, up) give all their B factors' gradients first
    (each B's from its own output gradient), then their A factors' (which wait for the shared input's)."""
    names = [name for name, _, _ in reversed(params) if is_adapter(name)]
    out, group = [], []

    def flush():
        out.extend(n for n in group if ".lora_B." in n)
        out.extend(n for n in group if ".lora_A." in n)
        group.clear()

    for name in names:
        module = name.rsplit(".lora_", 1)[0]
        if module.endswith(("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
            if group and group[0].rsplit(".", 3)[0] != module.rsplit(".", 1)[0]:
                flush()  # another block or sublayer: its own shared input
            group.append(name)
        else:
            flush()
            out.append(name)
    flush()
    return out
