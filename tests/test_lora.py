"""LoRA under every layout: TP 2 and 4 (+ SP), CP, DP with ZeRO-1/2/3, PP (1f1b and the zero-bubble split
backward) and, on a mixture-of-experts model's attention, EP train what one process trains; only the adapters change,
the base weights stay bit for bit what they were, in fp32 and in bf16 with fp8 GEMMs."""

import pytest
import torch

from tensorpar.checkpoints.peft_adapter import merge_adapters
from tensorpar.models import Transformer, full_state_dict
from tensorpar.models.placement import Placement
from tensorpar.tensor_parallel.lora import LoraSpec, is_adapter

from conftest import TINY8
from layout_runs import BASE, assert_same_training, reference, run

# One micro-batch per DP rank (the pipelines: four of two sequences), four steps of BASE's.
LORA = dict(lora_rank=4, lora_alpha=8.0, micro_batch_size=None)
LAYOUTS = [dict(tp=2), dict(tp=2, sequence_parallel=True, dp=2, zero=1), dict(tp=4, sequence_parallel=True),
           dict(cp=2, dp=2, zero=3), dict(dp=2, zero=2), dict(pp=2, micro_batch_size=2),
           dict(pp=2, schedule="zb-h1", micro_batch_size=2)]
IDS = ["tp2", "tp2-sp-dp2-zero1", "tp4-sp", "cp2-dp2-zero3", "dp2-zero2", "pp2", "pp2-zb-h1"]


@pytest.fixture(scope="module")
def initial():
    """The dense weights the runs start from (BASE's seed): the seeded base, A drawn as PEFT draws it, B zero."""
    model = Transformer(TINY8, Placement.on(None, lora=LoraSpec(4, 8.0)), seed=BASE["seed"])
    return full_state_dict(model)


def test_adapter_dropout_is_seeded_recomputable_and_off_in_eval():
    """--lora-dropout: each adapter's input mask comes from the micro-batch's dropout seed (the same loss for the same
    seed, another for another), full recomputation replays it (the same gradients), evaluation drops nothing."""
    cfg = TINY8.replace(num_layers=2)
    ids = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))

    def model(dropout, recompute="none"):
        m = Transformer(cfg, Placement.on(None, lora=LoraSpec(4, 8.0, dropout=dropout), recompute=recompute), seed=3)
        with torch.no_grad():
            for name, p in m.named_parameters():
                if name.endswith("lora_B.weight"):
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
        return m

    def loss_and_grads(m, seed):
        loss = m(ids[:, :-1], ids[:, 1:], dropout_seed=seed)
        loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    plain, replayed = model(0.3), model(0.3, recompute="full")
    loss, grads = loss_and_grads(plain, 1)
    assert loss == loss_and_grads(model(0.3), 1)[0] and loss != loss_and_grads(model(0.3), 2)[0]
    loss_r, grads_r = loss_and_grads(replayed, 1)
    assert abs(loss_r - loss) <= 1e-6 * loss and all(torch.allclose(grads_r[n], g, rtol=1e-5, atol=1e-9)
                                                      for n, g in grads.items())
    no_dropout = model(0.0).eval()
    with torch.no_grad():
        assert torch.equal(plain.eval()(ids), no_dropout(ids))


def _world(layout):
    return layout.get("tp", 1) * layout.get("cp", 1) * layout.get("pp", 1) * layout.get("dp", 1)


def assert_only_adapters_trained(state, initial, dtype=torch.float32):
    """Every base weight bit for bit its initial value (in the run's dtype); every adapter's B moved off zero."""
    assert state.keys() == initial.keys()
    for name, value in state.items():
        if is_adapter(name):
            if name.endswith("lora_B.weight"):
                assert value.abs().max() > 0, f"{name} never trained"
        else:
            assert value.dtype == dtype and torch.equal(value, initial[name].to(dtype)), f"{name} changed"


def test_the_single_process_run_trains_the_adapters_alone(pools, config_file, initial):
    ref = reference(pools, config_file, **LORA)
    assert_only_adapters_trained(ref["state"], initial)
    assert ref["trajectory"][-1][0] < ref["trajectory"][0][0]


def _trained_model(result, spec=LoraSpec(4, 8.0)):
    """A run's trajectory and the weights of the model it trained, W + s B A (PEFT's merge). B starts at zero, so
    the factors themselves are compared through their product: an element of B whose first gradient sits within
    float noise of AdamW's eps (about one of the model's 28,000 B elements here) takes a noise-sized step, which
    no weight of the base dilutes; its effect on what the layer computes is that noise's."""
    return {"trajectory": result["trajectory"], "state": merge_adapters(result["state"], spec)}


@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS)
def test_lora_layouts_train_like_one_process(pools, config_file, initial, layout):
    ref = reference(pools, config_file, **LORA)
    results = pools(_world(layout)).run(run, config_file, **{**LORA, **layout})
    assert all(r["trajectory"] == results[0]["trajectory"] for r in results), "ranks disagree on the trajectory"
    assert_same_training([_trained_model(results[0])], _trained_model(ref), tol=1e-4)
    assert_only_adapters_trained(results[0]["state"], initial)


def test_zero3_shards_the_frozen_base_over_dp(pools, config_file, initial):
    """ZeRO-3 shards LoRA's frozen base as it shards the adapters: each of 2 DP ranks holds half of the base (up to
    the padding of its flat units) between uses, and the run is still the one-process run."""
    ref = reference(pools, config_file, **LORA)
    results = pools(2).run(run, config_file, **{**LORA, "dp": 2, "zero": 3})
    assert_same_training([_trained_model(results[0])], _trained_model(ref), tol=1e-4)
    assert_only_adapters_trained(results[0]["state"], initial)
    whole = ref["memory_mib"][0]["frozen"]
    for rank, memory in enumerate(results[0]["memory_mib"]):
        assert whole / 2 <= memory["frozen"] <= whole / 2 * 1.01, (rank, memory["frozen"], whole)


def test_bf16_base_with_fp8_gemms_stays_frozen(pools, config_file, initial):
    """--dtype fp8: the base weights are bf16 parameters multiplied in fp8 and never stepped; the adapters train
    (bf16 parameters, fp32 masters), their products in bf16."""
    result = pools(2).run(run, config_file, **LORA, tp=2, dtype="fp8")[0]
    assert_only_adapters_trained(result["state"], initial, torch.bfloat16)
    losses = [loss for loss, _ in result["trajectory"]]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


def test_attention_adapters_on_a_mixture_of_experts_model_train_like_one_process(pools):
    """A MoE model takes adapters on its attention (its routed experts frozen, stacked weights PEFT adapts
    otherwise): DP 2 x EP 2 with ZeRO-1, and DP 4 x EP 2 with ZeRO-3 (the frozen experts sharded over expert-DP,
    the frozen dense weights over DP), train what one process trains."""
    moe = dict(LORA, lora_targets="q,k,v,o")
    ref = reference(pools, "tiny-moe", **moe)
    spec = LoraSpec(4, 8.0, ("q", "k", "v", "o"))
    for layout in (dict(dp=2, ep=2, zero=1), dict(dp=4, ep=2, zero=3)):
        results = pools(layout["dp"]).run(run, "tiny-moe", **moe, **layout)
        assert_same_training([_trained_model(results[0], spec)], _trained_model(ref, spec), tol=1e-4)
