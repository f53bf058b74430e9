"""Document masking of packed sequences: the model on packed documents equals running each document alone through
the dense model (outputs, loss, every weight gradient; fp32, relative error <= 1e-5), on one process and at TP 2 +
SP, CP 2 / CP 4 (ring and all-gather, zigzag, documents crossing chunk and rank boundaries), PP 2, with
recomputation; the ring skips exactly the empty blocks; 20-step TP 2 x CP 2, TP 2 + SP and PP 2 runs equal one
process. One process attends by the default kernel (varlen on CPU) and by the dense [S, S] mask."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tensorpar.models.placement import PipelineStage, Placement
from tensorpar.data.corpus import default_corpus_text
from tensorpar.context_parallel.ring_attention import ContextSplit, context_attention
from tensorpar.distributed.comm import Group
from tensorpar.distributed.sharding import shard_spec, unshard_tensor
from tensorpar.functional.document_mask import PackedDocuments
from tensorpar.models import Transformer, get_config

from checks import rel_err
from harness import mesh
from conftest import TINY8
from layout_runs import assert_same_training, reference, run

# The 20-step run: TINY8 with 2 layers, one micro-batch of two sequences per step, the canonical 20-step runs' warmup.
TRAINING = dict(steps=20, warmup_steps=5, global_batch_size=2, micro_batch_size=2, seq_len=16, document_mask=True)
EOS = 256  # the byte-level tokenizer's
CONFIGS = {"tiny": get_config("tiny").replace(num_layers=2),  # RoPE, GQA
           "tiny-gpt2": get_config("tiny-gpt2").replace(num_layers=2),  # learned positions, tied embeddings
           # Mistral's sliding window (3, shorter than most documents) within the documents' masks
           "windowed": get_config("tiny").replace(num_layers=2, family="mistral", sliding_window=3)}


def packed_windows(seq_len: int, ends: list[list[int]]) -> torch.Tensor:
    """Token windows [rows, seq_len + 1]: random bytes with an EOS at each row's `ends`."""
    torch.manual_seed(0)
    windows = torch.randint(0, EOS, (len(ends), seq_len + 1))
    for row, where in enumerate(ends):
        windows[row, where] = EOS
    return windows


def packed(seq_len: int, ends: list[list[int]]):
    """(inputs, targets) [rows, seq_len] of `packed_windows`."""
    windows = packed_windows(seq_len, ends)
    return windows[:, :-1], windows[:, 1:]


# seq 32 in 8 chunks of 4 at CP 4: documents of 1 to 17 tokens; row 0 starts with one, row 1 with an EOS; two EOSes
# in a row (a one-token document); documents ending exactly at a chunk end (7, 11) and crossing several ranks.
LAYOUT_32 = [[2, 3, 11, 28], [0, 7, 20, 21, 31]]
LAYOUT_16 = [[3, 4, 12], [0, 7, 9]]


def each_document_alone(model, ids, targets):
    """(loss over all targets, logits) of running every document of every row through `model` on its own."""
    docs = PackedDocuments.from_tokens(ids, EOS)
    rows, total = [], 0.0
    for b in range(ids.shape[0]):
        pieces = []
        for d in docs.index[b].unique().tolist():
            where = (docs.index[b] == d).nonzero().flatten()
            start, end = where[0].item(), where[-1].item() + 1
            logits = model(ids[b:b + 1, start:end])
            total = total + model.loss(logits, targets[b:b + 1, start:end]) * (end - start)
            pieces.append(logits)
        rows.append(torch.cat(pieces, dim=1))
    return total / targets.numel(), torch.cat(rows)


def _errors(model, reference, loss, ref_loss, logits=None, ref_logits=None, cp_group=None) -> dict:
    """Relative errors of the loss, (this rank's) logits and every dense gradient this rank holds; gradients of CP
    ranks averaged first (what the optimizer applies)."""
    errs = {"loss": rel_err(loss, ref_loss)}
    if logits is not None:
        errs["logits"] = rel_err(logits, ref_logits)
    ref_grads = dict(reference.named_parameters())
    floor = 1e-3 * torch.sqrt(sum(p.grad.double().pow(2).sum() for p in reference.parameters())).item()
    for name, p in model.named_parameters():
        grad = p.grad.clone()
        if cp_group is not None:
            cp_group.all_reduce(grad)
            grad /= cp_group.size
        grad = unshard_tensor(grad, shard_spec(p), model.tp_group)
        expected = ref_grads[name].grad
        errs[f"grad {name}"] = (grad.double() - expected.double()).norm().item() / max(
            expected.double().norm().item(), floor)
    return errs


def _dense_reference(cfg, ids, targets):
    reference = Transformer(cfg, Group.single("tp"), seed=5)
    ref_loss, ref_logits = each_document_alone(reference, ids, targets)
    ref_loss.backward()
    return reference, ref_loss.detach(), ref_logits.detach()


