"""Packing a fill job into the bubble cycle: greedy (PipeFill Alg. 1), CP-SAT, validation."""

from __future__ import annotations

import dataclasses
import functools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.fill import packing as packing_mod
from planner.fill.packing import (
    BubbleSlot,
    FillUnit,
    PackingError,
    PackingParams,
    cpsat_pack,
    greedy_pack,
    validate_packing,
)

MS = 1e-3
EXACT = dict(safety_margin=0.0, launch_overhead_s=0.0)


def unit(name: str, ms: float, mem: int = 1, state: int = 0) -> FillUnit:
    return FillUnit(name=name, time_s=ms * MS, mem_bytes=mem, flops=ms * 1e9, state_bytes=state)


def bubble(i: int, ms: float, free: int = 100) -> BubbleSlot:
    return BubbleSlot(id=i, duration_s=ms * MS, free_bytes=free)


units_st = st.lists(
    st.builds(unit, name=st.just("u"), ms=st.integers(0, 20), mem=st.integers(0, 100),
              state=st.integers(0, 60)),
    min_size=1, max_size=5,
).filter(lambda us: sum(u.time_s for u in us) > 0)
cycle_st = st.lists(st.tuples(st.integers(0, 60), st.integers(0, 120)), min_size=1, max_size=4).map(
    lambda bs: [bubble(10 + i, ms, free) for i, (ms, free) in enumerate(bs)]
)
kwargs_st = st.fixed_dictionaries({
    "safety_margin": st.sampled_from([0.0, 0.1]),
    "launch_overhead_s": st.sampled_from([0.0, 1 * MS]),
    "resident_bytes": st.integers(0, 20),
    "cycles": st.integers(1, 3),
    # 10 kB/s turns state_bytes 0..60 into 0..6 ms of offload/reload per boundary.
    "state_swap_bw": st.sampled_from([None, 1e4]),
})


def brute_force_units(units, cycle, **kwargs) -> int:
    """Most units any packing completes, by trying every chunk end in every bubble."""
    params = PackingParams(**kwargs)
    prob = packing_mod._build(units, cycle, params)
    nb = len(cycle)

    @functools.cache
    def best_from(k: int, a: int) -> int:
        if k == params.cycles * nb:
            return a
        slot, b, best = k % nb, a, best_from(k + 1, a)
        while prob.mem_fits(slot, b) and prob.elapsed(b + 1) - prob.elapsed(a) <= prob.usable_ns[slot]:
            b += 1
            if prob.busy_ns(a, b) <= prob.usable_ns[slot]:
                best = max(best, best_from(k + 1, b))
        return best

    return best_from(0, 0)


@settings(max_examples=100, deadline=None)
@given(units=units_st, cycle=cycle_st, kwargs=kwargs_st)
def test_greedy_never_exceeds_a_bubble(units, cycle, kwargs):
    packing = greedy_pack(units, cycle, **kwargs)
    validate_packing(packing, units, cycle)
    assert len(packing.chunks) + len(packing.empty_bubbles) == kwargs["cycles"] * len(cycle)
    assert 0.0 <= packing.filled_fraction <= 1.0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(units=units_st, cycle=cycle_st, kwargs=kwargs_st)
def test_cpsat_is_valid_optimal_and_never_worse_than_greedy(units, cycle, kwargs):
    greedy = greedy_pack(units, cycle, **kwargs)
    best = cpsat_pack(units, cycle, **kwargs, time_limit_s=1.0)
    validate_packing(best, units, cycle)
    assert best.units_completed >= greedy.units_completed
    assert best.units_completed >= greedy_pack(units, cycle, **kwargs, farthest_fit=True).units_completed
    assert best.flops_per_cycle >= greedy.flops_per_cycle - 1e-6
    if best.status == "OPTIMAL":
        assert best.units_completed == brute_force_units(units, cycle, **kwargs)
    if kwargs["state_swap_bw"] is None:
        # Without boundary costs greedy is provably optimal (see the packing module docstring).
        assert best.units_completed == greedy.units_completed


