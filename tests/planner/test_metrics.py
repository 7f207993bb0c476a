"""The metrics document and the validation report: schema drift, what the runtime writes, loading,
and `compare` / `refit` / `planner validate` on a document built like the runtime builds it."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from passes.errors import UserError
from passes.load import file_sha256
from planner.cli import app
from planner.metrics import (METRICS_SCHEMA, VALIDATION_SCHEMA, FillReport, MetricsDocument, ValidationReport,
                             load_metrics, metrics_json_schema, save_metrics, validation_json_schema)
from planner.plan import Fill, FillChunk, FillJob, FillPredictions, Plan, save_plan
from planner.runtime import CheckedPlan, mean_iteration_s, summarize
from planner.runtime.__main__ import _run_entry
from planner.validate import compare, refit
from tests.conftest import EXAMPLES, ROOT
from tests.runtime._util import GPT, gpt_args, plan_file

METRICS_FILE = ROOT / "schemas" / "metrics.schema.json"
VALIDATION_FILE = ROOT / "schemas" / "validation.schema.json"
MLP = EXAMPLES / "mlp.py"
STEPS = 3
FWD, BWD, BUBBLE, UNITS = 1.5, 2.0, 3.0, 2  # measured / predicted in the fake run; fill units per occurrence


def _drift(current: dict, path: Path, regen: bool) -> None:
    text = json.dumps(current, indent=1, sort_keys=True) + "\n"
    if regen:
        path.write_text(text)
    assert path.read_text() == text, f"{path.name} changed: bump the schema string if needed, then --regen-golden"


def test_metrics_json_schema_has_not_drifted(regen):
    _drift(metrics_json_schema(), METRICS_FILE, regen)


def test_validation_json_schema_has_not_drifted(regen):
    _drift(validation_json_schema(), VALIDATION_FILE, regen)


# ---------------------------------------------------------------------------------------------
# A run as the runtime records it: Executor.run / run_step per rank, gathered, then _run_entry


@pytest.fixture(scope="module")
def plan(tmp_path_factory) -> tuple[Plan, Path]:
    """GPT tiny on p=2 GPipe, with a hand-made fill section: one MLP job in rank 0's bubbles."""
    path = tmp_path_factory.mktemp("metrics") / "plan.json"
    base = plan_file(path, GPT, gpt_args(2), gpus=2, global_batch=4, t=1, p=2, d=1, b=1, v=1, schedule="gpipe")
    units = ["F:0", "B:0", "OPT"]
    job = FillJob(name="mlp", model_file=str(MLP), model_sha256=file_sha256(MLP), model_args={"depth": 2},
                  kind="train", batch_size=8, config="plain", units=units, unit_time_s=[1e-3] * 3, resident=True)
    bubbles = [b for b in base.bubbles if b.rank == 0]
    chunks = [FillChunk(job="mlp", rank=0, bubble_id=b.id, first_unit=0, units=UNITS, expected_s=2e-3,
                        memory_bytes=1 << 20) for b in bubbles]
    fill = Fill(safety_margin=0.1, jobs=[job], chunks=chunks,
                predictions=FillPredictions(fill_tflops_per_gpu=0.0, bubble_time_used=0.5,
                                            total_useful_tflops_per_gpu=0.0, offload_optimizer=False))
    full = base.model_copy(update={"fill": fill})
    save_plan(full, path)
    return full, path


def _step(plan: Plan, pp: int, index: int, fill: bool) -> dict[str, Any]:
    """Executor.run_step's record, measured = predicted x the factors above."""
    m = plan.config.microbatches
    return {"step": index, "iteration_s": plan.predictions.iteration_s * (2.0 + 0.5 * pp + 0.1 * index),
            "loss": 5.0 - index if pp == plan.config.pp - 1 else None,
            "bubbles": [{"id": b.id, "start_s": 2 * b.start_s, "duration_s": BUBBLE * b.duration_s,
                         "predicted_start_s": b.start_s, "predicted_s": b.duration_s}
                        for b in plan.bubbles if b.rank == pp],
            "stages": {str(s.stage): {"forward_s": FWD * s.forward_s * m, "backward_s": BWD * s.backward_s * m}
                       for s in plan.partition if s.rank == pp},
            "peak_memory_bytes": None, "fill": fill and index > 0}


