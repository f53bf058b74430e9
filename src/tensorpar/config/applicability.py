"""Options that act only beside other options, on some models or on some data, in one table per command: an option
whose value would change nothing is refused, never silently ignored.

Each `Rule` names a field, when it applies, what it needs and what it does; `check(command, options, ...)` raises the
first rule a command's options break as one line naming the flag, its value and what it needs::

    --fp8-recipe rowwise needs --dtype fp8 (it scales the fp8 GEMMs; --dtype is bf16)

Only a value that differs from the field's default is refused: the options are dataclasses, so a default cannot be
told from a flag given with the default value, and a run's resolved configuration (which holds every field) must
load again. A rule that reads a fact beyond the options (`cfg`: the model's config, `data`: what --data holds) is
checked once the command knows it; `check` skips it until then. Each command calls `check` from the validation it
runs in the launching process, before any rank or process group exists.
"""

from __future__ import annotations

import dataclasses
import shlex
from typing import Callable

from tensorpar.config.fields import cli_specs
from tensorpar.errors import TensorparError


@dataclasses.dataclass(frozen=True)
class DataFacts:
    """What a command's data holds, worked out by the command (the data package reads it; this one does not)."""

    examples: str | None = None  # the instruction rows --data holds ("conversations", ...), None for documents/tokens
    kinds: frozenset = frozenset()  # how the sources of --data (and --val-data) are read (`data.source_kinds`)


@dataclasses.dataclass(frozen=True)
class Facts:
    """What a rule may read beyond the options (None: not known yet)."""

    cfg: object | None = None  # the model's ModelConfig
    data: DataFacts | None = None


@dataclasses.dataclass(frozen=True)
class Rule:
    """`field` acts only where `applies(options, facts)`: else a value other than its default is refused with
    "FLAG VALUE needs NEEDS (DOES; NOW)", NOW saying what the options (or the facts) are instead."""

    field: str
    applies: Callable[[object, Facts], bool]
    needs: str
    does: str
    now: Callable[[object, Facts], str]
    fact: str | None = None  # "cfg" or "data": the rule is checked once `check` is given it


def _is(flag: str, name: str) -> Callable[[object, Facts], str]:
    return lambda o, f: f"{flag} is {getattr(o, name)}"


def _data(o) -> str:
    return f"--data '{o.data}'" if o.data else "the default corpus (no --data)"


def _examples(o, f: Facts) -> str:
    return f"{_data(o)} holds {f.data.examples or 'no conversations nor prompt/completion rows'}"


_KINDS = {"default": "text", "text": "text", "documents": "documents", "megatron": "a Megatron dataset",
          "npy": ".npy token ids", "bin": ".bin token ids"}


def _read_as(o, f: Facts) -> str:
    return f"{_data(o)} holds {' and '.join(sorted({_KINDS.get(k, k) for k in f.data.kinds}))}"


# -- precision ---------------------------------------------------------------------------------------------------------

FP8_RECIPE = Rule("fp8_recipe", lambda o, f: o.dtype == "fp8", "--dtype fp8", "it scales the fp8 GEMMs",
                  _is("--dtype", "dtype"))
LOSS_SCALE = Rule("loss_scale", lambda o, f: o.dtype == "fp16", "--dtype fp16",
                  "fp16's dynamic loss scaling starts from it", _is("--dtype", "dtype"))
LOSS_SCALE_WINDOW = Rule("loss_scale_window", lambda o, f: o.dtype == "fp16", "--dtype fp16",
                         "fp16's dynamic loss scaling grows after this many steps without overflow",
                         _is("--dtype", "dtype"))
GRAD_REDUCE_DTYPE = Rule("grad_reduce_dtype", lambda o, f: o.dtype != "fp32", "--dtype bf16, fp16 or fp8",
                         "bf16/fp16 gradients are accumulated and reduced in it",
                         lambda o, f: "--dtype is fp32: fp32 gradients are accumulated and reduced in fp32")
ON_NAN = Rule("on_nan", lambda o, f: o.dtype != "fp16", "--dtype fp32, bf16 or fp8",
              "it handles a step whose gradient norm is not finite",
              lambda o, f: "--dtype is fp16, whose loss scaling skips such a step and lowers its scale")

