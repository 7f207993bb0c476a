"""Bubble characterization in a real pipeline finds a planted bubble (a known sleep): at least the sleep (less 10% for
the timers), and not more than twice it (a loaded machine only adds to it; the plan predicted microseconds)."""
from __future__ import annotations

import pytest
from typer.testing import CliRunner

from planner.api import make_plan
from planner.cli import app
from planner.plan import load_plan, save_plan
from planner.search import Pins

from ._util import ROOT

pytestmark = pytest.mark.multiprocess
SLEEPY = ROOT / "tests" / "runtime" / "fixtures" / "sleepy.py"


def test_characterize_finds_the_planted_sleep(tmp_path):
    planted = 0.1  # rank 1's forward of each microbatch sleeps this long; rank 0 waits for it
    plan, _ = make_plan(str(SLEEPY), gpus=2, gpus_per_node=2, global_batch=2, target="a100-80gb",
                        model_args={"sleep_s": planted}, leaves=("Sleep",),
                        pins=Pins(tp=1, pp=2, dp=1, b=1, schedule="1f1b", recompute="none", precision="fp32"))
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    last = max(b.id for b in plan.bubbles if b.rank == 0)  # rank 0's last wait: nothing later absorbs a delay
    predicted = next(b for b in plan.bubbles if b.rank == 0 and b.id == last).duration_s
    assert predicted < planted / 100  # the cost model cannot see the sleep: only a measurement finds it
    res = CliRunner().invoke(app, ["characterize", str(path), "--rank", "0", "--bubble", str(last), "--write"])
    assert res.exit_code == 0, res.stdout
    measured = next(b for b in load_plan(path).bubbles if b.rank == 0 and b.id == last).duration_s
    assert 0.9 * planted <= measured <= 2 * planted  # the sleep is a floor; scheduling noise only adds (a loaded
    # 2-core machine once measured 0.124 s)
