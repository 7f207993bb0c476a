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


def test_launch_too_large_for_this_machine_is_refused_with_the_numbers(small_plan: Path, monkeypatch) -> None:
    import planner.runtime as runtime

    monkeypatch.setattr(runtime, "RANKS_PER_CORE", 0)  # as if this machine held no rank process per core
    result = CliRunner().invoke(app, ["launch", str(small_plan), "--local"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    text = " ".join(result.output.split())
    assert "cannot hold" in text and "2 rank processes on" in text and "--oversubscribe" in text


def _ours(marker: str) -> list[int]:
    """Processes whose command line names `marker` (this test's plan), this one excluded."""
    import os

    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as fh:
                    if marker.encode() in fh.read():
                        pids.append(int(entry))
            except OSError:
                pass
    return pids


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_ctrl_c_stops_the_launch_and_every_rank_cleanly(small_plan: Path, tmp_path: Path) -> None:
    """SIGINT to `planner launch --local` while its ranks train: one line, exit code 130, no traceback, no process
    of the launch left, its temporary folder removed. The launch gets a TMPDIR of its own, so that only the folder it
    made is looked at (other launches on the machine make and remove theirs meanwhile)."""
    import signal
    import subprocess
    import sys
    import time

    from planner.runtime import child_env

    plan = tmp_path / "interrupted.json"
    plan.write_text(small_plan.read_text())
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", "from planner.cli import main; main()", "launch", str(plan),
                             "--local", "--steps", "100000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**child_env(), "TMPDIR": str(tmp)}, cwd=tmp_path)
    try:
        for line in proc.stdout:  # the ranks are training
            if "step 2: loss" in line:
                break
        made = list(tmp.glob("fxp-launch-*"))
        proc.send_signal(signal.SIGINT)
        out, errors = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, errors[-3000:]
    assert "Traceback" not in out + errors and errors.strip().splitlines()[-1] == "error: interrupted"
    deadline = time.monotonic() + 10
    while _ours(str(plan)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _ours(str(plan)) == []
    assert len(made) == 1 and not made[0].exists(), made  # the launch's own folder, there while it ran, is gone
