"""Distributed checkpoints that any layout can resume from.

A checkpoint is a folder ``DIR/step-000120/`` holding one safetensors file per model-parallel
rank (``model-tp01-pp00.safetensors``: that rank's parameter shards and their AdamW moments,
written by the DP and CP rank 0 of each (tp, pp) position; ZeRO slices are gathered first) and
``meta.json``: the model config, the layout, how every tensor is split (its ShardSpec), the
optimizer step, the training arguments that fix the data order and the learning-rate schedule,
and the size and SHA-256 of every file. Dropout masks and the sample order are functions of
(seed, step), so the step is all the RNG and data state there is.

Saving is atomic: files go to ``DIR/.tmp-step-000120``, which rank 0 renames into place only
after every file is written, then ``DIR/latest`` is replaced. A run killed mid-save leaves the
previous checkpoint and `latest` untouched. Loading rebuilds each dense tensor from the saved
shards and cuts this rank's shard for the current layout: any (tp, pp, dp, zero) resumes any other.

Mixture-of-experts models: the routed experts' stacked weights (ShardSpec group "ep") are not in the
model files but in one file per expert-parallel rank and stage (``experts-ep01-pp00.safetensors``,
written by expert-DP rank 0): rank e's slice of the [num_experts, ...] tensors, i.e. the experts with
global indices [e * E/ep, (e+1) * E/ep), at their full width: under expert-TP the expert-TP ranks' F-slices
are all-gathered before the write. Their meta entries say ``"group": "ep"``; loading concatenates the slices
and cuts the current EP (and expert-TP) rank's, so any (ep, expert-TP) resumes any other.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import shutil

import torch
from safetensors import SafetensorError
from safetensors.torch import safe_open, save_file

from tensorpar.checkpoints.meta_checks import VERSION, check_shards, check_version, checked_shard, sha256, shard_file
from tensorpar.checkpoints.peft_adapter import write_checkpoint_adapter
from tensorpar.data.tokenizer_files import copy_files
from tensorpar.distributed.sharding import ShardSpec, local_shard, shard_spec, tag
from tensorpar.errors import TensorparError
from tensorpar.models.state import dense_shape, model_state

FORMAT = "tensorpar-checkpoint"
KINDS = ("param", "exp_avg", "exp_avg_sq")


def step_folder(root: str, step: int) -> str:
    """Where step `step`'s checkpoint lives under `root`."""
    return os.path.join(root, f"step-{step:06d}")


def shard_file_name(tp_rank: int, pp_rank: int) -> str:
    return f"model-tp{tp_rank:02d}-pp{pp_rank:02d}.safetensors"


def expert_file_name(ep_rank: int, pp_rank: int) -> str:
    return f"experts-ep{ep_rank:02d}-pp{pp_rank:02d}.safetensors"


def _write_shard(tmp: str, file_name: str, params: dict, moments: dict, step: int, position: dict) -> dict:
    """Write `params` (name -> local tensor) and their AdamW moments to `tmp/file_name`; its entry for meta.json."""
    tensors = {}
    for name, p in params.items():
        # bf16/fp16 training saves its fp32 master weights: a resume continues exactly
        tensors[f"param/{name}"] = moments.get(name, {}).get("master", p.detach()).contiguous().cpu()
        for kind, value in moments.get(name, {}).items():  # the optimizer's state: AdamW's moments, or Muon's momentum
            if kind != "master":
                tensors[f"{kind}/{name}"] = value.contiguous().cpu()
    path = os.path.join(tmp, file_name)
    save_file(tensors, path, metadata={"format": FORMAT, "step": str(step)})
    fsync_path(path)
    return {
        "file": file_name, "bytes": os.path.getsize(path), "sha256": sha256(path), **position,
        "tensors": {name: {"shape": list(dense_shape(p, shard_spec(p))), **_spec_dict(shard_spec(p))}
                    for name, p in params.items()},
    }


# -- saving ---------------------------------------------------------------------------------------
#
# A save has three phases: `begin_save` (rank 0 makes the temporary folder), `take_shards` (what each rank writes:
# its parameter shards, fp32 masters and AdamW moments, gathered over DP / expert-TP where sharded), the writes
# (`write_shards`: files and hashes, no communication), and `commit_save` (every rank's file list gathered, then
# rank 0 writes meta.json, renames the folder into place and replaces `latest`). `save_checkpoint` runs them in a row;
# an asynchronous save (checkpoints/async_save.py) copies the shards to host memory and writes them in a thread.

