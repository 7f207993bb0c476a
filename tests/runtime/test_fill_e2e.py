"""Fill jobs end to end under real torchrun on CPU (gloo): the planner's own Fill section for a tiny
GPT (p=2, GPipe) runs its fill job inside the measured bubbles without touching the main job.

The plan is made for a CPU-like target (a core's FLOP/s as the "GPU"): on a datacenter GPU the tiny
GPT's bubbles last microseconds, less than the packer's per-chunk launch overhead, and nothing would
be placed. Three plans with the same main job run in turn in ONE torchrun launch with fill: the
planned MLP training job, and that plan with its fill job pointed (on the Plan object) at a model
that stalls and at one that raises. A second launch runs the planned plan with --no-fill; the main
job's losses of all of them must equal it. Besides those, issue 24's mechanisms together ("all") and two training
jobs paired on one rank as Waterwave pairs them beside a streamed inference job, the main job's optimizer offloaded
("pair").
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from passes.load import file_sha256
from planner.api import make_plan
from planner.fill.assign import assign_fill, held_bytes, plan_cycles
from planner.fill.physics import FILL_CONTEXT_BYTES
from planner.fill.profiles import profile_job
from planner.fill.section import fill_section
from planner.fill.waterwave import PairLedger
from planner.fill.spec import FillJobSpec, FillSpec, Work
from planner.metrics import FillJobReport, FillReport, RunEntry, load_metrics
from planner.plan import Plan, plan_hardware, save_plan
from planner.runtime.fill_executor import TaskOptions
from planner.runtime.fill_task import UnitRunner
from planner.search import Pins

from ._util import GPT, ROOT, gpt_args, torchrun

pytestmark = pytest.mark.multiprocess

STEPS = 8  # step 0 measures the bubbles without fill; steps 1-7 fill them (one rank runs the training job)
LOSS_TOL = 1e-7
MLP = ROOT / "examples" / "mlp.py"
FAULTY = ROOT / "tests" / "runtime_fill" / "fixtures" / "faulty.py"
STALL_S = 30.0  # the stalling unit's sleep: far longer than any bubble, so only a kill ends it
CPU_TARGET = ROOT / "examples" / "targets" / "cpu-core.yaml"
PLANS = ("planned", "stall", "raise", "offload", "all", "pair")
OFFLOAD_BYTES = 1 << 40  # every optimizer state tensor (PipeFill 4.2 offloads it all)


def _planned(tmp: Path) -> Plan:
    job = FillJobSpec(name="mlp", model=str(MLP), model_args={"features": 32, "width": 64, "depth": 2},
                      kind="train", batch_sizes=[8], work=Work(iterations=100_000))
    plan, _ = make_plan(str(GPT), gpus=2, global_batch=16, target=str(CPU_TARGET), gpus_per_node=2,
                        model_args=gpt_args(), fill=FillSpec(jobs=[job], gpu_sharing="none"),
                        pins=Pins(tp=1, pp=2, dp=1, b=2, v=1, schedule="gpipe", recompute="none", precision="fp32"))
    return plan


def _everything() -> Plan:
    """Issue 24's mechanisms at once: a checkpointed training job and an inference job streamed in by groups
    (PipeSwitch) taking turns on the ranks, with the main job's optimizer state offloaded for the bubbles."""
    args = {"features": 32, "width": 64, "depth": 2}
    jobs = [FillJobSpec(name="mlp", model=str(MLP), model_args=args, kind="train", batch_sizes=[8],
                        work=Work(iterations=100_000)),
            FillJobSpec(name="mlp-infer", model=str(MLP), model_args=args, kind="infer", batch_sizes=[8],
                        work=Work(iterations=6))]
    plan, _ = make_plan(str(GPT), gpus=2, global_batch=16, target=str(CPU_TARGET), gpus_per_node=2,
                        model_args=gpt_args(), fill=FillSpec(jobs=jobs, gpu_sharing="none"),
                        pins=Pins(tp=1, pp=2, dp=1, b=2, v=1, schedule="gpipe", recompute="none", precision="fp32"))
    fill = [j.model_copy(update={"config": "checkpoint"} if j.kind == "train" else
                         {"resident": False, "load_groups": [[0, 2], [2, len(j.units)]]}) for j in plan.fill.jobs]
    return _offloading(plan.model_copy(update={"fill": plan.fill.model_copy(update={"jobs": fill})}))