def test_cpsat_beats_greedy_when_a_boundary_costs_state_swapping():
    # A training-like job: after the short unit "fwd" 3 ms worth of saved activations are live
    # (offloaded at the end of a bubble, reloaded at the start of the next chunk); after "bwd"
    # nothing is. Bubbles: 13 ms, then 10 ms.
    # Greedy fills bubble 0 as far as it fits: fwd,bwd,fwd = 1+8+1 + 3 ms offload = 13 ms, so it
    # stops right after a "fwd", and bubble 1 would need 3 ms reload + 8 ms bwd = 11 > 10 ms: empty.
    # CP-SAT stops bubble 0 after fwd,bwd (9 ms, nothing to offload) and runs fwd,bwd in bubble 1
    # (9 ms): 4 units per cycle. Greedy's next cycle starts mid-iteration, runs bwd alone in
    # bubble 0 and fwd,bwd in bubble 1: 3 units per cycle in steady state. Without the swap cost greedy would be
    # optimal (module docstring), so this boundary cost is exactly what CP-SAT exploits.
    units = [unit("fwd", 1, state=3), unit("bwd", 8)]
    cycle = [bubble(0, 13), bubble(1, 10)]
    kwargs = dict(EXACT, state_swap_bw=1.0 / MS, cycles=3)  # 1 state byte = 1 ms
    greedy = greedy_pack(units, cycle, **kwargs)
    best = cpsat_pack(units, cycle, **kwargs, time_limit_s=2.0)
    validate_packing(best, units, cycle)
    assert greedy.units_per_cycle == 3 and best.units_per_cycle == 4
    assert greedy_pack(units, cycle, **kwargs, farthest_fit=True).units_per_cycle == 3
    assert best.solver == "cp-sat" and best.status == "OPTIMAL"
    assert (greedy.empty_bubbles[0].slot, greedy.empty_bubbles[0].reason) == (1, "too_short")
    assert [(c.slot, c.num_units) for c in best.chunks[:2]] == [(0, 2), (1, 2)]


def test_cpsat_leaves_a_bubble_empty_so_state_is_not_stranded():
    # One iteration is fwd (2 ms, leaves 20 ms worth of state) then bwd (30 ms). In bubble A
    # (25 ms) fwd alone fits with its offload (22 ms) but fwd,bwd (32 ms) does not, so greedy and
    # farthest-fit run fwd there, and from then on every bubble would need 20 ms reload + 30 ms
    # bwd: the job is stuck for good. CP-SAT leaves A empty and runs whole iterations in B (40 ms).
    units = [unit("fwd", 2, state=20), unit("bwd", 30)]
    cycle = [bubble(0, 25), bubble(1, 40)]
    kwargs = dict(EXACT, state_swap_bw=1.0 / MS, cycles=3)
    for farthest_fit in (False, True):
        stuck = greedy_pack(units, cycle, **kwargs, farthest_fit=farthest_fit)
        assert stuck.units_completed == 1
    best = cpsat_pack(units, cycle, **kwargs, time_limit_s=2.0)
    assert best.units_completed == 6 and best.status == "OPTIMAL"
    assert {(e.slot, e.reason) for e in best.empty_bubbles} == {(0, "skipped")}


@settings(max_examples=100, deadline=None)
@given(units=units_st, cycle=cycle_st, kwargs=kwargs_st)
def test_farthest_fit_is_valid_and_matches_greedy_without_state_swapping(units, cycle, kwargs):
    farthest = greedy_pack(units, cycle, **kwargs, farthest_fit=True)
    validate_packing(farthest, units, cycle)
    if kwargs["state_swap_bw"] is None:
        assert farthest.chunks == greedy_pack(units, cycle, **kwargs).chunks


