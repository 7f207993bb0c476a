"""`planner export` of a plan with fill jobs writes a job that runs them (issue 48): torchtitan's command line names the
fill trainer (planner/engines/titan.py) and parses with torchtitan's own ConfigManager to its config; Megatron-LM's
script runs pretrain_gpt.py under the fill adapter (planner/engines/megatron_fill.py); the plan travels beside the
job, and --check maps every bubble to a receive torch's lowered order waits for."""
from __future__ import annotations

import importlib.util
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from planner.cli import app
from planner.export import to_megatron, to_torchtitan
from planner.plan import load_plan, save_plan

from .test_pipelining_fill import _plan

needs_titan = pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None,
                                 reason="torchtitan is not installed (pip install -e '.[engines]')")


@pytest.fixture(scope="module")
def plan():
    made = _plan("1f1b")
    assert made.fill.chunks
    return made


@needs_titan
def test_torchtitans_config_manager_builds_the_fill_trainers_config(plan, tmp_path):
    import warnings

    from torchtitan.config.manager import ConfigManager

    from planner.engines.titan import FillTrainer

    ex = to_torchtitan(plan, module="llama3", config="llama3_debugmodel", schedule_csv=str(tmp_path / "job.csv"),
                       fill_plan=str(tmp_path / "job.plan.json"))
    assert not any("fill" in u for u in ex.unexpressed)
    assert load_plan_text(ex.files[str(tmp_path / "job.plan.json")], tmp_path) == plan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = ConfigManager().parse_args(list(ex.argv))
    assert type(cfg) is FillTrainer.Config and cfg.fill.plan == str(tmp_path / "job.plan.json")
    assert cfg.parallelism.pipeline_parallel_schedule_csv == str(tmp_path / "job.csv")
    assert cfg.parallelism.pipeline_parallel_degree == 2 and cfg.model_spec.name == "llama3"


def load_plan_text(text: str, tmp_path: Path):
    (tmp_path / "copy.json").write_text(text)
    return load_plan(tmp_path / "copy.json")


@needs_titan
def test_export_check_maps_every_bubble_and_writes_the_plan_beside_the_job(plan, tmp_path):
    save_plan(plan, tmp_path / "plan.json")
    job = tmp_path / "out" / "job.sh"
    result = CliRunner().invoke(app, ["export", str(tmp_path / "plan.json"), "--to", "torchtitan", "--titan-module",
                                      "llama3", "--titan-config", "llama3_debugmodel", "-o", str(job), "--check"])
    assert result.exit_code == 0, result.output
    assert f"fill_plan={job.with_suffix('.plan.json')}" in result.output
    assert load_plan(job.with_suffix(".plan.json")) == plan
    assert '--fill.plan "$(dirname "$0")"/job.plan.json' in job.read_text()
    assert "not expressed" not in result.output.split("fill")[0]


def test_megatrons_script_runs_pretrain_gpt_under_the_fill_adapter(plan):
    ex = to_megatron(plan, fill_plan="job.plan.json")
    assert not any("fill" in u for u in ex.unexpressed) and "job.plan.json" in ex.files
    launch = next(line for line in ex.text.splitlines() if line.startswith("torchrun"))
    words = shlex.split(launch.replace('"$(dirname "$0")"/', "").rstrip("\\"))
    i = words.index("-m")
    assert words[i:i + 4] == ["-m", "planner.engines.megatron_fill", "job.plan.json", "pretrain_gpt.py"]
    # a plan Megatron's own schedule cannot mark: a bubble moved off its receive
    acts = [list(a) for a in plan.actions]
    at = acts[1].index("BUBBLE0")
    acts[1].insert(at + 2, acts[1].pop(at))  # after the RECV: before a compute action
    moved = to_megatron(plan.model_copy(update={"actions": acts}))
    (why,) = [u for u in moved.unexpressed if "fill jobs" in u]
    assert "cannot mark the plan's bubbles" in why and "bubble 0" in why and not moved.files
