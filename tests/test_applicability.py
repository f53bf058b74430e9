"""Options that act only beside other options, on some models or on some data (tensorpar.config.applicability): given
with a value other than their default where they would change nothing, each is refused by its command's validation in
one line naming it, its value and what it needs; the same option is accepted where it applies, and a run's resolved
configuration loads again. In process, before any rank exists."""

import json

import numpy as np
import pytest

from tensorpar.commands import eval as eval_command
from tensorpar.commands import generate, serve
from tensorpar.config import applicability
from tensorpar.config.fields import cli_specs, load_toml, to_toml
from tensorpar.config.options import (CalibrateOptions, EvalOptions, GenerateOptions, PlanOptions, ServeOptions,
                                      TrainOptions)
from tensorpar.errors import TensorparError
from tensorpar.tensor_parallel.fp8_scaling import fp8_unsupported
from tensorpar.training import validate

import chat_data
from corpora import write_jsonl
from layout_runs import BASE

FP8 = pytest.mark.skipif(fp8_unsupported("cpu") is not None, reason="this torch has no fp8 GEMMs on CPU")
OPTIONS = {"train": TrainOptions, "eval": EvalOptions, "generate": GenerateOptions, "serve": ServeOptions,
           "plan": PlanOptions, "calibrate": CalibrateOptions}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Paths the cases name: data of every kind, the chat model and tokenizer, a dense and an MoE checkpoint."""
    from tensorpar.checkpoints.dense_checkpoint import write_dense_checkpoint
    from tensorpar.models import Transformer, get_config
    from tensorpar.models.state import full_state_dict

    root = tmp_path_factory.mktemp("applicability")
    (root / "plain.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    (np.arange(2000, dtype=np.int32) % 250).tofile(root / "ids32.bin")
    chat = chat_data.write_chat_jsonl(root / "chat.jsonl", 8)
    with open(chat) as f, open(root / "conv.jsonl", "w") as out:  # the conversations under another field's name
        for line in f:
            out.write(json.dumps({"conv": json.loads(line)["messages"]}) + "\n")
    with open(root / "qa.jsonl", "w") as f:
        for i in range(8):
            f.write(json.dumps({"question": f"what is {i} plus 1?", "answer": f"{i + 1}"}) + "\n")
    chat_model = root / "chat-model.json"
    chat_model.write_text(json.dumps(get_config("tiny").replace(vocab_size=chat_data.VOCAB).to_dict()))
    checkpoints = {}
    for name in ("tiny-gpt2", "tiny-moe"):
        cfg = get_config(name)
        checkpoints[name] = write_dense_checkpoint(str(root / name), cfg, full_state_dict(Transformer(cfg, None)))
    return dict(text=str(root / "plain.txt"), bin32=str(root / "ids32.bin"), chat=chat, conv=str(root / "conv.jsonl"),
                qa=str(root / "qa.jsonl"), body=write_jsonl(root / "body.jsonl", field="body"),
                chat_model=str(chat_model), chat_tok=chat_data.write_tokenizer_folder(root / "llama3", "llama3"),
                dense=str(root / "tiny-gpt2"), moe=str(root / "tiny-moe"), save=str(root / "save"),
                cache=str(root / "cache"), template=str(root / "t.jinja"))


def _filled(files, value):
    return value.format(**files) if isinstance(value, str) else value


def train_options(files, overrides: dict) -> TrainOptions:
    given = {k: _filled(files, v) for k, v in overrides.items()}
    return TrainOptions(**{"model": "tiny", **BASE, "data_cache": files["cache"], **given})


def validate_train(files, overrides: dict):
    o = train_options(files, overrides)
    return validate(o, o.world_size or o.tp * o.cp * o.pp * (o.dp or 1))


CHAT = dict(model="{chat_model}", tokenizer="{chat_tok}", data="{chat}")
DEFAULT_DATA = "the default corpus (no --data)"
NO_ROWS = "holds no conversations nor prompt/completion rows"

# id: (refused options, the one line, the same option where it applies (None: covered elsewhere))
TRAIN = {
    "fp8-recipe": (dict(fp8_recipe="rowwise", dtype="bf16"),
                   "--fp8-recipe rowwise needs --dtype fp8 (it scales the fp8 GEMMs; --dtype is bf16)",
                   pytest.param(dict(fp8_recipe="rowwise", dtype="fp8"), marks=FP8)),
    "loss-scale": (dict(loss_scale=1024.0),
                   "--loss-scale 1024 needs --dtype fp16 (fp16's dynamic loss scaling starts from it; --dtype is fp32)",
                   dict(loss_scale=1024.0, dtype="fp16")),
    "loss-scale-window": (dict(loss_scale_window=10, dtype="bf16"),
                          "--loss-scale-window 10 needs --dtype fp16 (fp16's dynamic loss scaling grows after this "
                          "many steps without overflow; --dtype is bf16)", dict(loss_scale_window=10, dtype="fp16")),
    "grad-reduce-dtype": (dict(grad_reduce_dtype="bf16"),
                          "--grad-reduce-dtype bf16 needs --dtype bf16, fp16 or fp8 (bf16/fp16 gradients are "
                          "accumulated and reduced in it; --dtype is fp32: fp32 gradients are accumulated and reduced "
                          "in fp32)", dict(grad_reduce_dtype="bf16", dtype="bf16")),
    "on-nan": (dict(on_nan="skip", dtype="fp16"),
               "--on-nan skip needs --dtype fp32, bf16 or fp8 (it handles a step whose gradient norm is not finite; "
               "--dtype is fp16, whose loss scaling skips such a step and lowers its scale)",
               dict(on_nan="skip", dtype="bf16")),
    "decay-fraction": (dict(decay_fraction=0.25),
                       "--decay-fraction 0.25 needs --lr-schedule wsd (the share of the steps WSD's decay takes; "
                       "--lr-schedule is cosine)", dict(decay_fraction=0.25, lr_schedule="wsd")),
    "decay-shape": (dict(decay_shape="linear"),
                    "--decay-shape linear needs --lr-schedule wsd (how WSD's decay falls; --lr-schedule is cosine)",
                    dict(decay_shape="linear", lr_schedule="wsd")),
    "muon-momentum": (dict(muon_momentum=0.9),
                      "--muon-momentum 0.9 needs --optimizer muon (Muon's momentum; --optimizer is adamw)",
                      dict(muon_momentum=0.9, optimizer="muon")),
    "expert-gemm": (dict(expert_gemm="loop"),
                    "--expert-gemm loop needs a mixture-of-experts model (it runs the routed experts' GEMMs; this "
                    "model is dense (num_experts = 0))", dict(expert_gemm="loop", model="tiny-moe")),
    "schedule": (dict(schedule="zbv"),
                 "--schedule zbv needs --pp > 1 (it orders the pipeline stages' micro-batches; --pp is 1)",
                 dict(schedule="zbv", pp=2)),
    "pipeline-layers": (dict(pipeline_layers="1,3"),
                        "--pipeline-layers 1,3 needs --pp > 1 (it sizes the pipeline stages; --pp is 1)",
                        dict(pipeline_layers="1,3", pp=2)),
    "cp-impl": (dict(cp_impl="allgather"),
                "--cp-impl allgather needs --cp > 1 (it is context parallelism's attention; --cp is 1)",
                dict(cp_impl="allgather", cp=2)),
    "cp-split": (dict(cp_split="contiguous"),
                 "--cp-split contiguous needs --cp > 1 (it deals a sequence's chunks to the CP ranks; --cp is 1)",
                 dict(cp_split="contiguous", cp=2)),
    "sequence-parallel": (dict(sequence_parallel=True),
                          "--sequence-parallel needs --tp > 1 (it shards the activations along the sequence over the "
                          "TP ranks; --tp is 1)", dict(sequence_parallel=True, tp=2)),
    "no-tp-overlap": (dict(tp_overlap=False),
                      "--no-tp-overlap needs --tp > 1 (it issues the TP collectives blocking; --tp is 1)",
                      dict(tp_overlap=False, tp=2)),
    "no-tp-overlap-fp8": pytest.param(dict(tp_overlap=False, tp=2, dtype="fp8"),
                                      "--no-tp-overlap needs --dtype fp32, bf16 or fp16 (fp8 GEMMs always issue the "
                                      "TP collectives blocking; --dtype is fp8)", dict(tp_overlap=False, tp=2,
                                                                                       dtype="bf16"), marks=FP8),
    "no-tp-overlap-split-backward": (dict(tp_overlap=False, tp=2, pp=2, schedule="zb-h1"),
                                     "--no-tp-overlap needs --schedule afab, 1f1b or interleaved (a split backward "
                                     "always issues the TP collectives blocking; --schedule is zb-h1)",
                                     dict(tp_overlap=False, tp=2, pp=2, schedule="1f1b")),
    "no-zero3-reshard": (dict(zero3_reshard_after_forward=False, dp=2, zero=2),
                         "--no-zero3-reshard-after-forward needs --zero 3 (it keeps ZeRO-3's gathered parameters from "
                         "a block's forward to its backward; --zero is 2)",
                         dict(zero3_reshard_after_forward=False, dp=2, zero=3)),
    "bucket-mb": (dict(bucket_mb=10.0, dp=2, zero=3),
                  "--bucket-mb 10 needs --zero 0, 1 or 2 (it sizes the gradient buckets; --zero is 3, which reduces "
                  "each block's gradients as one unit)", dict(bucket_mb=10.0, dp=2, zero=1)),
    "model": (dict(model="tiny-moe", init_from="{dense}"),
              "--model tiny-moe needs no --init-from (it names the model to build; --init-from '{dense}' is the "
              "model)", dict(init_from="{dense}")),
    "keep-last": (dict(keep_last=5),
                  "--keep-last 5 needs --save DIR (it is how many of its checkpoints to keep; the run saves none)",
                  dict(keep_last=5, save="{save}")),
    "sample-prompt": (dict(sample_prompt="What is 3 plus 4?"),
                      "--sample-prompt 'What is 3 plus 4?' needs --sample-tokens N (it prompts the sample generated "
                      "at the end; --sample-tokens is 0)", dict(sample_prompt="What is 3 plus 4?", sample_tokens=4)),
    "val-fraction": (dict(val_fraction=0.1, val_data="{text}"),
                     "--val-fraction 0.1 needs no --val-data (it holds the end of --data out for validation; "
                     "--val-data '{text}' is the validation data and --data all training)", dict(val_fraction=0.1)),
    "world-size": (dict(world_size=8),
                   "--world-size 8 needs --dry-run (the world a dry run builds one rank of; a run's world is --nproc "
                   "or tp x cp x pp x dp)", dict(world_size=8, dry_run=True)),
    "rank": (dict(rank=3),
             "--rank 3 needs --dry-run (the rank a dry run builds; a run starts every rank)",
             dict(rank=3, dry_run=True, world_size=4)),
    "document-mask": (dict(CHAT, document_mask=True),
                      "--document-mask needs documents in --data (it keeps attention within the documents its EOS "
                      "ends; --data '{chat}' holds conversations, each of which attends only within itself already)",
                      dict(document_mask=True, data="{text}")),
    "document-attention": (dict(document_attention="dense"),
                           "--document-attention dense needs --document-mask, or conversations or prompt/completion "
                           f"rows in --data (it is the kernel of attention within documents; {DEFAULT_DATA} {NO_ROWS}, "
                           "and --document-mask is off)", dict(document_attention="dense", document_mask=True)),
    "document-attention-examples": (dict(document_attention="dense", data="{text}"),
                                    "--document-attention dense needs --document-mask, or conversations or "
                                    "prompt/completion rows in --data (it is the kernel of attention within documents; "
                                    f"--data '{{text}}' {NO_ROWS}, and --document-mask is off)",
                                    dict(CHAT, document_attention="dense")),
    "document-attention-cp": (dict(document_attention="dense", document_mask=True, cp=2),
                              "--document-attention dense needs --cp 1 (it is the kernel of attention within "
                              "documents, which context parallelism's --cp-impl masks itself; --cp is 2)",
                              None),
    "messages-field": (dict(messages_field="conv", data="{text}"),
                       f"--messages-field conv needs conversations in --data (it names their field; --data '{{text}}' "
                       f"{NO_ROWS})", dict(CHAT, messages_field="conv", data="{conv}")),
    "prompt-field": (dict(CHAT, prompt_field="question"),
                     "--prompt-field question needs prompt/completion rows in --data (it names their prompt field; "
                     "--data '{chat}' holds conversations)",
                     dict(CHAT, prompt_field="question", completion_field="answer", data="{qa}")),
    "completion-field": (dict(CHAT, completion_field="answer"),
                         "--completion-field answer needs prompt/completion rows in --data (it names their completion "
                         "field; --data '{chat}' holds conversations)", None),
    "chat-template": (dict(CHAT, prompt_field="question", completion_field="answer", data="{qa}",
                           chat_template="{template}"),
                      "--chat-template {template} needs conversations in --data (it renders them; --data '{qa}' holds "
                      "prompt/completion pairs)", None),
    "example-packing": (dict(example_packing="padded"),
                        "--example-packing padded needs conversations or prompt/completion rows in --data (it lays "
                        f"their examples into rows; {DEFAULT_DATA} {NO_ROWS})", dict(CHAT, example_packing="padded")),
    "long-examples": (dict(long_examples="drop", data="{text}"),
                      "--long-examples drop needs conversations or prompt/completion rows in --data (it is what "
                      f"becomes of an example longer than --seq-len; --data '{{text}}' {NO_ROWS})",
                      dict(CHAT, long_examples="drop")),
    "text-field": (dict(text_field="body", data="{text}"),
                   "--text-field body needs a JSONL, Parquet or datasets source of documents (it names their text "
                   "field; --data '{text}' holds text)", dict(text_field="body", data="{body}")),
    "text-field-examples": (dict(CHAT, text_field="body"),
                            "--text-field body needs a JSONL, Parquet or datasets source of documents (it names their "
                            "text field; --data '{chat}' holds conversations)", None),
    "val-every": (dict(val_every=10),
                  "--val-every 10 needs validation data (--val-fraction > 0 or --val-data) (it is how often the "
                  "validation loss is taken; --val-fraction is 0 and there is no --val-data)",
                  dict(val_every=10, val_fraction=0.1)),
    "eval-every": (dict(eval_every=10),
                   "--eval-every 10 needs validation data (--val-fraction > 0 or --val-data) (it is how often the "
                   "validation loss is taken; --val-fraction is 0 and there is no --val-data)",
                   dict(eval_every=10, val_data="{text}", val_fraction=TrainOptions().val_fraction)),
    "val-windows": (dict(val_windows=4),
                    "--val-windows 4 needs validation data (--val-fraction > 0 or --val-data) (it is how many windows "
                    "each validation evaluates; --val-fraction is 0 and there is no --val-data)",
                    dict(val_windows=4, val_fraction=0.1)),
    "bin-dtype": (dict(bin_dtype="int32"),
                  "--bin-dtype int32 needs a raw .bin token file (it is the dtype of .bin token files; "
                  f"{DEFAULT_DATA} holds text)", dict(bin_dtype="int32", data="{bin32}")),
}


def _unwrap(x) -> tuple:
    """(the values, the marks) of a case or of its options: as written, or a pytest.param's."""
    if not hasattr(x, "marks"):
        return x, ()
    return (x.values[0] if len(x.values) == 1 else x.values), tuple(x.marks)


