"""`tensorpar demo`: the four TP building blocks on a toy model, rank by rank.

embedding (vocab-parallel) -> ColumnParallelLinear -> GELU -> RowParallelLinear -> output head
(column-parallel, vocab-sharded logits) -> vocab_parallel_cross_entropy, compared with the same
model on one device. Prints what each rank holds, what was communicated, and the comparison.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tensorpar.commands.common import launch
from tensorpar.config.fields import add_options, options_from_args
from tensorpar.config.options import DemoOptions
from tensorpar.distributed.launch import world_size
from tensorpar.distributed.mesh import init_mesh
from tensorpar.errors import LayoutError
from tensorpar.layout import resolve_dp
from tensorpar.layout.problem import divisibility, require
from tensorpar.layout.rules import sequence_parallel_problem
from tensorpar.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelLMHead,
    tp_region,
    vocab_parallel_cross_entropy,
)


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="show the TP layers at work across local processes")
    add_options(p, DemoOptions)
    p.set_defaults(run=run)


class DenseToy(nn.Module):
    def __init__(self, vocab, hidden, ffn):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids, targets):
        h = self.embed(ids)
        h = h + self.fc2(F.gelu(self.fc1(h)))
        logits = self.head(h)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), label_smoothing=0.1)


class ParallelToy(nn.Module):
    def __init__(self, dense: DenseToy, mesh, sequence_parallel: bool):
        super().__init__()
        self.mesh, self.sp = mesh, sequence_parallel
        # how every layer enters and leaves the TP regions
        region = tp_region(mesh.tp_group, sequence_parallel=sequence_parallel)
        self.embed = VocabParallelEmbedding.from_dense(dense.embed, region)
        self.fc1 = ColumnParallelLinear.from_dense(dense.fc1, region)
        self.fc2 = RowParallelLinear.from_dense(dense.fc2, region)
        # Vocabulary padded to a multiple of TP, like the embedding, so that its logits line up with the loss's shards.
        self.head = VocabParallelLMHead.from_dense(dense.head, region)

    def forward(self, ids, targets):
        h = self.embed(ids)
        h = h + self.fc2(F.gelu(self.fc1(h)))
        logits = self.head(h)
        return vocab_parallel_cross_entropy(
            logits, targets, self.mesh, label_smoothing=0.1, vocab_size=self.head.vocab_size
        )


def _rows(layer, dim: int, full: int) -> str:
    size = layer.weight.shape[dim]
    start = layer.tp_group.rank * size
    return f"[{start}:{min(start + size, full)}) of {full}"


def _comm_lines(snapshot) -> list[str]:
    if not snapshot:
        return ["    nothing (one rank)"]
    return [
        f"    {op:<15} on {group}: {c.calls} call(s), {c.elements} elements, {c.bytes} bytes"
        for (op, group), c in sorted(snapshot.items())
    ]


def run_rank(options: DemoOptions) -> int:
    mesh = init_mesh(tp=options.tp, pp=options.pp, dp=options.dp, device="cpu", timeout=options.timeout)
    ffn = options.ffn or 4 * options.hidden
    torch.manual_seed(options.seed)  # every rank builds the same dense model and batch
    dense = DenseToy(options.vocab, options.hidden, ffn)
    ids = torch.randint(0, options.vocab, (options.batch, options.seq_len))
    targets = torch.randint(0, options.vocab, (options.batch, options.seq_len))
    dense_loss = dense(ids, targets)
    dense_loss.backward()

    model = ParallelToy(dense, mesh, options.sequence_parallel)
    mesh.stats.reset()
    loss = model(ids, targets)
    forward = mesh.stats.snapshot()
    mesh.stats.reset()
    loss.backward()
    backward = mesh.stats.snapshot()

    tp, r = mesh.tp_size, mesh.tp_rank
    checks = {
        "embedding grad": (model.embed.weight.grad[: model.embed.vocab_end - model.embed.vocab_start],
                           dense.embed.weight.grad[model.embed.vocab_start: model.embed.vocab_end]),
        "fc1 grad": (model.fc1.weight.grad, dense.fc1.weight.grad.chunk(tp, 0)[r]),
        "fc2 grad": (model.fc2.weight.grad, dense.fc2.weight.grad.chunk(tp, 1)[r]),
    }
    worst = max((a - b).norm().item() / max(b.norm().item(), 1e-30) for a, b in checks.values())
    e = model.embed
    lines = [
        f"rank {mesh.rank} (tp rank {r}/{tp}) holds:",
        f"  embedding rows {_rows(e, 0, options.vocab)}"
        + (f" + {pad} zero padding row(s) (vocabulary padded to {e.padded_vocab_size})" if (pad := e.rows_per_rank - (e.vocab_end - e.vocab_start)) else ""),
        f"  fc1 (column-parallel) output features {_rows(model.fc1, 0, ffn)}: weight {tuple(model.fc1.weight.shape)}",
        f"  fc2 (row-parallel) input features {_rows(model.fc2, 1, ffn)}: weight {tuple(model.fc2.weight.shape)}",
        f"  head (column-parallel) vocabulary {_rows(model.head, 0, options.vocab)}: logits [{options.batch}, {options.seq_len}, {model.head.out_per_rank}]",
        "  communicated in forward:", *_comm_lines(forward),
        "  communicated in backward:", *_comm_lines(backward),
        f"  loss {loss.item():.6f} vs single device {dense_loss.item():.6f}; worst relative gradient error {worst:.1e}",
    ]
    report = mesh.tp_group.all_gather_object("\n".join(lines)) if mesh.world_size > 1 else ["\n".join(lines)]
    ok = abs(loss.item() - dense_loss.item()) <= 1e-5 * abs(dense_loss.item()) and worst <= 1e-5
    if mesh.rank == 0:
        mode = "tensor + sequence parallel" if options.sequence_parallel else "tensor parallel"
        print(f"tensorpar demo: {mode}, TP={tp} over {mesh.world_size} process(es) ({mesh.backend or 'no'} backend, {mesh.device})")
        print(f"toy model: embedding({options.vocab}, {options.hidden}) -> Linear({options.hidden}, {ffn}) -> GELU -> "
              f"Linear({ffn}, {options.hidden}) + residual -> head({options.hidden}, {options.vocab}) -> cross-entropy "
              f"(label smoothing 0.1); batch {options.batch} x seq {options.seq_len}\n")
        print("\n\n".join(report))
        print(f"\n{'OK' if ok else 'MISMATCH'}: the {tp}-way model computes what the single-device model computes")
    mesh.destroy()
    return 0 if ok else 1


def check_shapes(options: DemoOptions) -> None:
    """Refuse a toy model that the TP size cannot split, before any rank starts (the layers would refuse it on
    every rank): the MLP width over TP and, under sequence parallelism, the sequence."""
    if options.cp != 1:
        raise LayoutError(f"the demo shows tensor parallelism: --cp must be 1, got {options.cp}")
    resolve_dp(world_size(options), options.tp, options.cp, options.pp, options.dp)  # the world first, as launch
    require(divisibility(options.ffn or 4 * options.hidden, options.tp, "the toy MLP's width (--ffn)"))
    if options.sequence_parallel:
        require(sequence_parallel_problem(options.seq_len, options.tp))


def run(args, argv) -> int:
    options = options_from_args(DemoOptions, args, "demo")
    check_shapes(options)
    return launch(options, argv, lambda: run_rank(options))
