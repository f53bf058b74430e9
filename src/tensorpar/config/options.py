"""The options of every `tensorpar` command, each written once: type, default, choices and help.

The command line (`tensorpar.config.fields.add_options`), the ``--config`` TOML file and the
Python API (``tensorpar.training.train(TrainOptions(tp=2, ...))``) all take these dataclasses.
Checks that need more than one field or the model (does the layout divide the heads?) are done
by each command's validation, once, before any process group exists.
"""

from __future__ import annotations

import dataclasses

from tensorpar.config.choices import (
    BACKENDS,
    BATCHING_MODES,
    BIN_DTYPES,
    CP_IMPLS,
    CP_SPLITS,
    DOCUMENT_ATTENTION,
    DTYPES,
    EXAMPLE_PACKINGS,
    EXPERT_GEMMS,
    FP8_RECIPES,
    GRAD_REDUCE_DTYPES,
    LONG_EXAMPLES,
    LOSS_CHUNK_TOKENS,
    LR_SCHEDULES,
    ON_NAN,
    OPTIMIZERS,
    PIPELINE_SCHEDULES,
    PLANNED_SCHEDULES,
    PLAN_PRECISIONS,
    PLANNED_ZERO_STAGES,
    RECOMPUTE_MODES,
    SEQUENCE_PARALLEL_SEARCH,
    TRAIN_DTYPES,
    WSD_DECAY_SHAPES,
    ZERO_STAGES,
)
from tensorpar.config.fields import option
from tensorpar.config.lora_options import LoraAdapterOptions, LoraOptions, LoraShapeOptions
from tensorpar.config.memory_lever_options import MemoryLeverOptions, PlanMemoryOptions
from tensorpar.config.sampling_options import SamplingOptions

LAYOUT = "layout"
LAUNCH = "processes"


@dataclasses.dataclass
class LaunchOptions:
    """How a multi-process command lays out its processes."""

    tp: int = option(1, "tensor-parallel size", group=LAYOUT)
    pp: int = option(1, "pipeline-parallel size", group=LAYOUT)
    dp: int | None = option(None, "data-parallel size (default: the rest of the world)", group=LAYOUT)
    cp: int = option(1, "context-parallel size: each sequence split over cp ranks (train, eval)", group=LAYOUT)
    nproc: int | None = option(None, "processes to start from a plain shell (default tp*pp*dp); ignored under "
                                     "torchrun", group=LAYOUT)
    device: str | None = option(None, "default: this rank's GPU if any, else cpu", group=LAYOUT)
    backend: str | None = option(None, "torch.distributed backend (default: nccl on CUDA, gloo on cpu); gloo on CUDA "
                                        "lets several ranks share one GPU, their collectives staged through host "
                                        "memory (for testing every layout on one GPU, not for speed)",
                                 choices=BACKENDS, group=LAUNCH)
    timeout: float | None = option(None, "seconds a collective may wait for a peer before the job fails, naming "
                                         "the rank and the operation (default $TENSORPAR_TIMEOUT or 300)",
                                   group=LAUNCH)
    grace_period: float = option(30.0, "seconds the ranks get to stop (and save) after SIGTERM or Ctrl-C before "
                                       "they are killed", group=LAUNCH)


@dataclasses.dataclass
class ExpertOptions:
    """The expert-parallel layout of mixture-of-experts models (train, eval, generate, serve)."""

    ep: int = option(1, "expert-parallel size (mixture-of-experts models): num_experts / ep experts per rank, the "
                        "tp x cp x dp ranks of a stage regrouped into ep x expert-DP for the MoE layers (ep must "
                        "divide tp x cp x dp; eval, generate and serve without --dp start fold / gcd(tp x cp, fold) "
                        "data-parallel replicas so that ep x expert-tp = fold does)", group=LAYOUT)
    expert_tp: int = option(1, "expert tensor-parallel size (mixture-of-experts models): each expert's MLP split "
                               "Megatron-style over this many ranks, folded fastest (expert-TP x EP x expert-DP); "
                               "expert_tp x ep must divide tp x cp x dp (eval, generate and serve: see --ep)",
                            group=LAYOUT)
    expert_gemm: str = option("grouped", "the routed experts' GEMMs: one grouped GEMM per projection "
                                         "(torch._grouped_mm where it runs), or one GEMM per expert",
                              choices=EXPERT_GEMMS, group=LAYOUT)


