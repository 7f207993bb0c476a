"""Fill inside torch's own pipeline runtime (issue 48): real torchrun, 2 processes on gloo, torch's
`_PipelineScheduleRuntime` loaded from the schedule CSV the torchtitan export writes, the fill adapter
(planner/engines/pipelining.py) and the fill executor the fxplanner runtime uses. One 1F1B plan and one zero-bubble
(ZB-H1) plan of examples/mlp.py, each with a small MLP training job packed into its bubbles (a CPU-like target, on
which the bubbles last milliseconds: see tests/runtime/test_fill_e2e.py). Each runs twice (tests/engines/
pipelining_run.py): the schedule built directly, and as torchtitan builds it from the export's command line for the
fill trainer (planner/engines/titan.py). Everything asserted is read from the metrics the ranks write, not from
timing.
"""
from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from planner.api import make_plan
from planner.engines.pipelining import attach, bubble_actions, check_bubbles
from planner.export import to_torchtitan
from planner.fill.spec import FillJobSpec, FillSpec, Work
from planner.metrics import FillReport
from planner.plan import Plan, save_plan
from planner.search import Pins
from tests.runtime._util import ROOT, child_env

pytestmark = pytest.mark.multiprocess

MLP = ROOT / "examples" / "mlp.py"
CPU_TARGET = ROOT / "examples" / "targets" / "cpu-core.yaml"
SCHEDULES = ("1f1b", "zbh1")
RUNS = [(mode, s) for mode in ("torch", "titan") for s in SCHEDULES]
STEPS = 6  # step 0 measures the bubbles without fill


def _plan(schedule: str) -> Plan:
    job = FillJobSpec(name="mlp", model=str(MLP), model_args={"features": 32, "width": 64, "depth": 2},
                      kind="train", batch_sizes=[8], work=Work(iterations=100_000))
    plan, _ = make_plan(str(MLP), gpus=2, global_batch=64, target=str(CPU_TARGET), gpus_per_node=2,
                        model_args={"features": 256, "width": 256, "depth": 6},
                        fill=FillSpec(jobs=[job], gpu_sharing="none"),
                        pins=Pins(tp=1, pp=2, dp=1, b=8, v=1, schedule=schedule, recompute="none", precision="fp32"))
    return plan


