"""Bubble characterization as PipeFill 4.2 does it: occupy the device inside a bubble for a
growing (doubling) time until the main job's step time rises; the largest harmless wait is the
bubble's measured duration (then refined by bisection between the last harmless and first
harmful wait).

`characterize(step, ...)` takes `step(wait_s) -> step time` — in the runtime, one training step
with `wait_s` of busy waiting inserted at the bubble's BUBBLE action — and needs nothing else.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

__all__ = ["Characterization", "characterize"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Characterization:
    duration_s: float  # largest wait that did not slow the step
    baseline_s: float  # step time with no wait
    probes: tuple[tuple[float, float], ...]  # (wait, step time) in the order tried


def characterize(step: Callable[[float], float], *, start_s: float = 1e-3, max_s: float = 10.0,
                 tolerance: float = 0.05, min_slowdown_s: float = 2e-3, repeats: int = 3,
                 refine: int = 4) -> Characterization:
    """A wait is harmful when the step takes longer than the baseline by both `tolerance` (relative)
    and `min_slowdown_s` (absolute). Each probe is the fastest of `repeats` steps: interference from
    the rest of the machine only ever adds time, so the minimum is the steadiest estimate."""
    probes: list[tuple[float, float]] = []

    def timed(wait: float) -> float:
        t = min(step(wait) for _ in range(repeats))
        probes.append((wait, t))
        return t

    base = timed(0.0)
    limit = base + max(tolerance * base, min_slowdown_s)
    harmless, wait = 0.0, start_s
    while wait <= max_s and timed(wait) <= limit:
        harmless, wait = wait, wait * 2
    harmful = min(wait, max_s)
    for _ in range(refine):  # bisection between the last harmless and the first harmful wait
        mid = (harmless + harmful) / 2
        if timed(mid) <= limit:
            harmless = mid
        else:
            harmful = mid
    return Characterization(duration_s=harmless, baseline_s=base, probes=tuple(probes))