@dataclasses.dataclass
class TokenCacheOptions:
    """How document sources become tokens (train, eval, prepare-data)."""

    text_field: str = option("text", "the text field of JSONL records / column of Parquet and datasets",
                             group="data")
    data_cache: str | None = option(None, "folder of the token cache (default $TENSORPAR_CACHE/tokens or "
                                          "~/.cache/tensorpar/tokens)", group="data")


@dataclasses.dataclass
class DataOptions(TokenCacheOptions):
    """Where a command reads its tokens (train, eval)."""

    data: str | None = option(None, "text, .npy or .bin token file; .jsonl/.jsonl.gz/.parquet file or folder; a "
                                    "datasets save_to_disk folder; a Megatron PREFIX (.bin + .idx); train also takes "
                                    "a mixture '0.7 PATH_A 0.3 PATH_B' or mix.toml (default: the embedded corpus)",
                              group="data")
    bin_dtype: str = option("uint16", "token dtype of a .bin file", choices=BIN_DTYPES, group="data")


@dataclasses.dataclass
class TrainOptions(LoraOptions, DataOptions, ExpertOptions, LaunchOptions, MemoryLeverOptions):
    """`tensorpar train`: everything a training run needs. From Python, outputs (metrics, plots) are written only
    where `metrics` / `out_dir` say; the command line defaults them to runs/MODEL-tpT/."""

    model: str = option("tiny", "preset name or config .json", group="model")
    init_from: str | None = option(None, "start from a Hugging Face folder or a tensorpar checkpoint", group="model")
    dropout: float = option(0.0, "dropout probability (embedding, residual, attention)", group="model")
    document_mask: bool = option(False, "attention only within each packed document (causal inside it) and "
                                        "positions restarting at each, the documents ending at the tokenizer's "
                                        "EOS (which belongs to the document it ends); training and its validation",
                                 group="model")
    document_attention: str = option("auto", "--document-mask's attention: varlen (padded per-length batches, SDPA "
                                             "causal, no mask), flex (flex_attention, CUDA), dense (an [S, S] mask); "
                                             "auto: varlen on CPU and CUDA", choices=DOCUMENT_ATTENTION,
                                     group="model")
    sequence_parallel: bool = option(False, "shard norms/dropout/residuals along the sequence", group=LAYOUT)
    zero: int = option(0, "ZeRO stage over the DP group: 1 shards optimizer states, 2 also gradients, 3 also "
                          "parameters (each block gathered just before use)", choices=ZERO_STAGES, group=LAYOUT)
    dp_replicate: int = option(1, "HSDP: split the DP ranks into this many replicas; ZeRO shards within a replica "
                                  "(one node's ranks) and all-reduces each shard's gradients across the replicas",
                               metavar="R", group=LAYOUT)
    zero3_reshard_after_forward: bool = option(True, "ZeRO-3: keep a block's gathered parameters from its forward "
                                                     "to its backward (one all-gather less per block, more memory; "
                                                     "in a config file: zero3_reshard_after_forward = false)",
                                               flag="--no-zero3-reshard-after-forward", group=LAYOUT)
    bucket_mb: float = option(25.0, "MiB of gradients per DP bucket (one all-reduce, or ZeRO-1/2 reduce-scatter, "
                                    "each)", group=LAYOUT)
    schedule: str = option("1f1b", "pipeline schedule when --pp > 1", choices=PIPELINE_SCHEDULES, group=LAYOUT)
    virtual_stages: int = option(1, "model chunks per pipeline rank (interleaved; zbv always runs 2)", group=LAYOUT)
    pipeline_layers: str | None = option(None, "comma-separated layer counts of the pipeline stages, summing to "
                                               "the model's layers, e.g. 4,6,6,4 to give the stages holding the "
                                               "embedding and the LM head fewer blocks (default: an even split); "
                                               "with several chunks per rank (interleaved, zbv) one count per "
                                               "virtual stage", metavar="N,N,...", group=LAYOUT)
    recompute: str = option("none", "activation recomputation", choices=RECOMPUTE_MODES, group=LAYOUT)
    compile: bool = option(False, "torch.compile each transformer block (where the backend cannot compile, a "
                                  "warning and an uncompiled run)", group=LAYOUT)
    tp_overlap: bool = option(True, "issue the TP collectives as plain blocking ones, not overlapped with the "
                                    "GEMMs beside them (the same results; to measure the difference; in a config "
                                    "file: tp_overlap = false)", flag="--no-tp-overlap", group=LAYOUT)
    loss_chunk_tokens: int = option(LOSS_CHUNK_TOKENS, "run the LM head and the loss fused, this many tokens at a "
                                                       "time, never holding all the logits (0: logits, then the "
                                                       "loss)", metavar="N", group=LAYOUT)
    dtype: str = option("fp32", "bf16/fp16: parameters, activations and gradients in bf16/fp16 with fp32 master "
                                "weights in the optimizer (fp16 with dynamic loss scaling); fp8: as bf16, with the "
                                "GEMMs of every column/row-parallel linear and expert in fp8 (--fp8-recipe)",
                        choices=TRAIN_DTYPES, group=LAYOUT)
    fp8_recipe: str = option("tensorwise", "--dtype fp8: one dynamic scale per tensor (gradients in e5m2), or per "
                                           "row (gradients in e4m3, the weight gradient in bf16)",
                             choices=FP8_RECIPES, group=LAYOUT)
    grad_reduce_dtype: str = option("fp32", "bf16/fp16 training: accumulate and reduce gradients in this dtype",
                                    choices=GRAD_REDUCE_DTYPES, group=LAYOUT)
    loss_scale: float = option(2.0**16, "fp16: the initial dynamic loss scale", group="optimization")
    loss_scale_window: int = option(1000, "fp16: double the loss scale after this many steps without overflow",
                                    group="optimization")
    cp_impl: str = option("ring", "context-parallel attention: K/V passed round a ring, or all-gathered",
                          choices=CP_IMPLS, group=LAYOUT)
    cp_split: str = option("zigzag", "how the 2 x cp chunks of a sequence are dealt to the CP ranks (zigzag "
                                     "balances causal attention)", choices=CP_SPLITS, group=LAYOUT)
    steps: int = option(300, "total optimizer steps (a resumed run continues up to it)", group="optimization")
    seed: int = option(0, "seeds the weights, the sample order and dropout", group="optimization")
    global_batch_size: int = option(16, "sequences per optimizer step", group="optimization")
    micro_batch_size: int | None = option(None, "sequences per forward pass (default: global batch / dp; 1 with "
                                          "--pp > 1)", group="optimization")
    seq_len: int = option(128, "tokens per sequence", group="optimization")
    lr: float = option(3e-3, "peak learning rate", group="optimization")
    min_lr: float | None = option(None, "final learning rate of the cosine (default lr / 10)", group="optimization")
    warmup_steps: int | None = option(None, "linear warmup steps (default min(100, steps / 10))",
                                      group="optimization")
    lr_schedule: str = option("cosine", "warmup then cosine decay to --min-lr, or WSD: warmup, the peak held, then "
                                        "a decay to --min-lr over the last --decay-fraction of the steps",
                              choices=LR_SCHEDULES, group="optimization")
    decay_fraction: float = option(0.2, "--lr-schedule wsd: the share of --steps its decay takes", metavar="F",
                                   group="optimization")
    decay_shape: str = option("1-sqrt", "--lr-schedule wsd: how the decay falls (1-sqrt: Hägele et al. 2024)",
                              choices=WSD_DECAY_SHAPES, group="optimization")
    optimizer: str = option("adamw", "muon: Muon (momentum, Newton-Schulz orthogonalised, scaled to AdamW's RMS "
                                     "as Moonlight does) for the hidden 2-D weights, AdamW for embeddings, head, "
                                     "norms, biases and routers", choices=OPTIMIZERS, group="optimization")
    muon_momentum: float = option(0.95, "--optimizer muon: the momentum (Nesterov)", group="optimization")
    weight_decay: float = option(0.1, "AdamW weight decay of matrices and embeddings", group="optimization")
    grad_clip: float = option(1.0, "clip the dense gradient norm to this (0: no clipping)", group="optimization")
    on_nan: str = option("stop", "a gradient norm that is NaN or Inf (fp32/bf16; fp16's loss scale handles its own "
                                 "overflows): the step is never applied; stop the run naming the step, the ranks and "
                                 "the first parameter whose gradient is not finite, or skip the step and go on",
                         choices=ON_NAN, group="optimization")
    spike_factor: float = option(0.0, "log a step whose loss exceeds this many times the mean of the previous "
                                      "(up to 20) steps, with the samples it trained on (0: off)", metavar="X",
                                 group="optimization")
    tokenizer: str | None = option(None, "a tokenizer.json or a folder holding one (default: --init-from's, "
                                         "else bytes)", group="data")
    chat_template: str | None = option(None, "a Jinja chat template file for conversations in --data (default: the "
                                             "tokenizer folder's)", metavar="FILE", group="data")
    messages_field: str = option("messages", "the field of conversation rows ([{role, content}, ...]): the loss "
                                             "covers the assistant's turns", group="data")
    prompt_field: str = option("prompt", "the prompt field of prompt/completion rows (not learned)", group="data")
    completion_field: str = option("completion", "the completion field of prompt/completion rows (learned, with "
                                                 "an EOS after it)", group="data")
    example_packing: str = option("packed", "conversations and prompt/completion rows: several to a sequence, none "
                                            "attending to another, or one per sequence, padded",
                                  choices=EXAMPLE_PACKINGS, group="data")
    long_examples: str = option("truncate", "an example longer than --seq-len: cut to it, or left out (counted in "
                                            "the summary either way)", choices=LONG_EXAMPLES, group="data")
    val_data: str | None = option(None, "validation data, any --data form (default: the last --val-fraction of "
                                        "--data)", group="data")
    val_fraction: float = option(0.05, "share of the token stream held out for validation", group="data")
    val_every: int = option(50, "validation loss every this many steps (0: only at the end)", group="data")
    eval_every: int | None = option(None, "the same as --val-every (wins when both are given)", group="data")
    val_windows: int = option(32, "validation windows evaluated each time", group="data")
    save: str | None = option(None, "checkpoint folder (written at the end and every --save-every steps)",
                              group="checkpoints")
    save_every: int = option(0, "save every this many steps (0: only at the end)", group="checkpoints")
    keep_last: int = option(3, "checkpoints to keep", group="checkpoints")
    async_save: bool = option(False, "save in the background: each save copies this rank's shards to host memory "
                                     "(pinned on CUDA) and a thread writes them while training goes on; `latest` "
                                     "moves once every rank has written its files", group="checkpoints")
    resume: str | None = option(None, "continue from a checkpoint up to --steps, at any layout", group="checkpoints")
    out_dir: str | None = option(None, "for the metrics, plots and resolved config (default runs/MODEL-tpT)",
                                 group="output")
    metrics: str | None = option(None, "JSONL file, one object per step (default OUT_DIR/metrics.jsonl)",
                                 group="output")
    sample_tokens: int = option(0, "greedy sample this many tokens at the end", group="output")
    sample_prompt: str = option("The ", "prompt of the sample (conversations in --data: the user's message, rendered "
                                        "with the chat template and its generation prompt)", group="output")
    progress: bool = option(True, "no progress bar", flag="--no-progress", group="output")
    profile_steps: str | None = option(None, "profile training steps A to B (1-based, inclusive) with torch.profiler: "
                                             "one Chrome / Perfetto trace per rank in OUT_DIR/profile/rank{r}.json.gz,"
                                             " collectives and pipeline actions as named ranges", metavar="A:B",
                                       group="output")
    profile_ranks: str | None = option(None, "the ranks --profile-steps traces (default: every rank)",
                                       metavar="R,R,...", group="output")
    memory_snapshot: bool = option(False, "CUDA: record the allocator's history and write "
                                          "torch.cuda.memory._snapshot() to OUT_DIR/memory/rank{r}.pickle at the step "
                                          "of each rank's memory peak and on an out-of-memory error (view it at "
                                          "https://pytorch.org/memory_viz)", group="output")
    tensorboard: str | None = option(None, "also write every metric of each step as TensorBoard scalars to DIR, "
                                           "flushed each step (watch it live: tensorboard --logdir DIR; needs "
                                           "pip install 'tensorpar[tensorboard]')", metavar="DIR", group="output")
    wandb: str | None = option(None, "also log every metric of each step and the run's resolved configuration to "
                                     "this Weights & Biases project (WANDB_MODE=offline and the other WANDB_* "
                                     "variables apply; files in OUT_DIR/wandb unless WANDB_DIR; needs pip install "
                                     "'tensorpar[wandb]')", metavar="PROJECT", group="output")
    wandb_run: str | None = option(None, "the name of the --wandb run (default: one W&B makes up)", metavar="NAME",
                                   group="output")
    dump_collectives_on_exit: bool = option(False, "write every rank's flight record of its last collectives to "
                                                   "OUT_DIR/flight at the end of the run too (it is written when a "
                                                   "collective fails or the run is stopped; read it with "
                                                   "`tensorpar diagnose OUT_DIR`)", group="output")
    dry_run: bool = option(False, "build one rank of a world of --world-size ranks on the meta device with a fake "
                                  "process group (nothing allocated, no peers), run one micro-batch and step, and "
                                  "print its parameter, gradient and optimizer bytes and collectives against the "
                                  "planner's", group="dry run")
    world_size: int | None = option(None, "--dry-run: the world's size (default: --nproc or tp x cp x pp x dp)",
                                    metavar="N", group="dry run")
    rank: int = option(0, "--dry-run: the rank to build", metavar="R", group="dry run")
    return_state: bool = option(False, "put the final dense weights in the summary (tests, small models)", cli=False)
    stop_after: int | None = option(None, "stop at this step (the schedule still spans `steps`): an interrupted run",
                                    cli=False)