# -- optimization ------------------------------------------------------------------------------------------------------

DECAY_FRACTION = Rule("decay_fraction", lambda o, f: o.lr_schedule == "wsd", "--lr-schedule wsd",
                      "the share of the steps WSD's decay takes", _is("--lr-schedule", "lr_schedule"))
DECAY_SHAPE = Rule("decay_shape", lambda o, f: o.lr_schedule == "wsd", "--lr-schedule wsd", "how WSD's decay falls",
                   _is("--lr-schedule", "lr_schedule"))
MUON_MOMENTUM = Rule("muon_momentum", lambda o, f: o.optimizer == "muon", "--optimizer muon", "Muon's momentum",
                     _is("--optimizer", "optimizer"))

# -- layout ------------------------------------------------------------------------------------------------------------

_SPLIT_BACKWARD = ("zb-h1", "zbv")
EXPERT_GEMM = Rule("expert_gemm", lambda o, f: f.cfg.is_moe, "a mixture-of-experts model",
                   "it runs the routed experts' GEMMs", lambda o, f: "this model is dense (num_experts = 0)", "cfg")
SCHEDULE = Rule("schedule", lambda o, f: o.pp > 1, "--pp > 1", "it orders the pipeline stages' micro-batches",
                _is("--pp", "pp"))
PIPELINE_LAYERS = Rule("pipeline_layers", lambda o, f: o.pp > 1, "--pp > 1", "it sizes the pipeline stages",
                       _is("--pp", "pp"))
CP_IMPL = Rule("cp_impl", lambda o, f: o.cp > 1, "--cp > 1", "it is context parallelism's attention",
               _is("--cp", "cp"))
CP_SPLIT = Rule("cp_split", lambda o, f: o.cp > 1, "--cp > 1", "it deals a sequence's chunks to the CP ranks",
                _is("--cp", "cp"))
SEQUENCE_PARALLEL = Rule("sequence_parallel", lambda o, f: o.tp > 1, "--tp > 1",
                         "it shards the activations along the sequence over the TP ranks", _is("--tp", "tp"))
TP_OVERLAP = (
    Rule("tp_overlap", lambda o, f: o.tp > 1, "--tp > 1", "it issues the TP collectives blocking",
         _is("--tp", "tp")),
    Rule("tp_overlap", lambda o, f: o.dtype != "fp8", "--dtype fp32, bf16 or fp16",
         "fp8 GEMMs always issue the TP collectives blocking", _is("--dtype", "dtype")),
    Rule("tp_overlap", lambda o, f: o.pp == 1 or o.schedule not in _SPLIT_BACKWARD, "--schedule afab, 1f1b or "
         "interleaved", "a split backward always issues the TP collectives blocking", _is("--schedule", "schedule")),
)
ZERO3_RESHARD = Rule("zero3_reshard_after_forward", lambda o, f: o.zero == 3, "--zero 3",
                     "it keeps ZeRO-3's gathered parameters from a block's forward to its backward",
                     _is("--zero", "zero"))
BUCKET_MB = Rule("bucket_mb", lambda o, f: o.zero != 3, "--zero 0, 1 or 2", "it sizes the gradient buckets",
                 lambda o, f: "--zero is 3, which reduces each block's gradients as one unit")

# -- the run's inputs and outputs --------------------------------------------------------------------------------------

MODEL = Rule("model", lambda o, f: not o.init_from, "no --init-from", "it names the model to build",
             lambda o, f: f"--init-from '{o.init_from}' is the model")
KEEP_LAST = Rule("keep_last", lambda o, f: bool(o.save), "--save DIR", "it is how many of its checkpoints to keep",
                 lambda o, f: "the run saves none")
SAMPLE_PROMPT = Rule("sample_prompt", lambda o, f: o.sample_tokens > 0, "--sample-tokens N",
                     "it prompts the sample generated at the end", _is("--sample-tokens", "sample_tokens"))
