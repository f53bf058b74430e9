"""TP communication overlapped with compute (tensorpar.tensor_parallel.tp_overlap): the column- and row-parallel layers with
``tp_overlap=True`` match nn.Linear (outputs, input and weight gradients, weights after AdamW) exactly as without
it, move the same bytes in the same kinds of collectives (in more, smaller calls), and the chunking covers
shards that do not split evenly; the whole model trains the same with overlap on and off."""

import pytest
import torch

from tensorpar.tensor_parallel.tp_overlap import _pieces, sp_pieces

from harness import mesh
from test_linear import check_mlp


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


@pytest.mark.parametrize("tp", [2, 3])
def test_a_single_sequence_is_cut_along_the_sequence(pools, tp):
    """Micro-batch of one sequence: the pieces are sequence slices (the batch cannot be cut), still exact."""
    for rank, (errs, fwd, _) in enumerate(pools(tp).run(check_mlp, tp, True, tp_overlap=True, batch=1)):
        bad = {k: v for k, v in errs.items() if v > 1e-5}
        assert not bad, f"rank {rank}: {bad}"
        assert fwd[("all_gather", "tp")][0] == 2, "the forward all-gather was not sent in pieces"


def test_an_odd_number_of_tokens_is_reduced_in_uneven_pieces(pools):
    """Without SP the exit's all-reduce goes in pieces of the tokens: 11 tokens as 5 and 6, still exact."""
    for rank, (errs, fwd, _) in enumerate(pools(2).run(check_mlp, 2, False, tp_overlap=True, batch=1, seq=11)):
        bad = {k: v for k, v in errs.items() if v > 1e-5}
        assert not bad, f"rank {rank}: {bad}"
        assert fwd[("all_reduce", "tp")] == (2, 11 * 12), "the forward all-reduce was not sent in two pieces"


def test_pieces_divide_the_shard():
    assert [_pieces(n, 2) for n in (1, 2, 3, 4, 6)] == [1, 2, 1, 2, 2]
    assert _pieces(12, 5) == 4 and _pieces(7, 4) == 1
    # SP: batch slices where the micro-batch splits, else sequence slices of the shard
    assert [sp_pieces(b, 6) for b in (1, 2, 3, 4)] == [2, 2, 2, 2] and sp_pieces(1, 3) == 1 and sp_pieces(3, 3) == 1
    assert sp_pieces(4, 3, chunks=4) == 4 and sp_pieces(1, 12, chunks=4) == 4


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


BASE = dict(model="tiny", tp=2, steps=4, seed=3, global_batch_size=8, seq_len=32, lr=3e-3, warmup_steps=1,
            val_every=0, val_fraction=0.0, progress=False, metrics=None, out_dir=None, device="cpu", return_state=True)


def trajectory_and_calls(**overrides):
    from tensorpar.training import TrainOptions

    from harness import train

    summary = train(TrainOptions(**{**BASE, **overrides}))
    return [(r["loss"], r["grad_norm"]) for r in summary["history"]], summary["comm"], summary["state"]


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_training_with_overlap_on_and_off_gives_the_same_training(pools, sequence_parallel):
    """4 steps, fp32: loss and grad-norm trajectories and the weights after them within 1e-4; both match one device
    (tests/test_trainer.py)."""
    (on, calls_on, state_on), _ = pools(2).run(trajectory_and_calls, sequence_parallel=sequence_parallel)
    (off, calls_off, state_off), _ = pools(2).run(trajectory_and_calls, sequence_parallel=sequence_parallel,
                                                  tp_overlap=False)
    assert calls_on != calls_off, "--no-tp-overlap changed nothing: the comparison would be vacuous"
    assert {k: b for k, (_, b) in calls_on.items()} == {k: b for k, (_, b) in calls_off.items()}, "different bytes"
    assert len(on) == len(off) == BASE["steps"]
    for step, ((loss, gn), (loss_off, gn_off)) in enumerate(zip(on, off), 1):
        assert abs(loss - loss_off) <= 1e-4 * loss_off, f"step {step}: loss {loss} with overlap, {loss_off} without"
        assert abs(gn - gn_off) <= 1e-4 * gn_off, f"step {step}: grad norm {gn} with overlap, {gn_off} without"
    for name, w in state_off.items():
        err = (state_on[name] - w).norm() / w.norm()
        assert err <= 1e-4, f"weights after step {len(on)}: {name} differs by {err:.1e}"
    assert on[-1][0] < on[0][0] - 1.0, "the run did not learn: a vacuous comparison"