def _vocab_shard(logits, ref_logits, m):
    vocab = logits.shape[-1]
    full = F.pad(ref_logits, (0, vocab * m.tp_size - ref_logits.shape[-1]))
    return full[..., m.tp_rank * vocab:(m.tp_rank + 1) * vocab]


@pytest.mark.parametrize("kernel", ["auto", "dense"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_packed_documents_equal_each_document_alone(config, kernel):
    """Both kernels of attention within documents: auto (varlen on CPU) and the dense [S, S] mask."""
    cfg = CONFIGS[config]
    ids, targets = packed(16, LAYOUT_16)
    reference, ref_loss, ref_logits = _dense_reference(cfg, ids, targets)
    model = Transformer(cfg, Placement.on(None, document_attention=kernel), seed=5)
    docs = PackedDocuments.from_tokens(ids, EOS)
    loss = model(ids, targets, documents=docs)
    loss.backward()
    errs = _errors(model, reference, loss, ref_loss, model(ids, documents=docs), ref_logits)
    assert max(errs.values()) <= 1e-5, {k: v for k, v in errs.items() if v > 1e-5}
    # Without the mask the documents see each other: the comparison can fail.
    assert rel_err(model(ids), ref_logits) > 1e-3


def test_documents_end_at_and_include_their_eos():
    ids, _ = packed(16, LAYOUT_16)
    docs = PackedDocuments.from_tokens(ids, EOS)
    for b, ends in enumerate(LAYOUT_16):
        starts = [0] + [e + 1 for e in ends if e + 1 < ids.shape[1]]
        for i in range(ids.shape[1]):
            doc = sum(s <= i for s in starts) - 1
            assert docs.index[b, i] == doc and docs.position[b, i] == i - starts[doc]


def _check_ring_blocks(m, impl):
    """Context attention alone against SDPA with the dense document mask; for the ring, the blocks it attends
    (forward and backward) are exactly those the dense mask leaves non-empty."""
    seq_len, cp = 32, m.cp_size
    ids, _ = packed(seq_len, LAYOUT_32)
    docs = PackedDocuments.from_tokens(ids, EOS)
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, h, seq_len, 8, requires_grad=True) for h in (4, 2, 2))
    probe = torch.randn(2, 4, seq_len, 8)
    dense = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                           attn_mask=docs.causal_mask())
    (dense * probe).sum().backward()
    split = ContextSplit(m.cp_group, seq_len, "zigzag", impl, attended_blocks=[0])
    pos = split.positions()
    local = [t.detach()[:, :, pos].clone().requires_grad_() for t in (q, k, v)]
    out = context_attention(*local, split, documents=docs)
    (out * probe[:, :, pos]).sum().backward()
    errs = {f"{impl} out": rel_err(out, dense.detach()[:, :, pos])}
    errs.update({f"{impl} d{n}": rel_err(a.grad, b.grad[:, :, pos]) for n, a, b in zip("qkv", local, (q, k, v))})
    c, mask = split.chunk_len, docs.causal_mask()
    expected = sum(bool(mask[..., qc * c:(qc + 1) * c, kc * c:(kc + 1) * c].any())
                   for qc in split.chunks() for kc in range(2 * cp))
    return errs, (split.attended_blocks[0], 2 * expected if impl == "ring" else 0)


def _check_model(m, config, seq_len, layout, **build):
    """The parallel model with documents against each document alone through the dense model."""
    cfg = CONFIGS[config]
    ids, targets = packed(seq_len, layout)
    reference, ref_loss, ref_logits = _dense_reference(cfg, ids, targets)
    model = Transformer(cfg, Placement.on(m, **build), seed=5)
    model.train()
    docs = PackedDocuments.from_tokens(ids, EOS)
    loss = model(ids, targets, documents=docs)
    loss.backward()
    logits = model(ids, documents=docs).detach()
    context = model.context(seq_len)
    if context is not None:
        ref_logits = ref_logits[:, context.positions()]
    cp_group = m.cp_group if m.cp_size > 1 else None
    return _errors(model, reference, loss, ref_loss, logits, _vocab_shard(logits, ref_logits, m), cp_group)


