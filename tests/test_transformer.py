"""The whole TP transformer against the same model on one device: loss, every dense gradient, and a step."""

import pytest
import torch

from tensorpar.models.placement import Placement
from tensorpar.distributed.comm import Group
from tensorpar.distributed.sharding import shard_spec, unshard_tensor
from tensorpar.models import Transformer, get_config

from checks import rel_err
from harness import mesh

# tiny: Llama-style, 4 query heads, 2 KV heads (TP=4 replicates each KV head on 2 ranks), vocab 257.
# tiny-gpt2: LayerNorm, learned positions, biases, tied embeddings, vocab 257.
# mqa-relu: one KV head shared by all ranks, the course slides' ReLU MLP, 6 heads for TP=3.
CONFIGS = {
    "tiny": get_config("tiny").replace(num_layers=2),
    "tiny-gpt2": get_config("tiny-gpt2").replace(num_layers=2),
    "mqa-relu": get_config("tiny").replace(num_layers=2, hidden_size=96, num_heads=6, num_kv_heads=1,
                                           ffn_hidden_size=192, activation="relu", gated_mlp=False),
}


def _dense_grads(model):
    return {n: unshard_tensor(p.grad, shard_spec(p), model.tp_group) for n, p in model.named_parameters()}


def check_model(tp, config, sequence_parallel, recompute):
    m = mesh(tp=tp)
    cfg = CONFIGS[config]
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (2, 12))
    targets = torch.randint(0, cfg.vocab_size, (2, 12))
    targets[0, :2] = -100

    reference = Transformer(cfg, Group.single("tp"), seed=5)
    ref_loss = reference(ids, targets)
    ref_loss.backward()
    model = Transformer(cfg, Placement.on(m, sequence_parallel=sequence_parallel, recompute=recompute), seed=5)
    model.train()
    loss = model(ids, targets)
    loss.backward()

    errs = {"loss": rel_err(loss, ref_loss)}
    grads = _dense_grads(model)
    # The key bias has an identically zero gradient (softmax ignores a shift shared by all keys), so its
    # "relative" error would compare noise with noise: errors are relative to max(|grad|, 1e-3 |all grads|).
    floor = 1e-3 * torch.sqrt(sum(p.grad.double().pow(2).sum() for p in reference.parameters())).item()
    for name, p in reference.named_parameters():
        diff = (grads[name].double() - p.grad.double()).norm().item()
        errs[f"grad {name}"] = diff / max(p.grad.double().norm().item(), floor)
    # SGD: AdamW's first step is about lr * sign(grad), which turns float noise in near-zero gradient
    # entries into O(lr) differences; the layer tests check AdamW steps on better-conditioned gradients.
    for opt_model in (reference, model):
        torch.optim.SGD(opt_model.parameters(), lr=0.5, weight_decay=0.1).step()
    floor = 1e-3 * torch.sqrt(sum(p.detach().double().pow(2).sum() for p in reference.parameters())).item()
    for name, p in reference.named_parameters():
        q = dict(model.named_parameters())[name]
        diff = (unshard_tensor(q.detach(), shard_spec(q), model.tp_group).double() - p.detach().double()).norm()
        errs[f"after step {name}"] = diff.item() / max(p.detach().double().norm().item(), floor)
    return errs


@pytest.mark.parametrize(
    "tp,config,sp,recompute",
    [
        (2, "tiny", False, "none"),
        (4, "tiny", False, "none"),
        (4, "tiny", True, "none"),
        (2, "tiny-gpt2", False, "none"),
        (2, "tiny-gpt2", True, "selective"),
        (4, "tiny-gpt2", True, "full"),
        (3, "mqa-relu", False, "none"),
        (3, "mqa-relu", True, "full"),
    ],
)
def test_tp_transformer_matches_single_device(pools, tp, config, sp, recompute):
    for rank, errs in enumerate(pools(tp).run(check_model, tp, config, sp, recompute)):
        bad = {k: f"{v:.1e}" for k, v in errs.items() if v > 1e-5}
        assert not bad, f"rank {rank}: {bad}"


