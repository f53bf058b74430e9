"""The choices the commands offer, written once: every flag, check and error message reads them from here."""

DTYPES = ("fp32", "bf16", "fp8")  # evaluation and generation precision (--dtype; bf16: autocast over fp32 weights;
#                                  fp8: bf16 autocast, the parallel linears' GEMMs in fp8)
TRAIN_DTYPES = ("fp32", "bf16", "fp16", "fp8")  # training precision (--dtype; bf16/fp16 parameters, fp32 master weights;
#                                                fp8: bf16 parameters, the parallel linears' GEMMs in fp8)
FP8_RECIPES = ("tensorwise", "rowwise")  # how fp8 GEMMs are scaled (--fp8-recipe)
GRAD_REDUCE_DTYPES = ("fp32", "bf16")  # the dtype gradients are accumulated and reduced in (--grad-reduce-dtype)
RECOMPUTE_MODES = ("none", "selective", "full")  # activation recomputation (--recompute)
PIPELINE_SCHEDULES = ("afab", "1f1b", "interleaved", "zb-h1", "zbv")  # --schedule
SPLIT_BACKWARD_SCHEDULES = ("zb-h1", "zbv")  # backward split into B (input gradient) and W (weight gradients)
V_SHAPED_SCHEDULES = ("zbv",)  # two chunks per rank in a V: rank 0 holds the first and the last stage
ZERO_STAGES = (0, 1, 2, 3)  # what training runs (--zero)
PLANNED_ZERO_STAGES = (0, 1, 2, 3)  # what the planner models
LOSS_CHUNK_TOKENS = 1024  # tokens per chunk of the fused LM head + loss, training's default (--loss-chunk-tokens)
ON_NAN = ("stop", "skip")  # what a non-finite gradient norm does to the run (--on-nan)
BIN_DTYPES = ("uint16", "int32")  # raw token files (--bin-dtype)
PLAN_PRECISIONS = ("tensorpar-bf16", "tensorpar-fp16", "tensorpar-fp8", "tensorpar-fp8-rowwise", "tensorpar-bf16-autocast", "tensorpar-fp32", "mixed-bf16",
                   "megatron-bf16", "megatron-fp8", "megatron-fp8-params")  # plan --precision
PLANNED_SCHEDULES = ("1f1b", "interleaved", "zb-h1", "zbv")  # the pipeline schedules the planner models (plan --schedule)
SEQUENCE_PARALLEL_SEARCH = ("both", "on", "off")  # plan --sequence-parallel
CP_IMPLS = ("ring", "allgather")  # context-parallel attention (--cp-impl)
CP_SPLITS = ("zigzag", "contiguous")  # how the sequence's chunks are dealt to the CP ranks (--cp-split)
BATCHING_MODES = ("continuous", "static")  # tensorpar serve --batching
EXAMPLE_PACKINGS = ("packed", "padded")  # instruction examples: several to a row (attention within each), or one
LONG_EXAMPLES = ("truncate", "drop")  # an instruction example longer than the row (--long-examples)
LR_SCHEDULES = ("cosine", "wsd")  # --lr-schedule: warmup + cosine, or warmup-stable-decay
WSD_DECAY_SHAPES = ("1-sqrt", "linear", "cosine")  # the shape of WSD's decay (--decay-shape)
BACKENDS = ("nccl", "gloo")  # --backend (gloo on CUDA: several ranks share one GPU, collectives through host memory)
OPTIMIZERS = ("adamw", "muon")  # --optimizer (muon: Muon for the hidden 2-D weights, AdamW for the rest)
DOCUMENT_ATTENTION = ("auto", "varlen", "flex", "dense")  # --document-attention: packed documents' attention kernel
EXPERT_GEMMS = ("grouped", "loop")  # --expert-gemm: the routed experts' GEMMs, grouped in one call or one per expert
OPTIMIZER_STATE_DTYPES = ("fp32", "bf16")  # --optimizer-state-dtype: AdamW's moments (the master weights stay fp32)
