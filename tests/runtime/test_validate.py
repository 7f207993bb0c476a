"""`planner validate` and `planner refit` on a tiny CPU plan run with real torchrun processes."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from planner.cli import app
from planner.metrics import ValidationReport
from planner.plan import load_plan
from tests.conftest import ROOT

pytestmark = pytest.mark.multiprocess


def test_validate_prints_the_error_table_writes_json_and_refit_uses_it(small_plan, tmp_path):
    runner = CliRunner()
    out = tmp_path / "validation.json"
    metrics = tmp_path / "metrics.json"
    res = runner.invoke(app, ["launch", str(small_plan), "--local", "--steps", "3", "--no-fill",
                              "--metrics", str(metrics)])
    assert res.exit_code == 0, res.stdout
    res = runner.invoke(app, ["validate", str(small_plan), "--metrics", str(metrics), "-o", str(out)])
    assert res.exit_code == 0, res.stdout
    assert "predicted vs measured" in res.stdout and "iteration (slowest rank)" in res.stdout
    doc = ValidationReport.model_validate_json(out.read_text())
    jsonschema = pytest.importorskip("jsonschema")  # what a run and `planner validate` write, against schemas/
    for written, schema in ((metrics, "metrics.schema.json"), (out, "validation.schema.json")):
        jsonschema.validate(json.loads(written.read_text()), json.loads((ROOT / "schemas" / schema).read_text()))
    plan = load_plan(small_plan)
    assert len(doc.ranks) == plan.config.pp
    whats = {row.what for rank in doc.ranks for row in rank.rows}
    assert {"stage 0 forward", "stage 1 backward", "iteration", "peak memory"} <= whats
    assert any(w.startswith("bubble") and w.endswith("duration") for w in whats)
    for rank in doc.ranks:
        for row in rank.rows:
            if row.what.startswith("stage"):
                assert row.measured > 0 and row.error == pytest.approx(row.measured / row.predicted - 1)
    assert doc.iteration.measured > 0
    refit = tmp_path / "refit.json"
    res = runner.invoke(app, ["refit", str(small_plan), "--measured", str(metrics), "-o", str(refit)])
    assert res.exit_code == 0, res.stdout
    new = load_plan(refit)
    measured = {(r.rank, row.what): row.measured for r in doc.ranks for row in r.rows}
    for b in new.bubbles:
        assert b.duration_s == pytest.approx(measured[(b.rank, f"bubble {b.id} duration")])
    res = runner.invoke(app, ["refit", str(small_plan), "--measured", str(small_plan)])
    assert res.exit_code != 0 and "not a metrics file" in res.stdout + (res.stderr or "")
    # a launch of several plans records one run each: validate takes the one of the plan it is given
    data = json.loads(metrics.read_text())
    other = tmp_path / "other.json"
    other.write_text(small_plan.read_text())
    data["runs"] = [{**data["runs"][0], "plan": str(other)}, data["runs"][0]]
    both = tmp_path / "both.json"
    both.write_text(json.dumps(data))
    res = runner.invoke(app, ["validate", str(small_plan), "--metrics", str(both), "-o", str(out)])
    assert res.exit_code == 0, res.stdout
    third = tmp_path / "third.json"  # the same plan under another name: its runs are matched by the plan's hash
    third.write_text(small_plan.read_text())
    res = runner.invoke(app, ["validate", str(third), "--metrics", str(both), "-o", str(out)])
    assert res.exit_code == 0, res.stdout
    data["runs"] = [{**run, "plan_key": "0" * 64} for run in data["runs"]]  # runs of another plan
    foreign = tmp_path / "foreign.json"
    foreign.write_text(json.dumps(data))
    for args in (["validate", str(small_plan), "--metrics", str(foreign)],
                 ["refit", str(small_plan), "--measured", str(foreign), "-o", str(refit)]):
        res = runner.invoke(app, args)
        text = " ".join((res.stdout + (res.stderr or "")).split())
        assert res.exit_code == 2 and "holds runs of other plans than" in text, text
    data["runs"] = [{k: v for k, v in run.items() if k != "plan_key"} for run in data["runs"]]  # older metrics
    keyless = tmp_path / "keyless.json"
    keyless.write_text(json.dumps(data))
    res = runner.invoke(app, ["validate", str(third), "--metrics", str(keyless)])
    assert res.exit_code != 0 and "none of them is" in res.stdout + (res.stderr or "")