@dataclasses.dataclass
class EvalOptions(LoraAdapterOptions, DataOptions, ExpertOptions, LaunchOptions):
    """`tensorpar eval`: the mean next-token loss of a checkpoint on a token stream."""

    checkpoint: str | None = option(None, "a tensorpar checkpoint or a Hugging Face model folder", required=True)
    seq_len: int | None = option(None, "tokens per window (inputs; the window holds one more)", required=True)
    batch_size: int = option(8, "windows per forward pass")
    sequence_parallel: bool = option(False, "shard norms/dropout/residuals along the sequence", group=LAYOUT)
    dtype: str = option("fp32", "fp32, bf16 autocast, or fp8 (bf16 autocast, the parallel linears' GEMMs in fp8)",
                        choices=DTYPES, group=LAYOUT)
    fp8_recipe: str = option("tensorwise", "--dtype fp8: one scale per tensor, or per row", choices=FP8_RECIPES,
                             group=LAYOUT)
    compile: bool = option(False, "torch.compile each transformer block (where the backend cannot compile, a "
                                  "warning and an uncompiled run)", group=LAYOUT)
    cp_impl: str = option("ring", "context-parallel attention: K/V passed round a ring, or all-gathered",
                          choices=CP_IMPLS, group=LAYOUT)


@dataclasses.dataclass
class GenerateOptions(SamplingOptions, LoraAdapterOptions, ExpertOptions, LaunchOptions):
    """`tensorpar generate`: continue prompts with a KV cache sharded by heads."""

    checkpoint: str | None = option(None, "a tensorpar checkpoint or a Hugging Face model folder", required=True)
    prompt: list[str] | None = option(None, "text, tokenised with the checkpoint's tokenizer (tokenizer.json, else "
                                            "bytes); repeat for a batch", repeat=True)
    prompt_ids: list[str] | None = option(None, "comma-separated token ids; repeat for a batch", repeat=True)
    max_new_tokens: int | None = option(None, "tokens to generate per prompt", required=True)
    ignore_eos: bool = option(False, "always generate --max-new-tokens tokens")
    json: bool = option(False, "one JSON line per prompt: ids, text, tokens_per_s")
    sequence_parallel: bool = option(False, "only to refuse it clearly", hidden=True)
    dtype: str = option("fp32", "fp32, bf16 autocast, or fp8 (bf16 autocast, the parallel linears' GEMMs in fp8)",
                        choices=DTYPES, group=LAYOUT)
    fp8_recipe: str = option("tensorwise", "--dtype fp8: one scale per tensor, or per row", choices=FP8_RECIPES,
                             group=LAYOUT)


