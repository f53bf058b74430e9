"""`tensorpar convert`: tensorpar checkpoint -> Hugging Face folder -> checkpoint -> folder, bit-exact."""

import pytest
import torch

from conftest import TINY8 as CONFIG
from test_cli import tensorpar
from test_sharded import run, saved  # noqa: F401  (the fixture and the function its workers run)


def test_convert_round_trip_is_bit_exact_and_transformers_loads_the_export(saved, tmp_path, cli):  # noqa: F811
    """The first conversion is the command's smoke test from a shell; the others run in this process."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    save, _, _ = saved
    hf_dir, back, hf_again = tmp_path / "hf", tmp_path / "back", tmp_path / "hf2"
    proc, _ = tensorpar("convert", str(save), str(hf_dir))
    assert proc.returncode == 0, proc.stderr
    for src, dst in ((hf_dir, back), (back, hf_again)):
        code, _, err = cli("convert", src, dst)
        assert code == 0, err
    first, second = load_file(hf_dir / "model.safetensors"), load_file(hf_again / "model.safetensors")
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
    assert sum(p.numel() for p in model.parameters()) == CONFIG.num_parameters()
    code, _, err = cli("convert", save, hf_dir)
    assert code == 2 and "refusing to overwrite" in err
