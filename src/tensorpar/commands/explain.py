"""`tensorpar explain COLLECTIVE --ranks N`: a collective's algorithm, step by step, on small numbers.

Simulates the ring (all-reduce, all-gather, reduce-scatter) or binomial-tree (reduce, broadcast,
gather, scatter; all-reduce too) algorithm of `tensorpar.distributed.collective_simulation` and prints its
cost, the initial buffers, every step (who sends which chunk to whom and the receiver's buffer
after it) and the result on every rank. No processes are started. By default rank r holds
[r*N+1 .. r*N+N], as in the reduce-scatter example of the NCCL walk-through, so
`tensorpar explain reduce-scatter --ranks 4` ends with 28, 32, 36, 40.
"""

from __future__ import annotations

from fractions import Fraction

from tensorpar.config.fields import add_options, options_from_args
from tensorpar.config.options import ExplainOptions
from tensorpar.distributed.collective_simulation import chunk_bounds, normalize, resolve_algorithm, simulate, tree_steps
from tensorpar.errors import TensorparError

MAX_RANKS = 64  # every step prints every rank's buffer: beyond this the output stops being readable
BYTES_PER_VALUE = 4  # the byte figures assume fp32

_DESCRIPTIONS = {
    ("all-reduce", "ring"): (
        "each buffer is cut into N chunks. Reduce-scatter phase, N-1 steps: every rank sends one chunk to the\n"
        "next rank on the ring, which adds it to its own copy of that chunk; afterwards rank r holds chunk r\n"
        "summed over all ranks. All-gather phase, N-1 steps: the finished chunks travel round the ring and\n"
        "overwrite the stale copies."
    ),
    ("all-reduce", "tree"): (
        "a binomial-tree reduce onto the root (each rank adds its children's buffers and sends the sum to its\n"
        "parent), then a binomial-tree broadcast of the result back down."
    ),
    ("reduce-scatter", "ring"): (
        "each buffer is cut into N chunks. In each of N-1 steps every rank sends one chunk to the next rank on\n"
        "the ring, which adds it to its own copy of that chunk. Chunk c starts at rank c+1 and collects one\n"
        "contribution per step, so after the last step rank r holds chunk r summed over all ranks."
    ),
    ("all-gather", "ring"): (
        "every rank starts with its own block in its slot of an N-block buffer. In each of N-1 steps every rank\n"
        "passes the block it received last (first its own) to the next rank on the ring."
    ),
    ("reduce", "tree"): (
        "binomial tree: in step k every rank whose distance from the root has lowest set bit 2^k sends its\n"
        "(partial) sum to the rank 2^k closer to the root, which adds it to its own; the number of ranks still\n"
        "holding partial sums halves each step."
    ),
    ("broadcast", "tree"): (
        "binomial tree: every rank that already has the data sends it to the rank 2^k further from the root,\n"
        "k counting down; the number of ranks holding the data doubles each step."
    ),
    ("gather", "tree"): (
        "binomial tree: each rank collects the blocks of its subtree, then sends them to its parent in one\n"
        "message; the root ends with every rank's block, in rank order."
    ),
    ("scatter", "tree"): (
        "binomial tree: the root sends each child the blocks of that child's whole subtree in one message;\n"
        "every rank keeps its own block and passes the rest on."
    ),
}

_RESULTS = {
    "all-reduce": "every rank holds the elementwise sum of all buffers",
    "reduce-scatter": "rank r holds chunk r summed over all ranks",
    "all-gather": "every rank holds every rank's block, in rank order",
    "reduce": "rank {root} holds the elementwise sum (the other buffers are scratch)",
    "broadcast": "every rank holds rank {root}'s buffer",
    "gather": "rank {root} holds every rank's block, in rank order",
    "scatter": "rank r holds block r of rank {root}'s buffer",
}


def add_parser(sub) -> None:
    p = sub.add_parser(
        "explain",
        help="show a collective's ring or tree algorithm step by step",
        description=(
            "Simulate a collective's algorithm on small numbers and print every step. Collectives: all-reduce, "
            "all-gather, reduce-scatter (ring), reduce, broadcast, gather, scatter (binomial tree); all-reduce "
            "also as --algorithm tree."
        ),
    )
    add_options(p, ExplainOptions)
    p.set_defaults(run=run)


def _parse_values(text: str) -> list[list[float]]:
    ranks = []
    for part in text.replace("/", ";").split(";"):
        values = []
        for item in part.split(","):
            item = item.strip()
            if not item:
                continue
            try:
                x = float(item)
            except ValueError:
                raise TensorparError(f"--values: '{item}' is not a number") from None
            values.append(int(x) if x.is_integer() and "." not in item and "e" not in item.lower() else x)
        ranks.append(values)
    return ranks


