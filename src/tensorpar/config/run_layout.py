"""The layout of one training run, as one value: what the session builds, the checkpoint's meta.json records,
the run's summary reports and the command line prints."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class RunLayout:
    """The mesh's sizes and the options that shape a run's parallel step. `schedule` and `pipeline_layers` are
    None without pipeline parallelism."""

    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    expert_tp: int = 1
    zero: int = 0
    dp_replicate: int = 1  # HSDP: ZeRO sharded within dp / dp_replicate ranks, replicated across dp_replicate
    schedule: str | None = None
    virtual_stages: int = 1
    pipeline_layers: str | None = None
    sequence_parallel: bool = False
    recompute: str = "none"
    dtype: str = "fp32"

    @classmethod
    def of(cls, options, mesh, *, sequence_parallel: bool) -> "RunLayout":
        """The layout of a run of `options` (TrainOptions) on `mesh`; `sequence_parallel` as the model applies it
        (off on one TP rank)."""
        pipelined = mesh.pp_size > 1
        return cls(tp=mesh.tp_size, cp=mesh.cp_size, pp=mesh.pp_size, dp=mesh.dp_size, ep=mesh.ep_size,
                   expert_tp=mesh.expert_tp_size, zero=options.zero, dp_replicate=mesh.dp_replicate_group.size,
                   schedule=options.schedule if pipelined else None, virtual_stages=options.virtual_stages,
                   pipeline_layers=options.pipeline_layers if pipelined else None,
                   sequence_parallel=sequence_parallel, recompute=options.recompute, dtype=options.dtype)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        """'tp=2 pp=2 dp=1 zero-1 1f1b +sequence-parallel, recompute=none, fp32': what a summary line prints."""
        parts = [f"tp={self.tp}"] + ([f"cp={self.cp}"] if self.cp > 1 else []) + [f"pp={self.pp}", f"dp={self.dp}"]
        parts += [f"ep={self.ep}"] if self.ep > 1 else []
        parts += [f"expert-tp={self.expert_tp}"] if self.expert_tp > 1 else []
        parts += [f"zero-{self.zero}"] if self.zero else []
        parts += [f"hsdp {self.dp_replicate}x{self.dp // self.dp_replicate}"] if self.dp_replicate > 1 else []
        if self.schedule:
            parts.append(self.schedule + (f" v={self.virtual_stages}" if self.virtual_stages > 1 else ""))
        parts += [f"layers={self.pipeline_layers}"] if self.pipeline_layers else []
        parts += ["+sequence-parallel"] if self.sequence_parallel else []
        return " ".join(parts) + f", recompute={self.recompute}, {self.dtype}"