def _fill_report(plan: Plan, pp: int) -> dict[str, Any]:
    """FillClient.report() of a rank whose fill job ran UNITS units in every occurrence of its bubbles."""
    job = plan.fill.jobs[0]
    t0, occurrences, pos, seq = 1.7e9, [], 0, 0
    for step in range(1, STEPS):
        for b in (b for b in plan.bubbles if b.rank == pp):
            seq += 1
            begin = t0 + step + b.start_s
            steps = [{"job": job.name, "unit": job.units[(pos + k) % 3], "pos": pos + k, "iteration": (pos + k) // 3,
                      "start": begin + 1e-4 * k, "end": begin + 1e-4 * (k + 1), "interface": "iterative"}
                     for k in range(UNITS)]
            pos += UNITS
            occurrences.append({"bubble_id": b.id, "seq": seq, "main_begin": begin, "gpu_idle": begin,
                                "main_end": begin + b.duration_s, "deadline": begin + b.duration_s,
                                "usable_until": begin + 0.9 * b.duration_s, "duration_s": b.duration_s,
                                "free_bytes": b.free_bytes, "jobs": [job.name], "planned_units": {job.name: UNITS},
                                "units_done": UNITS, "samples_done": 0, "steps": steps, "overruns": [], "kills": [],
                                "errors": []})
    transitions = [{"t": t0, "job": job.name, "transition": "CreateSideTask", "from": "SUBMITTED", "to": "CREATED",
                    "reason": "task process 123 started (iterative interface)"},
                   {"t": t0 + 1, "job": job.name, "transition": "InitSideTask", "from": "CREATED", "to": "PAUSED",
                    "reason": "profiled 3 units, 3.0 ms per iteration"}]
    jobs = [{"name": job.name, "kind": job.kind, "interface": "iterative", "batch_size": job.batch_size,
             "state": "STOPPED", "stop_reason": "shutdown", "error": None, "units_done": pos,
             "iterations_done": pos // 3, "samples_done": pos // 3 * job.batch_size, "units": job.units,
             "profile_s": dict.fromkeys(job.units, 1e-3), "observed_s": {"F:0": 1.2e-3},
             "predicted_s": dict(zip(job.units, job.unit_time_s))}]
    return {"pipeline_rank": pp, "global_rank": pp, "device": "cpu", "executor_pid": 4321, "grace_s": 0.05,
            "safety_margin": 0.1, "started_at": t0, "jobs": jobs, "bubbles": occurrences, "overruns": [], "kills": [],
            "errors": [], "transitions": transitions}


def _records(plan: Plan) -> list[dict[str, Any]]:
    """Executor.run's record of every rank (rank 0 runs the fill client)."""
    out = []
    for pp in range(plan.config.pp):
        fill = any(c.rank == pp for c in plan.fill.chunks)
        out.append({"rank": pp, "pp": pp, "dp": 0, "tp": 0,
                    "stages": sorted(s.stage for s in plan.partition if s.rank == pp),
                    "steps": [_step(plan, pp, i, fill) for i in range(STEPS)],
                    "fill_report": _fill_report(plan, pp) if fill else {},
                    "fill_client": "FillClient" if fill else "NullFill", "characterization": None})
    return out


def _args() -> argparse.Namespace:
    return argparse.Namespace(steps=STEPS, no_fill=False, optimizer="adam", lr=1e-3, seed=0)


@pytest.fixture(scope="module")
def doc(plan) -> MetricsDocument:
    full, path = plan
    entry = _run_entry(CheckedPlan(path=path, plan=full, model_file=GPT), _records(full), _args(), "cpu")
    return MetricsDocument(runs=[entry])


def test_runtime_records_round_trip_through_the_file(doc, tmp_path):
    out = tmp_path / "sub" / "metrics.json"
    save_metrics(doc, out)
    data = json.loads(out.read_text())
    assert data["schema"] == METRICS_SCHEMA and set(data) == {"schema", "runs"}
    assert load_metrics(out) == doc
    run = doc.runs[0]
    assert run.loss == [5.0, 4.0, 3.0] and run.world == 2 and run.dtype == "float32"
    assert run.ranks[1].fill_report is None  # the executor's NullFill reports {}
    rep = run.ranks[0].fill_report
    assert rep is not None and rep.jobs[0].stop_reason == "shutdown" and rep.transitions[0].from_ == "SUBMITTED"
    assert data["runs"][0]["ranks"][0]["fill_report"]["transitions"][0]["from"] == "SUBMITTED"


