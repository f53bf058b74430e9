"""Precisions for the planner: how many bytes each kind of state takes, and which activation model applies.

Precisions (how many bytes each kind of state takes, and which activation model applies):

================  =====  =====  ======  =====  ==================================================
name              param  grad   master  AdamW  what it is
================  =====  =====  ======  =====  ==================================================
tensorpar-fp32      4      4      -       8    tensorpar with --dtype fp32
tensorpar-bf16      2      4      4       8    tensorpar with --dtype bf16 (and tensorpar-fp16 with
                                               --dtype fp16): bf16 parameters and activations,
                                               gradients moved into fp32 buffers as they arrive,
                                               fp32 master weights (whole under ZeRO-0)
tensorpar-fp8       2      4      4       8    tensorpar with --dtype fp8 (--fp8-recipe tensorwise;
                                               tensorpar-fp8-rowwise: rowwise): as tensorpar-bf16,
                                               the linear layers' GEMMs in fp8; tensorwise keeps
                                               their inputs in fp8 for backward (rowwise: in bf16);
                                               the weights are quantised again in the backward
tensorpar-bf16-     4      4      -       8    bf16 autocast over fp32 parameters; every matmul
 autocast                                      weight is cast to bf16 in the forward and that copy
                                               is kept for backward
mixed-bf16          2      2      4       8    the Playbook's mixed precision (Megatron-style bf16
                                               parameters and gradients + fp32 master weights and
                                               AdamW states): 16 bytes per parameter
megatron-bf16       2      4      4       8    Megatron-LM's bf16 default: gradients accumulated
                                               and reduced in fp32 ("main_grad"): 18 bytes
megatron-fp8        2      4      4       8    as megatron-bf16, with the linear layers' GEMMs in
                                               fp8 (Transformer Engine; `gemm_dtype`): their saved
                                               inputs in fp8, + 2 bytes per weight (fp8 caches)
megatron-fp8-       2      2      4       8    what NeMo 2.0's fp8 recipes run: fp8 GEMMs as
 params                                        megatron-fp8, with fp8 parameters (`fp8_param_gather`:
                                               each linear weight held as fp8 plus its fp8
                                               transpose, 2 bytes, no bf16 copy; the rest bf16) and
                                               gradients reduced in bf16 (`grad_reduce_in_fp32=False`)
================  =====  =====  ======  =====  ==================================================

AdamW keeps two fp32 states per parameter (exp_avg, exp_avg_sq) plus a one-element fp32
``step`` tensor per parameter tensor (torch's implementation; counted exactly).
"""

from __future__ import annotations

import dataclasses

from tensorpar.errors import TensorparError


@dataclasses.dataclass(frozen=True)
class Precision:
    name: str
    compute_dtype: str  # the peak FLOP/s used: "bf16" or "fp32"
    param_bytes: int
    grad_bytes: int
    master_bytes: int  # fp32 master weights kept by the optimizer (0: the parameters are the fp32 copy)
    optimizer_bytes: int  # AdamW's two fp32 states
    activations: str  # "tensorpar" or "playbook"
    act_bytes: int  # residual stream, norm inputs, hidden states between stages
    matmul_bytes: int  # matmul inputs / outputs
    autocast: bool  # bf16 copies of weights saved for backward
    zero_master_bytes: int = 0  # tensorpar's ZeRO-1/2 keeps an fp32 master slice even of fp32 parameters
    zero2_full_grads_at_peak: bool = False  # a ZeRO-2 that holds full gradient buckets during backward
    zero_buffers_in_flight: bool = False  # count tensorpar's ZeRO-2/3 full gradient buffers in flight
    description: str = ""
    gemm_dtype: str = ""  # the dtype the GEMMs run in ("" : compute_dtype; "fp8": Transformer Engine's fp8 GEMMs)
    fp8_params: bool = False  # linear weights held in fp8 (+ fp8 transpose) in place of bf16: no separate fp8 caches
    gather_bytes: int = 0  # bytes per parameter the ZeRO all-gathers move (0: param_bytes; fp8 parameters: 1)
    fp8_recipe: str = ""  # tensorpar's fp8 GEMMs (--fp8-recipe): "tensorwise" or "rowwise"; "" for none

    def __post_init__(self):
        if not self.gemm_dtype:
            object.__setattr__(self, "gemm_dtype", self.compute_dtype)
        if not self.gather_bytes:
            object.__setattr__(self, "gather_bytes", self.param_bytes)


