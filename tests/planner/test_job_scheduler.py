"""Fill-job scheduling: policies' defining orders, user score files, placement and unplaceable jobs."""

from __future__ import annotations

import math

import pytest

from planner.fill.cluster_sim import simulate
from planner.fill.packing import BubbleSlot
from planner.fill.job_scheduler import (
    POLICIES,
    ExecutorState,
    TraceJob,
    PlanChunk,
    Rank,
    RankPlan,
    SchedulerState,
    Unplaceable,
    choose,
    job_view,
    load_score_function,
    placement,
    resolve_policy,
)

PERIOD = 2.0
GB = 1 << 30


def rank(i: int, free: int = 4 * GB, bubble_s: float = 1.0) -> Rank:
    return Rank(id=i, slots=(BubbleSlot(id=0, duration_s=bubble_s, free_bytes=free),), period_s=PERIOD)


def plan(rate: float = 1.0) -> RankPlan:
    """``rate`` work per cycle in one chunk that fills the 1 s bubble."""
    return RankPlan(chunks=(PlanChunk(cycle=0, slot=0, work=rate, busy_s=1.0, overhead_s=0.1,
                                      flops=1e12),))


def job(name: str, work: float, n_ranks: int = 1, *, arrival: float = 0.0,
        deadline: float | None = None, rates: tuple[float, ...] | None = None,
        mem: int = GB) -> TraceJob:
    rates = rates or (1.0,) * n_ranks
    return TraceJob(name=name, work=work, plans=tuple(plan(r) for r in rates), mem_bytes=mem,
                   arrival_s=arrival, deadline_s=deadline, dedicated_s_per_work=0.5)


def started(report, name: str) -> float:
    return next(j.start_s for j in report.jobs if j.name == name)


# --- policies ------------------------------------------------------------------------------------


def test_fifo_runs_in_arrival_order():
    jobs = [job("c", 1, arrival=0.2), job("a", 1, arrival=0.0), job("b", 1, arrival=0.1)]
    rep = simulate(jobs, [rank(0)], "fifo")
    order = sorted(rep.jobs, key=lambda j: j.start_s)
    assert [j.name for j in order] == ["a", "b", "c"]


def test_sjf_lowers_mean_jct_against_fifo():
    jobs = [job("long", 20)] + [job(f"short{i}", 1) for i in range(5)]
    fifo, sjf = simulate(jobs, [rank(0)], "fifo"), simulate(jobs, [rank(0)], "sjf")
    assert sjf.mean_jct_s < fifo.mean_jct_s
    assert started(sjf, "long") > max(started(sjf, f"short{i}") for i in range(5))


def test_makespan_score_is_pipefills_formula():
    # PipeFill 4.4: score = 1 / max(proc_times[i], s.rem_times). Rank 1 is busy for 5 s more; a 3 s job on rank 0
    # leaves 5 s until all are idle, an 8 s job 8 s: the 3 s job wins, and rank 0 over rank 1 for it.
    ranks = [rank(0), rank(1)]
    short, long_ = job("short", 3, 2), job("long", 8, 2)
    infos = [job_view(j, ranks, i) for i, j in enumerate((long_, short))]
    state = SchedulerState(now_s=0.0, executors=(ExecutorState(rank=0, busy_until_s=0.0, running=None, assigned_s=0),
                                                 ExecutorState(rank=1, busy_until_s=5.0, running="x", assigned_s=5)))
    picked, at = choose(infos, [0], state, POLICIES["makespan"], {i.name: (0, 1) for i in infos})
    assert (picked.name, at) == ("short", 0)
    key = POLICIES["makespan"](infos[0], state, 0)
    assert key[:2] == (0.0, -max(infos[0].proc_times[0], 5.0))  # (priority, PipeFill's score)