VAL_FRACTION = Rule("val_fraction", lambda o, f: not o.val_data, "no --val-data",
                    "it holds the end of --data out for validation",
                    lambda o, f: f"--val-data '{o.val_data}' is the validation data and --data all training")


def _validates(o) -> bool:
    return bool(o.val_data) or o.val_fraction > 0


def _no_validation(o, f: Facts) -> str:
    return "--val-fraction is 0 and there is no --val-data"


_VALIDATION = "validation data (--val-fraction > 0 or --val-data)"
# --val-every 0 ("only at the end") reads as "no validation during the run", which holds without validation too.
VAL_EVERY = tuple(Rule(name, lambda o, f, name=name: _validates(o) or getattr(o, name) == 0, _VALIDATION,
                       "it is how often the validation loss is taken", _no_validation)
                  for name in ("val_every", "eval_every"))
VAL_WINDOWS = Rule("val_windows", lambda o, f: _validates(o), _VALIDATION,
                   "it is how many windows each validation evaluates", _no_validation)
WORLD_SIZE = Rule("world_size", lambda o, f: o.dry_run, "--dry-run", "the world a dry run builds one rank of",
                  lambda o, f: "a run's world is --nproc or tp x cp x pp x dp")
RANK = Rule("rank", lambda o, f: o.dry_run, "--dry-run", "the rank a dry run builds",
            lambda o, f: "a run starts every rank")

# -- what --data holds -------------------------------------------------------------------------------------------------

DOCUMENT_MASK = Rule("document_mask", lambda o, f: f.data.examples is None, "documents in --data",
                     "it keeps attention within the documents its EOS ends", lambda o, f: (
                         f"{_data(o)} holds {f.data.examples}, each of which attends only within itself already"),
                     "data")
DOCUMENT_ATTENTION = Rule("document_attention", lambda o, f: o.document_mask or f.data.examples is not None,
                          "--document-mask, or conversations or prompt/completion rows in --data",
                          "it is the kernel of attention within documents",
                          lambda o, f: f"{_examples(o, f)}, and --document-mask is off", "data")
DOCUMENT_ATTENTION_CP = Rule("document_attention", lambda o, f: o.cp == 1, "--cp 1",
                             "it is the kernel of attention within documents, which context parallelism's --cp-impl "
                             "masks itself", _is("--cp", "cp"))
MESSAGES_FIELD = Rule("messages_field", lambda o, f: f.data.examples == "conversations", "conversations in --data",
                      "it names their field", _examples, "data")
PROMPT_FIELD = Rule("prompt_field", lambda o, f: f.data.examples == "prompt/completion pairs",
                    "prompt/completion rows in --data", "it names their prompt field", _examples, "data")
COMPLETION_FIELD = Rule("completion_field", lambda o, f: f.data.examples == "prompt/completion pairs",
                        "prompt/completion rows in --data", "it names their completion field", _examples, "data")
CHAT_TEMPLATE = Rule("chat_template", lambda o, f: f.data.examples == "conversations", "conversations in --data",
                     "it renders them", _examples, "data")
EXAMPLE_PACKING = Rule("example_packing", lambda o, f: f.data.examples is not None,
                       "conversations or prompt/completion rows in --data", "it lays their examples into rows",
                       _examples, "data")
LONG_EXAMPLES = Rule("long_examples", lambda o, f: f.data.examples is not None,
                     "conversations or prompt/completion rows in --data",
                     "it is what becomes of an example longer than --seq-len", _examples, "data")
TEXT_FIELD = Rule("text_field", lambda o, f: "documents" in f.data.kinds and f.data.examples is None,
                  "a JSONL, Parquet or datasets source of documents", "it names their text field",
                  lambda o, f: _examples(o, f) if f.data.examples else _read_as(o, f), "data")
BIN_DTYPE = Rule("bin_dtype", lambda o, f: "bin" in f.data.kinds, "a raw .bin token file",
                 "it is the dtype of .bin token files",
                 _read_as, "data")

# -- plan --------------------------------------------------------------------------------------------------------------

