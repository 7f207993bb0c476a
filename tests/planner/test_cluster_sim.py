"""Event-driven fill-job simulator: conservation, bubble limits, metrics, and the PipeFill bench."""

from __future__ import annotations

import importlib.util
import sys
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.fill.cluster_sim import Prices, cost_savings, gpus_saved, run_job, simulate
from planner.fill.packing import BubbleSlot, FillUnit, greedy_pack
from planner.fill.job_scheduler import TraceJob, PlanChunk, Rank, RankPlan

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_pipefill_sim", ROOT / "bench" / "pipefill_sim.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench  # dataclasses resolve string annotations through sys.modules
_spec.loader.exec_module(bench)


# --- random cases --------------------------------------------------------------------------------


@st.composite
def ranks_st(draw) -> list[Rank]:
    out = []
    for i in range(draw(st.integers(1, 3))):
        n = draw(st.integers(1, 3))
        gaps = draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
        durs = draw(st.lists(st.integers(1, 10), min_size=n, max_size=n))
        starts, t = [], 0
        for g, d in zip(gaps, durs):
            starts.append(float(t + g))
            t += g + d
        period = float(t + draw(st.integers(0, 5)))
        slots = tuple(BubbleSlot(id=k, duration_s=float(d), free_bytes=100) for k, d in enumerate(durs))
        out.append(Rank(id=i, slots=slots, period_s=period, starts_s=tuple(starts)))
    return out


@st.composite
def plan_st(draw, r: Rank) -> RankPlan | None:
    cycles = draw(st.integers(1, 3))
    keys = [(c, s) for c in range(cycles) for s in range(len(r.slots))]
    used = draw(st.lists(st.sampled_from(keys), unique=True, max_size=len(keys)))
    chunks = []
    for c, s in used:
        busy = draw(st.floats(0.05, 1.0)) * r.slots[s].duration_s
        chunks.append(PlanChunk(cycle=c, slot=s, work=float(draw(st.integers(1, 5))), busy_s=busy,
                                overhead_s=busy * draw(st.floats(0.0, 0.5)), flops=1e9))
    return RankPlan(chunks=tuple(chunks), cycles=cycles) if chunks else None


@st.composite
def case_st(draw):
    ranks = draw(ranks_st())
    jobs = []
    for k in range(draw(st.integers(1, 6))):
        plans = tuple(draw(plan_st(r)) for r in ranks)
        jobs.append(TraceJob(name=f"j{k}", work=float(draw(st.integers(1, 25))), plans=plans,
                            mem_bytes=draw(st.sampled_from([10, 100, 200])),
                            arrival_s=float(draw(st.integers(0, 40))),
                            deadline_s=draw(st.none() | st.floats(0, 200)),
                            dedicated_s_per_work=0.3))
    policy = draw(st.sampled_from(["fifo", "sjf", "makespan", "edf"]))
    horizon = draw(st.none() | st.floats(1.0, 300.0))
    return ranks, jobs, policy, horizon


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case_st())
def test_conservation_and_bubble_limits(case):
    ranks, jobs, policy, horizon = case
    rep = simulate(jobs, ranks, policy, horizon_s=horizon)
    by_job: dict[str, float] = {}
    for c in rep.chunks:
        r = ranks[c.rank]
        assert c.bubble_s == r.slots[c.slot].duration_s
        assert c.busy_s <= c.bubble_s * (1 + 1e-12)
        assert c.start_s == pytest.approx(c.cycle * r.period_s + r.starts_s[c.slot])
        assert c.start_s + c.busy_s <= rep.horizon_s + 1e-9
        by_job[c.job] = by_job.get(c.job, 0.0) + c.work
    # Work done equals the sum of executed chunks, per job and in total.
    for j in rep.jobs:
        assert j.work_done == pytest.approx(by_job.get(j.name, 0.0))
        if j.completion_s is not None:
            assert j.work_done == pytest.approx(j.work)
        assert j.work_done <= j.work * (1 + 1e-9)
    assert rep.work_done == pytest.approx(sum(c.work for c in rep.chunks))
    # One chunk per bubble, and bubble time used never exceeds the bubble time there was.
    visits = [(c.rank, c.cycle, c.slot) for c in rep.chunks]
    assert len(visits) == len(set(visits))
    assert rep.bubble_s_used <= rep.bubble_s_total + 1e-9
    assert rep.gpus_saved == pytest.approx(rep.gpus * rep.bubble_ratio * rep.relative_perf)


