"""Bubble characterization finds a planted bubble (a known idle time) within 20%."""
from __future__ import annotations

import time

import pytest

from planner.characterize import characterize


@pytest.mark.parametrize("planted", [0.05, 0.2])
def test_finds_a_planted_bubble_in_a_real_timed_step(planted):
    """The step waits `planted` seconds for a peer's message (the bubble) while fill work runs for
    `wait` seconds, then computes: fill is free until it outlasts the bubble — the shape of a
    pipeline rank waiting for a gradient."""
    def step(wait: float) -> float:
        start = time.perf_counter()
        time.sleep(max(wait, planted))  # the rank resumes when both the message and the fill are done
        sum(range(20_000))  # the compute after the bubble
        return time.perf_counter() - start

    found = characterize(step, start_s=0.002, min_slowdown_s=0.006, tolerance=0.01, refine=6,
                         repeats=5)
    assert found.duration_s == pytest.approx(planted, rel=0.2)
    waits = [w for w, _ in found.probes[1:4]]
    assert waits == [0.002, 0.004, 0.008]  # doubling first


def test_exact_on_a_noiseless_step():
    planted = 0.3
    found = characterize(lambda wait: 1.0 + max(0.0, wait - planted), start_s=0.01, tolerance=0.0,
                         min_slowdown_s=1e-9, refine=12)
    assert found.duration_s == pytest.approx(planted, rel=0.01)


def test_no_bubble_means_zero():
    found = characterize(lambda wait: 1.0 + wait, start_s=0.01, tolerance=0.0, min_slowdown_s=1e-3)
    assert found.duration_s <= 1e-3  # nothing beyond the detection threshold
