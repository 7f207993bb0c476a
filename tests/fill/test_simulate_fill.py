"""`planner simulate-fill` on a plan and the jobs it was planned with: the simulation places, pairs and packs them as
the planner does (planner/fill/trace_sim.py), so its figures while each rank has fill work agree with the plan's."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from planner.api import make_plan
from planner.cli import app
from planner.fill.assign import FillAssignment, plan_cycles
from planner.fill.packing import BubbleSlot, FillUnit, greedy_pack
from planner.fill.profiles import FillProfile
from planner.fill.spec import load_fill_spec
from planner.fill.trace_sim import trace_jobs
from planner.plan import save_plan
from planner.search import Pins
from tests.conftest import EXAMPLES

JOBS = EXAMPLES / "fill" / "jobs.yaml"  # resnet-wide-train asks to pair with resnet-train (pair_with)
TFLOPS_REL = 0.02
"""The plan takes each job's steady rate per bubble cycle over its turn; the simulation starts a job at the first bubble
after it may and cuts its last chunk: over turns of thousands of iterations they differ by far less than this."""
USED_ABS = 0.01


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    plan, _ = make_plan(str(EXAMPLES / "gpt.py"), gpus=8, global_batch=32, target="a100-80gb",
                        model_args={"preset": "1.7b"}, fill=load_fill_spec(JOBS), pins=Pins(pp=4, schedule="1f1b"))
    path = tmp_path_factory.mktemp("simfill") / "plan.json"
    save_plan(plan, path)
    return plan, path


def test_simulate_fill_agrees_with_the_plan_and_runs_the_pair_it_asked_for(planned):
    plan, path = planned
    assert plan.fill.pairs, "jobs.yaml's pair_with should pair the two resnets on this plan"
    res = CliRunner().invoke(app, ["simulate-fill", str(path), str(JOBS), "--json"])
    assert res.exit_code == 0, res.stdout
    data = json.loads(res.stdout)
    fp = plan.fill.predictions
    assert data["policy"] == plan.fill.policy  # the fill file's, as planned
    assert data["plan"] == {"fill_tflops_per_gpu": fp.fill_tflops_per_gpu, "bubble_time_used": fp.bubble_time_used}
    busy = data["while_busy"]
    assert busy["fill_tflops_per_gpu"] == pytest.approx(fp.fill_tflops_per_gpu, rel=TFLOPS_REL)
    assert busy["bubble_time_used"] == pytest.approx(fp.bubble_time_used, abs=USED_ABS)
    # pair_with honoured: the two run as one pair on the plan's rank, never one after the other
    pair = plan.fill.pairs[0]
    a, b = (n.split("@")[0] for n in pair.jobs)
    jobs = {j["name"]: j for j in data["jobs"]}
    assert f"{a}+{b}" in jobs and a not in jobs and b not in jobs
    assert jobs[f"{a}+{b}"]["rank"] == pair.rank and jobs[f"{a}+{b}"]["completion_s"] is not None
    turn = next(s for j in plan.fill.jobs if j.name == pair.jobs[0] for s in j.shards)
    assert jobs[f"{a}+{b}"]["completion_s"] == pytest.approx(turn.end_s, rel=0.01)
    # every (job, rank) share of the plan is simulated on that rank
    shares = {(j.name.split("@")[0], s.rank) for j in plan.fill.jobs for s in j.shards
              if j.name not in pair.jobs}
    simulated = {(j["name"].split("/")[0], j["rank"]) for j in data["jobs"] if "+" not in j["name"]}
    assert simulated == shares


def test_simulate_fill_names_what_differs_from_the_plan(planned):
    plan, path = planned
    res = CliRunner().invoke(app, ["simulate-fill", str(path), str(JOBS)], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.stdout
    text = " ".join(res.stdout.split())
    fp = plan.fill.predictions
    assert "over the run (PipeFill 6.1" in text and "a rank's time without fill work" in text
    assert ("while each rank has fill work (as the plan counts)" in text
            and f"the plan: {fp.fill_tflops_per_gpu:.2f} and {fp.bubble_time_used:.1%}" in text)


def _profile(job: str, n: int = 4) -> FillProfile:
    units = tuple(FillUnit(name=f"u{i}", time_s=0.01, mem_bytes=1, flops=1e9, state_bytes=0) for i in range(n))
    return FillProfile(job=job, kind="infer", batch_size=8, config="plain", units=units, resident_bytes=0, layers=(),
                       params=1, sha256="", batches=10)


def test_trace_jobs_divide_a_share_over_the_ranks_gpus_and_name_shards():
    """A rank's share of the batches is divided among its GPUs: one simulated GPU does ceil(batches / replicas)
    iterations of the job's units; a job on two ranks is two simulated jobs, job/rank."""
    from planner.fill.assign import RankFill, Turn

    cycle = [BubbleSlot(id=0, duration_s=1.0, free_bytes=1 << 30)]
    fills = [RankFill(rank=r, profile=_profile("x"), resident=True,
                      packing=greedy_pack(_profile("x").units, cycle, safety_margin=0.0, cycles=2)) for r in (0, 1)]
    turns = (Turn(fill=fills[0], first_batch=0, batches=7, start_s=0.0, end_s=1.0),
             Turn(fill=fills[1], first_batch=7, batches=3, start_s=0.0, end_s=1.0))
    fa = FillAssignment(per_rank=((fills[0],), (fills[1],)), turns=turns, iteration_s=1.0, fill_flops_per_gpu_s=0.0,
                        bubble_time_used=0.0, replicas=2, unplaceable={"y": "too big"})
    jobs, unplaceable = trace_jobs(fa, 2)
    assert [(j.name, j.work, [p is not None for p in j.plans]) for j in jobs] == [
        ("x/0", 4 * 4.0, [True, False]), ("x/1", 2 * 4.0, [False, True])]
    assert [(u.job, u.reason, u.detail) for u in unplaceable] == [("y", "unplaceable", "too big")]


