"""The validation table of docs/validation.md is what the planner predicts now (recomputed, not stored)."""

from __future__ import annotations

import pathlib
import re

import pytest

from planning_validation import RUNS, predict

DOC = pathlib.Path(__file__).parent.parent / "docs" / "validation.md"


def _doc_errors() -> dict[str, float]:
    rows = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) == 8 and re.fullmatch(r"[+-]\d+\.\d%", cells[5]):
            rows[cells[0]] = float(cells[5][:-1])
    return rows


def test_every_published_run_has_a_source_and_the_doc_states_its_current_error():
    doc = _doc_errors()
    assert len(RUNS) >= 12 and set(doc) == {r.name for r in RUNS}
    for run in RUNS:
        assert run.source and run.published > 0
        plan, pred, err = predict(run)
        assert plan.time is not None and pred > 0
        assert doc[run.name] == pytest.approx(100 * err, abs=0.051), f"{run.name}: docs/validation.md is stale"


def test_the_validation_is_one_model_not_per_run_factors():
    # every run of one software shares its cluster settings; the runs differ only in what their sources publish
    from planning_validation import SOFTWARE, cluster_for

    for name in SOFTWARE:
        clusters = {(c.overlap, c.tp_overlap, c.link_efficiency, c.mfu_ceiling)
                    for c in (cluster_for(r) for r in RUNS if r.software == name)}
        assert len(clusters) == 1, name