def _fmt(x) -> str:
    if x is None:
        return "_"
    if isinstance(x, float) and x.is_integer():
        return str(int(x))
    return f"{x:g}" if isinstance(x, float) else str(x)


def _fmt_buffer(buf, bounds) -> str:
    if bounds is None:
        return "[" + ", ".join(_fmt(x) for x in buf) + "]"
    return "[" + " | ".join(" ".join(_fmt(x) for x in buf[a:b]) for a, b in bounds) + "]"


def _fmt_values(values) -> str:
    return "[" + ", ".join(_fmt(x) for x in values) + "]"


def _plural(k: int, word: str) -> str:
    return f"{k} {word}{'' if k == 1 else 's'}"


def _cost_lines(collective: str, algorithm: str, n: int, root: int, trace, buf_len: int) -> list[str]:
    k = tree_steps(n)
    if (collective, algorithm) == ("all-reduce", "ring"):
        formula = (f"2(N-1) = {2 * (n - 1)} steps; in each step every rank sends 1/N of its buffer to the next rank, "
                   f"2(N-1)/N = {Fraction(2 * (n - 1), n)} of it in all")
    elif collective == "reduce-scatter":
        formula = (f"N-1 = {n - 1} steps; in each step every rank sends 1/N of its buffer to the next rank, "
                   f"(N-1)/N = {Fraction(n - 1, n)} of it in all")
    elif collective == "all-gather":
        formula = (f"N-1 = {n - 1} steps; in each step every rank sends one block (1/N of the result) to the next "
                   f"rank, (N-1)/N = {Fraction(n - 1, n)} of the result in all")
    elif collective == "all-reduce":
        formula = (f"2 ceil(log2 N) = {2 * k} steps; every rank but the root sends its whole buffer up once, "
                   f"and every rank sends it down once per child (the root ceil(log2 N) = {k} times)")
    elif collective == "reduce":
        formula = (f"ceil(log2 N) = {k} steps; every rank but the root sends its whole buffer once, to its parent; "
                   f"the root receives ceil(log2 N) = {k} buffers")
    elif collective == "broadcast":
        formula = (f"ceil(log2 N) = {k} steps; every rank but the root receives the buffer once; each rank sends "
                   f"it once per child (the root ceil(log2 N) = {k} times)")
    elif collective == "gather":
        formula = (f"ceil(log2 N) = {k} steps; every rank but the root sends its subtree's blocks once; "
                   f"the root receives N-1 = {n - 1} blocks in {k} messages")
    else:  # scatter
        formula = (f"ceil(log2 N) = {k} steps; every rank but the root receives its subtree's blocks once; "
                   f"the root sends N-1 = {n - 1} blocks in {k} messages")
    sent = [[0, 0] for _ in range(n)]
    for step in trace:
        for t in step.transfers:
            sent[t.src][0] += 1
            sent[t.src][1] += len(t.values)
    per_rank = [f"{_plural(m, 'message')}, {_plural(v, 'value')} = {v * BYTES_PER_VALUE} bytes" for m, v in sent]
    head = f"sent here (buffers of {_plural(buf_len, 'value')}, {BYTES_PER_VALUE} bytes each):"
    if len(set(per_rank)) == 1:
        return [f"cost: {formula}", f"{head} every rank {per_rank[0]}"]
    return [f"cost: {formula}", head] + [f"  rank {r}: {text}" for r, text in enumerate(per_rank)]


def explain(collective: str, ranks: int | None = None, algorithm: str | None = None, root: int | None = None,
            values: list[list[float]] | None = None) -> list[str]:
    """The lines `tensorpar explain` prints; bad input raises TensorparError."""
    collective = normalize(collective)
    algorithm = resolve_algorithm(collective, algorithm)
    n, root, values = _resolve_inputs(collective, algorithm, ranks, root, values)
    outputs, trace = simulate(collective, values, algorithm, root=root)

    tree = algorithm == "tree"
    buf_len = len(trace[0].buffers[0]) if trace else len(values[0])
    chunked = collective not in ("reduce", "broadcast") and not (collective == "all-reduce" and tree)
    bounds = chunk_bounds(buf_len, n) if chunked else None

    lines = _description_lines(collective, algorithm, n, root)
    lines += _cost_lines(collective, algorithm, n, root, trace, buf_len)
    lines.append("")
    lines += _initial_lines(collective, values, n, root, buf_len, chunked, bounds)
    for step in trace:
        lines.append("")
        lines += _step_lines(step, len(trace), bounds)
    lines.append("")
    lines += _result_lines(collective, n, root, outputs, values, buf_len)
    return lines