def test_plan_cycles_free_the_optimizer_bytes_the_plan_offloads(planned):
    plan, _ = planned
    base = plan_cycles(plan)
    fill = plan.fill.model_copy(update={"predictions": plan.fill.predictions.model_copy(
        update={"offload_optimizer": True, "offload_bytes": [r + 1 for r in range(plan.config.pp)]})})
    more = plan_cycles(plan.model_copy(update={"fill": fill}))
    assert [[s.free_bytes - r - 1 for s in c] for r, c in enumerate(more)] == [[s.free_bytes for s in c] for c in base]


def test_a_pair_counts_once_in_the_plans_figures_each_job_at_its_own_rate(planned):
    """A pair's two turns run one packing (both jobs' units): the plan's steady figures count it once, over the longer
    turn, and its recovered GPU-seconds take each job's share of the FLOPs at that job's own dedicated rate."""
    from planner.fill.joint import recovered_gpu_s_per_s
    from planner.fill.trace_sim import plan_assignment

    plan, _ = planned
    fa = plan_assignment(plan, load_fill_spec(JOBS))
    assert fa.fill_flops_per_gpu_s / 1e12 == pytest.approx(plan.fill.predictions.fill_tflops_per_gpu)
    p = len(fa.per_rank)
    flops = gpu_s = 0.0
    for r in range(p):
        runs, seen = [], set()
        for t in fa.turns:
            key = t.fill.packed_as
            if t.rank == r and key not in seen:
                seen.add(key)
                mine = [u for u in fa.turns if u.rank == r and u.fill.packed_as == key]
                runs.append((t.fill, max(u.end_s - u.start_s for u in mine), [u.fill.profile for u in mine]))
        busy = sum(d for _, d, _ in runs)
        if not busy:
            continue
        flops += sum(rf.packing.flops_per_cycle * d for rf, d, _ in runs) / busy
        for rf, d, profs in runs:
            units = rf.units
            for j, prof in enumerate(profs if rf.pair is None else
                                     [next(q for q in profs if q.job == n) for n in rf.pair.jobs]):
                share = 1.0 if rf.pair is None else (sum(u.flops for u in units if u.name.startswith(f"{j}:"))
                                                     / sum(u.flops for u in units))
                gpu_s += rf.packing.flops_per_cycle * share * prof.dedicated_s / prof.flops_per_iteration * d / busy
    assert any(rf.pair is not None for q in fa.per_rank for rf in q)
    assert fa.fill_flops_per_gpu_s == pytest.approx(flops / p / fa.iteration_s)
    assert recovered_gpu_s_per_s(fa, fa.iteration_s) == pytest.approx(gpu_s / p / fa.iteration_s)