def check_four_ranks(config_file, data):
    """TP 2 + SP (selective and full recomputation, both position kinds), CP 4 (ring and all-gather), and a 20-step
    TP 2 x CP 2 training run."""
    errs, blocks = {}, {}
    m = mesh(tp=2, dp=2)
    for config, recompute in (("tiny", "selective"), ("tiny-gpt2", "full")):
        found = _check_model(m, config, 16, LAYOUT_16, sequence_parallel=True, recompute=recompute)
        errs.update({f"tp2+sp {config} {k}": v for k, v in found.items()})
    m = mesh(tp=1, cp=4)
    for impl in ("ring", "allgather"):
        found, blocks[impl] = _check_ring_blocks(m, impl)
        errs.update(found)
    for config, impl in (("tiny", "ring"), ("tiny-gpt2", "allgather")):
        found = _check_model(m, config, 32, LAYOUT_32, cp_impl=impl)
        errs.update({f"cp4 {impl} {config} {k}": v for k, v in found.items()})
    runs = [run(config_file, tp=2, cp=2, data=data, **TRAINING),
            run(config_file, tp=2, dp=2, sequence_parallel=True, data=data, **{**TRAINING, "micro_batch_size": 1})]
    return errs, blocks, runs


def check_two_ranks(config_file, data):
    """CP 2 (ring with full recomputation, learned positions) and PP 2 (1F1B, two micro-batches: the second stage
    gets the documents with the hidden states); a 20-step PP 2 training run."""
    from tensorpar.layout import ParallelLayout
    from tensorpar.pipeline_parallel.runner import PipelineRunner

    errs = {f"cp2 {k}": v for k, v in _check_model(mesh(tp=1, cp=2), "tiny-gpt2", 16, LAYOUT_16,
                                                   recompute="full").items()}
    m, cfg = mesh(tp=1, pp=2), CONFIGS["tiny"]
    windows = packed_windows(16, LAYOUT_16)
    reference = Transformer(cfg, Group.single("tp"), seed=5)
    ref_loss = sum(each_document_alone(reference, w[:, :-1], w[:, 1:])[0] for w in windows.split(1)) / 2
    ref_loss.backward()
    stage = Transformer(cfg, Placement.on(m, stage=PipelineStage((m.pp_rank,), m.pp_rank == 0, m.pp_rank == 1)), seed=5)
    stage.train()
    runner = PipelineRunner(stage, m, ParallelLayout(pp=2), 2, (1, 16, cfg.hidden_size))
    documents = [PackedDocuments.from_tokens(w[:, :-1], EOS) for w in windows.split(1)]
    loss = runner.train_step(list(windows.split(1)), lambda i: None, 1.0, documents)
    errs.update({f"pp2 {k}": v for k, v in _errors(stage, reference, torch.tensor(loss), ref_loss).items()})
    return errs, run(config_file, pp=2, data=data, **TRAINING)


def test_document_mask_across_layouts(pools, tmp_path):
    config_file = tmp_path / "tiny8-2-layers.json"
    config_file.write_text(json.dumps(TINY8.replace(num_layers=2).to_dict()))
    config_file = str(config_file)
    data = str(tmp_path / "packed.npy")  # the default corpus's bytes cut into documents of 3 to 20 tokens
    tokens = np.frombuffer(default_corpus_text().encode()[:8192], dtype=np.uint8).astype(np.int64)
    tokens[np.cumsum(np.random.default_rng(0).integers(3, 20, 1000)).clip(max=tokens.size - 1)] = EOS
    np.save(data, tokens)
    found = pools(4).run(check_four_ranks, config_file, data) + [
        (e, {}, [r]) for e, r in pools(2).run(check_two_ranks, config_file, data)]
    for rank, (errs, blocks, _) in enumerate(found):
        bad = {k: f"{v:.1e}" for k, v in errs.items() if v > 1e-5}
        assert not bad, f"rank {rank % 4}: {bad}"
        for impl, (attended, expected) in blocks.items():
            assert attended == expected, f"rank {rank}: the {impl} attended {attended} blocks, not {expected}"
    single = reference(pools, config_file, data=data, **TRAINING)
    assert_same_training([r for _, _, runs in found for r in runs], single)  # TP 2 x CP 2, TP 2 + SP, PP 2
    losses = [loss for loss, _ in single["trajectory"]]
    assert losses[-1] < losses[0] - 1.0, "the reference does not learn: a vacuous comparison"
    unmasked = reference(pools, config_file, data=data, **{**TRAINING, "steps": 5, "document_mask": False})
    assert abs(unmasked["trajectory"][0][0] - losses[0]) > 1e-3 * losses[0], "--document-mask changed nothing"


def test_document_mask_without_an_eos_in_the_vocabulary_is_refused_in_one_line(cli, tmp_path):
    config = tmp_path / "small-vocab.json"
    config.write_text(json.dumps(get_config("tiny").replace(vocab_size=200).to_dict()))
    code, _, err = cli("train", "--model", config, "--document-mask", "--steps", 1)
    assert code != 0 and err.strip().splitlines() == [
        "tensorpar: error: --document-mask: the tokenizer's EOS id 256 is outside the model's vocabulary of 200, so "
        "no document would ever end: use the model's own tokenizer"], err