def _paired(planned: Plan) -> Plan:
    """Two MLP training jobs on rank 0 where one job's peak is all the memory they may share beside an inference job,
    in the bubbles and between them (rank 1 has room for the inference job only): side by side they do not fit, so
    the planner pairs them (Waterwave). The pair has the higher priority, so it takes rank 0's turn first whatever the
    machine's load (under SJF the inference job went first and, on a loaded machine, kept rank 0's bubbles for the
    whole run); the inference job runs on rank 1, streamed in per bubble by PipeSwitch's groups, and the main job
    offloads its optimizer state for the bubbles: issue 24's mechanisms together (the checkpointed configuration runs
    in "all")."""
    args = {"features": 32, "width": 64, "depth": 2}
    jobs = [*(FillJobSpec(name=n, model=str(MLP), model_args=args, kind="train", batch_sizes=[8], priority=1,
                          work=Work(iterations=100_000)) for n in ("mlp-a", "mlp-b")),
            FillJobSpec(name="mlp-infer", model=str(MLP), model_args=args, kind="infer", batch_sizes=[8],
                        work=Work(iterations=6))]
    spec = FillSpec(jobs=jobs, gpu_sharing="none")
    hw = plan_hardware(planned)
    profiles = {j.name: [p for p in profile_job(j, hw, "fp32", spec.gpu_sharing) if p.config == "plain"] for j in jobs}
    a, infer = profiles["mlp-a"][0], profiles["mlp-infer"][0]
    beside = held_bytes(infer) + max(u.mem_bytes for u in infer.units)  # the inference job, running
    hold = [2 * (FILL_CONTEXT_BYTES + a.resident_bytes) + max(u.mem_bytes for u in a.units) + beside,
            held_bytes(infer)]
    cycles = plan_cycles(planned)
    cycles[0] = [replace(s, free_bytes=hold[0]) for s in cycles[0]]
    fa = assign_fill(cycles, planned.predictions.iteration_s, profiles, hw, hold_free=hold,
                     safety_margin=spec.safety_margin, policy=spec.policy)
    fill = fill_section(fa, spec, offload=False, main_useful_per_gpu=0.0)
    streamed = [j.model_copy(update={"resident": False, "load_groups": [[0, 2], [2, len(j.units)]]})
                if j.kind == "infer" else j for j in fill.jobs]
    return _offloading(planned.model_copy(update={"fill": fill.model_copy(update={"jobs": streamed})}))


def _offloading(plan: Plan) -> Plan:
    """The plan with the main job's optimizer state offloaded to the host for the bubbles on every rank."""
    fp = plan.fill.predictions.model_copy(update={"offload_optimizer": True,
                                                  "offload_bytes": [OFFLOAD_BYTES] * plan.config.pp})
    return plan.model_copy(update={"fill": plan.fill.model_copy(update={"predictions": fp})})


