"""Options that mean something only beside others (`tensorpar.config.applicability`): given where they cannot apply
they are refused in one line naming what they need, before any rank starts; where they apply, and at their
defaults (a run's resolved config.toml holds every field), they pass."""

import pytest

from tensorpar.config.applicability import check_applicable
from tensorpar.config.options import EvalOptions, TrainOptions
from tensorpar.errors import TensorparError
from tensorpar.models import get_config

DENSE, MOE = get_config("tiny"), get_config("tiny-moe")

# (option given, what refuses it, the same option where it applies)
CASES = [
    (dict(fp8_recipe="rowwise"), "--fp8-recipe rowwise needs --dtype fp8", dict(dtype="fp8")),
    (dict(loss_scale=1024.0), "--loss-scale 1024.0 needs --dtype fp16", dict(dtype="fp16")),
    (dict(loss_scale_window=10), "--loss-scale-window 10 needs --dtype fp16", dict(dtype="fp16")),
    (dict(dtype="fp16", on_nan="skip"), "--on-nan skip needs fp32, bf16 or fp8", dict(dtype="bf16")),
    (dict(decay_fraction=0.5), "--decay-fraction 0.5 needs --lr-schedule wsd", dict(lr_schedule="wsd")),
    (dict(decay_shape="linear"), "--decay-shape linear needs --lr-schedule wsd", dict(lr_schedule="wsd")),
    (dict(muon_momentum=0.9), "--muon-momentum 0.9 needs --optimizer muon", dict(optimizer="muon")),
    (dict(sequence_parallel=True), "--sequence-parallel needs --tp 2 or more", dict(tp=2)),
    (dict(tp_overlap=False), "--no-tp-overlap needs --tp 2 or more", dict(tp=2)),
    (dict(schedule="zbv"), "--schedule zbv needs --pp 2 or more", dict(pp=2)),
    (dict(virtual_stages=2), "--virtual-stages 2 needs --pp 2 or more", dict(pp=2)),
    (dict(pipeline_layers="1,3"), "--pipeline-layers 1,3 needs --pp 2 or more", dict(pp=2)),
    (dict(cp_impl="allgather"), "--cp-impl allgather needs --cp 2 or more", dict(cp=2)),
    (dict(cp_split="contiguous"), "--cp-split contiguous needs --cp 2 or more", dict(cp=2)),
    (dict(zero3_reshard_after_forward=False), "--no-zero3-reshard-after-forward needs --zero 3", dict(zero=3)),
    (dict(zero=3, bucket_mb=50.0), "--bucket-mb 50.0 needs --zero 0, 1 or 2", dict(zero=2)),
    (dict(document_attention="dense"), "--document-attention dense needs --document-mask",
     dict(document_mask=True)),
    (dict(keep_last=1), "--keep-last 1 needs --save DIR", dict(save="ck")),
    (dict(world_size=8), "--world-size 8 needs --dry-run", dict(dry_run=True)),
    (dict(bin_dtype="uint32", data="corpus.txt"), "--bin-dtype uint32 needs a raw .bin token file in --data",
     dict(data="0.5 a.bin 0.5 b.txt")),
    (dict(text_field="body", data="corpus.txt"), "--text-field body needs JSONL, Parquet or a datasets folder",
     dict(data="docs.jsonl.gz")),
    (dict(sample_prompt="Hi"), "--sample-prompt Hi needs --sample-tokens N", dict(sample_tokens=4)),
]


@pytest.mark.parametrize("given,error,where", CASES, ids=[next(iter(c[0])) if len(c[0]) == 1 else
                                                          list(c[0])[-1] for c in CASES])
def test_an_option_where_it_cannot_apply_is_refused_and_passes_where_it_does(given, error, where):
    with pytest.raises(TensorparError, match="^" + error.replace("(", r"\(").replace(")", r"\)")):
        check_applicable(TrainOptions(**given), DENSE)
    check_applicable(TrainOptions(**{**given, **where}), DENSE)


def test_the_model_decides_the_expert_options():
    with pytest.raises(TensorparError, match="--expert-gemm loop needs a mixture-of-experts model"):
        check_applicable(TrainOptions(expert_gemm="loop"), DENSE)
    check_applicable(TrainOptions(expert_gemm="loop"), MOE)
    with pytest.raises(TensorparError, match="--fp8-recipe rowwise needs --dtype fp8"):  # eval's options too
        check_applicable(EvalOptions(checkpoint="c", seq_len=8, fp8_recipe="rowwise"), DENSE)


def test_defaults_and_a_resolved_configuration_pass():
    check_applicable(TrainOptions(), DENSE)
    check_applicable(EvalOptions(checkpoint="c", seq_len=8), MOE)
    everything_at_default = TrainOptions(fp8_recipe="tensorwise", loss_scale=2.0**16, decay_fraction=0.2,
                                         schedule="1f1b", cp_impl="ring", keep_last=3)
    check_applicable(everything_at_default, DENSE)


@pytest.mark.parametrize("args,needle", [
    (["--fp8-recipe", "rowwise"], "--fp8-recipe rowwise needs --dtype fp8"),
    (["--pp", "1", "--schedule", "zbv"], "--schedule zbv needs --pp 2 or more"),
    (["--micro-batch-size", "0"], "--micro-batch-size must be at least 1"),
])
def test_the_train_command_refuses_them_in_one_line(cli, args, needle):
    code, _, err = cli("train", "--steps", "2", *args)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