def test_the_runtime_cannot_record_a_nonconforming_run(plan):
    full, path = plan
    records = _records(full)
    del records[0]["steps"][1]["iteration_s"]
    records[1]["steps"][0]["bubbles"][0]["colour"] = "red"
    with pytest.raises(ValidationError) as info:
        _run_entry(CheckedPlan(path=path, plan=full, model_file=GPT), records, _args(), "cpu")
    assert {e["loc"][:5] for e in info.value.errors()} == {("ranks", 0, "steps", 1, "iteration_s"),
                                                          ("ranks", 1, "steps", 0, "bubbles")}


def test_the_runtime_package_still_imports_neither_torch_nor_pydantic():
    code = "import sys, planner.runtime; print(sorted({'torch', 'pydantic'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_a_fill_executor_that_did_not_answer_is_recorded():
    lists = dict.fromkeys(("jobs", "bubbles", "overruns", "kills", "errors", "transitions"), [])
    rep = FillReport.model_validate({**lists, "error": "fill executor exited (code -9) before answering 'report'"})
    assert rep.pipeline_rank is None and "exited" in rep.error


def test_documents_validate_against_the_exported_schemas(doc, plan, tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    save_metrics(doc, tmp_path / "m.json")
    jsonschema.validate(json.loads((tmp_path / "m.json").read_text()), json.loads(METRICS_FILE.read_text()))
    report = json.loads(compare(plan[0], doc).model_dump_json(by_alias=True))
    jsonschema.validate(report, json.loads(VALIDATION_FILE.read_text()))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**report, "steps": "three"}, json.loads(VALIDATION_FILE.read_text()))


# ---------------------------------------------------------------------------------------------
# Readers


def test_compare_on_a_metrics_document(doc, plan):
    full, _ = plan
    report = compare(full, doc)
    assert report.schema_version == VALIDATION_SCHEMA and report.device == "cpu" and report.steps == STEPS
    assert [r.rank for r in report.ranks] == [0, 1]
    for rank in report.ranks:
        rows = {row.what: row for row in rank.rows}
        assert all(row.rank == rank.rank for row in rank.rows)
        for st in (s for s in full.partition if s.rank == rank.rank):
            assert rows[f"stage {st.stage} forward"].error == pytest.approx(FWD - 1)
            assert rows[f"stage {st.stage} backward"].error == pytest.approx(BWD - 1)
        for b in (b for b in full.bubbles if b.rank == rank.rank):
            duration = rows[f"bubble {b.id} duration"]
            assert duration.measured == pytest.approx(BUBBLE * b.duration_s) and duration.kind == b.kind
            assert rows[f"bubble {b.id} start"].measured == pytest.approx(2 * b.start_s)
        # steps after the warm-up: 2.0 + 0.5 pp + 0.1 step for steps 1 and 2
        assert rows["iteration"].measured == pytest.approx(full.predictions.iteration_s * (2.15 + 0.5 * rank.rank))
        assert rows["peak memory"].measured is None and rows["peak memory"].error is None
        fill = {w: r for w, r in rows.items() if w.startswith("fill units")}
        chunked = {c.bubble_id for c in full.fill.chunks if c.rank == rank.rank}
        assert set(fill) == {f"fill units in bubble {b}" for b in chunked}
        assert all(r.predicted == UNITS and r.measured == UNITS and r.error == 0 for r in fill.values())
    assert report.iteration.measured == pytest.approx(full.predictions.iteration_s * 2.65)


def test_refit_and_summaries_read_the_document(doc, plan):
    full, _ = plan
    new = refit(full, doc)
    assert [b.duration_s for b in new.bubbles] == pytest.approx([BUBBLE * b.duration_s for b in full.bubbles])
    rows = summarize(doc)
    assert [(r["step"], r["loss"], r["fill"]) for r in rows] == [(0, 5.0, False), (1, 4.0, True), (2, 3.0, True)]
    assert rows[0]["bubbles"] == len(full.bubbles)
    assert mean_iteration_s(doc) == pytest.approx(full.predictions.iteration_s * 2.65)


def test_launch_report_reads_the_document(doc, capsys):
    from planner.cli_launch import _report

    _report(doc, doc, as_json=False)
    text = capsys.readouterr().out
    assert "main job per step" in text and "main-job slowdown with fill: +0.0%" in text
    rep = doc.runs[0].ranks[0].fill_report
    assert f"rank 0: fill {len(rep.bubbles)} bubble(s) used, {UNITS * len(rep.bubbles)} unit(s) done" in text
    assert "rank 1: fill" not in text  # no fill client there
    _report(doc, None, as_json=True)
    data = json.loads(capsys.readouterr().out)
    assert MetricsDocument.model_validate(data["metrics"]) == doc and data["no_fill"] is None


