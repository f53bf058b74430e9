"""Pictures of pipeline schedules: a terminal drawing and a Gantt chart (PNG), from a simulated
Timeline or from a training run's measured per-rank timings.

Text cells read ``F3`` (forward of microbatch 3) and ``B3`` (its backward; in the zero-bubble
schedules only the input gradient) and ``W3`` (its weight gradients, zero-bubble schedules); with
several model chunks per rank a letter names the chunk (``F3a`` chunk 0, ``F3b`` chunk 1, ...);
``.`` is idle.
"""

from __future__ import annotations

import math
import os

from tensorpar.errors import TensorparError
from tensorpar.pipeline_parallel.schedule_simulation import Timeline
from tensorpar.pipeline_parallel.schedules import ACTION_KINDS, bubble_formula

_PREFIX = "rank {r:>{w}} |"


def _chunk_tag(chunk: int, v: int) -> str:
    if v <= 1:
        return ""
    return chr(ord("a") + chunk) if v <= 26 else f".{chunk}"


def _label(kind: str, mb: int, chunk: int, v: int) -> str:
    return f"{kind}{mb}{_chunk_tag(chunk, v)}"


def _formula(tl: Timeline) -> tuple[str, float]:
    """The published bubble of the timeline's schedule (its name's; unnamed: 1F1B's, or interleaved's with chunks)."""
    name = tl.name if tl.name in _NAMED else ("interleaved" if tl.virtual_stages > 1 else "1f1b")
    return bubble_formula(name, tl.pp, tl.microbatches, tl.virtual_stages)


_NAMED = ("afab", "1f1b", "interleaved", "zb-h1", "zbv")


def _chunk_legend(tl: Timeline) -> str:
    pp, v = tl.pp, tl.virtual_stages
    if tl.v_shape:
        return f"letter = chunk (a: stages 0..{pp - 1}, b: stages {2 * pp - 1}..{pp} in a V; rank 0 holds both ends)"
    return "letter = chunk (" + ", ".join(
        f"{_chunk_tag(c, v)}: stages {c * pp}..{c * pp + pp - 1}" for c in range(min(v, 3))
    ) + (", ..." if v > 3 else "") + "; stage = chunk*pp + rank)"


def _fmt_time(t: float) -> str:
    return f"{t:g}"


def _col(t: float, scale: float) -> int:
    return math.floor(t * scale + 0.5 + 1e-9)  # half up, not to even: equal durations, equal widths


def render_text(timeline: Timeline, width: int | None = None) -> str:
    """One row per rank, time flowing right, ``F3``/``B3`` blocks (chunk letter appended when
    interleaved), ``.`` for idle; then a legend and a line with the simulated bubble fraction and
    the formula's value. ``width`` caps the row length in characters (labels are cut to fit)."""
    tl = timeline
    pp, m, v = tl.pp, tl.microbatches, tl.virtual_stages
    events = tl.events
    all_ev = [ev for evs in events for ev in evs]
    if not all_ev or not tl.makespan > 0:
        raise TensorparError("render_text: the timeline has no events")
    longest = max(len(_label(a.kind, a.microbatch, a.chunk, v)) for a, _, _ in all_ev)
    shortest = min(e - s for _, s, e in all_ev if e > s) if any(e > s for _, s, e in all_ev) else tl.makespan
    scale = (longest + 1) / shortest  # columns per time unit: the shortest block fits its label + a space
    rank_w = len(str(pp - 1))
    prefix_len = len(_PREFIX.format(r=0, w=rank_w)) + 1  # + closing "|"
    ncols = math.ceil(tl.makespan * scale - 1e-9)
    if width is not None and prefix_len + ncols > width:
        avail = max(width - prefix_len, 1)
        scale = avail / tl.makespan
        ncols = avail
    rows = []
    for r in range(pp):
        cells = ["."] * ncols
        for a, s, e in events[r]:
            c0 = min(_col(s, scale), ncols - 1)
            c1 = min(max(_col(e, scale), c0 + 1), ncols)
            w = c1 - c0
            lab = _label(a.kind, a.microbatch, a.chunk, v)
            text = lab.ljust(w)[:w]  # the natural scale always fits the label; a capped width cuts it
            cells[c0:c1] = list(text)
        rows.append(_PREFIX.format(r=r, w=rank_w) + "".join(cells) + "|")
    title = f"{tl.name or 'pipeline'} schedule: pp={pp}, microbatches={m}"
    if v > 1:
        title += f", virtual stages per rank={v}"
    per = " per chunk" if v > 1 else ""
    backward = _fmt_time(tl.backward_time)
    if tl.weight_time is not None:
        backward += f" (B {_fmt_time(tl.backward_time - tl.weight_time)} + W {_fmt_time(tl.weight_time)})"
    title += (
        f"; forward {_fmt_time(tl.forward_time)}, backward {backward}{per}"
        f", p2p {_fmt_time(tl.p2p_time)} time units; makespan {_fmt_time(tl.makespan)}"
    )
    split = tl.weight_time is not None
    legend = "F3 = forward of microbatch 3, " + ("B3 = its input gradient, W3 = its weight gradients"
                                                   if split else "B3 = its backward")
    if v > 1:
        legend += ", " + _chunk_legend(tl)
    legend += f"; . = idle; one column = {_fmt_time(round(1 / scale, 4))} time units"
    text, value = _formula(tl)
    ideal = "" if tl.p2p_time == 0 else " (ideal, without p2p time)"
    bubble = (
        f"bubble fraction: simulated {tl.bubble_fraction:.4f} ({100 * tl.bubble_fraction:.2f}%); "
        f"formula {text} = {value:.4f}{ideal}"
    )
    return "\n".join([title, *rows, legend, bubble])


