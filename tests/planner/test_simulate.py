"""Discrete-event simulation and bubbles (planner/simulate.py)."""

from __future__ import annotations

import math

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from planner.schedule_ir import (
    Action,
    Op,
    Schedule,
    ScheduleError,
    generate,
    lower_timed,
    validate,
)
from planner.schedules import SCHEDULES
from tests.planner.kinds import KINDS, gpipe, interleaved, one_f_one_b
from planner.simulate import SimCosts, SimResult, simulate, simulate_time, with_bubbles

CAPACITY = 1000
STATIC = 100
ACT = 10


def uniform(s: Schedule, tf: float = 1.0, tb: float = 2.0, **extra: object) -> SimCosts:
    """Same forward/backward time on every virtual stage; no communication unless given."""
    fields = dict(
        forward_s=(tf,) * s.num_stages,
        backward_s=(tb,) * s.num_stages,
        p2p_s=0.0,
        allreduce_s=(0.0,) * s.p,
        optimizer_s=(0.0,) * s.p,
        static_bytes=(STATIC,) * s.p,
        activation_bytes=(ACT,) * s.num_stages,
        capacity_bytes=CAPACITY,
    )
    fields.update(extra)
    return SimCosts(**fields)


@st.composite
def cases(draw: st.DrawFn) -> tuple[Schedule, SimCosts]:
    kind = draw(st.sampled_from(KINDS))
    p = draw(st.integers(1, 6))
    v = draw(st.integers(1, 3)) if kind == "interleaved" else max(SCHEDULES[kind].v_choices(max(p, 2), 3), default=1)
    m = p * draw(st.integers(1, 3)) if kind == "interleaved" else draw(st.integers(1, 10))
    assume(SCHEDULES[kind].check(p, v, m) is None)
    s = generate(kind, p, m, v)
    time = st.floats(0.01, 10.0)
    stages, ranks = s.num_stages, s.p
    backward = tuple(draw(st.lists(time, min_size=stages, max_size=stages)))
    acts = tuple(draw(st.lists(st.integers(0, 100), min_size=stages, max_size=stages)))
    share = draw(st.floats(0.0, 0.9))  # of a backward, the W step (split-backward kinds)
    costs = SimCosts(
        forward_s=tuple(draw(st.lists(time, min_size=stages, max_size=stages))),
        backward_s=backward, weight_s=tuple(b * share for b in backward),
        weight_bytes=tuple(int(a * share) for a in acts),
        p2p_s=draw(st.sampled_from([0.0, 0.05, 1.5])),
        allreduce_s=tuple(draw(st.lists(st.floats(0.0, 5.0), min_size=ranks, max_size=ranks))),
        optimizer_s=tuple(draw(st.lists(st.floats(0.0, 1.0), min_size=ranks, max_size=ranks))),
        static_bytes=tuple(draw(st.lists(st.integers(0, 500), min_size=ranks, max_size=ranks))),
        activation_bytes=acts,
        capacity_bytes=draw(st.integers(0, 2000)),
    )
    return s, costs


def _spans(res: SimResult, r: int) -> dict[str, tuple[float, float]]:
    return {iv.action: (iv.start, iv.end) for iv in res.timelines[r] if iv.kind != "bubble"}


def _fwd_bwd_bubble(res: SimResult, r: int) -> float:
    """The idle gap that ends at the rank's first backward (0 if it starts right away)."""
    tl = res.timelines[r]
    first_b = next(j for j, iv in enumerate(tl) if iv.kind == "compute" and "B" in iv.action)
    before = tl[first_b - 1]
    return before.end - before.start if before.kind == "bubble" else 0.0


# --- invariants ---------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(cases())
def test_bubbles_plus_busy_fill_every_rank(case: tuple[Schedule, SimCosts]) -> None:
    s, costs = case
    res = simulate(s, costs)
    tol = 1e-9 * max(res.iteration_s, 1.0)
    for r in range(s.p):
        tl = res.timelines[r]
        idle = sum(b.duration_s for b in res.bubbles if b.rank == r)
        assert math.isclose(res.busy_s[r] + idle, res.iteration_s, rel_tol=1e-9, abs_tol=1e-9)
        # Contiguous, ordered, covering [0, iteration]; gaps below 1e-12 s are not bubbles.
        assert abs(tl[0].start) <= tol and abs(tl[-1].end - res.iteration_s) <= tol
        for a, b in zip(tl, tl[1:]):
            assert a.start <= a.end and abs(b.start - a.end) <= tol
        ids = [b.id for b in res.bubbles if b.rank == r]
        assert ids == list(range(len(ids)))
    assert all(b.free_bytes >= 0 and b.kind in "ABC" and b.duration_s > 1e-12 for b in res.bubbles)
    total_idle = sum(b.duration_s for b in res.bubbles)
    assert math.isclose(res.bubble_fraction, total_idle / (s.p * res.iteration_s), rel_tol=1e-9)