def _cases(table, accepted: bool):
    out = []
    for name, case in table.items():
        (refused, message, applies), marks = _unwrap(case)
        applies, more = _unwrap(applies)
        if not accepted:
            out.append(pytest.param(refused, message, id=name, marks=marks))
        elif applies is not None:
            out.append(pytest.param(applies, id=name, marks=marks + more))
    return out


@pytest.mark.parametrize("overrides,message", _cases(TRAIN, accepted=False))
def test_train_refuses_an_option_that_would_change_nothing(files, overrides, message):
    with pytest.raises(TensorparError) as e:
        validate_train(files, overrides)
    assert str(e.value) == message.format(**files)


@pytest.mark.parametrize("overrides", _cases(TRAIN, accepted=True))
def test_train_accepts_the_same_option_where_it_applies(files, overrides):
    validate_train(files, overrides)


def test_a_runs_resolved_configuration_loads_again(files, tmp_path):
    """Every field written (defaults included), those that apply given: `train --config` takes it back."""
    for overrides in ({}, dict(dtype="fp16", loss_scale=256.0, lr_schedule="wsd", decay_fraction=0.25, tp=2,
                               sequence_parallel=True, tp_overlap=False, save="{save}", keep_last=1)):
        path = tmp_path / "config.toml"
        path.write_text(to_toml(train_options(files, overrides)))
        options = TrainOptions(**load_toml(str(path), TrainOptions, "train"))
        validate(options, options.tp)