@dataclasses.dataclass
class Shard:
    """One file a rank writes: `params` (name -> local tensor, tagged with its ShardSpec) and their moments."""

    file_name: str
    params: dict
    moments: dict
    position: dict  # {"tp_rank", "pp_rank"} or {"ep_rank", "pp_rank"}


def begin_save(root: str, step: int, mesh) -> str:
    """Rank 0 makes the empty temporary folder of step `step`'s checkpoint (a collective: a failure, such as a
    folder that cannot be written, fails every rank); its path."""
    tmp = os.path.join(root, f".tmp-step-{step:06d}")
    error = None
    if mesh.rank == 0:
        try:
            os.makedirs(root, exist_ok=True)
            if os.path.exists(tmp):
                shutil.rmtree(tmp)  # the remains of a save that was killed
            os.makedirs(tmp)
        except OSError as e:
            error = f"rank 0 cannot make '{tmp}': {e}"
    error = mesh.world_group.all_gather_object(error)[0]  # also the barrier
    if error:
        raise _save_failed(root, step, error)
    return tmp


def _save_failed(root: str, step: int, what: str) -> TensorparError:
    return TensorparError(f"the save of step {step} failed ({what}); the previous checkpoint and "
                          f"'{os.path.join(root, 'latest')}' are untouched")


def take_shards(model, optimizer, mesh) -> tuple[list[Shard], int]:
    """(the files this rank writes, the AdamW step count). A collective over DP when ZeRO shards the moments (and
    over expert-TP for the routed experts); call inside `optimizer.gathered()`: ZeRO-3 parameters are whole there."""
    params = model_state(model)  # the persistent buffers (untrained, no moments) too
    names = {id(p): n for n, p in params.items()}
    moments, opt_step = optimizer.local_state(names) if optimizer is not None else ({}, 0)
    moments = {n: moments.get(n, {}) for n in params}  # frozen parameters (LoRA's base) keep no optimizer state
    saved = {n: p for n, p in params.items() if not shard_spec(p).pipeline_duplicate}  # the first
    dense = {n: p for n, p in saved.items() if not shard_spec(p).expert}  # stage saves the tied embedding
    experts = {n: p for n, p in saved.items() if shard_spec(p).expert}
    if experts and mesh.expert_tp_size > 1:
        experts, moments = _gather_expert_width(experts, moments, mesh.expert_tp_group)
    shards = []
    if mesh.dp_rank == 0 and mesh.cp_rank == 0:  # one writer per (tp, pp) position
        shards.append(Shard(shard_file_name(mesh.tp_rank, mesh.pp_rank), dense, moments,
                            {"tp_rank": mesh.tp_rank, "pp_rank": mesh.pp_rank}))
    if experts and mesh.expert_dp_group.rank == 0 and mesh.expert_tp_rank == 0:  # one per (ep, pp) position
        shards.append(Shard(expert_file_name(mesh.ep_rank, mesh.pp_rank), experts, moments,
                            {"ep_rank": mesh.ep_rank, "pp_rank": mesh.pp_rank}))
    return shards, opt_step


def write_shards(tmp: str, step: int, shards: list[Shard]) -> list[dict] | str:
    """Write and hash this rank's files (no communication): their entries for meta.json, or what went wrong (the
    file and the error) for `commit_save` to report on every rank."""
    infos = []
    for s in shards:
        try:
            infos.append(_write_shard(tmp, s.file_name, s.params, s.moments, step, s.position))
        except (OSError, SafetensorError, RuntimeError) as e:
            return f"writing '{os.path.join(tmp, s.file_name)}' failed: {type(e).__name__}: {e}"
    return infos


