"""Mixture of experts: the router (`router`), the experts of one EP rank (`experts`), the all-to-all token
dispatch of expert parallelism (`dispatch`), and the layer that puts them together (`layer`)."""

from tensorpar.layers.moe.experts import GroupedExperts, experts_per_rank
from tensorpar.layers.moe.layer import STAT_FIELDS, MoELayer, MoEStats
from tensorpar.layers.moe.router import TopKRouter

__all__ = ["MoELayer", "MoEStats", "STAT_FIELDS", "TopKRouter", "GroupedExperts", "experts_per_rank"]