def test_validate_and_refit_commands_read_a_metrics_file(doc, plan, tmp_path):
    _, path = plan
    save_metrics(doc, tmp_path / "m.json")
    runner = CliRunner()
    res = runner.invoke(app, ["validate", str(path), "--metrics", str(tmp_path / "m.json"), "-o",
                              str(tmp_path / "v.json")])
    assert res.exit_code == 0, res.output
    assert "predicted vs measured" in res.stdout and "iteration (slowest rank)" in res.stdout
    report = ValidationReport.model_validate_json((tmp_path / "v.json").read_text())
    assert report == compare(plan[0], doc)
    res = runner.invoke(app, ["refit", str(path), "--measured", str(tmp_path / "m.json"), "-o",
                              str(tmp_path / "refit.json")])
    assert res.exit_code == 0 and "bubbles now carry measured durations" in res.stdout, res.output
    res = runner.invoke(app, ["refit", str(path), "--measured", str(path)])
    assert res.exit_code == 2 and "not a metrics file" in res.output


# ---------------------------------------------------------------------------------------------
# load_metrics: one sentence per bad input


def _bad(tmp_path: Path, case: str, doc: MetricsDocument) -> Path:
    path = tmp_path / "m.json"
    data = json.loads(doc.model_dump_json(by_alias=True))
    if case == "missing":
        return tmp_path / "nothing.json"
    if case == "not json":
        path.write_text('{"schema": "fxplanner.metrics/v1",\n "runs": [}')
    elif case == "not an object":
        path.write_text("[1, 2]")
    elif case == "wrong schema":
        path.write_text(json.dumps({**data, "schema": "fxplanner.plan/v1"}))
    elif case == "bad field":
        data["runs"][0]["ranks"][1]["steps"][2]["iteration_s"] = "fast"
        path.write_text(json.dumps(data))
    elif case == "no runs":
        path.write_text(json.dumps({**data, "runs": []}))
    return path


@pytest.mark.parametrize("case, message", [
    ("missing", "does not exist; write one with `planner launch PLAN --local --metrics"),
    ("not json", "is not valid JSON (line 2: "),
    ("not an object", "must hold a JSON object"),
    ("wrong schema", "has schema 'fxplanner.plan/v1', not 'fxplanner.metrics/v1': it is not a metrics file"),
    ("bad field", "field runs.0.ranks.1.steps.2.iteration_s: Input should be a valid number"),
    ("no runs", "field runs: List should have at least 1 item"),
])
def test_load_metrics_says_what_is_wrong_in_one_sentence(doc, tmp_path, case, message):
    path = _bad(tmp_path, case, doc)
    with pytest.raises(UserError) as info:
        load_metrics(path)
    text = str(info.value)
    assert text.startswith(f"metrics file {path}") and message in text, text
    assert "\n" not in text and text.count(". ") == 0, text


def test_refit_repacks_the_fill_into_the_measured_bubbles(plan):
    """Bubbles measured longer than predicted: the fill is packed again into them and its predictions follow."""
    from dataclasses import replace

    from planner.validate import repack_fill

    full, _ = plan
    longest = max(b.duration_s for b in full.bubbles)
    scaled = lambda s: full.model_copy(update={"bubbles": [replace(b, duration_s=b.duration_s * s / longest)  # noqa: E731
                                                           for b in full.bubbles]})
    short, long = scaled(0.05), scaled(0.5)  # the longest bubble 50 ms, then 500 ms
    before, after = repack_fill(short), repack_fill(long)
    for p in (before, after):
        room = {(b.rank, b.id): b.duration_s * (1 - p.fill.safety_margin) for b in p.bubbles}
        assert all(ch.expected_s <= room[(ch.rank, ch.bubble_id)] + 1e-12 for ch in p.fill.chunks)
    units = lambda p: sum(c.units for c in p.fill.chunks)  # noqa: E731
    assert units(after) > units(before) > 0
    assert after.fill.predictions.fill_tflops_per_gpu > before.fill.predictions.fill_tflops_per_gpu > 0
    assert {j.name.split("@")[0] for j in after.fill.jobs} == {"mlp"}
    if full.fill.predictions.choice:  # the plan's shrink-or-fill reasoning survives the re-pack
        assert after.fill.predictions.choice.startswith(full.fill.predictions.choice)