# -- eval, generate, serve: on a checkpoint ----------------------------------------------------------------------------

def _inference(command: str, files, overrides: dict):
    given = {"checkpoint": "{dense}", **overrides}
    given = {k: _filled(files, v) for k, v in given.items()}
    if command == "eval":
        return eval_command.validate(EvalOptions(**{"seq_len": 16, "data_cache": files["cache"], **given}))
    if command == "generate":
        return generate.validate(GenerateOptions(**{"prompt_ids": ["1,2"], "max_new_tokens": 2, **given}))
    return serve.validate(ServeOptions(**given))


INFERENCE = [  # (command, refused options, the one line, the same option where it applies)
    ("eval", dict(fp8_recipe="rowwise"),
     "--fp8-recipe rowwise needs --dtype fp8 (it scales the fp8 GEMMs; --dtype is fp32)",
     pytest.param(dict(fp8_recipe="rowwise", dtype="fp8"), marks=FP8)),
    ("eval", dict(expert_gemm="loop"), "--expert-gemm loop needs a mixture-of-experts model (it runs the routed "
     "experts' GEMMs; this model is dense (num_experts = 0))", dict(expert_gemm="loop", checkpoint="{moe}")),
    ("eval", dict(cp_impl="allgather"),
     "--cp-impl allgather needs --cp > 1 (it is context parallelism's attention; --cp is 1)",
     dict(cp_impl="allgather", cp=2)),
    ("eval", dict(sequence_parallel=True), "--sequence-parallel needs --tp > 1 (it shards the activations along the "
     "sequence over the TP ranks; --tp is 1)", dict(sequence_parallel=True, tp=2)),
    ("eval", dict(text_field="body", data="{text}"), "--text-field body needs a JSONL, Parquet or datasets source "
     "of documents (it names their text field; --data '{text}' holds text)", dict(text_field="body", data="{body}")),
    ("eval", dict(bin_dtype="int32"), "--bin-dtype int32 needs a raw .bin token file (it is the dtype of .bin token "
     f"files; {DEFAULT_DATA} holds text)", dict(bin_dtype="int32", data="{bin32}")),
    ("generate", dict(fp8_recipe="rowwise"),
     "--fp8-recipe rowwise needs --dtype fp8 (it scales the fp8 GEMMs; --dtype is fp32)",
     pytest.param(dict(fp8_recipe="rowwise", dtype="fp8"), marks=FP8)),
    ("generate", dict(expert_gemm="loop"), "--expert-gemm loop needs a mixture-of-experts model (it runs the routed "
     "experts' GEMMs; this model is dense (num_experts = 0))", dict(expert_gemm="loop", checkpoint="{moe}")),
    ("serve", dict(fp8_recipe="rowwise", dtype="bf16"),
     "--fp8-recipe rowwise needs --dtype fp8 (it scales the fp8 GEMMs; --dtype is bf16)",
     pytest.param(dict(fp8_recipe="rowwise", dtype="fp8"), marks=FP8)),
    ("serve", dict(expert_gemm="loop"), "--expert-gemm loop needs a mixture-of-experts model (it runs the routed "
     "experts' GEMMs; this model is dense (num_experts = 0))", dict(expert_gemm="loop", checkpoint="{moe}")),
]
_INFERENCE_IDS = [f"{c[0]}-{next(iter(c[1]))}" for c in INFERENCE]


