"""The sharding-rule registry (passes/sharding/): how a column-parallel projection's rows are dealt over the ranks,
and what registering a rule guarantees."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from passes.sharding import RULES, Rule, register, shard_rows, unregister


@st.composite
def layouts(draw):
    t = draw(st.sampled_from([1, 2, 4, 8]))
    heads = draw(st.lists(st.integers(1, 6), min_size=1, max_size=4))  # per segment, in units of t rows
    return t, tuple(h * t * draw(st.integers(1, 3)) for h in heads)


@settings(max_examples=60, deadline=None)
@given(layouts())
def test_every_row_of_a_segmented_projection_is_held_by_exactly_one_rank_its_share_of_each_segment(layout):
    t, segments = layout
    n = sum(segments)
    mine = [shard_rows(n, t, r, 1, segments) for r in range(t)]
    assert sorted(torch.cat(mine).tolist()) == list(range(n))  # a partition of the rows
    start = 0
    for size in segments:  # rank r: the r-th contiguous block of every segment, in segment order
        for r in range(t):
            block = torch.arange(start + r * size // t, start + (r + 1) * size // t)
            assert set(block.tolist()) <= set(mine[r].tolist())
        start += size
    assert all(len(m) == n // t for m in mine)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([1, 2, 4]), st.integers(1, 4), st.integers(1, 5))
def test_strided_groups_are_equal_segments(t, groups, per):
    n = groups * per * t
    for r in range(t):
        assert torch.equal(shard_rows(n, t, r, groups), shard_rows(n, t, r, 1, (n // groups,) * groups))


def test_one_op_has_one_rule():
    rule = Rule(("softmax",), lambda *a: None, "a second softmax rule")
    with pytest.raises(ValueError, match="already has a sharding rule"):
        register(rule)
    assert RULES["softmax"] is not rule
    unregister(rule)  # (not the registered one: nothing happens)
    assert "softmax" in RULES