def test_greedy_follows_algorithm_1_across_iterations_and_cycles():
    units = [unit("a", 4), unit("b", 3), unit("c", 5)]
    cycle = [bubble(0, 10), bubble(1, 6)]
    packing = greedy_pack(units, cycle, **EXACT, cycles=2)
    got = [(c.cycle, c.slot, c.first_unit, c.num_units) for c in packing.chunks]
    # a,b (7) | c (5) | a,b (7; the second iteration follows the first) | c (5)
    assert got == [(0, 0, 0, 2), (0, 1, 2, 1), (1, 0, 3, 2), (1, 1, 5, 1)]
    assert packing.units_per_cycle == 3 and packing.iterations_per_cycle == 1
    assert packing.filled_fraction == pytest.approx(24 / 32)
    assert packing.flops_per_cycle == pytest.approx(12e9)


def test_chunk_may_cross_an_iteration_boundary():
    packing = greedy_pack([unit("a", 2), unit("b", 3)], [bubble(0, 12)], **EXACT)
    assert [(c.first_unit, c.num_units) for c in packing.chunks] == [(0, 5)]  # a,b,a,b,a


@pytest.mark.parametrize("pack", [greedy_pack, cpsat_pack])
def test_unit_too_long_for_every_bubble_gives_empty_packing(pack):
    units = [unit("small", 1), unit("huge", 500)]
    packing = pack(units, [bubble(0, 100), bubble(1, 50)], **EXACT, cycles=2)
    validate_packing(packing, units, [bubble(0, 100), bubble(1, 50)])
    assert packing.units_completed == 1  # "small" runs, then "huge" blocks forever
    assert {e.reason for e in packing.empty_bubbles} == {"too_short"}
    assert packing.empty_bubbles[-1].next_unit == 1


@pytest.mark.parametrize("pack", [greedy_pack, cpsat_pack])
def test_unit_too_big_for_every_bubble_memory_gives_empty_packing(pack):
    units = [unit("act", 1, mem=90)]
    packing = pack(units, [bubble(0, 100, free=50), bubble(1, 50, free=99)], **EXACT,
                   resident_bytes=10)
    assert packing.chunks == () and packing.units_completed == 0
    assert [e.reason for e in packing.empty_bubbles] == ["no_memory", "no_memory"]


def test_empty_reason_reports_both_limits():
    packing = greedy_pack([unit("x", 9, mem=9)], [bubble(0, 5, free=5)], **EXACT)
    assert packing.empty_bubbles[0].reason == "too_short_and_no_memory"


def test_launch_overhead_and_safety_margin_are_charged():
    # usable = 10 ms * 0.8 = 8 ms; two 3 ms units + 2 ms launch = 8 ms fit, a third does not.
    packing = greedy_pack([unit("a", 3)], [bubble(0, 10)], safety_margin=0.2,
                          launch_overhead_s=2 * MS)
    assert packing.chunks[0].num_units == 2
    assert packing.chunks[0].overhead_s == pytest.approx(2 * MS)


def test_memory_uses_the_peak_unit_plus_resident_bytes():
    units = [unit("a", 1, mem=30), unit("b", 1, mem=60)]
    packing = greedy_pack(units, [bubble(0, 100, free=70), bubble(1, 100, free=80)], **EXACT,
                          resident_bytes=20)
    # b needs 60 + 20 = 80 > 70 bytes: bubble 0 stops before it; bubble 1 (80) fits all 100 units.
    assert [(c.slot, c.num_units, c.mem_bytes) for c in packing.chunks] == [(0, 1, 50), (1, 100, 80)]
    packing = greedy_pack(units, [bubble(0, 100, free=70)], **EXACT, resident_bytes=20, cycles=2)
    assert packing.empty_bubbles[0].reason == "no_memory"


def test_cpsat_falls_back_to_greedy_without_a_solution(monkeypatch):
    monkeypatch.setattr(packing_mod, "_solve_cpsat", lambda *a, **k: (None, "UNKNOWN"))
    units, cycle = [unit("a", 3)], [bubble(0, 10)]
    packing = cpsat_pack(units, cycle, **EXACT)
    assert packing.solver == "greedy-fallback" and packing.status == "UNKNOWN"
    assert packing.units_completed == greedy_pack(units, cycle, **EXACT).units_completed