def save_checkpoint(root: str, step: int, model, optimizer, mesh, *, cfg, layout: dict | None = None,
                    train: dict | None = None, options: dict | None = None, run_id: str | None = None,
                    keep_last: int = 3, tokenizer_files: dict | None = None, tokenizer_unknown: bool = False,
                    lora: dict | None = None) -> str:
    """Write step `step`'s checkpoint under `root` (a collective: every rank calls it). Returns its folder. A
    complete checkpoint already at this step is kept, renamed superseded-step-N-K, never overwritten.
    `optimizer` None: the weights alone (a Python loop whose torch optimizer keeps its own state), which
    `load_checkpoint`, `train --init-from`, eval, generate, serve and convert read at any layout, and `train --resume`
    refuses. `layout`: the mesh's (`ParallelLayout.as_dict()`) by default.
    `train` holds what fixes the data order and the learning rate; `options`, the run's whole resolved
    configuration (so that a resumed run can say what changed); `run_id`, the run (a resumed run keeps its
    checkpoint's) whose checkpoints `keep_last` rotates, never another's; `tokenizer_files` (name -> path), the
    files of the run's tokenizer, copied into the checkpoint (none: the byte tokenizer, or with `tokenizer_unknown`
    none known: the run read token ids without their tokenizer); `lora`, a LoRA run's
    adapters (`LoraSpec.as_dict`), also written as a PEFT adapter folder, `adapter/`, in the step folder."""
    layout = layout if layout is not None else mesh.layout.as_dict()
    tmp = begin_save(root, step, mesh)
    # ZeRO-3 stores 1/dp of each parameter: gathered for the save
    with optimizer.gathered() if optimizer is not None else contextlib.nullcontext():
        shards, opt_step = take_shards(model, optimizer, mesh)
        info = write_shards(tmp, step, shards)
    return commit_save(root, step, info, mesh, dict(optimizer_step=opt_step, model=cfg.to_dict(), run_id=run_id,
                                                    weights_only=optimizer is None,
                                                    layout=layout, train=train or {}, options=options,
                                                    tokenizer_files=tokenizer_files or {},
                                                    tokenizer_unknown=tokenizer_unknown, lora=lora), keep_last)


def commit_save(root: str, step: int, info: list[dict] | str | None, mesh, facts: dict, keep_last: int) -> str:
    """Put step `step`'s checkpoint in place once every rank has written its files (a collective: every rank calls
    it, with the entries `write_shards` returned, the message of its failed write, or None while it is still
    writing because another rank's write failed). `facts`: meta.json's optimizer_step, model, run_id, layout, train
    and options, and the tokenizer's files to copy. Rank 0 checks that every file is there at its size, writes
    meta.json, renames the folder into place and replaces `latest`. A rank's failure fails every rank."""
    final = step_folder(root, step)
    world = mesh.world_group
    gathered = world.all_gather_object(info)
    failed = [f"rank {r}: {item}" for r, item in enumerate(gathered) if isinstance(item, str)]
    if failed or None in gathered:
        raise _save_failed(root, step, "; ".join(failed))
    infos = [item for items in gathered for item in items]
    error = None
    if mesh.rank == 0:
        try:
            _put_in_place(root, step, infos, facts, keep_last)
        except (OSError, SafetensorError, TensorparError) as e:  # SafetensorError: the adapter write on a full disk
            error = f"rank 0: {e}"
    error = world.all_gather_object(error)[0]  # also the barrier: no rank returns before `latest` has moved
    if error:
        raise TensorparError(f"the save of step {step} failed ({error}); '{os.path.join(root, 'latest')}' still "
                             f"names the previous checkpoint")
    return final


def _put_in_place(root: str, step: int, infos: list[dict], facts: dict, keep_last: int) -> None:
    """Rank 0's part of a commit: meta.json in the temporary folder, the folder renamed into place, `latest`
    replaced, old checkpoints rotated away."""
    tmp, final = os.path.join(root, f".tmp-step-{step:06d}"), step_folder(root, step)
    files, tensors = {}, {}
    for item in infos:
        files[item["file"]] = {k: item[k] for k in ("bytes", "sha256", "tp_rank", "ep_rank", "pp_rank") if k in item}
        for name, spec in item["tensors"].items():
            tensors.setdefault(name, {**spec, "pp_rank": item["pp_rank"]})
    _check_written(tmp, files)
    facts = dict(facts)
    unknown = facts.pop("tokenizer_unknown", False)
    facts["tokenizer"] = copy_files(facts.pop("tokenizer_files", {}), tmp) or ("unknown" if unknown else "byte")
    meta = {"format": FORMAT, "version": VERSION, "step": step, **facts, "tensors": tensors, "files": files,
            "rng": "none needed: dropout masks and the sample order are functions of (seed, step)"}
    write_atomic(os.path.join(tmp, "meta.json"), json.dumps(meta, indent=1))
    write_checkpoint_adapter(tmp, meta, CheckpointReader(tmp, meta).dense)  # a LoRA run's: tmp/adapter, PEFT's
    _move_aside(final)
    fsync_path(tmp)  # the files' names, then the folder's, on disk before `latest` names it (a power cut)
    os.replace(tmp, final)
    fsync_path(root)
    write_atomic(os.path.join(root, "latest"), os.path.basename(final) + "\n")
    fsync_path(root)
    rotate(root, keep_last, facts["run_id"], step)


