"""Waterwave's pairing (planner/fill/waterwave.py): node groups, the pair rule's ledger, and the placement that
co-locates two training jobs whose peaks do not fit side by side."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from costmodels.hardware import Hardware
from planner.fill.assign import assign_fill, held_bytes
from planner.fill.packing import BubbleSlot, FillUnit
from planner.fill.physics import FILL_CONTEXT_BYTES
from planner.fill.profiles import FillProfile
from planner.fill.waterwave import RELEASE_S, node_groups, pair_units, schedule_pair
from targets.registry import get_target

HW = Hardware(target=get_target("a100-80gb"))
GiB = 1 << 30
MS = 1e-3


def _units(saved: list[int], fwd_ms: float = 1.0) -> list[FillUnit]:
    """A training job's iteration: forward units leaving `saved` bytes each, backward units freeing them, then the
    optimizer (as planner/fill/profiles.py linearizes one)."""
    out, live = [], 0
    for i, s in enumerate(saved):
        live += s
        out.append(FillUnit(name=f"F:{i}", time_s=fwd_ms * MS, flops=1e9, mem_bytes=live, state_bytes=live))
    for i in reversed(range(len(saved))):
        out.append(FillUnit(name=f"B:{i}", time_s=2 * fwd_ms * MS, flops=2e9, mem_bytes=live + saved[i] // 2,
                            state_bytes=live - saved[i]))
        live -= saved[i]
    out.append(FillUnit(name="OPT", time_s=0.1 * MS, flops=0.0, mem_bytes=0))
    return out


def test_node_groups_split_by_size_and_never_mix_allocation_with_deallocation():
    units = _units([4, 4, 4, 4])
    groups = node_groups(units, 8)
    assert [(g.first, g.stop) for g in groups] == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 9)]
    assert [g.allocates for g in groups] == [True, True, False, False, False]
    assert sum(g.delta_bytes for g in groups) == 0
    fine = node_groups(units, 1)  # one unit each
    assert len(fine) == len(units)


def test_two_identical_jobs_pair_within_one_jobs_peak():
    """Side by side two jobs need twice the peak; staggered (one allocating while the other frees) they fit in the
    memory one of them peaks at - Waterwave's Table 1 effect."""
    a = _units([10, 10, 10, 10])
    peak = max(u.mem_bytes for u in a)
    sched = schedule_pair(a, a, peak, 10)
    assert sched is not None
    assert sched.side_by_side_bytes == 2 * peak
    assert sched.peak_bytes <= peak and sched.held_bytes <= peak
    assert sched.iterations >= 1
    assert schedule_pair(a, a, peak - 1, 10) is None  # below one job's own peak nothing can run
    roomy = schedule_pair(a, a, 2 * peak, 10)
    assert roomy is not None and roomy.peak_bytes > peak  # with room to spare, nothing waits


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=6), st.lists(st.integers(1, 50), min_size=1, max_size=6),
       st.floats(1.0, 2.5), st.integers(1, 60))
def test_the_pair_rule_keeps_the_budget_runs_each_job_in_order_and_never_deadlocks(sa, sb, room, split):
    a, b = _units(sa), _units(sb)
    budget = int(max(max(u.mem_bytes for u in a), max(u.mem_bytes for u in b)) * room)
    sched = schedule_pair(a, b, budget, split)
    assert sched is not None, "the banker's rule always finds a unit when each job fits alone"
    assert sched.peak_bytes <= budget and sched.held_bytes <= budget
    for j, units in ((0, a), (1, b)):  # each job's units in order, whole iterations per period
        ks = [k for jj, k in sched.prologue + sched.period if jj == j]
        assert ks == [i % len(units) for i in range(len(ks))]
        assert sum(1 for jj, _ in sched.period if jj == j) == sched.iterations * len(units)
    merged = pair_units(sched, a, b)
    assert len(merged) == len(sched.period)
    assert max(u.mem_bytes for u in merged) == sched.peak_bytes
    assert sum(u.flops for u in merged) == sched.iterations * (sum(u.flops for u in a) + sum(u.flops for u in b))
    for u, (j, k) in zip(merged, sched.period):  # a deallocation group's end hands its memory back, at a price
        assert abs(u.time_s - (a, b)[j][k].time_s - (RELEASE_S if sched.ledger.frees(j, k) else 0.0)) < 1e-12


def _job(name: str, saved_gib: float, units: int = 4) -> FillProfile:
    return FillProfile(job=name, kind="train", batch_size=8, config="plain",
                       units=tuple(_units([int(saved_gib * GiB)] * units, fwd_ms=2.0)), resident_bytes=GiB,
                       layers=(), params=1, sha256="", batches=100)


def test_the_placement_pairs_two_training_jobs_that_do_not_fit_side_by_side():
    """One rank, two training jobs of ~9 GiB peak each, 16 GiB free beside the main job: one after the other does not
    fit (each holds its activations between bubbles), paired they do, and both run."""
    a, b = _job("a", 2.0), _job("b", 2.0)
    cycle = [BubbleSlot(id=i, duration_s=40 * MS, free_bytes=16 * GiB) for i in range(4)]
    assert held_bytes(a) + held_bytes(b) > 16 * GiB  # the turns' rule refuses them together
    fa = assign_fill([cycle], 0.5, {"a": [a], "b": [b]}, HW, hold_free=[16 * GiB])
    (queue,) = fa.per_rank
    assert {rf.profile.job for rf in queue} == {"a", "b"} and not fa.not_chosen
    pair = queue[0].pair
    assert pair is not None and pair is queue[1].pair and set(pair.jobs) == {"a", "b"}
    budget = 16 * GiB - 2 * GiB - 2 * FILL_CONTEXT_BYTES
    assert pair.schedule.ledger.budget == budget
    assert pair.schedule.peak_bytes <= budget < pair.schedule.side_by_side_bytes
    turns = [t for t in fa.turns if t.rank == 0]
    assert len(turns) == 2 and turns[0].start_s == turns[1].start_s  # they run together
    assert fa.fill_flops_per_gpu_s > 0
    assert all(ch.mem_bytes <= 16 * GiB for ch in queue[0].packing.chunks)
    roomy = assign_fill([[BubbleSlot(id=0, duration_s=40 * MS, free_bytes=40 * GiB)]], 0.5, {"a": [a], "b": [b]},
                        HW, hold_free=[40 * GiB])
    assert all(rf.pair is None for rf in roomy.per_rank[0])  # where they fit side by side, they take turns