def check_context_parallel_model(tp, cp, config, sp, recompute, impl, prompt_on_a_rank=False):
    """At cp ranks each holding its zigzag chunks: the loss, this rank's logits, and every gradient averaged over
    the CP ranks (what the optimizer applies) equal the single-device model's. `prompt_on_a_rank`: every target of
    CP rank 1's chunks (positions 4-11 at cp 2) ignored, as a chat's prompt may be."""
    m = mesh(tp=tp, cp=cp, dp=4 // (tp * cp))
    cfg = CONFIGS[config]
    seq_len = 16
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (2, seq_len))
    targets = torch.randint(0, cfg.vocab_size, (2, seq_len))
    targets[0, :3] = -100  # ignored targets, all on one CP rank: the mean weighs each rank by its tokens
    if prompt_on_a_rank:
        targets[:, 4:12] = -100

    reference = Transformer(cfg, Group.single("tp"), seed=5)
    ref_loss = reference(ids, targets)
    ref_loss.backward()
    ref_logits = reference(ids).detach()
    model = Transformer(cfg, Placement.on(m, sequence_parallel=sp, recompute=recompute, cp_impl=impl), seed=5)
    model.train()
    loss = model(ids, targets)
    loss.backward()
    logits = model(ids).detach()  # this rank's chunks and vocabulary shard (SP gathers the sequence back)

    pos = model.context(seq_len).positions()
    vocab = logits.shape[-1]
    expected = torch.nn.functional.pad(ref_logits, (0, vocab * m.tp_size - cfg.vocab_size))[:, pos]
    errs = {"loss": rel_err(loss, ref_loss),
            "logits": rel_err(logits, expected[..., m.tp_rank * vocab:(m.tp_rank + 1) * vocab])}
    for p in model.parameters():
        m.cp_group.all_reduce(p.grad)
        p.grad /= m.cp_size
    grads = _dense_grads(model)
    floor = 1e-3 * torch.sqrt(sum(p.grad.double().pow(2).sum() for p in reference.parameters())).item()
    for name, p in reference.named_parameters():
        diff = (grads[name].double() - p.grad.double()).norm().item()
        errs[f"grad {name}"] = diff / max(p.grad.double().norm().item(), floor)
    return errs


@pytest.mark.parametrize(
    "tp,cp,config,sp,recompute,impl",
    [
        (1, 2, "tiny", False, "none", "ring"),
        (1, 4, "tiny", False, "none", "ring"),
        (1, 4, "tiny", False, "selective", "allgather"),
        (2, 2, "tiny", True, "none", "ring"),  # GQA: 2 KV heads, one per TP rank
        (2, 2, "tiny-gpt2", True, "full", "ring"),  # learned positions follow the zigzag chunks
        (1, 2, "mqa-relu", False, "none", "allgather"),
    ],
)
def test_context_parallel_transformer_matches_single_device(pools, tp, cp, config, sp, recompute, impl):
    for rank, errs in enumerate(pools(4).run(check_context_parallel_model, tp, cp, config, sp, recompute, impl)):
        bad = {k: f"{v:.1e}" for k, v in errs.items() if v > 1e-5}
        assert not bad, f"rank {rank}: {bad}"


def test_a_context_parallel_rank_without_a_learned_target_adds_nothing(pools):
    """A CP rank whose positions are all prompt (ignored targets) adds nothing to the loss, not 0 / 0."""
    for rank, errs in enumerate(pools(4).run(check_context_parallel_model, 1, 2, "tiny", False, "none", "ring", True)):
        bad = {k: f"{v:.1e}" for k, v in errs.items() if not v <= 1e-5}
        assert not bad, f"rank {rank}: {bad}"


@pytest.mark.parametrize("cfg", ["tiny", {"family": "llama", "num_layers": 2}])
def test_a_preset_name_or_a_dict_for_the_config_is_named(cfg):
    """Transformer, build_transformer and ParallelLayout.problems took a preset's name or a dict where a ModelConfig
    goes into an AttributeError ('str' object has no attribute 'num_layers')."""
    import tensorpar
    from tensorpar.errors import TensorparError
    from tensorpar.layout import ParallelLayout
    from tensorpar.models.build import build_transformer

    needle = r"expected a model config \(tensorpar.models.ModelConfig: get_config\('tiny'\).*got " + type(cfg).__name__
    for make in (lambda: Transformer(cfg), lambda: build_transformer(cfg, tensorpar.init_mesh()),
                 lambda: ParallelLayout(tp=2).problems(cfg)):
        with pytest.raises(TensorparError, match=needle):
            make()


def test_token_ids_of_the_wrong_shape_or_dtype_are_named():
    """model(ids) with one sequence as 1-d ids was an IndexError ('tuple index out of range'), float ids a
    RuntimeError from the embedding, and targets of another shape an error deep inside the loss."""
    from tensorpar.errors import TensorparError

    model = Transformer(get_config("tiny"))
    ids = torch.tensor([[1, 2, 3]])
    for args, needle in (((ids[0],), r"token ids must be an int64 or int32 tensor \[batch, seq\] \(one sequence: "
                                     r"ids\[None\]\), got a 1-d torch.int64 tensor"),
                         ((ids.float(),), "got a 2-d torch.float32 tensor"),
                         ((ids, ids[:, :2]),
                          r"targets must be a tensor of the token ids' shape \[1, 3\], got \[1, 2\]")):
        with pytest.raises(TensorparError, match=needle):
            model(*args)
    assert torch.equal(model(ids.int()), model(ids))