# --------------------------------------------------------------------------- PNG


def _gantt(rows, path: str, title: str, xlabel: str, subtitle: str) -> str:
    """rows[r] = list of (kind, microbatch, chunk, start, end)."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
        from matplotlib import colormaps
    except ImportError as e:  # pragma: no cover - matplotlib is a test dependency
        raise TensorparError("drawing a schedule needs matplotlib (pip install matplotlib)") from e
    pp = len(rows)
    all_ev = [ev for evs in rows for ev in evs]
    if not all_ev:
        raise TensorparError("nothing to draw: no events")
    v = 1 + max(ev[2] for ev in all_ev)
    span = max(ev[4] for ev in all_ev)
    n_per_row = max(len(evs) for evs in rows)
    fig_w = min(max(8.0, 0.22 * n_per_row + 2), 26.0)
    fig = Figure(figsize=(fig_w, 1.0 + 0.55 * pp + 0.6), dpi=110)
    ax = fig.add_subplot(1, 1, 1)
    maps = {"F": colormaps["Blues"], "B": colormaps["Oranges"], "W": colormaps["Greens"]}

    def colour(kind, chunk):
        shade = 0.45 + (0.4 * chunk / (v - 1) if v > 1 else 0.0)
        return maps[kind](shade)

    fontsize = 7 if n_per_row <= 80 else 5
    for r, evs in enumerate(rows):
        for kind, mb, chunk, s, e in evs:
            ax.barh(r, e - s, left=s, height=0.8, color=colour(kind, chunk), edgecolor="white", linewidth=0.6)
            if n_per_row <= 160:
                ax.text((s + e) / 2, r, str(mb), ha="center", va="center", fontsize=fontsize,
                        color="black" if chunk < (v + 1) // 2 or v == 1 else "white")
    ax.set_yticks(range(pp))
    ax.set_yticklabels([f"rank {r}" for r in range(pp)])
    ax.set_ylim(pp - 0.5, -0.5)  # rank 0 on top
    ax.set_xlim(0, span)
    ax.set_xlabel(xlabel)
    ax.set_title(f"{title}\n{subtitle}", fontsize=10)
    handles = []
    split = any(ev[0] == "W" for ev in all_ev)
    words = (("F", "forward"), ("B", "input gradient"), ("W", "weight gradients")) if split else \
        (("F", "forward"), ("B", "backward"))
    for kind, word in words:
        for c in range(v):
            handles.append(Patch(color=colour(kind, c), label=word + (f" chunk {c}" if v > 1 else "")))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.25 if pp > 2 else -0.4),
              ncol=min(len(handles), 8), fontsize=8, frameon=False)
    ax.grid(axis="x", alpha=0.25)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    return path


def render_png(timeline: Timeline, path: str, title: str) -> str:
    """Gantt chart of a simulated timeline (forwards in blues, backwards in oranges, weight gradients in
    greens, darker for later chunks, microbatch numbers in the boxes); returns ``path``."""
    tl = timeline
    rows = [[(a.kind, a.microbatch, a.chunk, s, e) for a, s, e in evs] for evs in tl.events]
    text, value = _formula(tl)
    sub = f"bubble {100 * tl.bubble_fraction:.1f}% simulated, formula {text} = {100 * value:.1f}%"
    per = " per chunk" if tl.virtual_stages > 1 else ""
    xlabel = f"time (forward = {tl.forward_time:.4g}, backward = {tl.backward_time:.4g}{per})"
    return _gantt(rows, path, title, xlabel, sub)


def _measured_rows(per_rank_events):
    if not per_rank_events or not any(per_rank_events):
        raise TensorparError("measured timeline: no events")
    t0 = min(ev[3] for evs in per_rank_events for ev in evs)
    rows = []
    for r, evs in enumerate(per_rank_events):
        row = []
        for ev in evs:
            kind, mb, chunk, s, e = ev
            if kind not in ACTION_KINDS or e < s:
                raise TensorparError(f"measured timeline, rank {r}: bad event {ev!r} (kind F/B/W, end >= start)")
            row.append((kind, int(mb), int(chunk), float(s) - t0, float(e) - t0))
        rows.append(row)
    return rows


def measured_bubble(per_rank_events) -> float:
    """1 - busy / (pp * span) of a measured run: ``per_rank_events[r]`` lists rank r's
    (kind, microbatch, chunk, start_s, end_s); span = last end - first start over all ranks."""
    rows = _measured_rows(per_rank_events)
    span = max(ev[4] for evs in rows for ev in evs)
    if not span > 0:
        raise TensorparError("measured timeline: zero time span")
    busy = sum(e - s for evs in rows for _, _, _, s, e in evs)
    return 1.0 - busy / (len(rows) * span)


def render_measured(per_rank_events, path: str, title: str) -> str:
    """The same Gantt chart from a training run's measured timings (seconds from the first
    start); returns ``path``."""
    rows = _measured_rows(per_rank_events)
    b = measured_bubble(per_rank_events)
    return _gantt(rows, path, title, "seconds", f"measured bubble {100 * b:.1f}%")