@dataclasses.dataclass
class ServeOptions(LoraAdapterOptions, ExpertOptions, LaunchOptions):
    """`tensorpar serve`: an OpenAI-compatible server over the TP ranks, continuous batching, a paged KV cache."""

    checkpoint: str | None = option(None, "a tensorpar checkpoint or a Hugging Face model folder", required=True)
    host: str = option("127.0.0.1", "address rank 0's HTTP server listens on", group="server")
    port: int = option(8000, "port rank 0's HTTP server listens on", group="server")
    served_model_name: str | None = option(None, "the model's name in the API (default: --checkpoint as given)",
                                           group="server")
    max_running: int = option(64, "sequences in the running batch at most", group="batching")
    max_queue: int = option(256, "sequences waiting to join the batch at most; a request beyond gets 429",
                            group="batching")
    token_budget: int = option(512, "tokens one step feeds at most (decoding sequences, then prefill chunks)",
                               group="batching")
    block_size: int = option(16, "token slots per block of the paged KV cache", group="batching")
    kv_cache_tokens: int | None = option(None, "token slots of the paged KV pool on each rank (default: "
                                               "max-running full-context sequences)", group="batching")
    batching: str = option("continuous", "continuous: sequences join and leave the batch at every step; static: a "
                                         "batch forms when the last one has finished (for comparison)",
                           choices=BATCHING_MODES, group="batching")
    prefix_caching: bool = option(True, "compute every prompt whole, sharing no KV blocks of prefixes computed before",
                                  flag="--no-prefix-caching", group="batching")
    sequence_parallel: bool = option(False, "only to refuse it clearly", hidden=True)
    dtype: str = option("fp32", "fp32, bf16 autocast, or fp8 (bf16 autocast, the parallel linears' GEMMs in fp8)",
                        choices=DTYPES, group=LAYOUT)
    fp8_recipe: str = option("tensorwise", "--dtype fp8: one scale per tensor, or per row", choices=FP8_RECIPES,
                             group=LAYOUT)