def _check_written(tmp: str, files: dict) -> None:
    """Every file the ranks reported is in `tmp` at the size they wrote (their hashes are of those bytes)."""
    for name, f in files.items():
        path = os.path.join(tmp, name)
        size = os.path.getsize(path) if os.path.isfile(path) else None
        if size != f["bytes"]:
            raise TensorparError(f"checkpoint shard '{path}' is {'missing' if size is None else f'{size} bytes'} "
                                 f"after its rank wrote {f['bytes']}: the folder changed during the save")


def _gather_expert_width(experts: dict, moments: dict, expert_tp_group) -> tuple[dict, dict]:
    """The routed experts' weights and moments at their full width F: all-gathered over the expert-TP group (a
    collective), each tagged with its ShardSpec less the expert-TP split."""
    full, moments = {}, dict(moments)
    for name, p in experts.items():
        spec = shard_spec(p)
        dim = spec.expert_tp_dim
        full[name] = tag(expert_tp_group.all_gather(p.detach(), dim=dim),
                         dataclasses.replace(spec, expert_tp_dim=None, expert_tp_full_size=None))
        moments[name] = {k: expert_tp_group.all_gather(v, dim=dim) for k, v in moments[name].items()}
    return full, moments


def _spec_dict(spec: ShardSpec) -> dict:
    out = {"dim": spec.dim, "full_size": spec.full_size, "padded_size": spec.padded_size,
           "replicas": spec.replicas}
    if spec.expert:
        out["group"] = "ep"  # split over the expert-parallel ranks (whose files are experts-ep*)
    return out