_SCHEDULE_MODE_FIELDS = ("model", "schedule", "pp", "microbatches", "virtual_stages", "json", "png")
_LAYOUT_MODE_FIELDS = (  # every plan option that only layout mode (--model) reads
    "gpus", "gpu", "seq_len", "global_batch_size", "precision", "top", "gpus_per_node", "intra_bandwidth",
    "inter_bandwidth", "intra_latency", "inter_latency", "memory_gib", "peak_tflops", "mfu_ceiling", "overlap", "tp",
    "cp", "ep", "zero", "recompute", "sequence_parallel", "flash_attention", "max_micro_batch", "pipeline_layers",
    "hardware", "tp_overlap", "pp_overlap", "link_efficiency", "host_memory_gib", "host_link_bandwidth",
    "host_link_back_bandwidth",
    "host_optimizer_bandwidth", "lora_rank", "lora_alpha",
    "lora_targets", "lora_dropout", "optimizer_offload", "activation_offload", "activation_offload_layers",
    "activation_offload_fit", "optimizer_state_dtype")


def _layout_mode(o) -> bool:
    return o.model is not None or not o.schedule


PLAN_LAYOUT_MODE = tuple(Rule(name, lambda o, f: _layout_mode(o), "--model", "layout mode plans with it",
                              lambda o, f: f"without --model, plan draws the --schedule {o.schedule} pipeline")
                         for name in _LAYOUT_MODE_FIELDS)
PLAN_MICROBATCHES = Rule("microbatches", lambda o, f: not _layout_mode(o), "--schedule without --model",
                         "it is the micro-batches of the schedule drawn",
                         lambda o, f: "layout mode works them out from --global-batch-size and the micro-batch "
                                      "sizes it tries")
PLAN_FLASH_ATTENTION = Rule("flash_attention", lambda o, f: not o.precision.startswith("tensorpar-"),
                            "a Playbook --precision (mixed-bf16, megatron-...)",
                            "it makes the Playbook's attention store its s x s scores",
                            lambda o, f: f"--precision is {o.precision}, whose attention never stores them")
PLAN_GPU = Rule("gpu", lambda o, f: o.hardware is None, "no --hardware", "it picks the catalog's GPU",
                lambda o, f: f"--hardware '{o.hardware}' is the device planned for")
PLAN_SCHEDULE = Rule("schedule", lambda o, f: not _layout_mode(o) or o.pp != 1, "--pp > 1 (or no --pp)",
                     "layout mode keeps the pipelined layouts of this schedule", _is("--pp", "pp"))
PLAN_VIRTUAL_STAGES = Rule("virtual_stages", lambda o, f: not _layout_mode(o) or o.pp != 1, "--pp > 1 (or no --pp)",
                           "layout mode interleaves the pipelined layouts' stages up to it", _is("--pp", "pp"))
ACTIVATION_OFFLOAD_LAYERS = Rule("activation_offload_layers", lambda o, f: o.activation_offload,
                                 "--activation-offload", "it chooses the layers whose saved tensors move",
                                 lambda o, f: "nothing is offloaded")
PLAN_OFFLOAD_FIT = Rule("activation_offload_fit",
                        lambda o, f: o.activation_offload and o.activation_offload_layers is None,
                        "--activation-offload without --activation-offload-layers",
                        "it chooses each layout's layers whose saved tensors move",
                        lambda o, f: (f"--activation-offload-layers {o.activation_offload_layers} chooses them"
                                      if o.activation_offload else "nothing is offloaded"))


def _host_rule(field: str, does: str) -> Rule:
    """A plan option about the host that an offloading lever uses."""
    return Rule(field, lambda o, f: o.optimizer_offload or o.activation_offload,
                "--optimizer-offload or --activation-offload", does, lambda o, f: "nothing is offloaded")


PLAN_HOST_MEMORY = _host_rule("host_memory_gib", "it is the host memory offloading may fill")
PLAN_HOST_LINK = _host_rule("host_link_bandwidth", "the offloaded tensors cross it")
PLAN_HOST_LINK_BACK = _host_rule("host_link_back_bandwidth", "the offloaded tensors come back over it")
PLAN_HOST_OPTIMIZER = Rule("host_optimizer_bandwidth", lambda o, f: o.optimizer_offload, "--optimizer-offload",
                           "the optimizer steps on the host with it", lambda o, f: "the optimizer steps on the GPU")