@dataclasses.dataclass
class PlanOptions(LoraShapeOptions, PlanMemoryOptions):
    """`tensorpar plan`: rank layouts for a model on a cluster, or draw a pipeline schedule."""

    model: str | None = option(None, "preset name or config .json", group="layout mode")
    gpus: int | None = option(None, "number of GPUs", group="layout mode")
    gpu: str | None = option(None, "GPU kind, e.g. h100-80gb, a100-80gb, a100-40gb, h200, b200", group="layout mode")
    seq_len: int | None = option(None, "sequence length", group="layout mode")
    global_batch_size: int | None = option(None, "sequences per optimizer step", group="layout mode")
    precision: str = option("tensorpar-bf16", "memory/compute recipe (tensorpar-bf16: what tensorpar does with "
                                              "--dtype bf16)", choices=PLAN_PRECISIONS, group="layout mode")
    top: int | None = option(None, "show the K best layouts (default 10; --json: all)", group="layout mode")
    gpus_per_node: int = option(8, "GPUs per node", group="layout mode")
    intra_bandwidth: float | None = option(None, "NVLink GB/s per GPU per direction", group="layout mode")
    inter_bandwidth: float | None = option(None, "inter-node GB/s per GPU per direction", group="layout mode")
    intra_latency: float | None = option(None, "NVLink latency, microseconds", group="layout mode")
    inter_latency: float | None = option(None, "inter-node latency, microseconds", group="layout mode")
    memory_gib: float | None = option(None, "GPU memory in GiB (default: the catalog's)", group="layout mode")
    peak_tflops: float | None = option(None, "dense bf16 peak TFLOP/s (default: the catalog's)", group="layout mode")
    mfu_ceiling: float | None = option(None, "fraction of peak the arithmetic reaches without communication "
                                             "(default 0.55)", group="layout mode")
    overlap: float | None = option(None, "fraction of data-parallel communication hidden behind backward "
                                         "(default 0.5)", group="layout mode")
    tp: int | None = option(None, "consider only this tensor-parallel size", group="layout mode")
    cp: list[int] = option([1], "context-parallel sizes to consider", group="layout mode")
    ep: int | None = option(None, "consider only this expert-parallel size (MoE models; default: every size that "
                                  "divides num_experts and tp x cp x dp)", group="layout mode")
    zero: list[int] = option(list(PLANNED_ZERO_STAGES), "ZeRO stages to consider", choices=PLANNED_ZERO_STAGES,
                             group="layout mode")
    recompute: list[str] = option(list(RECOMPUTE_MODES), "recomputation modes to consider", choices=RECOMPUTE_MODES,
                                  group="layout mode")
    sequence_parallel: str = option("both", "consider sequence parallelism on, off or both",
                                    choices=SEQUENCE_PARALLEL_SEARCH, group="layout mode")
    flash_attention: bool = option(True, "Playbook precisions: attention stores its s x s scores (no flash "
                                         "attention)", flag="--no-flash-attention", group="layout mode")
    max_micro_batch: int = option(64, "largest micro-batch size tried", group="layout mode")
    schedule: str | None = option(None, "without --model: draw this pipeline schedule; with --model: plan only "
                                        "layouts of this schedule (default: 1f1b, interleaved, zb-h1 and zbv)",
                                  choices=tuple(dict.fromkeys(PIPELINE_SCHEDULES + PLANNED_SCHEDULES)),
                                  group="schedule mode")
    pp: int | None = option(None, "pipeline stages (schedule mode; in layout mode: consider only this pp)",
                            group="schedule mode")
    microbatches: int | None = option(None, "micro-batches per step (schedule mode)", group="schedule mode")
    virtual_stages: int = option(1, "model chunks per pipeline rank (schedule mode; in layout mode: try "
                                    "interleaving up to this)", group="schedule mode")
    pipeline_layers: str | None = option(None, "layout mode: plan uneven pipeline stages with these comma-separated "
                                               "layer counts (as train --pipeline-layers; pp = their number)",
                                         metavar="N,N,...", group="layout mode")
    hardware: str | None = option(None, "layout mode: a `tensorpar calibrate` profile (JSON) to plan for instead of "
                                        "--gpu's catalog figures and compute curve", metavar="PROFILE.json",
                                  group="layout mode")
    tp_overlap: float | None = option(None, "fraction of TP/SP communication hidden behind GEMMs (Megatron "
                                            "--tp-comm-overlap; default 0)", group="layout mode")
    pp_overlap: float | None = option(None, "fraction of the interleaved schedule's point-to-point traffic hidden "
                                            "behind compute (Megatron-Core --overlap-p2p-communication, on in NeMo; "
                                            "default 0)", group="layout mode")
    link_efficiency: float | None = option(None, "fraction of the nominal link bandwidths collectives reach "
                                                 "(default 0.8; 1 with --hardware)", group="layout mode")
    json: bool = option(False, "print JSON instead of a table")
    png: str | None = option(None, "write a picture (layout mode: memory bars + PATH-heatmap.png)")


