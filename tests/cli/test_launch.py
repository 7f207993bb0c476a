"""`planner launch PLAN` without --local: it prints the per-node commands of whatever runs the plan (the engine's own,
as `planner export` writes them, for a megatron or torchtitan plan; torchrun's for fxplanner's runtime) and never
overwrites a file silently (issue 51)."""
from __future__ import annotations

from typer.testing import CliRunner

from planner.api import make_plan
from planner.cli import app
from planner.plan import save_plan
from planner.search import Pins
from tests.conftest import EXAMPLES


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_a_megatron_plans_launch_prints_the_exports_commands_and_writes_nothing(tmp_path):
    path = tmp_path / "plan.json"
    plan, _ = make_plan(str(EXAMPLES / "gpt.py"), gpus=16, global_batch=64, target="h100-sxm",
                        pins=Pins(engine="megatron"), plan_path=str(path))
    save_plan(plan, path)
    mine = tmp_path / "launch.sh"
    mine.write_text("#!/bin/sh\necho mine\n")
    res = CliRunner().invoke(app, ["launch", str(path)])
    assert res.exit_code == 0, res.output
    assert mine.read_text() == "#!/bin/sh\necho mine\n"  # not overwritten
    lines = [line.strip() for line in res.stdout.splitlines()]
    cmds = [line for line in lines if line.startswith("planner export")]
    assert cmds == plan.launch.commands and len(cmds) == plan.launch.nnodes == 2  # one per node
    script = tmp_path / "plan.megatron.sh"
    assert cmds[0] == f"planner export {path} --to megatron -o {script} && bash {script}"
    assert "NODE_RANK" not in res.stdout and "nothing was written now" in _flat(res.stdout)
    mine.unlink()
    assert CliRunner().invoke(app, ["launch", str(path)]).exit_code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]  # no launch.sh, no script
    # what the printed command runs is the export: the script `planner export` writes holds pretrain_gpt.py's arguments
    res = CliRunner().invoke(app, ["export", str(path), "--to", "megatron", "-o", str(script)])
    assert res.exit_code == 0 and script.read_text() == plan.launch.script


def test_an_fxplanner_plans_launch_prints_torchrun_and_keeps_another_launch_sh(tmp_path):
    path = tmp_path / "plan.json"
    runner = CliRunner()
    assert runner.invoke(app, ["plan", str(EXAMPLES / "gpt.py"), "--gpus", "16", "-o", str(path)]).exit_code == 0
    from planner.plan import load_plan

    plan = load_plan(path)
    mine = tmp_path / "launch.sh"
    mine.write_text("#!/bin/sh\necho mine\n")
    res = runner.invoke(app, ["launch", str(path)])
    assert res.exit_code == 0, res.output
    assert mine.read_text() == "#!/bin/sh\necho mine\n" and "is not this plan's script: left as it is" in _flat(res.stdout)
    cmds = [line.strip() for line in res.stdout.splitlines() if "--node-rank" in line]
    assert cmds == plan.launch.commands and all("torchrun" in c and "-m planner.runtime" in c for c in cmds)
    mine.unlink()
    res = runner.invoke(app, ["launch", str(path)])
    assert res.exit_code == 0 and mine.read_text() == plan.launch.script  # absent: written, as before