def _resolve_inputs(collective: str, algorithm: str, ranks: int | None, root: int | None,
                    values: list[list[float]] | None) -> tuple[int, int, list[list[float]]]:
    """(number of ranks, root, every rank's numbers) with the defaults filled in; bad input raises TensorparError."""
    if values is not None:
        if ranks is not None and ranks != len(values):
            raise TensorparError(f"--ranks {ranks} but --values gives {len(values)} ranks' numbers")
        ranks = len(values)
    n = 4 if ranks is None else ranks
    if n < 2:
        raise TensorparError(f"--ranks must be at least 2 (a collective over {_plural(n, 'rank')} sends nothing)")
    if n > MAX_RANKS:
        raise TensorparError(f"--ranks {n} is more than explain prints ({MAX_RANKS} at most)")
    if root is not None and algorithm != "tree":
        raise TensorparError(f"ring {collective} has no root; --root applies to the tree algorithms")
    root = 0 if root is None else root
    if not 0 <= root < n:
        raise TensorparError(f"--root {root} is not one of the ranks 0..{n - 1}")
    if values is None:
        values = [[r * n + i + 1 for i in range(n)] for r in range(n)]
    return n, root, values


def _description_lines(collective: str, algorithm: str, n: int, root: int) -> list[str]:
    """The heading lines: the collective, how its algorithm works, and the ring or the tree's root."""
    tree = algorithm == "tree"
    lines = [f"{collective} over {n} ranks: {'ring' if not tree else 'binomial tree'} algorithm"]
    lines += ["  " + ln for ln in _DESCRIPTIONS[(collective, algorithm)].splitlines()]
    if tree:
        lines.append(f"  root: rank {root}; with d = (r - root) mod N, rank r's parent is rank "
                     f"(root + d with its lowest set bit cleared) mod N")
    else:
        lines.append("  ring: " + " -> ".join(f"{r}" for r in list(range(n)) + [0]))
    return lines


def _initial_lines(collective: str, values, n: int, root: int, buf_len: int, chunked: bool, bounds) -> list[str]:
    """The 'initial buffers' heading and every rank's buffer before the first step."""
    first = _initial_buffers(collective, values, n, root, buf_len)
    if collective in ("all-reduce", "reduce-scatter") and chunked:
        label = f" ({n} chunks each)"
    elif chunked:
        label = f" ({n} blocks each; _ = no value yet)"
    elif collective == "broadcast":
        label = " (_ = no value yet)"
    else:
        label = ""
    return [f"initial buffers{label}:"] + [f"  rank {r}: {_fmt_buffer(b, bounds)}" for r, b in enumerate(first)]


def _step_lines(step, num_steps: int, bounds) -> list[str]:
    """One step's lines: its heading, then every transfer with the receiver's buffer after it."""
    lines = [f"step {step.index} of {num_steps} ({step.phase}):"]
    for t in step.transfers:
        lines.append(f"  rank {t.src} -> rank {t.dst}: {t.what} {_fmt_values(t.values)}"
                     f"  =>  rank {t.dst}: {_fmt_buffer(t.result, bounds)}")
    return lines


def _result_lines(collective: str, n: int, root: int, outputs, values, buf_len: int) -> list[str]:
    """The 'result' line and every rank's output ('-' where the collective leaves it none)."""
    lines = ["result: " + _RESULTS[collective].format(root=root)]
    terms = collective == "reduce-scatter" and buf_len == n  # one value per chunk: show the sums, as the blog does
    for r, out in enumerate(outputs):
        line = f"  rank {r}: " + ("-" if out is None else _fmt_values(out))
        if terms:
            line += f"   = {' + '.join(_fmt(values[q][r]) for q in range(n))}"
        lines.append(line)
    return lines


def _initial_buffers(collective: str, values, n: int, root: int, buf_len: int) -> list[list]:
    """Every rank's buffer before the first step, as the simulation lays it out."""
    if collective in ("all-gather", "gather"):
        m = len(values[0])
        bufs = [[None] * (n * m) for _ in range(n)]
        for r in range(n):
            bufs[r][r * m : (r + 1) * m] = values[r]
        return bufs
    if collective in ("broadcast", "scatter"):
        return [list(values[root]) if r == root else [None] * buf_len for r in range(n)]
    return [list(v) for v in values]


def run(args, argv) -> int:
    options = options_from_args(ExplainOptions, args, "explain")
    values = _parse_values(options.values) if options.values is not None else None
    print("\n".join(explain(options.collective, options.ranks, options.algorithm, options.root, values)))
    return 0