def test_cpsat_accepts_a_hint_and_is_deterministic():
    units = [unit("fwd", 1, state=3), unit("bwd", 8)]
    cycle = [bubble(0, 13), bubble(1, 10)]
    kwargs = dict(EXACT, state_swap_bw=1.0 / MS, cycles=2)
    first = cpsat_pack(units, cycle, **kwargs, hint=greedy_pack(units, cycle, **kwargs))
    second = cpsat_pack(units, cycle, **kwargs)
    assert first.chunks == second.chunks


def _packing(units, cycle, **kwargs):
    return greedy_pack(units, cycle, **EXACT, **kwargs)


def test_validate_rejects_over_time_over_memory_and_disorder():
    units, cycle = [unit("a", 3, mem=10)], [bubble(0, 10, free=20), bubble(1, 10, free=20)]
    good = _packing(units, cycle)
    c0, c1 = good.chunks
    with pytest.raises(PackingError, match="usable"):
        validate_packing(good, units, [bubble(0, 5, free=20), bubble(1, 10, free=20)])
    with pytest.raises(PackingError, match="free"):
        validate_packing(good, units, [bubble(0, 10, free=5), bubble(1, 10, free=20)])
    overlap = dataclasses.replace(c1, first_unit=c0.first_unit + 1)
    with pytest.raises(PackingError, match="out of order"):
        validate_packing(dataclasses.replace(good, chunks=(c0, overlap)), units, cycle)
    with pytest.raises(PackingError, match="already used"):
        twice = dataclasses.replace(c1, slot=0, bubble_id=0)
        validate_packing(dataclasses.replace(good, chunks=(c0, twice)), units, cycle)
    with pytest.raises(PackingError, match="no such bubble"):
        late = dataclasses.replace(c1, cycle=5)
        validate_packing(dataclasses.replace(good, chunks=(c0, late)), units, cycle)


def test_inputs_are_checked_with_their_numbers():
    with pytest.raises(ValueError, match="time_s=-1"):
        FillUnit(name="x", time_s=-1, mem_bytes=0, flops=0)
    with pytest.raises(ValueError, match="safety_margin=1.5"):
        greedy_pack([unit("a", 1)], [bubble(0, 1)], safety_margin=1.5)
    with pytest.raises(ValueError, match="unique"):
        greedy_pack([unit("a", 1)], [bubble(0, 1), bubble(0, 2)])
    with pytest.raises(ValueError, match="must be > 0"):
        greedy_pack([unit("a", 0)], [bubble(0, 1)])


def test_one_cpsat_budget_covers_every_solve_and_reports_its_gap():
    units = [unit("fwd", 1, state=3), unit("bwd", 8)]
    cycle = [bubble(0, 13), bubble(1, 10)]
    kwargs = dict(EXACT, state_swap_bw=1.0 / MS, cycles=3)
    with packing_mod.cpsat_budget(30.0) as budget:
        best = cpsat_pack(units, cycle, **kwargs, time_limit_s=2.0)
    assert best.units_per_cycle == 4 and (budget.solves, budget.optimal, budget.skipped) == (1, 1, 0)
    assert budget.summary().startswith("CP-SAT: 1 solves in") and "every solve proved optimal" in budget.summary()
    with packing_mod.cpsat_budget(0.0) as spent:  # nothing left: the heuristic stands, never worse than greedy
        kept = [cpsat_pack(units, cycle, **kwargs, time_limit_s=2.0) for _ in range(3)]
    assert all(k.solver == "greedy-fallback" and k.status == "BUDGET_SPENT" for k in kept)
    assert kept[0].units_completed >= greedy_pack(units, cycle, **kwargs).units_completed
    assert (spent.solves, spent.skipped) == (0, 3) and "3 kept greedy (budget of 0 s spent)" in spent.summary()
