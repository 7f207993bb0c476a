"""`planner launch PLAN --local`: torchrun on this machine, rank logs streamed, metrics summarized."""
from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from planner.cli import app
from planner.metrics import load_metrics

from ._util import GPT, gpt_args, reference

pytestmark = pytest.mark.multiprocess


def test_launch_local_compare_no_fill(small_plan: Path, tmp_path: Path) -> None:
    out = tmp_path / "m.json"
    result = CliRunner().invoke(app, ["launch", str(small_plan), "--local", "--steps", "3", "--compare-no-fill",
                                      "--metrics", str(out)])
    assert result.exit_code == 0, result.output[-4000:]
    assert "[rank 1] plan.json: step 2: loss" in result.output
    assert "main job per step" in result.output and "main-job slowdown with fill:" in result.output
    doc, base = load_metrics(out), load_metrics(out.with_suffix(".nofill.json"))
    assert doc.runs[0].fill is True and base.runs[0].fill is False
    # default optimizer (Adam, lr 1e-3): the losses equal single-process training
    ref = reference(GPT, gpt_args(2), global_batch=4, steps=3, optimizer="adam", lr=1e-3)
    for got in (doc.runs[0].loss, base.runs[0].loss):
        assert got == pytest.approx(ref["loss"], rel=1e-5, abs=1e-5)


def test_launch_without_local_prints_commands(small_plan: Path) -> None:
    result = CliRunner().invoke(app, ["launch", str(small_plan)])
    assert result.exit_code == 0
    assert "torchrun" in result.output and "--local" in result.output


def test_launch_bad_flags(small_plan: Path) -> None:
    result = CliRunner().invoke(app, ["launch", str(small_plan), "--local", "--no-fill", "--compare-no-fill"])
    assert result.exit_code == 2 and "drop --no-fill" in result.output