def test_makespan_policy_takes_the_rank_that_finishes_earliest():
    # Rank 1 runs the job twice as fast; FIFO's least-loaded tie-break takes rank 0.
    jobs = [job("j", 10, 2, rates=(1.0, 2.0))]
    ranks = [rank(0), rank(1)]
    assert simulate(jobs, ranks, "fifo").jobs[0].rank == 0
    fast = simulate(jobs, ranks, "makespan")
    assert fast.jobs[0].rank == 1
    assert fast.makespan_s < simulate(jobs, ranks, "fifo").makespan_s


def test_edf_meets_more_deadlines_than_fifo():
    jobs = [job("bulk", 10, deadline=100.0), job("tight1", 1, deadline=3.0),
            job("tight2", 1, deadline=5.0), job("free", 1)]
    fifo, edf = simulate(jobs, [rank(0)], "fifo"), simulate(jobs, [rank(0)], "edf")
    assert edf.deadlines_met > fifo.deadlines_met
    assert edf.deadlines_met == 3
    # A job without a deadline goes after every job with one.
    assert started(edf, "free") > started(edf, "bulk")


def test_sjf_score_is_pipefills_min_processing_time():
    ranks = [rank(0), rank(1)]
    info = job_view(job("j", 6, 2, rates=(1.0, 3.0)), ranks, 0)
    assert info.proc_times == (6 * PERIOD, 2 * PERIOD)
    state = SchedulerState(now_s=0.0, executors=tuple(
        ExecutorState(rank=i, busy_until_s=0.0, running=None, assigned_s=0.0) for i in range(2)))
    assert POLICIES["sjf"](info, state, 0)[:2] == (0.0, -2 * PERIOD)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_built_in_policy_runs_a_higher_priority_job_first(policy):
    """The job file's `priority: 1  # higher first` ranks above each policy's own rule (PipeFill's hierarchical
    policies): a long, late, deadline-free job with priority runs before short, early ones with deadlines."""
    from dataclasses import replace

    jobs = [job("short", 1, deadline=3.0), job("early", 1, deadline=4.0),
            replace(job("urgent", 10, arrival=0.0), priority=1.0)]
    rep = simulate(jobs, [rank(0)], policy)
    assert min(rep.jobs, key=lambda j: j.start_s).name == "urgent"
    plain = simulate([replace(j, priority=0.0) for j in jobs], [rank(0)], policy)
    assert min(plain.jobs, key=lambda j: j.start_s).name != "urgent"


def test_least_loaded_idle_rank_gets_the_job():
    # "big" loads rank 0; once both ranks are idle again, the next job goes to rank 1.
    jobs = [job("big", 6, 2), job("small", 1, 2), job("late", 1, 2, arrival=50.0)]
    rep = simulate(jobs, [rank(0), rank(1)], "fifo")
    assert {j.name: j.rank for j in rep.jobs} == {"big": 0, "small": 1, "late": 1}


def test_placement_skips_ranks_without_enough_bubble_memory():
    jobs = [job("wide", 1, 2, mem=3 * GB)]
    rep = simulate(jobs, [rank(0, free=2 * GB), rank(1, free=4 * GB)], "fifo")
    assert rep.jobs[0].rank == 1


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown policy 'lifo'"):
        resolve_policy("lifo")


# --- unplaceable jobs ----------------------------------------------------------------------------


def test_job_needing_more_memory_than_any_bubble_is_unplaceable_for_memory():
    big = job("big", 1, 2, mem=8 * GB)
    where = placement(big, [rank(0), rank(1)])
    assert isinstance(where, Unplaceable) and where.reason == "memory"
    assert f"{8 * GB / 2**30:.2f} GiB" in where.detail and f"{4 * GB / 2**30:.2f} GiB" in where.detail


def test_job_whose_units_fit_no_bubble_is_unplaceable_for_time():
    slow = TraceJob(name="slow", work=1, plans=(None, RankPlan(chunks=())), mem_bytes=GB)
    where = placement(slow, [rank(0), rank(1)])
    assert isinstance(where, Unplaceable) and where.reason == "time"