# -- calibrate ---------------------------------------------------------------------------------------------------------

CALIBRATE_RANKS = Rule("ranks", lambda o, f: not o.no_collectives, "the collectives timed",
                       "it is the processes they are timed over", lambda o, f: "--no-collectives skips them")
CALIBRATE_THREADS = Rule("threads", lambda o, f: o.device == "cpu", "--device cpu", "it sets the CPU GEMMs' threads",
                         _is("--device", "device"))

RULES: dict[str, tuple[Rule, ...]] = {
    "train": (FP8_RECIPE, LOSS_SCALE, LOSS_SCALE_WINDOW, GRAD_REDUCE_DTYPE, ON_NAN, DECAY_FRACTION, DECAY_SHAPE,
              MUON_MOMENTUM, EXPERT_GEMM, SCHEDULE, PIPELINE_LAYERS, CP_IMPL, CP_SPLIT, SEQUENCE_PARALLEL, *TP_OVERLAP,
              ZERO3_RESHARD, BUCKET_MB, MODEL, KEEP_LAST, SAMPLE_PROMPT, VAL_FRACTION, *VAL_EVERY, VAL_WINDOWS,
              WORLD_SIZE, RANK, CHAT_TEMPLATE, MESSAGES_FIELD, PROMPT_FIELD, COMPLETION_FIELD, EXAMPLE_PACKING,
              LONG_EXAMPLES, DOCUMENT_MASK, DOCUMENT_ATTENTION, DOCUMENT_ATTENTION_CP, TEXT_FIELD, BIN_DTYPE,
              ACTIVATION_OFFLOAD_LAYERS),
    "eval": (FP8_RECIPE, EXPERT_GEMM, CP_IMPL, SEQUENCE_PARALLEL, TEXT_FIELD, BIN_DTYPE),
    "generate": (FP8_RECIPE, EXPERT_GEMM),
    "serve": (FP8_RECIPE, EXPERT_GEMM),
    "plan": (PLAN_MICROBATCHES, *PLAN_LAYOUT_MODE, PLAN_GPU, PLAN_FLASH_ATTENTION, PLAN_SCHEDULE, PLAN_VIRTUAL_STAGES,
             PLAN_HOST_MEMORY, PLAN_HOST_LINK, PLAN_HOST_LINK_BACK, PLAN_HOST_OPTIMIZER, ACTIVATION_OFFLOAD_LAYERS,
             PLAN_OFFLOAD_FIT),
    "calibrate": (CALIBRATE_RANKS, CALIBRATE_THREADS),
}


def _shown(spec, value) -> str:
    """The flag as given: a switch alone, else the flag and its value."""
    if spec.kind is bool:
        return spec.flag
    if isinstance(value, list):
        return f"{spec.flag} {' '.join(map(str, value))}"
    if isinstance(value, float):
        return f"{spec.flag} {value:g}"
    return f"{spec.flag} {shlex.quote(value) if isinstance(value, str) else value}"


def problem(command: str, options, *, cfg=None, data: DataFacts | None = None) -> str | None:
    """The first rule of `command` that `options` break (in one line), or None; rules reading a fact not given are
    skipped."""
    facts = Facts(cfg, data)
    specs = {s.name: s for s in cli_specs(type(options))}
    for rule in RULES[command]:
        if rule.fact is not None and getattr(facts, rule.fact) is None:
            continue
        spec, value = specs[rule.field], getattr(options, rule.field)
        if value == spec.default or rule.applies(options, facts):
            continue
        return f"{_shown(spec, value)} needs {rule.needs} ({rule.does}; {rule.now(options, facts)})"
    return None


def check(command: str, options, *, cfg=None, data: DataFacts | None = None) -> None:
    """Raise the first rule of `command` that `options` break as a TensorparError (see `problem`)."""
    found = problem(command, options, cfg=cfg, data=data)
    if found:
        raise TensorparError(found)