@settings(max_examples=60, deadline=None)
@given(cases())
def test_dependencies_and_ordering_are_respected(case: tuple[Schedule, SimCosts]) -> None:
    """A forward after the previous stage's (plus a hop across ranks), a backward (B or I) after its own forward
    and the next stage's backward, W after its I; each takes its cost (I and W split B's)."""
    s, costs = case
    res = simulate(s, costs)
    rank_of = s.placement.rank_of
    spans = [_spans(res, r) for r in range(s.p)]
    last = s.num_stages - 1
    eps = 1e-9
    split = SCHEDULES[s.kind].split_backward

    def hop(a: int, b: int) -> float:
        return costs.p2p_s if rank_of[a] != rank_of[b] else 0.0

    def back(k: int, mb: int) -> tuple[float, float]:
        return spans[rank_of[k]][f"{k}{'I' if split else 'B'}{mb}"]

    for k in range(s.num_stages):
        here = spans[rank_of[k]]
        for mb in range(s.m):
            f0, f1 = here[f"{k}F{mb}"]
            b0, b1 = back(k, mb)
            want = costs.backward_s[k] - (costs.weight_s[k] if split else 0.0)
            assert math.isclose(f1 - f0, costs.forward_s[k]) and math.isclose(b1 - b0, want, abs_tol=1e-12)
            assert b0 >= f1 - eps
            if split:
                w0, w1 = here[f"{k}W{mb}"]
                assert w0 >= b1 - eps and math.isclose(w1 - w0, costs.weight_s[k], abs_tol=1e-12)
            if k > 0:
                assert f0 >= spans[rank_of[k - 1]][f"{k - 1}F{mb}"][1] + hop(k - 1, k) - eps
            if k < last:
                assert b0 >= back(k + 1, mb)[1] + hop(k + 1, k) - eps
    for r in range(s.p):
        last_b = max(end for name, (_, end) in spans[r].items() if any(x in name for x in "BIW"))
        assert math.isclose(spans[r]["ALLREDUCE"][0], last_b)
        assert math.isclose(spans[r]["OPT"][0], spans[r]["ALLREDUCE"][1])


@settings(max_examples=60, deadline=None)
@given(cases())
def test_with_bubbles_validates_and_resimulates_identically(case: tuple[Schedule, SimCosts]) -> None:
    s, costs = case
    res = simulate(s, costs)
    marked = with_bubbles(s, res)
    validate(marked)
    for r, acts in enumerate(marked.ranks):
        assert [a.mb for a in acts if a.op is Op.BUBBLE] == [b.id for b in res.bubbles if b.rank == r]
        for i, a in enumerate(acts):
            if a.op is Op.BUBBLE and i + 1 < len(acts):
                assert acts[i + 1].op not in (Op.SEND_F, Op.SEND_B)  # placed before the wait
    again = simulate(marked, costs)
    assert again == res
    assert with_bubbles(marked, again) == marked


@settings(max_examples=100, deadline=None)
@given(cases())
def test_simulate_time_is_simulate_without_timelines(case: tuple[Schedule, SimCosts]) -> None:
    """The search's runners-up are timed without their timelines, on their timed actions alone: the same numbers."""
    s, costs = case
    res = simulate(s, costs)
    kind = SCHEDULES[s.kind]
    timed = lower_timed(s.kind, s.p, s.m, s.v, kind.compute(s.p, s.m, s.v))
    assert simulate_time(s, costs) == simulate_time(timed, costs) == (res.iteration_s, res.bubble_fraction)


# --- golden formulas ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("p", "m"), [(1, 4), (2, 1), (2, 8), (4, 4), (4, 16), (8, 3), (8, 32), (16, 64)])
@pytest.mark.parametrize(("tf", "tb"), [(1.0, 2.0), (1.0, 1.0), (0.3, 1.1)])
def test_uniform_bubble_fraction(kind: str, p: int, m: int, tf: float, tb: float) -> None:
    """Narayanan et al. 4.2.2: bubble (p-1)(tf+tb) per rank against m(tf+tb) of work, i.e. a
    (p-1)/m share of the ideal time and (p-1)/(m+p-1) of the iteration."""
    res = simulate(generate(kind, p, m), uniform(generate(kind, p, m), tf, tb))
    assert res.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), rel=0.01, abs=1e-12)
    assert res.iteration_s == pytest.approx((m + p - 1) * (tf + tb), rel=1e-9)