def fsync_path(path: str) -> None:
    """Flush a file, or a folder's entries, to the disk (as torch.distributed.checkpoint's sync_files); a folder
    where the system cannot open one (Windows) is left to the system."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        if os.path.isdir(path):
            return
        raise
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str, text: str) -> None:
    """Write `text` to `path` so that a reader sees the old file or the whole new one, never a part."""
    with open(path + ".part", "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".part", path)


def _move_aside(folder: str) -> str | None:
    """A complete checkpoint is never overwritten: one already at this step (a later branch this run abandoned by
    resuming an earlier step, or a save whose `latest` update a kill prevented) becomes superseded-step-N-K."""
    if not os.path.exists(folder):
        return None
    root, name = os.path.split(folder)
    k = 1
    while os.path.exists(os.path.join(root, f"superseded-{name}-{k}")):
        k += 1
    target = os.path.join(root, f"superseded-{name}-{k}")
    os.replace(folder, target)
    return target


def rotate(root: str, keep_last: int, run_id: str | None, step: int) -> None:
    """Keep this run's `keep_last` newest checkpoints up to `step`. Never touched: the one `latest` names, and any
    checkpoint of another run (another run_id) or beyond `step` (a later branch this run resumed before)."""
    if keep_last <= 0:
        return
    latest = os.path.join(root, _read_latest(root) or "")
    ours = []
    for folder in step_folders(root):
        meta = _read_meta_file(folder)
        if meta is not None and meta.get("run_id") == run_id and meta.get("step", step + 1) <= step:
            ours.append((meta["step"], folder))
    for _, folder in sorted(ours)[:-keep_last]:
        if os.path.abspath(folder) != os.path.abspath(latest):
            shutil.rmtree(folder, ignore_errors=True)


# -- finding and checking ---------------------------------------------------------------------------

def step_folders(root: str) -> list[str]:
    """The complete step folders (holding meta.json) under `root`, by step."""
    if not os.path.isdir(root):
        return []
    names = sorted(d for d in os.listdir(root) if d.startswith("step-"))
    return [os.path.join(root, d) for d in names if os.path.isfile(os.path.join(root, d, "meta.json"))]


def _read_latest(root: str) -> str | None:
    try:
        with open(os.path.join(root, "latest")) as f:
            return f.read().strip() or None
    except OSError:
        return None


def _read_meta_file(folder: str) -> dict | None:
    try:
        with open(os.path.join(folder, "meta.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def is_checkpoint(path: str) -> bool:
    """Whether `path` holds a checkpoint: a step folder, or a folder with `latest` or a complete step folder."""
    return (os.path.isfile(os.path.join(path, "latest")) or os.path.isfile(os.path.join(path, "meta.json"))
            or bool(step_folders(path)))


def newest_checkpoint(root: str) -> str | None:
    """The step folder `latest` names, else the highest complete one; None when `root` holds none. A re-save of the
    step `latest` names moves that folder aside before its own takes the name: a kill between the two renames leaves
    `latest` naming the moved one, superseded-step-N-K (the highest K)."""
    name = _read_latest(root)
    if name is None:
        folders = step_folders(root)
        return folders[-1] if folders else None
    folder = os.path.join(root, name)
    if not os.path.exists(folder):
        moved = [d for d in os.listdir(root) if d.startswith(f"superseded-{name}-") and d.rsplit("-", 1)[1].isdigit()]
        if moved:
            return os.path.join(root, max(moved, key=lambda d: int(d.rsplit("-", 1)[1])))
    return folder


def resolve(path: str) -> str:
    """The step folder of `path`: itself if it holds meta.json, else the one its `latest` names (or, when a run
    was killed between renaming its newest step folder into place and updating `latest`, that newest one)."""
    if not os.path.exists(path):
        raise TensorparError(f"checkpoint '{path}' does not exist")
    if os.path.isfile(os.path.join(path, "meta.json")):
        return path
    step_dir = newest_checkpoint(path)
    if step_dir is None:
        raise TensorparError(f"'{path}' holds no tensorpar checkpoint (no meta.json, no 'latest' file)")
    if not os.path.isfile(os.path.join(step_dir, "meta.json")):
        raise TensorparError(f"'{os.path.join(path, 'latest')}' names '{step_dir}', which holds no meta.json")
    return step_dir


def read_meta(path: str, verify: bool = True) -> tuple[str, dict]:
    """(step folder, metadata) of a checkpoint, every shard checked for presence, size and SHA-256."""
    step_dir = resolve(path)
    meta_path = os.path.join(step_dir, "meta.json")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise TensorparError(f"'{meta_path}' is unreadable or not JSON: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:  # a JSON list, a number: no checkpoint's
        raise TensorparError(f"'{meta_path}' is not a tensorpar checkpoint "
                             f"(format {meta.get('format') if isinstance(meta, dict) else None!r})")
    check_version(meta, meta_path)
    if verify:
        check_shards(step_dir, meta)
    return step_dir, meta


def check_compatible(meta: dict, cfg, source: str) -> None:
    """Refuse a checkpoint of another model, naming the fields that differ."""
    known = {f.name for f in dataclasses.fields(cfg)}
    # As a config of its own: a field the checkpoint predates (the MoE ones) had its default value then, and JSON's
    # lists are the config's tuples.
    saved = type(cfg)(**{k: v for k, v in meta["model"].items() if k in known}).to_dict()
    current = cfg.to_dict()
    ignore = {"dropout"}
    diffs = [f"{k}: checkpoint {saved[k]!r} vs model {current[k]!r}"
             for k in current if k not in ignore and saved[k] != current[k]]
    if diffs:
        raise TensorparError(f"checkpoint '{source}' is of another model: " + "; ".join(diffs[:4]))


# -- loading ----------------------------------------------------------------------------------------

class CheckpointReader:
    """Rebuilds dense tensors from a checkpoint's shard files (no communication)."""

    def __init__(self, step_dir: str, meta: dict):
        self.step_dir, self.meta = step_dir, meta
        files = meta["files"].items()
        self.by_position = {(f["tp_rank"], f["pp_rank"]): name for name, f in files if "tp_rank" in f}
        self.by_expert_rank = {(f["ep_rank"], f["pp_rank"]): name for name, f in files if "ep_rank" in f}
        self.tp = meta["layout"]["tp"]
        self.ep = meta["layout"].get("ep", 1)
        self.file_of = functools.partial(shard_file, step_dir, meta)  # (files, position, what) -> its file name

    def _read(self, file_name: str, key: str) -> torch.Tensor:
        path = os.path.join(self.step_dir, file_name)
        try:
            with safe_open(path, framework="pt") as f:
                if key not in f.keys():
                    raise TensorparError(f"checkpoint shard '{path}' has no tensor '{key}'")
                return f.get_tensor(key)
        except SafetensorError as e:
            raise TensorparError(f"checkpoint shard '{path}' is unreadable: {e}") from None

    def dense(self, name: str, kind: str = "param") -> torch.Tensor:
        info = self.meta["tensors"].get(name)
        if info is None:
            raise TensorparError(f"checkpoint '{self.step_dir}' has no tensor '{name}'")
        pp_rank = info["pp_rank"]
        key = f"{kind}/{name}"
        if info["dim"] is None:
            return self._read(self.file_of(self.by_position, (0, pp_rank), "tp"), key)
        if info.get("group") == "ep":
            parts = [self._read(self.file_of(self.by_expert_rank, (e, pp_rank), "ep"), key) for e in range(self.ep)]
        else:
            parts = [self._read(self.file_of(self.by_position, (t, pp_rank), "tp"), key)
                     for t in range(0, self.tp, info["replicas"])]
        full = torch.cat(parts, info["dim"])
        return full.narrow(info["dim"], 0, info["full_size"])

    def names(self) -> list[str]:
        return list(self.meta["tensors"])

    def has(self, name: str, kind: str) -> bool:
        """Whether the checkpoint holds `kind` (e.g. "momentum_buffer") of tensor `name`."""
        info = self.meta["tensors"][name]
        files, what = (self.by_expert_rank, "ep") if info.get("group") == "ep" else (self.by_position, "tp")
        file_name = self.file_of(files, (0, info["pp_rank"]), what)
        with safe_open(os.path.join(self.step_dir, file_name), framework="pt") as f:
            return f"{kind}/{name}" in f.keys()