@settings(max_examples=100, deadline=None)
@given(case_st())
def test_jobs_start_after_arrival_and_never_share_a_rank(case):
    ranks, jobs, policy, horizon = case
    rep = simulate(jobs, ranks, policy, horizon_s=horizon)
    arrival = {j.name: j.arrival_s for j in jobs}
    spans: dict[int, list[tuple[float, float]]] = {}
    for j in rep.jobs:
        if j.start_s is None:
            continue
        assert j.start_s >= arrival[j.name] - 1e-9
        end = j.completion_s if j.completion_s is not None else rep.horizon_s
        spans.setdefault(j.rank, []).append((j.start_s, end))
    for rank_spans in spans.values():
        rank_spans.sort()
        for (_, end), (start, _) in zip(rank_spans, rank_spans[1:]):
            assert start >= end - 1e-9


# --- execution and metrics -----------------------------------------------------------------------


def one_bubble_rank(period: float = 10.0) -> Rank:
    return Rank(id=0, slots=(BubbleSlot(id=0, duration_s=4.0, free_bytes=10),), period_s=period,
                starts_s=(3.0,))


def test_last_chunk_is_cut_to_the_work_left_and_keeps_its_overhead():
    p = RankPlan(chunks=(PlanChunk(cycle=0, slot=0, work=4.0, busy_s=3.0, overhead_s=1.0, flops=8.0),))
    j = TraceJob(name="j", work=10.0, plans=(p,), dedicated_s_per_work=1.0)
    chunks, end = run_job(j, 0, one_bubble_rank(), 0.0, j.work)
    assert [c.work for c in chunks] == [4.0, 4.0, 2.0]
    assert [c.start_s for c in chunks] == [3.0, 13.0, 23.0]
    assert chunks[-1].busy_s == pytest.approx(1.0 + 2.0 * 0.5)
    assert chunks[-1].flops == pytest.approx(4.0)
    assert end == pytest.approx(25.0)


def test_job_submitted_mid_cycle_starts_at_the_next_bubble():
    p = RankPlan(chunks=(PlanChunk(cycle=1, slot=0, work=1.0, busy_s=1.0),), cycles=2)
    j = TraceJob(name="j", work=2.0, plans=(p,))
    chunks, end = run_job(j, 0, one_bubble_rank(), 3.5, j.work)
    assert [c.cycle for c in chunks] == [1, 3]  # the plan's phase follows the main job's iteration
    assert end == pytest.approx(34.0)


def test_metrics_by_hand():
    p = RankPlan(chunks=(PlanChunk(cycle=0, slot=0, work=1.0, busy_s=2.0, flops=2e12),))
    jobs = [TraceJob(name="j", work=3.0, plans=(p,), dedicated_s_per_work=1.0)]
    rep = simulate(jobs, [one_bubble_rank()], gpus_per_rank=8,
                   prices=Prices(main_per_gpu_hour=2.0, side_per_gpu_hour=1.0))
    j = rep.jobs[0]
    assert (j.start_s, j.completion_s, j.jct_s) == (3.0, 25.0, 25.0)
    assert j.bubble_s_used == 12.0 and j.slowdown == pytest.approx(22.0 / 3.0)
    assert rep.horizon_s == 25.0
    assert rep.bubble_ratio == pytest.approx(0.4)
    assert rep.relative_perf == pytest.approx(3.0 / 12.0)  # dedicated s / bubble s used
    assert rep.gpus_saved == pytest.approx(8 * 0.4 * 0.25)  # C * B * P
    assert rep.fill_tflops_per_gpu == pytest.approx(6.0 / 25.0)
    assert rep.bubble_s_used == 6.0 and rep.bubble_s_total == pytest.approx(4 + 4 + 2)
    assert rep.gpus_worth == pytest.approx(8 * 3.0 / 25.0)
    c_no = 2.0 * 8 * 25.0 / 3600
    assert rep.cost.time_increase == 0.0
    assert rep.cost.savings == pytest.approx(1.0 * 8 * 3.0 / 3600 / c_no)