@pytest.mark.parametrize("command,overrides,message", [c[:3] for c in INFERENCE], ids=_INFERENCE_IDS)
def test_eval_generate_serve_refuse_an_option_that_would_change_nothing(files, command, overrides, message):
    with pytest.raises(TensorparError) as e:
        _inference(command, files, overrides)
    assert str(e.value) == message.format(**files)


@pytest.mark.parametrize("command,overrides", [pytest.param(c[0], _unwrap(c[3])[0], marks=_unwrap(c[3])[1])
                                               for c in INFERENCE], ids=_INFERENCE_IDS)
def test_eval_generate_serve_accept_the_same_option_where_it_applies(files, command, overrides):
    _inference(command, files, overrides)


# -- plan, calibrate: the options alone --------------------------------------------------------------------------------

LAYOUT = dict(model="tiny", gpus=8, gpu="h100-80gb", seq_len=512, global_batch_size=8)
SCHEDULE = dict(schedule="1f1b", pp=4, microbatches=8)
OPTIONS_ONLY = [  # (command, refused options, the one line, the same option where it applies)
    ("plan", dict(SCHEDULE, gpus=8), "--gpus 8 needs --model (layout mode plans with it; without --model, plan draws "
     "the --schedule 1f1b pipeline)", dict(LAYOUT)),
    ("plan", dict(SCHEDULE, zero=[1]), "--zero 1 needs --model (layout mode plans with it; without --model, plan "
     "draws the --schedule 1f1b pipeline)", dict(LAYOUT, zero=[1])),
    ("plan", dict(LAYOUT, microbatches=4), "--microbatches 4 needs --schedule without --model (it is the "
     "micro-batches of the schedule drawn; layout mode works them out from --global-batch-size and the micro-batch "
     "sizes it tries)", dict(SCHEDULE, microbatches=4, virtual_stages=2, json=True, png="x.png")),
    ("plan", dict(LAYOUT, flash_attention=False), "--no-flash-attention needs a Playbook --precision (mixed-bf16, "
     "megatron-...) (it makes the Playbook's attention store its s x s scores; --precision is tensorpar-bf16, whose "
     "attention never stores them)", dict(LAYOUT, flash_attention=False, precision="mixed-bf16")),
    ("plan", dict(LAYOUT, hardware="profile.json"), "--gpu h100-80gb needs no --hardware (it picks the catalog's GPU; "
     "--hardware 'profile.json' is the device planned for)", dict(LAYOUT, gpu=None, hardware="profile.json")),
    ("plan", dict(LAYOUT, pp=1, schedule="zbv"), "--schedule zbv needs --pp > 1 (or no --pp) (layout mode keeps the "
     "pipelined layouts of this schedule; --pp is 1)", dict(LAYOUT, pp=2, schedule="zbv")),
    ("plan", dict(LAYOUT, pp=1, virtual_stages=2), "--virtual-stages 2 needs --pp > 1 (or no --pp) (layout mode "
     "interleaves the pipelined layouts' stages up to it; --pp is 1)", dict(LAYOUT, virtual_stages=2)),
    ("plan", dict(LAYOUT, host_memory_gib=128.0), "--host-memory-gib 128 needs --optimizer-offload or "
     "--activation-offload (it is the host memory offloading may fill; nothing is offloaded)",
     dict(LAYOUT, host_memory_gib=128.0, optimizer_offload=True)),
    ("calibrate", dict(no_collectives=True, ranks=4), "--ranks 4 needs the collectives timed (it is the processes "
     "they are timed over; --no-collectives skips them)", dict(ranks=4)),
    ("calibrate", dict(device="cuda", threads=2), "--threads 2 needs --device cpu (it sets the CPU GEMMs' threads; "
     "--device is cuda)", dict(threads=2)),
]