def _faulty(plan: Plan, args: dict[str, Any]) -> Plan:
    """The plan with its fill job's model replaced by the faulty fixture (same name, chunks, bubbles).
    The planner cannot price that model (its misbehaviour reads a tensor's value, which the meta
    shape pass has not got), so its linearized units come from the runtime's own tracing."""
    job = plan.fill.jobs[0].model_copy(update={"model_file": str(FAULTY), "model_sha256": file_sha256(FAULTY),
                                               "model_args": args, "units": []})
    units = UnitRunner(job, TaskOptions(device="cpu", interface="iterative", iterations=None)).linearized
    faulty = job.model_copy(update={"units": units, "unit_time_s": [1e-4] * len(units)})
    return plan.model_copy(update={"fill": plan.fill.model_copy(update={"jobs": [faulty]})})


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("fill_e2e")
    planned = _planned(tmp)
    plans = {"planned": planned,
             "stall": _faulty(planned, {"mode": "slow", "after": 1, "seconds": STALL_S}),
             "raise": _faulty(planned, {"mode": "raise", "after": 1}),
             "offload": _offloading(planned), "all": _everything(), "pair": _paired(planned)}
    for name, plan in plans.items():
        save_plan(plan, tmp / f"{name}.json")
    common = ["--steps", str(STEPS), "--optimizer", "adam"]
    for _ in range(5):  # again when a loaded machine left no unit room in any bubble, or overran one
        proc = torchrun(2, [*(str(tmp / f"{n}.json") for n in PLANS), *common, "--metrics", str(tmp / "fill.json")],
                        cwd=tmp)
        assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
        runs = dict(zip(PLANS, load_metrics(tmp / "fill.json").runs))
        progressed = sum(_job(rep).units_done for _, rep in _reports(runs["planned"])) > 0 and all(
            j.iterations_done for _, rep in _reports(runs["pair"]) for j in rep.jobs if j.kind == "train") and any(
            j.loads and j.iterations_done for _, rep in _reports(runs["all"]) for j in rep.jobs if j.kind == "infer")
        raised = any(rep.errors for _, rep in _reports(runs["raise"]))  # its job reached the step that raises
        killed = any(rep.kills for _, rep in _reports(runs["stall"]))  # and the one that stalls
        calm = not any(rep.kills for n in ("planned", "offload", "all", "pair")
                       for _, rep in _reports(runs[n]))  # no step descheduled
        # past its grace period (a killed paired job leaves its partner alone, off the pair's order)
        if progressed and raised and killed and calm:
            break
    base = torchrun(2, [str(tmp / "planned.json"), *common, "--no-fill", "--metrics", str(tmp / "nofill.json")],
                    cwd=tmp)
    assert base.returncode == 0, base.stdout[-6000:] + base.stderr[-6000:]
    fill, nofill = (load_metrics(tmp / f) for f in ("fill.json", "nofill.json"))
    return {"plans": plans, "fill": dict(zip(PLANS, fill.runs)), "nofill": nofill.runs[0]}


def _reports(entry: RunEntry) -> list[tuple[int, FillReport]]:
    """(pipeline rank, fill report) of every rank that ran a fill client."""
    return [(r.pp, r.fill_report) for r in entry.ranks if r.fill_report is not None]


def _job(report: FillReport) -> FillJobReport:
    (job,) = report.jobs
    return job


def test_fill_section_comes_from_the_planner(run: dict) -> None:
    plan = run["plans"]["planned"]
    assert plan.fill is not None and plan.fill.predictions.unplaceable == {}
    (job,) = plan.fill.jobs
    assert job.model_file == str(MLP) and job.kind == "train" and job.units[-1] == "OPT"
    assert plan.fill.chunks and {c.job for c in plan.fill.chunks} == {job.name}
    bubbles = {(b.rank, b.id) for b in plan.bubbles}
    assert all((c.rank, c.bubble_id) in bubbles for c in plan.fill.chunks)
    main = lambda p: p.model_dump(exclude={"fill"})  # noqa: E731
    assert main(run["plans"]["stall"]) == main(plan) == main(run["plans"]["raise"])


@pytest.mark.parametrize("name", PLANS)
def test_main_job_unchanged_by_fill(run: dict, name: str) -> None:
    """Every step ran on every rank, and the losses equal the --no-fill run's, whatever the fill job did."""
    entry, base = run["fill"][name], run["nofill"]
    assert entry.fill is True and base.fill is False
    assert all(len(r.steps) == STEPS for r in entry.ranks)
    assert all(s.fill for r in entry.ranks if r.fill_report is not None for s in r.steps[1:])
    assert len(entry.loss) == len(base.loss) == STEPS
    for step, (got, want) in enumerate(zip(entry.loss, base.loss)):
        assert abs(got - want) <= LOSS_TOL, f"{name}, step {step}: loss {got!r} with fill, {want!r} without"