def load_checkpoint(path: str, model, optimizer=None, cfg=None, verify: bool = True) -> dict:
    """Load weights (and, given an optimizer, AdamW moments) into this rank's shards; returns the metadata.
    ``verify=False`` skips hashing the shards, for a caller that has just checked them with `read_meta`."""
    step_dir, meta = read_meta(path, verify)
    if cfg is not None:
        check_compatible(meta, cfg, path)
    reader = CheckpointReader(step_dir, meta)
    params = model_state(model)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}  # not buffers, nor LoRA's frozen base
    missing = [n for n in params if n not in meta["tensors"]]
    if missing:
        raise TensorparError(f"checkpoint '{step_dir}' lacks {missing[:4]} that the model needs")
    moments = {}
    with torch.no_grad(), (optimizer.gathered() if optimizer is not None else contextlib.nullcontext()):
        for name, p in params.items():
            spec = shard_spec(p)  # split over TP, or EP (and expert-TP) for the routed experts
            p.copy_(checked_shard(local_shard(reader.dense(name), spec, model), p, name, step_dir))
            if optimizer is not None and name in trained:  # the moments, and the fp32 masters of bf16/fp16
                kinds = [k for k in optimizer.kinds_of(name, p.shape) if reader.has(name, k)]  # another optimizer's
                moments[name] = {k: local_shard(reader.dense(name, k), spec, model) for k in kinds}  # -> zeros
                moments[name]["master"] = local_shard(reader.dense(name).float(), spec, model)
        if optimizer is not None:
            optimizer.reload_parameters()
    if optimizer is not None:
        optimizer.load_local_state(moments, meta["optimizer_step"], {id(p): n for n, p in params.items()})
    return meta


def dense_model_state(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(metadata, every dense weight) of a checkpoint: for export and evaluation."""
    step_dir, meta = read_meta(path)
    reader = CheckpointReader(step_dir, meta)
    return meta, {name: reader.dense(name) for name in reader.names()}
