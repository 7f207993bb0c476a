"""Split ordered units into contiguous stages, minimizing the slowest stage under memory caps.

Dynamic programming over (stages, units): best[j][i] is the smallest possible slowest-stage time
when the first i units form j stages. Stage j (0-based) of a candidate segment must fit its cap:
static bytes + inflight[j] x activation bytes <= cap[j] (in 1F1B stage j holds p - j microbatches).
Because best[j-1][k] never decreases in k while the last segment's time never increases, the
optimal split point is found by bisection, so a partition costs O(stages x units x log units).
"""
from __future__ import annotations

from dataclasses import dataclass
from bisect import bisect_left
from itertools import accumulate
from typing import Sequence

__all__ = ["PartitionInput", "Partition", "partition", "brute_force_partition", "NoFeasiblePartition", "recomputed"]

INF = float("inf")


class NoFeasiblePartition(ValueError):
    """No contiguous split satisfies every stage's memory cap."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PartitionInput:
    time_s: tuple[float, ...]  # per unit, forward + backward per microbatch
    static_bytes: tuple[float, ...]  # per unit: weights + grads + optimizer state
    activation_bytes: tuple[float, ...]  # per unit, per microbatch in flight
    inflight: tuple[float, ...]  # per stage: microbatches whose activations the stage holds
    cap_bytes: tuple[float, ...]  # per stage: memory available for static + activations
    weight_bytes: tuple[float, ...] = ()  # per unit: what a microbatch holds from its I step to its W (split backward)
    w_pending: tuple[float, ...] = ()  # per stage: microbatches whose W is pending at the peak
    recompute_first: int = 0  # partial recomputation: the first this many of each stage's `recomputable` units redo
    # their forward in the backward, taking `recompute_time_s` more and holding `recompute_saves` fewer bytes each
    recomputable: tuple[int, ...] = ()  # ascending unit indices (the blocks)
    recompute_time_s: tuple[float, ...] = ()  # per unit
    recompute_saves: tuple[float, ...] = ()  # per unit, per microbatch in flight

    def __post_init__(self) -> None:
        n = len(self.time_s)
        if not (len(self.static_bytes) == len(self.activation_bytes) == n):
            raise ValueError("time_s, static_bytes and activation_bytes need one entry per unit")
        if len(self.inflight) != len(self.cap_bytes):
            raise ValueError("inflight and cap_bytes need one entry per stage")
        if len(self.inflight) > n:
            raise ValueError(f"{len(self.inflight)} stages cannot be made from {n} units")
        if self.weight_bytes and (len(self.weight_bytes) != n or len(self.w_pending) != len(self.inflight)):
            raise ValueError("weight_bytes needs one entry per unit and w_pending one per stage")


@dataclass(frozen=True, kw_only=True, slots=True)
class Partition:
    bounds: tuple[int, ...]  # stage j holds units bounds[j] .. bounds[j+1]-1; len = stages + 1
    stage_time_s: tuple[float, ...]
    stage_bytes: tuple[float, ...]

    @property
    def bottleneck_s(self) -> float:
        return max(self.stage_time_s)

    def stages(self) -> list[range]:
        return [range(a, b) for a, b in zip(self.bounds, self.bounds[1:])]


def _prefix(xs: Sequence[float]) -> list[float]:
    return [0.0, *accumulate(xs)]


def recomputed(recomputable: Sequence[int], n: int, lo: int, hi: int) -> Sequence[int]:
    """The units of stage lo..hi-1 that partial recomputation redoes: its first n of the (ascending) recomputable."""
    first = bisect_left(recomputable, lo)
    return recomputable[first:min(first + n, bisect_left(recomputable, hi))]


def _recompute_sums(inp: PartitionInput):
    """(lo, hi) -> (seconds added, bytes per microbatch saved) by partial recomputation of stage lo..hi-1 in O(1)
    (None without partial recomputation)."""
    if not inp.recompute_first:
        return None
    R, first = inp.recomputable, inp.recompute_first
    before = [0] * (len(inp.time_s) + 1)  # recomputable units before index i
    for i in R:
        before[i + 1] = 1
    before = list(accumulate(before))
    Rt = _prefix([inp.recompute_time_s[i] for i in R])
    Rb = _prefix([inp.recompute_saves[i] for i in R])

    def sums(lo: int, hi: int) -> tuple[float, float]:
        a = before[lo]
        b = min(a + first, before[hi])
        return Rt[b] - Rt[a], Rb[b] - Rb[a]

    return sums


def _stage_bytes(inp: PartitionInput):
    """(j, lo, hi) -> bytes stage j holds with units lo..hi-1: static, activations in flight (less what partial
    recomputation frees), and under a split backward what the pending weight gradients still hold (no W pending:
    zeros)."""
    S, A, fl = _prefix(inp.static_bytes), _prefix(inp.activation_bytes), inp.inflight
    Wb = _prefix(inp.weight_bytes) if inp.weight_bytes else [0.0] * len(S)
    pend = inp.w_pending if inp.weight_bytes else (0.0,) * len(fl)
    sums = _recompute_sums(inp)
    if sums is None:
        return lambda j, lo, hi: S[hi] - S[lo] + fl[j] * (A[hi] - A[lo]) + pend[j] * (Wb[hi] - Wb[lo])
    return lambda j, lo, hi: (S[hi] - S[lo] + fl[j] * (A[hi] - A[lo] - sums(lo, hi)[1])
                              + pend[j] * (Wb[hi] - Wb[lo]))


def _stage_time(inp: PartitionInput):
    """(lo, hi) -> seconds of stage lo..hi-1 per microbatch, partial recomputation included. It never grows as the
    stage loses its first unit (the recomputation moves to a later unit of the same cost, or goes)."""
    T, sums = _prefix(inp.time_s), _recompute_sums(inp)
    if sums is None:
        return lambda lo, hi: T[hi] - T[lo]
    return lambda lo, hi: T[hi] - T[lo] + sums(lo, hi)[0]


def partition(inp: PartitionInput) -> Partition:
    n, k = len(inp.time_s), len(inp.inflight)
    T = _stage_time(inp)
    held, cap = _stage_bytes(inp), inp.cap_bytes

    def fits(j: int, lo: int, hi: int) -> bool:
        return held(j, lo, hi) <= cap[j]

    best = [[INF] * (n + 1) for _ in range(k + 1)]
    choice = [[-1] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for j in range(1, k + 1):
        prev, row = best[j - 1], best[j]
        for i in range(j, n - (k - j) + 1):
            lo = _first_fitting(fits, j - 1, i, j - 1)  # smallest split k whose segment fits
            if lo is None:
                continue
            # among splits s in [lo, i-1]: minimize max(prev[s], T(s, i)); prev rises, segment falls
            s = _crossing(prev, T, lo, i)
            row[i], choice[j][i] = max(prev[s], T(s, i)), s
    if best[k][n] == INF:
        raise NoFeasiblePartition(f"no split of {n} units into {k} stages fits the memory caps")
    bounds = [n]
    for j in range(k, 0, -1):
        bounds.append(choice[j][bounds[-1]])
    bounds.reverse()
    return _result(tuple(bounds), T, held)


def _first_fitting(fits, j: int, i: int, min_split: int) -> int | None:
    """Smallest s in [min_split, i-1] with units s..i-1 fitting stage j (segments shrink as s grows)."""
    lo, hi = min_split, i - 1
    if not fits(j, hi, i):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(j, mid, i):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _crossing(prev: list[float], T, lo: int, i: int) -> int:
    """argmin over s in [lo, i-1] of max(prev[s], T(s, i))."""
    a, b = lo, i - 1
    while a < b:  # first s where prev[s] >= segment time
        mid = (a + b) // 2
        if prev[mid] >= T(mid, i):
            b = mid
        else:
            a = mid + 1
    cands = [s for s in (a - 1, a) if lo <= s <= i - 1]
    return min(cands, key=lambda s: (max(prev[s], T(s, i)), s))


def _result(bounds: tuple[int, ...], T, held) -> Partition:
    times = tuple(T(a, b) for a, b in zip(bounds, bounds[1:]))
    mem = tuple(held(j, a, b) for j, (a, b) in enumerate(zip(bounds, bounds[1:])))
    return Partition(bounds=bounds, stage_time_s=times, stage_bytes=mem)


def brute_force_partition(inp: PartitionInput) -> float:
    """Slowest-stage time of the best feasible split by enumerating every split (tests only)."""
    from itertools import combinations

    n, k = len(inp.time_s), len(inp.inflight)
    T, held = _stage_time(inp), _stage_bytes(inp)
    best = INF
    for cuts in combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        segs = list(zip(bounds, bounds[1:]))
        if all(held(j, a, b) <= inp.cap_bytes[j] for j, (a, b) in enumerate(segs)):
            best = min(best, max(T(a, b) for a, b in segs))
    return best
