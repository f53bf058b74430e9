"""A LoRA run's checkpoints against PEFT: the adapter folder saved in each checkpoint loads with `peft` onto the
transformers model and gives tensorpar's logits; `convert --merge-lora` writes PEFT's merged model; the checkpoint
resumes at another layout; a PEFT adapter continues in training; bad adapters and flags are refused in one line."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from tensorpar.checkpoints.peft_adapter import check_lora_model
from tensorpar.checkpoints.sources import load_model_source, load_unmerged
from tensorpar.cli import main
from tensorpar.errors import TensorparError
from tensorpar.models import Transformer, get_config
from tensorpar.models.placement import Placement
from tensorpar.models.state import load_full_state_dict
from tensorpar.tensor_parallel.lora import LoraSpec

from layout_runs import assert_same_training, run

LORA = dict(lora_rank=4, lora_alpha=8.0, micro_batch_size=None)


@pytest.fixture(scope="module")
def lora_run(pools, config_file, tmp_path_factory):
    """Four steps of LoRA at TP 2 + SP, saved at steps 2 and 4, and its checkpoint converted to a Hugging Face folder
    (the base model, its adapter in hf/adapter)."""
    root = tmp_path_factory.mktemp("lora")
    ckpt = str(root / "ckpt")
    result = pools(2).run(run, config_file, **LORA, tp=2, sequence_parallel=True, save=ckpt, save_every=2)[0]
    return dict(root=root, ckpt=ckpt, result=result, adapter=os.path.join(ckpt, "step-000004", "adapter"))


@pytest.fixture(scope="module")
def hf_base(lora_run):
    """`tensorpar convert CKPT hf`: the base model as a Hugging Face folder, its adapter in hf/adapter."""
    folder = str(lora_run["root"] / "hf")
    assert main(["convert", lora_run["ckpt"], folder]) == 0
    assert os.path.isfile(os.path.join(folder, "adapter", "adapter_model.safetensors"))
    return folder


def _peft_model(hf_folder: str, adapter: str):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(hf_folder, dtype=torch.float32),
                                     adapter).eval()


def test_the_saved_adapter_gives_tensorpars_logits_in_peft(lora_run, hf_base):
    with open(os.path.join(lora_run["adapter"], "adapter_config.json")) as f:
        config = json.load(f)
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")
    cfg, base, spec, adapters = load_unmerged(lora_run["ckpt"])
    model = Transformer(cfg, Placement.on(None, lora=spec), init=False).eval()
    load_full_state_dict(model, {**base, **adapters})
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    peft_model = _peft_model(hf_base, lora_run["adapter"])
    with torch.no_grad():
        ours = model(ids)[..., : cfg.vocab_size]
        theirs = peft_model(ids).logits
        with peft_model.disable_adapter():
            without = peft_model(ids).logits
    assert ((ours - theirs).norm() / theirs.norm()).item() <= 1e-5
    assert ((without - theirs).norm() / theirs.norm()).item() > 1e-3, "the adapter changes nothing: a weak check"


def test_an_adapter_peft_made_gives_pefts_logits_in_tensorpar(hf_base, tmp_path):
    """The other way: an adapter made by `peft.get_peft_model` (all linears, B drawn at random, rank 8) loads into
    tensorpar, unmerged for training and merged for eval / generate, with PEFT's logits."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_pretrained(hf_base, dtype=torch.float32)
    peft_model = get_peft_model(hf, LoraConfig(r=8, lora_alpha=4, target_modules="all-linear",
                                               init_lora_weights=False)).eval()
    peft_model.save_pretrained(tmp_path / "made")
    cfg, base, spec, adapters = load_unmerged(hf_base, str(tmp_path / "made"))
    assert (spec.rank, spec.scaling, len(adapters)) == (8, 0.5, 2 * 7 * cfg.num_layers)
    unmerged = Transformer(cfg, Placement.on(None, lora=spec), init=False).eval()
    load_full_state_dict(unmerged, {**base, **adapters})
    merged = Transformer(cfg, Placement.on(None), init=False).eval()
    load_full_state_dict(merged, load_model_source(hf_base, str(tmp_path / "made"))[1])
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = peft_model(ids).logits
        for model in (unmerged, merged):
            assert ((model(ids)[..., : cfg.vocab_size] - theirs).norm() / theirs.norm()).item() <= 1e-5


