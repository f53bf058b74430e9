"""`tensorpar convert`: tensorpar checkpoint -> Hugging Face folder -> checkpoint -> folder, bit-exact, the tokenizer
carried along; what the export holds is what transformers' AutoTokenizer and pipeline need."""

import json

import pytest
import torch

from conftest import TINY8 as CONFIG
from test_cli import tensorpar
from test_sharded import run, saved, saved_once  # noqa: F401  (the fixtures and the function their workers run)


def test_convert_round_trip_is_bit_exact_and_transformers_loads_the_export(saved, tmp_path, cli):  # noqa: F811
    """The first conversion is the command's smoke test from a shell; the others run in this process."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    save, _, _ = saved
    hf_dir, back, hf_again = tmp_path / "hf", tmp_path / "back", tmp_path / "hf2"
    proc, _ = tensorpar("convert", str(save), str(hf_dir))
    assert proc.returncode == 0, proc.stderr
    assert f"parameters, {transformers.AutoConfig.from_pretrained(hf_dir).architectures[0]}; " in proc.stdout
    for src, dst in ((hf_dir, back), (back, hf_again)):
        code, _, err = cli("convert", src, dst)
        assert code == 0, err
    first, second = load_file(hf_dir / "model.safetensors"), load_file(hf_again / "model.safetensors")
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
    assert sum(p.numel() for p in model.parameters()) == CONFIG.num_parameters()
    code, _, err = cli("convert", save, hf_dir)
    assert code == 2 and "refusing to overwrite" in err
    # The byte tokenizer the run used travels as files, unchanged through the round trip.
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (hf_dir / name).read_bytes() == (hf_again / name).read_bytes(), name
    assert json.loads((hf_dir / "config.json").read_text())["eos_token_id"] == 256


def test_the_export_generates_in_transformers_pipeline_what_tensorpar_generates(saved, tmp_path, cli):  # noqa: F811
    """A trained byte-tokenizer checkpoint (the demo's model, smaller), converted: AutoTokenizer has tensorpar's ids,
    and pipeline("text-generation")'s greedy text from a text prompt is `tensorpar generate --prompt`'s."""
    transformers = pytest.importorskip("transformers")
    from tensorpar.data import ByteTokenizer

    save, _, _ = saved
    code, _, err = cli("convert", save, tmp_path / "hf")
    assert code == 0, err
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "The héllo — 漢字 "
    assert tokenizer(text)["input_ids"] == ByteTokenizer().encode(text) and tokenizer.eos_token_id == 256
    generator = transformers.pipeline("text-generation", model=str(tmp_path / "hf"))
    expected = generator("The ", max_new_tokens=24, do_sample=False, return_full_text=False)[0]["generated_text"]
    code, out, err = cli("generate", "--checkpoint", save, "--prompt", "The ", "--greedy", "--max-new-tokens", 24,
                         "--json")
    assert code == 0, err
    assert expected and json.loads(out.strip().splitlines()[-1])["text"] == expected


def test_a_runs_tokenizer_folder_travels_with_its_checkpoints_and_exports(pools, tmp_path, cli):
    """Trained with --tokenizer (a Qwen-style folder, chat template included): each checkpoint carries its files,
    `tensorpar generate` finds them from the checkpoint's root, and the export copies them for transformers."""
    transformers = pytest.importorskip("transformers")
    import chat_data
    from tensorpar.data import load_tokenizer
    from tensorpar.models import get_config

    folder = chat_data.write_tokenizer_folder(tmp_path / "qwen", "qwen")
    model = tmp_path / "model.json"
    model.write_text(json.dumps(get_config("tiny").replace(hidden_size=32, ffn_hidden_size=64, num_layers=1,
                                                           vocab_size=chat_data.VOCAB).to_dict()))
    save = tmp_path / "ckpt"
    pools(1).run(run, str(model), steps=1, save=str(save), tokenizer=folder, global_batch_size=2)
    step = save / "step-000001"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (step / name).read_bytes() == (tmp_path / "qwen" / name).read_bytes(), name
    assert json.loads((step / "meta.json").read_text())["tokenizer"] == ["tokenizer.json", "tokenizer_config.json"]
    assert load_tokenizer(str(save)).fingerprint == load_tokenizer(folder).fingerprint

    code, _, err = cli("convert", save, tmp_path / "hf")
    assert code == 0, err
    assert (tmp_path / "hf" / "tokenizer_config.json").read_bytes() == (tmp_path / "qwen" / "tokenizer_config.json") \
        .read_bytes()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    messages = [{"role": "user", "content": "What is 3 plus 4?"}]
    assert "<|im_start|>user\nWhat is 3 plus 4?<|im_end|>" in hf_tokenizer.apply_chat_template(messages, tokenize=False)
    assert hf_tokenizer("a sum of 7")["input_ids"] == load_tokenizer(folder).encode("a sum of 7")
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == load_tokenizer(folder).eos_id == hf_tokenizer.eos_token_id
    # generation pads with the EOS; config.json names the model's own padding row (none here), which transformers
    # would never train: the EOS there would freeze the embedding of the token a chat model must learn to emit
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["pad_token_id"] is None


def test_a_vocabulary_without_room_for_the_byte_tokenizers_end_of_text_exports_without_it(tmp_path, cli):
    """A checkpoint of a 256-token model (say one imported from a Hugging Face folder without tokenizer files and
    trained on token ids) says "byte" like every run without tokenizer files; the byte tokenizer's end-of-text id
    256 lies outside its embedding, and a config.json naming it as eos/pad does not load in transformers."""
    transformers = pytest.importorskip("transformers")
    from tensorpar.checkpoints.dense_checkpoint import write_dense_checkpoint
    from tensorpar.models.state import full_state_dict
    from tensorpar.models import Transformer

    cfg = CONFIG.replace(vocab_size=256, num_layers=1)
    ckpt = write_dense_checkpoint(str(tmp_path / "ckpt"), cfg, full_state_dict(Transformer(cfg, None)))
    code, out, err = cli("convert", ckpt, tmp_path / "hf")
    assert code == 0, err
    assert "no tokenizer: the byte tokenizer's 257 ids do not fit its vocabulary of 256" in out, out
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["eos_token_id"] is None and config["pad_token_id"] is None, config
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert model.get_input_embeddings().num_embeddings == 256


def test_a_hugging_face_folder_without_a_tokenizer_is_not_given_the_byte_one(tmp_path, cli):
    """Weights and config.json alone (vocabulary 512, EOS 4): the converted checkpoint says its tokenizer is unknown,
    and the export back carries none, rather than the byte tokenizer and EOS 256, which this model never had."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, bos_token_id=0, eos_token_id=4)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "generation_config.json").unlink(missing_ok=True)
    for src, dst in (("hf", "ckpt"), ("ckpt", "back")):
        code, out, err = cli("convert", tmp_path / src, tmp_path / dst)
        assert code == 0, err
    assert json.loads((tmp_path / "ckpt" / "step-000000" / "meta.json").read_text())["tokenizer"] == "unknown"
    assert not (tmp_path / "back" / "tokenizer.json").exists() and "no tokenizer" in out
    assert json.loads((tmp_path / "back" / "config.json").read_text()).get("eos_token_id") != 256



def test_a_failed_write_is_one_line_and_leaves_the_destination_reusable(saved, tmp_path, cli):  # noqa: F811
    """A full disk (here a file-size limit: the writer's I/O error is safetensors' own error, not an OSError) fails
    each direction with one line naming the destination; the checkpoint's partial folder is removed, so that the same
    command succeeds once there is room."""
    import resource

    save, _, _ = saved
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    code, _, err = cli("convert", save, tmp_path / "hf")
    assert code == 0, err
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))  # Python ignores SIGXFSZ: a write past it fails EFBIG
    try:
        results = [cli("convert", src, dst)
                   for src, dst in ((save, tmp_path / "hf2"), (tmp_path / "hf", tmp_path / "ck"))]
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    for (code, _, err), dst in zip(results, ("hf2", "ck")):
        assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert f"'{tmp_path / dst}'" in err and "File too large" in err, err
    assert not list((tmp_path / "ck").iterdir())
    code, _, err = cli("convert", tmp_path / "hf", tmp_path / "ck")
    assert code == 0, err