def test_freeride_cost_savings_formula():
    prices = Prices(main_per_gpu_hour=3.0, side_per_gpu_hour=1.0, main_time_increase=0.01)
    rep = cost_savings(main_gpus=4, main_time_s=3600.0, side_dedicated_gpu_s=2 * 3600.0, prices=prices)
    c_no, c_with, c_side = 12.0, 12.12, 2.0
    assert rep.time_increase == pytest.approx(0.01)
    assert rep.savings == pytest.approx((c_side - (c_with - c_no)) / c_no)
    assert gpus_saved(8192, 0.652, 0.3) == pytest.approx(8192 * 0.652 * 0.3)


def test_packing_plans_run_in_the_simulator():
    units = [FillUnit(name=f"u{i}", time_s=0.3, mem_bytes=5, flops=1.0) for i in range(3)]
    r = Rank(id=0, slots=(BubbleSlot(id=0, duration_s=1.0, free_bytes=10),
                          BubbleSlot(id=1, duration_s=0.5, free_bytes=10)), period_s=3.0)
    pk = greedy_pack(units, r.slots, safety_margin=0.0, launch_overhead_s=0.0, cycles=2)
    plan = RankPlan.from_packing(pk)
    assert plan.work_per_cycle == pk.units_per_cycle
    rep = simulate([TraceJob(name="j", work=20.0, plans=(plan,), dedicated_s_per_work=0.3)], [r])
    assert rep.work_done == 20.0
    assert rep.fill_tflops_per_gpu * 1e12 * rep.horizon_s == pytest.approx(20.0)


def test_bad_inputs_are_clear_errors():
    p = RankPlan(chunks=(PlanChunk(cycle=0, slot=3, work=1.0, busy_s=1.0),))
    with pytest.raises(ValueError, match="uses slot 3, the rank has 1 bubbles"):
        simulate([TraceJob(name="j", work=1.0, plans=(p,))], [one_bubble_rank()])
    ok = RankPlan(chunks=(PlanChunk(cycle=0, slot=0, work=1.0, busy_s=1.0),))
    with pytest.raises(ValueError, match="'j' appears 2 times"):
        simulate([TraceJob(name="j", work=1.0, plans=(ok,))] * 2, [one_bubble_rank()])
    with pytest.raises(ValueError, match="bubbles end at 5.0 s, period_s=4.0"):
        Rank(id=0, slots=(BubbleSlot(id=0, duration_s=5.0, free_bytes=1),), period_s=4.0)


# --- the PipeFill reproduction -------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["1f1b", "gpipe"])
@pytest.mark.parametrize("n", bench.SCALES)
def test_reproduction_bubble_ratio_is_fill_drain_formula(n, kind):
    main = bench.main_job_ranks(n, kind)
    p, m = bench.MainJob().p, main["m"]
    assert m == 1024 // (n // 128 * 2)
    assert main["formula"] == Fraction(p - 1, m + p - 1)
    assert main["bubble_fraction"] == pytest.approx(float(main["formula"]), rel=1e-12)
    ratio = sum(r.bubble_s for r in main["ranks"]) / sum(r.period_s for r in main["ranks"])
    assert ratio == pytest.approx(float(main["formula"]), rel=1e-12)


@pytest.mark.parametrize("kind", ["1f1b", "gpipe"])
def test_reproduction_bubbles_follow_pipefill_4_5(kind):
    job = bench.MainJob()
    main = bench.main_job_ranks(2048, kind)
    tf, p, m = job.forward_s(), job.p, main["m"]
    tb = 2 * tf
    for r, (rank, fill) in enumerate(zip(main["ranks"], main["fillable"])):
        durs = [rank.slots[i].duration_s for i in fill]
        fwd_bwd = (p - r - 1) * (tf + tb) if kind == "gpipe" else (p - r - 1) * tb + max(0, p - r - m) * tf
        want = [x for x in (r * (tf + tb), fwd_bwd) if x > 0]  # fill-drain, then fwd-bwd
        assert durs == pytest.approx(want, rel=1e-9)
