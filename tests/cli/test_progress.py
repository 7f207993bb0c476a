"""`planner plan` says what it is doing on stderr while it works (tracing, pricing, searching, packing the fill), and
never on stdout: `--json` prints the plan and nothing else."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from planner.api import PHASES, make_plan
from planner.fill.spec import load_fill_spec
from planner.search import Pins
from tests.conftest import EXAMPLES, ROOT

TINY = ["plan", str(EXAMPLES / "gpt.py"), "--model-arg", "preset=tiny", "--gpus", "8", "--target", "a100-80gb"]


def test_make_plan_reports_each_phase_in_order():
    calls: list[str] = []
    counts: list[tuple[int, int]] = []
    plan, _ = make_plan(str(EXAMPLES / "gpt.py"), gpus=8, global_batch=64, target="a100-80gb",
                        model_args={"preset": "tiny"}, pins=Pins(tp=2), fill=load_fill_spec(EXAMPLES / "fill" / "jobs.yaml"),
                        progress=calls.append, search_progress=lambda i, n: counts.append((i, n)))
    assert plan.config.tp == 2 and plan.fill is not None  # so that every phase runs: the fill, the runtime's check
    phases = [c.split(": ")[0] for c in calls]
    assert set(phases) <= set(PHASES), calls
    assert list(dict.fromkeys(phases)) == list(PHASES), calls  # each once, in order (no phase comes back)
    assert [c for c in calls if c.startswith("tracing: ")] == ["tracing: load", "tracing: build", "tracing: capture"]
    assert "pricing: costs" in calls
    assert counts and all(0 <= i <= n for i, n in counts)


def _planner(args: list[str], tmp_path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "planner", *args, "-o", str(tmp_path / "plan.json")],
                          capture_output=True, text=True, cwd=ROOT, timeout=300, env={**os.environ, **env})


def test_json_stdout_is_the_plan_alone_even_on_a_terminal(tmp_path):
    # FORCE_COLOR: rich treats stdout and stderr as terminals, so a progress display would be drawn if it were on
    run = _planner(TINY + ["--json"], tmp_path, FORCE_COLOR="1")
    assert run.returncode == 0, run.stderr
    doc = json.loads(run.stdout)
    assert doc["config"]["tp"] >= 1
    assert doc == json.loads((tmp_path / "plan.json").read_text())
    assert not any(p in run.stderr for p in PHASES)


def test_progress_is_drawn_on_stderr_only(tmp_path):
    run = _planner(TINY, tmp_path, FORCE_COLOR="1")
    assert run.returncode == 0, run.stderr
    assert "loading torch and the cost models" in run.stderr  # (drawn as it starts; the later phases as rich
    # refreshes, 10 times a second: a tiny model's may pass between two)
    assert not any(p in run.stdout for p in ("loading torch", *PHASES, "writing"))
    assert "chosen:" in run.stdout
