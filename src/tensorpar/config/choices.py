"""The choices the commands offer, written once: every flag, check and error message reads them from here."""

DTYPES = ("fp32", "bf16")  # training and inference precision (--dtype)
RECOMPUTE_MODES = ("none", "selective", "full")  # activation recomputation (--recompute)
PIPELINE_SCHEDULES = ("afab", "1f1b", "interleaved")  # --schedule
ZERO_STAGES = (0, 1, 2, 3)  # what training runs (--zero)
PLANNED_ZERO_STAGES = (0, 1, 2, 3)  # what the planner models
BIN_DTYPES = ("uint16", "int32")  # raw token files (--bin-dtype)
PLAN_PRECISIONS = ("tensorpar-bf16", "tensorpar-fp32", "mixed-bf16", "megatron-bf16")  # plan --precision
SEQUENCE_PARALLEL_SEARCH = ("both", "on", "off")  # plan --sequence-parallel
CP_IMPLS = ("ring", "allgather")  # context-parallel attention (--cp-impl)
CP_SPLITS = ("zigzag", "contiguous")  # how the sequence's chunks are dealt to the CP ranks (--cp-split)
