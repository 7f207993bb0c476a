from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from planner.partition import (NoFeasiblePartition, PartitionInput, brute_force_partition, partition)


@st.composite
def cases(draw):
    n = draw(st.integers(1, 9))
    k = draw(st.integers(1, n))
    floats = st.floats(0.0, 10.0, allow_nan=False)
    time_s = tuple(draw(st.lists(floats, min_size=n, max_size=n)))
    static = tuple(draw(st.lists(floats, min_size=n, max_size=n)))
    act = tuple(draw(st.lists(floats, min_size=n, max_size=n)))
    inflight = tuple(float(k - j) for j in range(k))  # 1F1B: stage j holds k - j microbatches
    cap = draw(st.floats(1.0, 80.0))
    return PartitionInput(time_s=time_s, static_bytes=static, activation_bytes=act, inflight=inflight,
                          cap_bytes=(cap,) * k)


@settings(max_examples=300, deadline=None)
@given(cases())
def test_partition_equals_brute_force(inp):
    expected = brute_force_partition(inp)
    if expected == float("inf"):
        with pytest.raises(NoFeasiblePartition):
            partition(inp)
        return
    got = partition(inp)
    assert got.bottleneck_s == pytest.approx(expected, abs=1e-9)
    assert got.bounds[0] == 0 and got.bounds[-1] == len(inp.time_s)
    assert all(a < b for a, b in zip(got.bounds, got.bounds[1:]))  # every stage non-empty
    assert all(m <= c + 1e-9 for m, c in zip(got.stage_bytes, inp.cap_bytes))


def test_uniform_units_split_evenly():
    inp = PartitionInput(time_s=(1.0,) * 12, static_bytes=(0.0,) * 12, activation_bytes=(0.0,) * 12,
                         inflight=(1.0,) * 4, cap_bytes=(1.0,) * 4)
    assert partition(inp).bounds == (0, 3, 6, 9, 12)


def test_memory_cap_moves_units_off_the_first_stage():
    # stage 0 holds 2 microbatches of activations, stage 1 one: stage 0 must take fewer units
    inp = PartitionInput(time_s=(1.0,) * 4, static_bytes=(0.0,) * 4, activation_bytes=(1.0,) * 4,
                         inflight=(2.0, 1.0), cap_bytes=(2.0, 3.0))
    assert partition(inp).bounds == (0, 1, 4)


@st.composite
def shared_ranks(draw):
    """Two ranks of two chunks each (stages 0, 2 on rank 0 and 1, 3 on rank 1, as loop placement puts them), each
    chunk holding its own count of microbatches at each of the rank's peaks, and a split to start from."""
    n = draw(st.integers(4, 10))
    floats = st.floats(0.0, 10.0, allow_nan=False)
    row = st.lists(floats, min_size=n, max_size=n)
    counts = st.tuples(st.integers(0, 6), st.integers(0, 6))
    peaks = [draw(st.lists(counts, min_size=1, max_size=3)) for _ in range(2)]
    cuts = sorted(draw(st.lists(st.integers(1, n - 1), min_size=3, max_size=3, unique=True)))
    inp = PartitionInput(time_s=tuple(draw(row)), static_bytes=tuple(draw(row)), activation_bytes=tuple(draw(row)),
                         inflight=(1.0,) * 4, cap_bytes=(1.0,) * 4)
    return inp, (0, *cuts, n), peaks, draw(st.floats(1.0, 200.0))


@settings(max_examples=200, deadline=None)
@given(shared_ranks())
def test_rebalance_never_makes_a_rank_fuller_or_the_slowest_slower(case):
    """partition.rebalance: from any split, the bytes over a rank's memory do not grow, and where they do not either,
    neither does the slowest stage, then the slowest rank; what it returns is a split into non-empty stages."""
    from planner.partition import _result, _stage_bytes, _stage_time, rank_load, rebalance

    inp, bounds, peaks, cap = case
    ranks = [(0, 2), (1, 3)]
    T = _stage_time(inp)
    load = rank_load(inp, ranks, peaks, cap)

    def key(b):
        times, over = zip(*(load(b, r) for r in range(2)))
        return sum(over), max(T(x, y) for x, y in zip(b, b[1:])), max(times)

    got = rebalance(inp, _result(bounds, T, _stage_bytes(inp)), ranks, peaks, cap).bounds
    assert got[0] == 0 and got[-1] == len(inp.time_s) and all(a < b for a, b in zip(got, got[1:]))
    before, after = key(bounds), key(got)
    assert after[0] <= before[0] + 1e-9 * cap
    if after[0] == pytest.approx(before[0], abs=1e-9 * cap):
        assert after[1:] <= tuple(x + 1e-9 for x in before[1:])


@st.composite
def recomputing(draw):
    """cases() with partial recomputation (the first `first` of each stage's recomputable units redo their forward)
    and, half the time, a split backward's weight bytes and time shares."""
    inp = draw(cases())
    n, k = len(inp.time_s), len(inp.inflight)
    floats = st.floats(0.0, 10.0, allow_nan=False)
    recomputable = tuple(sorted(draw(st.sets(st.integers(0, n - 1), min_size=1))))
    split = draw(st.booleans())
    return PartitionInput(time_s=inp.time_s, static_bytes=inp.static_bytes, activation_bytes=inp.activation_bytes,
                          inflight=inp.inflight, cap_bytes=inp.cap_bytes,
                          weight_bytes=tuple(draw(st.lists(floats, min_size=n, max_size=n))) if split else (),
                          w_pending=tuple(draw(st.lists(floats, min_size=k, max_size=k))) if split else (),
                          time_share=tuple(draw(st.lists(st.floats(0.1, 1.0), min_size=k, max_size=k)))
                          if split else (),
                          recompute_first=draw(st.integers(1, 3)), recomputable=recomputable,
                          recompute_time_s=tuple(draw(st.lists(floats, min_size=n, max_size=n))),
                          recompute_saves=tuple(min(a, s) for a, s in zip(
                              inp.activation_bytes, draw(st.lists(floats, min_size=n, max_size=n)))))


@settings(max_examples=300, deadline=None)
@given(recomputing())
def test_partial_recomputation_rows_are_the_segments_loop(inp):
    """partition's rows under partial recomputation (_recompute_stage, written out) pick what the loop over
    _segments' fits and time picks, to the bit."""
    from planner.partition import INF, _segments

    n, k = len(inp.time_s), len(inp.inflight)
    best = [[INF] * (n + 1) for _ in range(k + 1)]
    choice = [[-1] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    segment = _segments(inp)
    for j in range(1, k + 1):
        prev, row, pick = best[j - 1], best[j], choice[j]
        fits, Tj = segment(j - 1)
        lo = cross = j - 1
        for i in range(j, n - (k - j) + 1):
            ok = fits(lo, i)
            while not ok and lo < i - 1:
                lo += 1
                ok = fits(lo, i)
            if not ok:
                continue
            cross = max(cross, lo)
            while cross < i - 1 and prev[cross] < Tj(cross, i):
                cross += 1
            s, slowest = cross, max(prev[cross], Tj(cross, i))
            if cross > lo and (before := max(prev[cross - 1], Tj(cross - 1, i))) <= slowest:
                s, slowest = cross - 1, before
            row[i], pick[i] = slowest, s
    if best[k][n] == INF:
        with pytest.raises(NoFeasiblePartition):
            partition(inp)
        return
    bounds = [n]
    for j in range(k, 0, -1):
        bounds.append(choice[j][bounds[-1]])
    assert partition(inp).bounds == tuple(reversed(bounds))