def test_fill_steps_run_inside_their_ranks_bubbles(run: dict) -> None:
    plan, entry = run["plans"]["planned"], run["fill"]["planned"]
    reports = _reports(entry)
    # a fill client runs on exactly the ranks the plan gives chunks
    assert {pp for pp, _ in reports} == {c.rank for c in plan.fill.chunks}
    steps = 0
    for pp, rep in reports:
        grace = rep.grace_s
        planned = {c.bubble_id for c in plan.fill.chunks if c.rank == pp}
        assert {b.bubble_id for b in rep.bubbles} <= {b.id for b in plan.bubbles if b.rank == pp}
        for occ in rep.bubbles:
            assert occ.main_end is not None and occ.main_begin <= occ.main_end, occ
            assert bool(occ.jobs) == (occ.bubble_id in planned)
            for s in occ.steps:
                assert s.job in occ.jobs, (pp, occ.bubble_id, s)
                assert occ.main_begin <= s.start <= s.end <= occ.main_end + grace, \
                    (f"rank {pp}, bubble {occ.bubble_id}: step {s.unit} ran {s.start - occ.main_begin:.4f}"
                     f"..{s.end - occ.main_begin:.4f} s after the bubble began, which ended after "
                     f"{occ.main_end - occ.main_begin:.4f} s (grace {grace} s)")
            steps += len(occ.steps)
            assert occ.units_done == len(occ.steps)
    assert steps > 0


def test_fill_job_makes_progress_without_incident(run: dict) -> None:
    reports = _reports(run["fill"]["planned"])
    jobs = [_job(rep) for _, rep in reports]
    assert sum(j.units_done for j in jobs) > 0, jobs
    for (pp, rep), job in zip(reports, jobs):
        assert rep.kills == [] and rep.errors == [], (pp, rep.kills, rep.errors)
        assert job.error is None and job.stop_reason == "shutdown", (pp, job)
        assert job.units_done == sum(len(b.steps) for b in rep.bubbles)
        # the stream of units is contiguous: each step is the next unit of the job
        positions = [s.pos for b in rep.bubbles for s in b.steps]
        assert positions == list(range(len(positions)))
        assert job.samples_done == job.iterations_done * job.batch_size


def test_stalling_fill_job_is_killed_after_the_grace_period(run: dict) -> None:
    plan, reports = run["plans"]["stall"], _reports(run["fill"]["stall"])
    stall_unit = plan.fill.jobs[0].units[0]  # faulty.py misbehaves in its first unit, from iteration 1 on
    killed = [(pp, rep, k) for pp, rep in reports for k in rep.kills]
    assert killed, "no rank killed the stalling fill job: " + repr([_job(rep) for _, rep in reports])
    for pp, rep, kill in killed:
        grace = rep.grace_s
        assert (kill.job, kill.what, kill.unit) == (plan.fill.jobs[0].name, "step", stall_unit)
        (occ,) = [b for b in rep.bubbles if kill in b.kills]
        pause = min(occ.deadline, occ.main_end)
        assert kill.limit == pytest.approx(pause + grace, abs=0.01), (pp, kill, occ)
        assert kill.limit <= kill.killed_at < kill.limit + 1.0, (pp, kill)
        assert kill.killed_at < kill.started + STALL_S / 2  # killed, not finished
        assert [(o.unit, o.killed) for o in occ.overruns] == [(stall_unit, True)]
        job = _job(rep)
        assert (job.state, job.stop_reason) == ("STOPPED", "killed")
        assert job.iterations_done == 1  # iteration 0 is clean; iteration 1 stalls at once
    for pp, rep in reports:
        assert rep.errors == [], (pp, rep.errors)


def test_raising_fill_job_is_recorded(run: dict) -> None:
    plan, reports = run["plans"]["raise"], _reports(run["fill"]["raise"])
    failed = [(pp, rep) for pp, rep in reports if rep.errors]
    assert failed, "no rank recorded the fill job's exception: " + repr([_job(rep) for _, rep in reports])
    for pp, rep in failed:
        (error,) = rep.errors
        assert "RuntimeError: fill model exploded at step 1" in error.message, error
        assert error.job == plan.fill.jobs[0].name and error.unit == plan.fill.jobs[0].units[0]
        assert [e.message for b in rep.bubbles for e in b.errors] == [error.message]
        job = _job(rep)
        assert (job.state, job.stop_reason, job.iterations_done) == ("STOPPED", "failed", 1)
        assert "exploded" in job.error
    for pp, rep in reports:
        assert rep.kills == [], (pp, rep.kills)


