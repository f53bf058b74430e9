"""Expert parallelism: mixture-of-experts layers whose experts are spread over the EP group.

The router (`router`), the experts of one EP rank (`experts`, each optionally split over the expert-TP group), the
all-to-all token dispatch (`dispatch`), the collectives it owns (`ep_mappings`: the all-to-all and the expert-TP
row gathers, with their autograd conjugates), and the layer that puts them together (`moe_layer`)."""

from tensorpar.expert_parallel.experts import GroupedExperts
from tensorpar.expert_parallel.moe_layer import STAT_FIELDS, MoELayer, MoEStats
from tensorpar.expert_parallel.router import TopKRouter
from tensorpar.layout.rules import experts_per_rank

__all__ = ["MoELayer", "MoEStats", "STAT_FIELDS", "TopKRouter", "GroupedExperts", "experts_per_rank"]