@dataclasses.dataclass
class CalibrateOptions:
    """`tensorpar calibrate`: measure this machine's GEMMs, memory bandwidth and collectives for the planner."""

    device: str = option("cpu", "the device to measure", choices=("cpu", "cuda"))
    out: str = option("profile.json", "where to write the profile (JSON; `tensorpar plan --hardware` reads it)")
    ranks: int = option(2, "processes (CPU: gloo) or GPUs (cuda: NCCL) the collectives are timed over")
    no_collectives: bool = option(False, "skip the collectives (GEMMs and bandwidth only)")
    threads: int | None = option(None, "CPU: threads the GEMMs may use (default all; a rank of an N-process run "
                                       "gets cores / N)")
    dtypes: str | None = option(None, "comma-separated dtypes whose GEMMs to time (fp32, bf16, fp16, fp8; default "
                                      "cuda: bf16,fp32 and fp8 where the GPU has it; cpu: fp32,bf16)")
    sustain: float = option(0.0, "also run each dtype's best GEMM back to back for this many seconds and plan with "
                                 "the rate it keeps (a GPU at its power limit slows after seconds of load; one "
                                 "process: with --no-collectives or --ranks 1)", metavar="SECONDS")


@dataclasses.dataclass
class DemoOptions(LaunchOptions):
    """`tensorpar demo`: the four TP building blocks on a toy model, rank by rank."""

    tp: int = option(2, "tensor-parallel size", group=LAYOUT)
    hidden: int = option(8, "hidden size")
    ffn: int | None = option(None, "MLP width (default 4 x hidden)")
    vocab: int = option(11, "vocabulary size")
    batch: int = option(2, "sequences")
    seq_len: int = option(4, "tokens per sequence")
    sequence_parallel: bool = option(False, "shard the activations along the sequence", group=LAYOUT)
    seed: int = option(0, "seeds the toy model and batch")