@pytest.mark.parametrize("family", ["qwen3", "gemma2"])
def test_adapters_on_other_families_give_pefts_logits(family, tmp_path):
    """Qwen 3 (q and k normalised per head after their projections, adapters included) and Gemma 2 (sandwich norms,
    soft caps): an adapter PEFT made on the transformers model gives its logits in tensorpar."""
    import transformers
    from peft import LoraConfig, get_peft_model

    config_cls, model_cls = {"qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
                             "gemma2": ("Gemma2Config", "Gemma2ForCausalLM")}[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(vocab_size=96, hidden_size=32, intermediate_size=48, head_dim=16,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    hf = getattr(transformers, model_cls)(config).eval()
    hf.save_pretrained(tmp_path / "base")
    peft_model = get_peft_model(hf, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                               init_lora_weights=False)).eval()
    peft_model.save_pretrained(tmp_path / "adapter")
    cfg, base, spec, adapters = load_unmerged(str(tmp_path / "base"), str(tmp_path / "adapter"))
    model = Transformer(cfg, Placement.on(None, lora=spec), init=False).eval()
    load_full_state_dict(model, {**base, **adapters})
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = peft_model(ids).logits
        assert ((model(ids)[..., :96] - theirs).norm() / theirs.norm()).item() <= 1e-5


def test_merge_lora_writes_pefts_merged_model(lora_run, hf_base, cli):
    merged = str(lora_run["root"] / "merged")
    code, out, err = cli("convert", lora_run["ckpt"], merged, "--merge-lora")
    assert code == 0, err
    ours = load_file(os.path.join(merged, "model.safetensors"))
    theirs = _peft_model(hf_base, lora_run["adapter"]).merge_and_unload().state_dict()
    assert ours and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert not torch.equal(ours["model.layers.0.mlp.down_proj.weight"],
                           load_file(os.path.join(hf_base, "model.safetensors"))["model.layers.0.mlp.down_proj.weight"])


def test_eval_and_generate_merge_the_checkpoints_or_the_given_adapter(cli, lora_run, hf_base, tmp_path):
    """A LoRA run's checkpoint and its base with --lora-adapter are the same model to eval and generate (the adapter
    merged), another than the base alone."""
    import numpy as np

    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, 200, 400, dtype=np.int32))
    adapter = ("--lora-adapter", lora_run["adapter"])
    evals = [json.loads(cli("eval", "--checkpoint", source, "--data", tokens, "--seq-len", "16", *extra)[1])["loss"]
             for source, extra in ((lora_run["ckpt"], ()), (hf_base, adapter), (hf_base, ()))]
    assert abs(evals[0] - evals[1]) <= 1e-6 * evals[0] and abs(evals[0] - evals[2]) > 1e-4 * evals[0]
    generate = ("--prompt-ids", "1,2,3,4", "--max-new-tokens", "8", "--json")
    ids = [json.loads(cli("generate", "--checkpoint", source, *generate, *extra)[1])["ids"]
           for source, extra in ((lora_run["ckpt"], ()), (hf_base, adapter))]
    assert ids[0] == ids[1]


def test_a_lora_checkpoint_resumes_at_another_layout(pools, config_file, lora_run):
    """Saved at step 2 at TP 2 + SP, resumed at DP 2 with ZeRO-3: steps 3 and 4 as the straight run's."""
    straight = lora_run["result"]
    resumed = pools(2).run(run, config_file, **LORA, dp=2, zero=3,
                           resume=os.path.join(lora_run["ckpt"], "step-000002"))[0]
    assert_same_training([resumed], {"trajectory": straight["trajectory"][2:], "state": straight["state"]}, tol=1e-4)


def test_a_peft_adapter_continues_in_training(pools, config_file, lora_run, hf_base):
    """--init-from the base and --lora-adapter: the model starts with the adapter's weights (lr 0 keeps them), at
    another TP size than it was trained at."""
    # the model is --init-from's: --model keeps its default ("tiny"; another value is refused as unused)
    result = pools(2).run(run, "tiny", **LORA, tp=2, init_from=hf_base, lora_adapter=lora_run["adapter"],
                          steps=1, lr=0.0, min_lr=0.0)[0]
    trained = lora_run["result"]["state"]
    assert all(torch.equal(result["state"][k], v) for k, v in trained.items()), "not the adapter's weights"


