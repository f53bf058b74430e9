"""Generation with tensor-parallel models."""

from tensorpar.inference.greedy import greedy_generate, tp_argmax

__all__ = ["greedy_generate", "tp_argmax"]