PRECISIONS: dict[str, Precision] = {
    "tensorpar-bf16": Precision("tensorpar-bf16", "bf16", 2, 4, 4, 8, "tensorpar", 2, 2, False, 0, False, True,
                                "tensorpar --dtype bf16: bf16 parameters and activations, gradients accumulated and "
                                "reduced in fp32, fp32 master weights and AdamW"),
    "tensorpar-fp16": Precision("tensorpar-fp16", "bf16", 2, 4, 4, 8, "tensorpar", 2, 2, False, 0, False, True,
                                "tensorpar --dtype fp16: as tensorpar-bf16, with dynamic loss scaling"),
    "tensorpar-fp8": Precision("tensorpar-fp8", "bf16", 2, 4, 4, 8, "tensorpar", 2, 2, False, 0, False, True,
                               "tensorpar --dtype fp8 (tensorwise): as tensorpar-bf16 with the linear layers' and "
                               "experts' GEMMs in fp8, their inputs kept in fp8 for backward",
                               gemm_dtype="fp8", fp8_recipe="tensorwise"),
    "tensorpar-fp8-rowwise": Precision("tensorpar-fp8-rowwise", "bf16", 2, 4, 4, 8, "tensorpar", 2, 2, False, 0,
                                       False, True, "tensorpar --dtype fp8 --fp8-recipe rowwise: fp8 GEMMs scaled per "
                                                    "row, the weight gradient's in bf16 (its input kept in bf16)",
                                       gemm_dtype="fp8", fp8_recipe="rowwise"),
    "tensorpar-bf16-autocast": Precision("tensorpar-bf16-autocast", "bf16", 4, 4, 0, 8, "tensorpar", 4, 2, True, 4,
                                         False, True, "bf16 autocast over fp32 parameters (what tensorpar eval and "
                                                      "generate do with --dtype bf16), fp32 gradients and AdamW"),
    "tensorpar-fp32": Precision("tensorpar-fp32", "fp32", 4, 4, 0, 8, "tensorpar", 4, 4, False, 4, False, True,
                                "tensorpar --dtype fp32"),
    "mixed-bf16": Precision("mixed-bf16", "bf16", 2, 2, 4, 8, "playbook", 2, 2, False,
                            description="Playbook / Megatron-style: bf16 parameters and gradients, "
                                        "fp32 master + AdamW"),
    "megatron-bf16": Precision("megatron-bf16", "bf16", 2, 4, 4, 8, "playbook", 2, 2, False,
                               description="Megatron-LM bf16: bf16 parameters, fp32 main gradients, "
                                           "fp32 master + AdamW"),
    "megatron-fp8": Precision("megatron-fp8", "bf16", 2, 4, 4, 8, "playbook", 2, 2, False,
                              description="Megatron-LM / NeMo with Transformer Engine fp8: the linear layers' GEMMs "
                                          "in fp8 (inputs cast per micro-batch, weights per step), attention and the "
                                          "rest in bf16; memory as megatron-bf16 but the linear layers' saved inputs "
                                          "in fp8 and the fp8 weight caches", gemm_dtype="fp8"),
    "megatron-fp8-params": Precision("megatron-fp8-params", "bf16", 2, 2, 4, 8, "playbook", 2, 2, False,
                                     description="NeMo 2.0's fp8 recipe (bf16_with_fp8_mixed: fp8_param_gather, "
                                                 "grad_reduce_in_fp32=False): fp8 GEMMs, each linear weight held as "
                                                 "fp8 and its fp8 transpose (2 bytes, as param_bytes counts it; "
                                                 "the all-gathers move the fp8 weight, 1 byte), bf16 gradients, "
                                                 "fp32 master + AdamW",
                                     gemm_dtype="fp8", fp8_params=True, gather_bytes=1),
}


def get_precision(name: str | Precision) -> Precision:
    if isinstance(name, Precision):
        return name
    if name not in PRECISIONS:
        raise TensorparError(f"unknown precision '{name}'; known: {', '.join(PRECISIONS)}")
    return PRECISIONS[name]