def test_bad_adapters_and_flags_are_refused(cli, config_file, lora_run, hf_base, tmp_path):
    dora = tmp_path / "dora"
    shutil.copytree(lora_run["adapter"], dora)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    train = ("train", "--model", config_file, "--steps", "2", "--no-progress")
    cases = [
        (train + ("--lora-alpha", "16"), "--lora-alpha set the LoRA adapters of --lora-rank R: give it too"),
        (train + ("--lora-rank", "4", "--lora-targets", "q,qkv"), "LoRA targets must be a non-empty list of q, k"),
        (train + ("--lora-rank", "-1"), "--lora-rank must be 0 (no adapters) or at least 1, got -1"),
        (train + ("--lora-rank", "4", "--lora-dropout", "1"), "the LoRA dropout must be in [0, 1), got 1.0"),
        (train + ("--lora-rank", "4", "--lora-alpha", "0"), "the LoRA alpha must be a positive number"),
        (("plan", "--model", "llama-8b", "--gpus", "8", "--gpu", "h100", "--seq-len", "4096", "--global-batch-size",
          "64", "--lora-rank", "8", "--lora-alpha", "-2"),
         "the LoRA alpha must be a positive number"),
        (("train", "--model", "tiny-gpt2", "--lora-rank", "4"), "LoRA needs a Llama-style model"),
        (("train", "--model", "tiny-moe", "--lora-rank", "4"), "LoRA on mixture-of-experts MLPs (--lora-targets "
                                                                "gate,up,down) is not supported"),
        (("train", "--model", "tiny-moe", "--lora-rank", "4"), "use --lora-targets q,k,v,o (the default targets "
                                                                "every linear)"),
        (("train", "--model", "tiny-moe", "--lora-rank", "4", "--lora-targets", "q,down"),
         "(--lora-targets down) is not supported: the routed experts are stacked weights, which PEFT adapts through "
         "target_parameters and tensorpar does not yet; use --lora-targets q,k,v,o\n"),
        (train + ("--lora-rank", "4", "--optimizer", "muon"), "--optimizer muon orthogonalises whole weight"),
        (("train", "--model", "tiny-deepseek", "--lora-rank", "4", "--lora-targets", "q,k,v,o"),
         "LoRA on latent attention (DeepSeek-V3, GLM-4.5"),
        (train + ("--lora-adapter", lora_run["adapter"]), "--lora-adapter continues an adapter of the model "
                                                          "--init-from names"),
        (("train", "--init-from", hf_base, "--lora-adapter", str(dora)), "use_dora = True is not supported"),
        (("train", "--init-from", hf_base, "--lora-adapter", lora_run["adapter"], "--lora-rank", "8"),
         "has rank 4, alpha 8 and targets q,k,v,o,gate,up,down"),
        (("train", "--resume", lora_run["ckpt"], "--steps", "6"), "was trained with LoRA adapters (--lora-rank 4 "
                                                                  "--lora-alpha 8 --lora-targets q,k,v,o,gate,up,down"),
        (("eval", "--checkpoint", lora_run["ckpt"], "--seq-len", "16", "--lora-adapter", lora_run["adapter"]),
         "holds LoRA adapters already"),
        (("convert", hf_base, str(tmp_path / "a"), "--merge-lora"), "holds no LoRA adapters"),
        (("convert", hf_base, str(tmp_path / "b"), "--lora-adapter", lora_run["adapter"]), "add --merge-lora"),
    ]
    for argv, message in cases:
        code, out, err = cli(*argv)
        assert code == 2 and message in err and err.count("\n") == 1, (argv, err)
    phi3 = get_config("tiny").replace(family="phi3")
    with pytest.raises(TensorparError, match="LoRA on phi3's fused projections .--lora-targets q,k,v,gate,up."):
        check_lora_model(phi3, LoraSpec(4, 8.0))
    check_lora_model(phi3, LoraSpec(4, 8.0, ("o", "down")))


def test_lora_on_glm_4_5_is_refused_in_one_line():
    """GLM-4.5's attention is grouped-query, not latent: it passed the latent-attention check, then failed with a
    KeyError looking up its family's PEFT names."""
    with pytest.raises(TensorparError, match="LoRA on GLM-4.5 .glm4_moe. is not supported"):
        check_lora_model(get_config("glm-4.5-air"), LoraSpec(4, 8.0, ("q", "k", "v", "o")))
    with pytest.raises(TensorparError, match="LoRA on latent attention"):
        check_lora_model(get_config("tiny-deepseek"), LoraSpec(4, 8.0, ("q", "k", "v", "o")))