@dataclasses.dataclass
class ExplainOptions:
    """`tensorpar explain`: a collective's ring or tree algorithm, step by step."""

    collective: str | None = option(None, "all-reduce | all-gather | reduce-scatter | reduce | broadcast | gather | "
                                          "scatter", positional=True, metavar="COLLECTIVE")
    ranks: int | None = option(None, "number of ranks N (default 4, or the number of --values lists)", metavar="N")
    algorithm: str | None = option(None, "ring or tree (all-reduce has both; default: ring for all-reduce, "
                                         "all-gather, reduce-scatter and tree for the rest)", metavar="ring|tree")
    root: int | None = option(None, "root rank of the tree collectives (default 0)", metavar="R")
    values: str | None = option(None, "each rank's numbers: comma-separated, ranks separated by ';' or '/' "
                                      "(default: rank r holds r*N+1 .. r*N+N)", metavar="A,B,..;C,D,..")


@dataclasses.dataclass
class DiagnoseOptions:
    """`tensorpar diagnose OUT_DIR`: what the ranks' flight records of collectives say about a failed or hung run."""

    folder: str | None = option(None, "a run's OUT_DIR (or its flight/ folder of rank*.json records)", positional=True,
                                metavar="out_dir")


@dataclasses.dataclass
class ConvertOptions:
    """`tensorpar convert SRC DST`: between tensorpar checkpoints and Hugging Face folders."""

    source: str | None = option(None, "a tensorpar checkpoint or a Hugging Face model folder", positional=True,
                                metavar="source")
    dest: str | None = option(None, "the folder to write (must not exist, or be empty)", positional=True,
                              metavar="dest")
    to: str | None = option(None, "output format (default: the other one)", choices=("hf", "tensorpar"))
    merge_lora: bool = option(False, "merge LoRA adapters (a LoRA run's checkpoint's, or --lora-adapter's) into the "
                                     "weights: W + alpha / r * B A, as PEFT's merge_and_unload")
    lora_adapter: str | None = option(None, "a PEFT LoRA adapter folder of the source model, for --merge-lora",
                                      metavar="DIR")


@dataclasses.dataclass
class PrepareDataOptions(TokenCacheOptions):
    """`tensorpar prepare-data`: tokenize document sources ahead of time into the token cache (what `train`
    reads), and optionally write them as a Megatron indexed dataset."""

    data: str | None = option(None, "a .jsonl/.jsonl.gz/.parquet file or folder, a datasets save_to_disk folder, or "
                                    "a mixture of them ('0.7 PATH_A 0.3 PATH_B' or mix.toml)", required=True,
                              group="data")
    tokenizer: str | None = option(None, "a tokenizer.json or a folder holding one (default: bytes)", group="data")
    output: str | None = option(None, "also write a Megatron indexed dataset PREFIX.bin + PREFIX.idx (one "
                                      "source only)", metavar="PREFIX")
    json: bool = option(False, "print one JSON line per source instead of a sentence")
    progress: bool = option(True, "no progress bar", flag="--no-progress")
