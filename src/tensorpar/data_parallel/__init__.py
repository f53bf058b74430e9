"""Data parallelism (the Playbook's DP chapter): gradients averaged over the ranks that hold the same parameters,
and ZeRO-1/2/3, which shard the optimizer states, the gradients and the parameters over them.

One class per stage, chosen once by `data_parallel_optimizer`: `AllReduceOptimizer` (ZeRO-0), `Zero1Optimizer`,
`Zero2Optimizer` (zero.py; all three bucketed, bucketed.py and buckets.py) and `FullyShardedOptimizer` (ZeRO-3,
fully_sharded.py). They share the flat buffer (flat_buffer.py: a bucket and a ZeRO-3 unit are both one), the fp32
master weights and their pieces (master_weights.py, shard_pieces.py; in host memory: host_masters.py) and the
reduce-scatter queue of ZeRO-2/3.
"""

from tensorpar.config.choices import ZERO_STAGES
from tensorpar.data_parallel.all_reduce import AllReduceOptimizer
from tensorpar.data_parallel.bucketed import BucketedOptimizer
from tensorpar.data_parallel.buckets import DEFAULT_BUCKET_BYTES
from tensorpar.data_parallel.fully_sharded import FullyShardedOptimizer
from tensorpar.data_parallel.zero import Zero1Optimizer, Zero2Optimizer
from tensorpar.errors import TensorparError

OPTIMIZERS = {0: AllReduceOptimizer, 1: Zero1Optimizer, 2: Zero2Optimizer, 3: FullyShardedOptimizer}


def data_parallel_optimizer(model, mesh, *, zero: int = 0, **kwargs) -> BucketedOptimizer | FullyShardedOptimizer:
    """AdamW (or with ``optimizer="muon"`` Muon for the hidden matrices: muon_matrices.py) over `model`'s parameters
    across the mesh's DP (x CP) group at ZeRO stage `zero`. `kwargs`: lr, weight_decay, betas, eps, reduce_dtype,
    optimizer, muon_momentum, offload (the masters and states on the host: host_masters.py), state_dtype (AdamW's
    moments), and the stage's own (bucket_bytes for 0-2; reshard_after_forward and prefetch for 3)."""
    if zero not in ZERO_STAGES:
        raise TensorparError(f"ZeRO stage must be one of {sorted(ZERO_STAGES)}, got {zero}")
    return OPTIMIZERS[zero](model, mesh, **kwargs)


__all__ = ["AllReduceOptimizer", "BucketedOptimizer", "DEFAULT_BUCKET_BYTES", "FullyShardedOptimizer", "OPTIMIZERS",
           "Zero1Optimizer", "Zero2Optimizer", "data_parallel_optimizer"]