@pytest.mark.parametrize(("p", "v", "m"), [(2, 2, 2), (2, 2, 8), (4, 2, 4), (4, 2, 8), (4, 3, 12), (4, 4, 16), (8, 2, 16), (8, 4, 8)])
@pytest.mark.parametrize(("tf", "tb"), [(1.0, 2.0), (1.0, 1.0), (2.0, 1.0)])
def test_interleaving_divides_the_bubble_by_v(p: int, v: int, m: int, tf: float, tb: float) -> None:
    """Narayanan et al. 4.2.2 with per-chunk times tf/v, tb/v: bubble (p-1)(tf+tb)/v per rank,
    i.e. (p-1)/(v m) of the ideal time, (p-1)/(v m + p - 1) of the iteration."""
    s = interleaved(p, v, m)
    res = simulate(s, uniform(s, tf / v, tb / v))
    assert res.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), rel=0.01)
    plain = simulate(one_f_one_b(p, m), uniform(one_f_one_b(p, m), tf, tb))
    for r in range(p):
        idle = res.iteration_s - res.busy_s[r]
        plain_idle = plain.iteration_s - plain.busy_s[r]
        assert idle == pytest.approx((p - 1) * (tf + tb) / v, rel=0.01)
        assert idle * v == pytest.approx(plain_idle, rel=0.01)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 12])
@pytest.mark.parametrize(("tf", "tb"), [(1.0, 2.0), (2.0, 1.0), (1.0, 3.5)])
def test_pipefill_fwd_bwd_bubbles(p: int, m: int, tf: float, tb: float) -> None:
    """PipeFill 4.5 fwd-bwd bubble of stage i: the gap that ends at the rank's first backward
    (after its forwards of the fill phase, before the gradient of microbatch 0 comes back).
    GPipe: (p-i-1)(tf+tb). 1F1B: (p-i-1) tb + max(0, p-i-m) tf. With p2p = 0 the simulation
    matches both as printed, exactly, for any m (including m < p)."""
    g, f = gpipe(p, m), one_f_one_b(p, m)
    g_res, f_res = simulate(g, uniform(g, tf, tb)), simulate(f, uniform(f, tf, tb))
    for i in range(p):
        assert _fwd_bwd_bubble(g_res, i) == pytest.approx((p - i - 1) * (tf + tb), abs=1e-9)
        expected = (p - i - 1) * tb + max(0, p - i - m) * tf
        assert _fwd_bwd_bubble(f_res, i) == pytest.approx(expected, abs=1e-9)
    # GPipe's fill-drain and fwd-bwd bubbles add up to the same total as 1F1B's.
    assert g_res.bubble_fraction == pytest.approx(f_res.bubble_fraction, abs=1e-12)


@pytest.mark.parametrize(("p", "m"), [(2, 2), (4, 8), (5, 3)])
def test_p2p_latency_in_gpipe(p: int, m: int) -> None:
    """Each hop adds p2p once on the fill path and once on the drain path; the fwd-bwd bubble
    of stage i grows by 2 (p-i-1) p2p."""
    s, hop = gpipe(p, m), 0.25
    res = simulate(s, uniform(s, 1.0, 2.0, p2p_s=hop))
    assert res.iteration_s == pytest.approx((m + p - 1) * 3.0 + 2 * (p - 1) * hop)
    for i in range(p):
        assert _fwd_bwd_bubble(res, i) == pytest.approx((p - i - 1) * (3.0 + 2 * hop))


def test_single_rank_has_free_transfers_and_no_bubbles() -> None:
    s = interleaved(1, 3, 2)
    res = simulate(s, uniform(s, 1.0, 2.0, p2p_s=5.0))
    assert res.iteration_s == pytest.approx(3 * 2 * 3.0)
    assert res.bubbles == () and res.bubble_fraction == 0.0