def _launch(out: Path, plans: list[Path], *extra: str) -> dict[tuple[str, str], list[dict]]:
    """(mode, schedule) -> each rank's record."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", "2",
           "-m", "tests.engines.pipelining_run", str(out), *map(str, plans), "--steps", str(STEPS), *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=child_env())
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    return {(mode, s): ranks for mode, runs in json.loads(out.read_text()).items() for s, ranks in zip(SCHEDULES, runs)}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("pipelining_fill")
    plans = {s: _plan(s) for s in SCHEDULES}
    paths = []
    for name, plan in plans.items():
        save_plan(plan, tmp / f"{name}.json")
        paths.append(tmp / f"{name}.json")
    for _ in range(3):  # again when a loaded machine left no unit room in any bubble
        fill = _launch(tmp / "fill.json", paths)
        if all(_report(r).jobs[0].units_done for ranks in fill.values() for r in ranks if r["fill_report"]):
            break
    nofill = _launch(tmp / "nofill.json", paths, "--no-fill")
    return {"plans": plans, "fill": fill, "nofill": nofill}


def _report(rank: dict) -> FillReport:
    return FillReport.model_validate(rank["fill_report"])


def test_plans_pack_fill_into_their_bubbles(run: dict) -> None:
    for plan in run["plans"].values():
        assert plan.fill is not None and plan.fill.chunks
        assert {(c.rank, c.bubble_id) for c in plan.fill.chunks} <= {(b.rank, b.id) for b in plan.bubbles}


@pytest.mark.parametrize("mode,schedule", RUNS)
def test_losses_equal_the_run_without_fill(run: dict, mode: str, schedule: str) -> None:
    ranks, base = run["fill"][mode, schedule], run["nofill"][mode, schedule]
    last = ranks[-1]["loss"]
    assert len(last) == STEPS and all(loss is not None for loss in last)
    assert last == base[-1]["loss"]
    assert all(not r.get("steps") for r in base)  # --no-fill attaches nothing


@pytest.mark.parametrize("mode,schedule", RUNS)
def test_every_planned_bubble_is_seen_each_step(run: dict, mode: str, schedule: str) -> None:
    plan = run["plans"][schedule]
    for rank in run["fill"][mode, schedule]:
        planned = sorted(b.id for b in plan.bubbles if b.rank == rank["rank"])
        assert len(rank["steps"]) == STEPS  # the evaluation after the steps runs without the adapter
        for step in rank["steps"]:
            assert sorted(b["id"] for b in step["bubbles"]) == planned, (rank["rank"], step)


@pytest.mark.parametrize("mode,schedule", RUNS)
def test_fill_runs_only_inside_the_bubbles_measured(run: dict, mode: str, schedule: str) -> None:
    plan = run["plans"][schedule]
    filled = {c.rank for c in plan.fill.chunks}
    units = 0
    for rank in run["fill"][mode, schedule]:
        steps = rank["steps"]
        assert not steps[0]["fill"]  # step 0 measures the bubbles without fill
        assert all(s["fill"] for s in steps[1:]) == (rank["rank"] in filled)
        if rank["rank"] not in filled:
            assert rank["fill_report"] == {}
            continue
        rep = _report(rank)
        assert rep.kills == [] and rep.errors == [], (rep.kills, rep.errors)
        # the executor was told of exactly the bubbles the rank waited in, in the steps with fill
        waited = Counter(b["id"] for s in steps[1:] for b in s["bubbles"] if b["waited"])
        assert Counter(o.bubble_id for o in rep.bubbles) == waited
        for occ in rep.bubbles:
            assert occ.main_end is not None and occ.main_begin <= occ.main_end
            for s in occ.steps:
                assert occ.main_begin <= s.start <= s.end <= occ.main_end + rep.grace_s, (occ.bubble_id, s)
            units += len(occ.steps)
    assert units > 0


def _loaded(plan: Plan, tmp_path: Path):
    """torch's runtime with the plan's exported CSV loaded, as torchtitan loads it (no process group needed)."""
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    export = to_torchtitan(plan, module="mlp", config="mlp", schedule_csv=str(tmp_path / "schedule.csv"))
    for path, text in export.files.items():
        Path(path).write_text(text)
    c = plan.config
    stub = SimpleNamespace(num_stages=c.pp * c.vp, group_size=c.pp, group_rank=0, group=None)
    runtime = _PipelineScheduleRuntime([stub], n_microbatches=c.microbatches)
    runtime._load_csv(str(tmp_path / "schedule.csv"))
    return runtime


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_bubble_maps_to_an_action_that_waits(run: dict, schedule: str, tmp_path: Path) -> None:
    plan = run["plans"][schedule]
    assert check_bubbles(_loaded(plan, tmp_path), plan) == len(plan.bubbles)


def test_a_bubble_before_a_weight_gradient_is_refused(run: dict) -> None:
    plan = run["plans"]["zbh1"]
    acts = [list(a) for a in plan.actions]
    w = next(i for i, a in enumerate(acts[1]) if a.endswith("W0"))
    acts[1].insert(w, "BUBBLE99")
    with pytest.raises(ValueError, match="bubble 99 precedes 1W0, which waits for no receive"):
        bubble_actions(plan.model_copy(update={"actions": acts}), 1)


def test_a_torch_without_what_the_adapter_reads_is_refused(run: dict) -> None:
    with pytest.raises(RuntimeError) as err:
        attach(SimpleNamespace(rank=0), run["plans"]["1f1b"])
    message = str(err.value)
    assert message.startswith(f"torch {torch.__version__}'s pipeline schedule") and "pipeline_order_with_comms" in message
