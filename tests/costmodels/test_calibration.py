"""Calibration: measured factors move predictions the right way; the CLI measures this machine."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from costmodels.calibration import Calibration, UnitFactor, apply_calibration, load_calibration
from costmodels.compute import unit_time
from costmodels.hardware import Hardware
from planner.config import ParallelConfig
from passes.errors import UserError
from passes.pipeline import analyze
from planner.cli import app
from targets.registry import get_target
from tests.conftest import EXAMPLES


def _cal(target: str, factor: float) -> Calibration:
    return Calibration(target=target, device="cpu", dtype="bf16", model_file="gpt.py", batch=1,
                       unit_factors={"block": UnitFactor(fwd=factor, bwd=factor, units=4)})


@pytest.mark.parametrize("factor", [0.5, 2.0])
def test_factor_moves_block_time_in_its_direction(factor):
    prof, _ = analyze(EXAMPLES / "gpt.py", {"preset": "tiny", "layers": 2})
    hw = Hardware(target=get_target("a100-80gb"))
    cal = apply_calibration(_cal(hw.name, factor), hw)
    cfg = ParallelConfig(tp=1, pp=1, dp=1, b=4, m=1)
    block = next(u for u in prof.units if u.kind == "block")
    head = prof.units[-1]
    assert unit_time(block, cal, cfg).fwd_s == pytest.approx(factor * unit_time(block, hw, cfg).fwd_s)
    assert unit_time(head, cal, cfg).fwd_s == pytest.approx(unit_time(head, hw, cfg).fwd_s)


def test_calibration_for_another_target_is_refused():
    with pytest.raises(UserError, match="measured for target"):
        apply_calibration(_cal("h100-sxm", 1.0), Hardware(target=get_target("a100-80gb")))


def test_calibrate_cli_measures_and_plan_uses_it(tmp_path):
    runner = CliRunner()
    cal_path, target_path = tmp_path / "cal.json", tmp_path / "local-cpu.yaml"
    res = runner.invoke(app, ["calibrate", str(EXAMPLES / "mlp.py"), "--measure", "--batch", "8", "--repeats", "3",
                              "--no-comm", "-o", str(cal_path), "--target-out", str(target_path)])
    assert res.exit_code == 0, res.stdout
    cal = load_calibration(cal_path)
    assert cal.target == "local-cpu" and set(cal.unit_factors) == {"embedding", "block", "head"}
    assert all(f.fwd > 0 and f.bwd > 0 for f in cal.unit_factors.values())
    out = tmp_path / "plan.json"
    res = runner.invoke(app, ["plan", str(EXAMPLES / "mlp.py"), "--gpus", "2", "--target", str(target_path),
                              "--dtype", "fp32", "--global-batch", "16", "--calibration", str(cal_path), "-o", str(out)])
    assert res.exit_code == 0, res.stdout
    assert json.loads(out.read_text())["predictions"]["iteration_s"] > 0
    res = runner.invoke(app, ["calibrate", str(EXAMPLES / "mlp.py")])
    assert res.exit_code != 0 and "--measure" in res.stdout + (res.stderr or "")
