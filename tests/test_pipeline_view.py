"""Pictures of pipeline schedules: the terminal drawing and the Gantt PNGs, simulated and measured."""

import pytest

from tensorpar.errors import TensorparError
from tensorpar.pipeline_parallel.schedule_simulation import simulate
from tensorpar.pipeline_parallel.schedule_view import (
    measured_bubble,
    render_measured,
    render_png,
    render_text,
)
from tensorpar.pipeline_parallel.schedules import (
    interleaved,
    one_f_one_b,
)


def test_render_text():
    tl = simulate(one_f_one_b(4, 8), name="1f1b")
    text = render_text(tl)
    for r in range(4):
        assert f"rank {r} |" in text
    assert "F7" in text and "B7" in text and "." in text
    assert "bubble fraction: simulated 0.2727" in text and "3/11" in text
    row3 = [line for line in text.splitlines() if line.startswith("rank 3 |")][0]
    assert row3.startswith("rank 3 |.........F0 B0    F1 B1")
    text = render_text(simulate(interleaved(4, 8, 2)), width=80)
    rows = [line for line in text.splitlines() if line.startswith("rank")]
    assert len(rows) == 4 and all(len(line) <= 80 for line in rows)
    assert "3/19" in text
    wide = render_text(simulate(interleaved(2, 4, 2)))
    assert "F0a" in wide and "B0b" in wide


def test_render_png_and_measured(tmp_path):
    path = render_png(simulate(interleaved(2, 4, 2)), str(tmp_path / "a" / "s.png"), "interleaved")
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    events = [[("F", 0, 0, 10.0, 11.0), ("B", 0, 0, 13.0, 15.0)],
              [("F", 0, 0, 11.0, 12.0), ("B", 0, 0, 12.0, 13.0)]]
    assert measured_bubble(events) == pytest.approx(1 - 5 / 10)
    out = render_measured(events, str(tmp_path / "m.png"), "measured")
    assert open(out, "rb").read()[:4] == b"\x89PNG"
    with pytest.raises(TensorparError):
        measured_bubble([[], []])
