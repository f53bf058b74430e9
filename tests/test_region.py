"""`tp_region` (tensor_parallel/region.py) composes a region's edges with its GEMMs by the rules in its docstring:
SP and overlap only on more than one rank, overlap only with dense GEMMs, fp8 with a split backward refused. Checked
in this process: building a region makes no collective. What each composition computes is checked against the dense
layers by test_linear.py (plain / overlapped, SP), test_fp8.py and test_weight_grad.py."""

import pytest

from tensorpar.distributed.comm import Group
from tensorpar.errors import TensorparError
from tensorpar.pipeline_parallel.weight_grad import WeightGradQueue
from tensorpar.tensor_parallel.fp8_scaling import Fp8Recipe
from tensorpar.tensor_parallel.region import TPRegion, as_region, tp_region
from tensorpar.tensor_parallel.region_edges import OverlappedEdges, PlainEdges
from tensorpar.tensor_parallel.region_gemms import DenseGemms, Fp8Gemms, SplitBackwardGemms


class _TwoRanks(Group):
    """A group's size and rank without a process group: enough for the rules, which make no collective."""

    def __init__(self):
        self.name, self.ranks, self.rank, self.size = "tp", [0, 1], 0, 2


def _parts(region: TPRegion):
    return type(region.edges), region.sequence_parallel, type(region.gemms)


def test_the_rules_compose_edges_with_gemms():
    two, one, queue, recipe = _TwoRanks(), Group.single("tp"), WeightGradQueue(), Fp8Recipe("tensorwise")
    assert _parts(tp_region(two, sequence_parallel=True, overlap=True)) == (OverlappedEdges, True, DenseGemms)
    assert _parts(tp_region(two, overlap=True)) == (OverlappedEdges, False, DenseGemms)
    assert _parts(tp_region(two, sequence_parallel=True)) == (PlainEdges, True, DenseGemms)
    # one rank: nothing to shard over, no collective to hide
    assert _parts(tp_region(one, sequence_parallel=True, overlap=True)) == (PlainEdges, False, DenseGemms)
    # the overlapped ops run their own GEMMs in the compute dtype: fp8 and the split backward take the plain edges
    fp8 = tp_region(two, sequence_parallel=True, overlap=True, fp8=recipe)
    assert _parts(fp8) == (PlainEdges, True, Fp8Gemms) and fp8.fp8 is recipe and fp8.weight_grads is None
    split = tp_region(two, sequence_parallel=True, overlap=True, weight_grads=queue)
    assert _parts(split) == (PlainEdges, True, SplitBackwardGemms) and split.weight_grads is queue
    assert split.fp8 is None and not split.overlap and tp_region(two, overlap=True).overlap


def test_fp8_under_a_split_backward_is_refused():
    with pytest.raises(TensorparError, match=r"^fp8 GEMMs cannot run under a split backward .*use 1f1b or interleaved"):
        tp_region(Group.single("tp"), weight_grads=WeightGradQueue(), fp8=Fp8Recipe("tensorwise"))


def test_without_overlap_and_without_fp8_keep_the_rest():
    two, queue, recipe = _TwoRanks(), WeightGradQueue(), Fp8Recipe("rowwise")
    overlapped = tp_region(two, sequence_parallel=True, overlap=True)
    assert _parts(overlapped.without_overlap()) == (PlainEdges, True, DenseGemms)
    assert overlapped.without_overlap().group is two and overlapped.without_fp8() is overlapped
    # the LM head's region under fp8: dense GEMMs, and still the plain edges fp8 chose
    assert _parts(tp_region(two, sequence_parallel=True, overlap=True, fp8=recipe).without_fp8()) == (
        PlainEdges, True, DenseGemms)
    split = tp_region(two, weight_grads=queue).without_overlap()
    assert _parts(split) == (PlainEdges, False, SplitBackwardGemms) and split.weight_grads is queue


def test_as_region_takes_a_region_or_a_group():
    region = tp_region(_TwoRanks(), sequence_parallel=True)
    assert as_region(region) is region
    assert _parts(as_region(None)) == (PlainEdges, False, DenseGemms) and as_region(None).group.size == 1
