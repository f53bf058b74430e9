"""`tensorpar demo`: the four TP building blocks on a toy model, rank by rank.

embedding (vocab-parallel) -> ColumnParallelLinear -> GELU -> RowParallelLinear -> output head
(column-parallel, vocab-sharded logits) -> vocab_parallel_cross_entropy, compared with the same
model on one device. Prints what each rank holds, what was communicated, and the comparison.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tensorpar.commands.common import add_layout_args, launch


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="show the TP layers at work across local processes")
    add_layout_args(p, tp_default=2)
    p.add_argument("--hidden", type=int, default=8)
    p.add_argument("--ffn", type=int, default=None, help="MLP width (default 4 x hidden)")
    p.add_argument("--vocab", type=int, default=11)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=4)
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=lambda args, argv: launch(args, argv, run_rank))


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
        from tensorpar.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

        super().__init__()
        self.mesh, self.sp = mesh, sequence_parallel
        self.embed = VocabParallelEmbedding.from_dense(dense.embed, mesh, sequence_parallel=sequence_parallel)
        self.fc1 = ColumnParallelLinear.from_dense(dense.fc1, mesh, sequence_parallel=sequence_parallel)
        self.fc2 = RowParallelLinear.from_dense(dense.fc2, mesh, sequence_parallel=sequence_parallel)
        # The head is a column-parallel linear over the padded vocabulary, so its logits line up with the loss's shards.
        head = nn.Linear(dense.head.in_features, self.embed.padded_vocab_size, bias=False)
        with torch.no_grad():
            head.weight.zero_()
            head.weight[: dense.head.out_features] = dense.head.weight
        self.head = ColumnParallelLinear.from_dense(head, mesh, sequence_parallel=sequence_parallel)

    def forward(self, ids, targets):
        from tensorpar.layers import vocab_parallel_cross_entropy

        h = self.embed(ids)
        h = h + self.fc2(F.gelu(self.fc1(h)))
        logits = self.head(h)
        return vocab_parallel_cross_entropy(
            logits, targets, self.mesh, label_smoothing=0.1, vocab_size=self.embed.vocab_size
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


def run_rank(args) -> int:
    import tensorpar

    mesh = tensorpar.init_mesh(tp=args.tp, pp=args.pp, dp=args.dp, device="cpu")
    ffn = args.ffn or 4 * args.hidden
    torch.manual_seed(args.seed)  # every rank builds the same dense model and batch
    dense = DenseToy(args.vocab, args.hidden, ffn)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq_len))
    targets = torch.randint(0, args.vocab, (args.batch, args.seq_len))
    dense_loss = dense(ids, targets)
    dense_loss.backward()

    model = ParallelToy(dense, mesh, args.sequence_parallel)
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
        f"  embedding rows {_rows(e, 0, args.vocab)}"
        + (f" + {pad} zero padding row(s) (vocabulary padded to {e.padded_vocab_size})" if (pad := e.rows_per_rank - (e.vocab_end - e.vocab_start)) else ""),
        f"  fc1 (column-parallel) output features {_rows(model.fc1, 0, ffn)}: weight {tuple(model.fc1.weight.shape)}",
        f"  fc2 (row-parallel) input features {_rows(model.fc2, 1, ffn)}: weight {tuple(model.fc2.weight.shape)}",
        f"  head (column-parallel) vocabulary {_rows(model.head, 0, args.vocab)}: logits [{args.batch}, {args.seq_len}, {model.head.out_per_rank}]",
        "  communicated in forward:", *_comm_lines(forward),
        "  communicated in backward:", *_comm_lines(backward),
        f"  loss {loss.item():.6f} vs single device {dense_loss.item():.6f}; worst relative gradient error {worst:.1e}",
    ]
    report = mesh.tp_group.all_gather_object("\n".join(lines)) if mesh.world_size > 1 else ["\n".join(lines)]
    ok = abs(loss.item() - dense_loss.item()) <= 1e-5 * abs(dense_loss.item()) and worst <= 1e-5
    if mesh.rank == 0:
        mode = "tensor + sequence parallel" if args.sequence_parallel else "tensor parallel"
        print(f"tensorpar demo: {mode}, TP={tp} over {mesh.world_size} process(es) ({mesh.backend or 'no'} backend, {mesh.device})")
        print(f"toy model: embedding({args.vocab}, {args.hidden}) -> Linear({args.hidden}, {ffn}) -> GELU -> "
              f"Linear({ffn}, {args.hidden}) + residual -> head({args.hidden}, {args.vocab}) -> cross-entropy "
              f"(label smoothing 0.1); batch {args.batch} x seq {args.seq_len}\n")
        print("\n\n".join(report))
        print(f"\n{'OK' if ok else 'MISMATCH'}: the {tp}-way model computes what the single-device model computes")
    mesh.destroy()
    return 0 if ok else 1