def test_simulate_reports_unplaceable_jobs_and_runs_the_rest():
    jobs = [job("ok", 2, 1), job("big", 1, 1, mem=8 * GB),
            TraceJob(name="slow", work=1, plans=(None,), mem_bytes=GB)]
    rep = simulate(jobs, [rank(0)], "sjf")
    assert {(u.job, u.reason) for u in rep.unplaceable} == {("big", "memory"), ("slow", "time")}
    outcome = {j.name: j for j in rep.jobs}
    assert outcome["ok"].completion_s is not None
    assert outcome["big"].rank is None and outcome["big"].completion_s is None


# --- user score functions ------------------------------------------------------------------------


def write(tmp_path, text: str):
    path = tmp_path / "policy.py"
    path.write_text(text)
    return path


def test_user_score_function_is_honored(tmp_path):
    fn = load_score_function(write(tmp_path, (
        "def score(job, state, rank):\n"
        "    return 10.0 if job.name == 'vip' else -job.arrival_s\n")))
    jobs = [job("a", 3), job("b", 3, arrival=0.5), job("vip", 3, arrival=1.0)]
    rep = simulate(jobs, [rank(0)], fn)
    order = [j.name for j in sorted(rep.jobs, key=lambda j: j.start_s)]
    assert order == ["a", "vip", "b"]  # "a" starts before the others arrive


def test_user_score_chooses_the_rank_too(tmp_path):
    fn = load_score_function(write(tmp_path, "def score(job, state, rank):\n    return rank\n"))
    rep = simulate([job("j", 1, 3)], [rank(0), rank(1), rank(2)], fn)
    assert rep.jobs[0].rank == 2


def test_user_score_sees_state_rem_times(tmp_path):
    fn = load_score_function(write(tmp_path, (
        "def score(job, state, rank):\n"
        "    assert len(state.rem_times) == 2 and all(t >= 0 for t in state.rem_times)\n"
        "    return -min(job.proc_times)\n")))
    rep = simulate([job("a", 2, 2), job("b", 1, 2), job("c", 1, 2)], [rank(0), rank(1)], fn)
    assert all(j.completion_s is not None for j in rep.jobs)


@pytest.mark.parametrize("text, match", [
    ("x = 1\n", r"defines no function `score\(job, state, rank\)`"),
    ("score = 3\n", r"`score` .* is a int, not a function"),
    ("def score(job):\n    return 0\n", r"must take three arguments \(job, state, rank\)"),
    ("def score(job, state, rank)\n", r"failed to load: SyntaxError"),
    ("import no_such_module_xyz\n", r"failed to load: ModuleNotFoundError"),
])
def test_bad_score_file_names_what_is_missing(tmp_path, text, match):
    with pytest.raises(ValueError, match=match):
        load_score_function(write(tmp_path, text))


def test_missing_score_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_score_function(tmp_path / "nope.py")


def test_score_returning_nan_is_a_clear_error():
    info = job_view(job("j", 1), [rank(0)], 0)
    state = SchedulerState(now_s=0.0, executors=(
        ExecutorState(rank=0, busy_until_s=0.0, running=None, assigned_s=0.0),))
    with pytest.raises(ValueError, match="score for job 'j' on rank 0 is nan"):
        choose([info], [0], state, lambda j, s, r: math.nan, {"j": (0,)})


def test_choose_returns_none_without_a_runnable_pair():
    info = job_view(job("j", 1, 2), [rank(0), rank(1)], 0)
    state = SchedulerState(now_s=0.0, executors=())
    assert choose([info], [1], state, POLICIES["fifo"], {"j": (0,)}) is None
    assert choose([], [0], state, POLICIES["fifo"], {}) is None


def test_every_policy_the_plan_file_names_is_a_policy():
    """The plan file's and the fill YAML's policy names (planner/fill/physics.py FillPolicy) are POLICIES' keys."""
    from typing import get_args

    from planner.fill.physics import FillPolicy

    assert set(get_args(FillPolicy)) == set(POLICIES)