def test_allreduce_and_optimizer_are_busy_and_others_wait_in_a_tail_bubble() -> None:
    s = gpipe(3, 4)
    res = simulate(s, uniform(s, allreduce_s=(0.5, 0.5, 6.0), optimizer_s=(0.25,) * 3))
    base = (4 + 3 - 1) * 3.0
    # Rank 2 (last stage) finishes its backwards first, at base - 2*2.0, then runs 6.25 s and
    # ends the iteration; rank 0 ends at base + 0.75 and waits in a type-A tail bubble.
    assert res.iteration_s == pytest.approx(base - 4.0 + 6.25)
    assert res.busy_s[0] == pytest.approx(4 * 3.0 + 0.75)
    tail = [b for b in res.bubbles if b.rank == 0][-1]
    assert tail.kind == "A"
    assert tail.start_s == pytest.approx(base + 0.75) and tail.duration_s == pytest.approx(1.5)
    assert [b for b in res.bubbles if b.rank == 2][-1].start_s < base  # its drain bubble only


# --- bubble kinds and memory --------------------------------------------------------------------


def test_gpipe_bubble_kinds() -> None:
    s = gpipe(4, 4)
    res = simulate(s, uniform(s))
    kinds = [[b.kind for b in res.bubbles if b.rank == r] for r in range(4)]
    # Rank 0: fwd-bwd only (it drains last). Middle ranks: fill, fwd-bwd, drain. Last: fill, drain.
    assert kinds == [["B"], ["A", "B", "A"], ["A", "B", "A"], ["A", "A"]]


def test_misaligned_forward_wait_is_type_c() -> None:
    s = interleaved(4, 2, 8)
    res = simulate(s, uniform(s, 0.5, 1.0))
    assert any(b.kind == "C" for b in res.bubbles)
    assert all(b.kind == "A" for b in res.bubbles if b.start_s == 0.0)


def test_free_memory_shrinks_while_activations_are_held() -> None:
    p, m = 4, 6
    s = gpipe(p, m)
    res = simulate(s, uniform(s))
    rank1 = [b for b in res.bubbles if b.rank == 1]
    start, middle = rank1[0], next(b for b in rank1 if b.kind == "B")
    assert start.start_s == 0.0 and start.free_bytes == CAPACITY - STATIC
    assert middle.free_bytes == CAPACITY - STATIC - m * ACT  # all m activations stashed
    assert middle.free_bytes < start.free_bytes
    assert res.peak_bytes == (STATIC + m * ACT,) * p
    f = one_f_one_b(p, m)
    assert simulate(f, uniform(f)).peak_bytes == tuple(STATIC + min(p - r, m) * ACT for r in range(p))


def test_free_memory_is_clamped_at_zero() -> None:
    s = gpipe(3, 8)
    res = simulate(s, uniform(s, capacity_bytes=STATIC + 3 * ACT))
    middle = next(b for b in res.bubbles if b.rank == 0 and b.kind == "B")
    assert middle.free_bytes == 0


# --- errors -------------------------------------------------------------------------------------


def test_deadlocked_schedule_raises() -> None:
    rank0 = "0F0 0SEND_F0 0RECV_B0 0B0 0F1 0SEND_F1 0RECV_B1 0B1 ALLREDUCE OPT"
    rank1 = "1RECV_F1 1F1 1B1 1SEND_B1 1RECV_F0 1F0 1B0 1SEND_B0 ALLREDUCE OPT"
    ranks = tuple(tuple(Action.parse(t) for t in row.split()) for row in (rank0, rank1))
    s = Schedule(kind="1f1b", p=2, v=1, m=2, ranks=ranks)
    with pytest.raises(ScheduleError, match=r"rank 0, step 3 \(0B0\).*rank 1, step 1 \(1F1\)"):
        simulate(s, uniform(s))


def test_cost_lengths_must_match_the_schedule() -> None:
    s = interleaved(2, 2, 2)
    with pytest.raises(ValueError, match=r"forward_s has 2 entries, schedule needs 4"):
        simulate(s, uniform(s, forward_s=(1.0, 1.0)))


def test_large_schedule_smoke() -> None:
    s = interleaved(16, 2, 64)
    res = simulate(s, uniform(s, 0.5, 1.0))
    assert res.bubble_fraction == pytest.approx(15 / (2 * 64 + 15), rel=0.01)


@pytest.mark.parametrize(
    ("field", "value"), [("forward_s", (1.0, -1.0)), ("backward_s", (math.nan, 1.0)), ("p2p_s", -0.1)]
)
def test_costs_must_be_non_negative(field: str, value: object) -> None:
    s = gpipe(2, 1)
    with pytest.raises(ValueError, match=f"SimCosts.{field} must be >= 0"):
        uniform(s, **{field: value})
