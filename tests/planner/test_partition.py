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