def test_main_job_offloads_its_optimizer_state_as_planned(run: dict) -> None:
    """PipeFill 4.2: from the step after the first optimizer step (Adam's state exists), every rank holds all its
    optimizer state on the host from the step's start to the gradient reduction; the losses are unchanged
    (test_main_job_unchanged_by_fill[offload]), and without the plan's offload nothing moves."""
    for rank in run["fill"]["offload"].ranks:
        moved = [s.optimizer_offloaded_bytes for s in rank.steps]
        assert moved[0] == 0 and all(m == rank.holds.optimizer_state_bytes > 0 for m in moved[1:]), (rank.rank, moved)
    assert all(s.optimizer_offloaded_bytes == 0 for r in run["fill"]["planned"].ranks for s in r.steps)


def test_all_of_issue_24s_mechanisms_run_together(run: dict) -> None:
    """The streamed inference job (short: SJF runs it first) loads by groups; the checkpointed training job takes
    its turn after it; the main job offloads its optimizer state every step after the first; nothing is killed or
    fails; the losses equal the no-fill run's (test_main_job_unchanged_by_fill[all]). How far the jobs get in 8
    steps depends on this machine's load, so only that they ran is asserted here."""
    entry = run["fill"]["all"]
    for rank in entry.ranks:
        assert all(s.optimizer_offloaded_bytes == rank.holds.optimizer_state_bytes > 0 for s in rank.steps[1:])
    jobs = [j for _, rep in _reports(entry) for j in rep.jobs]
    infer = [j for j in jobs if j.kind == "infer"]
    assert infer and all(not j.resident for j in infer) and any(j.loads and j.iterations_done for j in infer), infer
    assert sum(j.iterations_done for j in infer) <= 6  # its batches, each at most once, over its ranks
    train = [j for j in jobs if j.kind == "train"]
    assert len(train) == 1 and train[0].config == "checkpoint" and train[0].error is None, train
    for _, rep in _reports(entry):
        assert rep.kills == [] and rep.errors == [], (rep.kills, rep.errors)


def test_paired_jobs_share_a_ranks_bubbles_within_their_budget(run: dict) -> None:
    """Waterwave's pairing as run: the two jobs' units interleave in the same bubbles, in exactly the order of the
    rule the planner simulated, and the activations they keep together (measured by saved-tensor hooks) stay within
    the pair's budget, below what the two would hold at their peaks side by side."""
    plan = run["plans"]["pair"]
    (pair,) = plan.fill.pairs
    assert pair.rank == 0 and pair.peak_bytes <= pair.budget_bytes < pair.side_by_side_bytes
    infer = next(j for j in plan.fill.jobs if j.kind == "infer")
    assert {j.name for j in plan.fill.jobs} == {*pair.jobs, infer.name} and not infer.resident
    assert {s.rank for s in infer.shards} == {0, 1} and plan.fill.predictions.offload_optimizer
    reports = dict(_reports(run["fill"]["pair"]))
    rep = reports[0]
    assert not rep.errors and not rep.kills and not reports[1].errors
    done = {j.name: j for rank_report in reports.values() for j in rank_report.jobs}
    assert all(done[n].iterations_done >= 1 for n in pair.jobs), [(j.name, j.units_done) for j in rep.jobs]
    assert all(j.loads_total > 0 for r in reports.values() for j in r.jobs  # loads are reported per iteration
               if j.name == infer.name and j.iterations_done)
    assert any(set(pair.jobs) <= {s.job for s in b.steps} for b in rep.bubbles), "no bubble ran both paired jobs"
    steps = sorted((s for b in rep.bubbles for s in b.steps if s.job in pair.jobs), key=lambda s: s.start)
    n = len(pair.mem_bytes[0])
    led = PairLedger.of(pair)
    pos, last, ahead, expected = [0, 0], None, 0, []
    for _ in steps:
        j = led.next((pos[0], pos[1]), last, ahead)
        expected.append((pair.jobs[j], pos[j]))
        pos[j], last = pos[j] + 1, j
        ahead += (1 if j == 0 else -1) if pos[j] % n == 0 else 0
    assert [(s.job, s.pos) for s in steps] == expected
    paired = [s for s in steps if s.pair_live_bytes is not None]
    assert paired and all(s.pair_budget_bytes == pair.budget_bytes for s in paired)
    solo = sum(max(s.live_bytes for s in steps if s.job == name) for name in pair.jobs)
    assert max(s.pair_live_bytes for s in paired) <= pair.budget_bytes < solo
