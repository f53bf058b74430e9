"""Training the Llama-style families (tests/family_models.py) at every layout: 10 steps from each family's
transformers folder (`--init-from`) at TP 2 with sequence parallelism and CP 2 (the ring: sliding windows skip blocks,
Gemma's local and global layers alternate), and at PP 2 with DP 2 and ZeRO-1, equal one process step by step (loss,
grad norm) and in the final weights; the trained weights, exported, load in transformers with tensorpar's loss."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tensorpar.checkpoints.hf import save_hf_folder  # noqa: E402
from tensorpar.checkpoints.hf_config import config_from_hf  # noqa: E402
from tensorpar.models import Transformer, load_full_state_dict  # noqa: E402

from family_models import NAMES, SEQ, VOCAB, families  # noqa: E402,F401  (a fixture)
from layout_runs import assert_same_training, reference, run  # noqa: E402

TOL = 1e-5
STEPS = dict(steps=10, seq_len=SEQ, global_batch_size=2)  # one micro-batch per DP rank, two without DP
LAYOUTS = [dict(tp=2, sequence_parallel=True, cp=2), dict(pp=2, dp=2, zero=1)]


@pytest.mark.parametrize("name", NAMES)
def test_layouts_train_as_one_process_and_export_to_transformers(pools, families, tmp_path, name):
    folder = families[name]["folder"]
    ref = reference(pools, "tiny", init_from=folder, **STEPS)
    for layout in LAYOUTS:
        assert_same_training(pools(4).run(run, "tiny", init_from=folder, **STEPS, **layout), ref)

    cfg = config_from_hf(families[name]["model"].config.to_dict())
    save_hf_folder(tmp_path / "trained", cfg, ref["state"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "trained", attn_implementation="eager").eval()
    ours = Transformer(cfg, init=False)
    load_full_state_dict(ours, ref["state"], "trained")
    windows = families["windows"]
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(hf(windows[:, :-1]).logits.reshape(-1, VOCAB),
                                                     windows[:, 1:].reshape(-1))
        loss = ours.eval()(windows[:, :-1], windows[:, 1:])
    assert abs(loss.item() - expected.item()) <= TOL * expected.item(), (loss.item(), expected.item())
