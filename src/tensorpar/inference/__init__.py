"""Generation with tensor-parallel models: a KV cache sharded by heads, greedy and sampled decoding."""

from tensorpar.inference.generation import generate
from tensorpar.inference.greedy import greedy_generate, tp_argmax
from tensorpar.inference.kv_cache import KVCache

__all__ = ["generate", "KVCache", "greedy_generate", "tp_argmax"]