@pytest.mark.parametrize("command,refused,message,applies", OPTIONS_ONLY,
                         ids=[f"{c[0]}-{list(c[1])[-1]}" for c in OPTIONS_ONLY])
def test_plan_and_calibrate_options_that_would_change_nothing(command, refused, message, applies):
    assert applicability.problem(command, OPTIONS[command](**refused)) == message
    assert applicability.problem(command, OPTIONS[command](**applies)) is None


@pytest.mark.parametrize("args,needle", [
    (["plan", "--schedule", "1f1b", "--pp", "4", "--microbatches", "8", "--gpus", "8"], "--gpus 8 needs --model"),
    (["plan", "--model", "tiny", "--gpus", "8", "--gpu", "h100-80gb", "--seq-len", "512", "--global-batch-size", "8",
      "--microbatches", "4"], "--microbatches 4 needs --schedule without --model"),
    (["calibrate", "--no-collectives", "--ranks", "4"], "--ranks 4 needs the collectives timed"),
    (["train", "--fp8-recipe", "rowwise", "--dtype", "bf16"], "--fp8-recipe rowwise needs --dtype fp8"),
    (["train", "--dry-run", "--world-size", "2", "--loss-scale", "1024"], "--loss-scale 1024 needs --dtype fp16"),
], ids=["plan-schedule-mode", "plan-layout-mode", "calibrate", "train", "train-dry-run"])
def test_the_command_line_refuses_them_in_one_line(cli, args, needle):
    code, _, err = cli(*args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("tensorpar: error: ") and needle in err, err


def test_every_rule_names_a_field_of_its_commands_options():
    for command, rules in applicability.RULES.items():
        fields = {s.name for s in cli_specs(OPTIONS[command])}
        assert [r.field for r in rules if r.field not in fields] == [], command
    # plan: each option belongs to schedule mode (read there) or to layout mode (refused in schedule mode)
    plan = {s.name for s in cli_specs(PlanOptions)}
    assert plan == set(applicability._SCHEDULE_MODE_FIELDS) | set(applicability._LAYOUT_MODE_FIELDS)
