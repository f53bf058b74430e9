"""TP communication overlapped with compute (tensorpar.layers.tp_overlap): the column- and row-parallel layers with
``tp_overlap=True`` match nn.Linear (outputs, input and weight gradients, weights after AdamW) exactly as without
it, move the same bytes in the same kinds of collectives (in more, smaller calls), and the chunking covers
shards that do not split evenly; the whole model trains the same with overlap on and off."""

import pytest
import torch

from tensorpar.layers.tp_overlap import _pieces

from harness import mesh
from test_linear import B, H, S, check_mlp


@pytest.mark.parametrize("tp", [2, 3, 4])  # at tp 4 the [B, 3, H] shard is not split into 2 pieces: 1 is used
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_overlapped_column_row_mlp_matches_dense(pools, tp, sequence_parallel):
    plain = pools(tp).run(check_mlp, tp, sequence_parallel)
    for rank, ((errs, fwd, total), (_, fwd_ref, total_ref)) in enumerate(
            zip(pools(tp).run(check_mlp, tp, sequence_parallel, tp_overlap=True), plain)):
        bad = {k: v for k, v in errs.items() if v > 1e-5}
        assert not bad, f"rank {rank}: {bad}"
        elements = lambda counts: {op: n for op, (_, n) in counts.items()}  # noqa: E731
        assert elements(fwd) == elements(fwd_ref) and elements(total) == elements(total_ref), \
            f"rank {rank}: overlap moved {total}, without it {total_ref}"
        if sequence_parallel and tp < 4:
            assert fwd[("all_gather", "tp")][0] == 2, "the forward all-gather was not sent in pieces"


def test_pieces_divide_the_shard():
    assert [_pieces(n, 2) for n in (1, 2, 3, 4, 6)] == [1, 2, 1, 2, 2]
    assert _pieces(12, 5) == 4 and _pieces(7, 4) == 1


def check_async_op_is_timed():
    """An asynchronous all-reduce counts once when started and adds the seconds blocked in wait() to its time."""
    m = mesh(tp=2)
    m.stats.timing = True
    try:
        pending = m.tp_group.all_reduce_async(torch.ones(1000))
        pending.wait()
        counts = m.stats.snapshot()[("all_reduce", "tp")]
        return counts.calls, counts.elements, counts.seconds
    finally:
        m.stats.timing = False


def test_async_collectives_are_counted_and_timed(pools):
    for calls, elements, seconds in pools(2).run(check_async_op_is_timed):
        assert (calls, elements) == (1, 1000) and seconds > 0
