"""Split ordered units into contiguous stages, minimizing the slowest stage under memory caps.

Dynamic programming over (stages, units): best[j][i] is the smallest possible slowest-stage time
when the first i units form j stages. Stage j (0-based) of a candidate segment must fit its cap:
static bytes + inflight[j] x activation bytes <= cap[j] (in 1F1B stage j holds p - j microbatches).
Because best[j-1][s] never decreases in s while the last segment's time never increases, the optimal split
point is where the two cross; the smallest split whose segment fits and that crossing only move right as i grows,
so two pointers find them and a partition costs O(stages x units).
"""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from itertools import accumulate
from operator import itemgetter, mul
from typing import Sequence

__all__ = ["PartitionInput", "Partition", "partition", "brute_force_partition", "NoFeasiblePartition", "rank_load",
           "rebalance", "recomputed"]

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
    time_share: tuple[float, ...] = ()  # per stage: minimize the slowest stage's time over its share, not its time
    # (several stages on one rank: a rank's shares sum to at most 1, so no rank is slower than the optimum)

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


def _recompute_tables(inp: PartitionInput) -> tuple[list[int], list[float], list[float]] | None:
    """(stop, Rt, Rb): a stage from unit lo redoes its recomputable units before stop[lo] (the first
    `recompute_first` of them), and Rt / Rb are prefix sums over the units of the seconds partial recomputation
    adds and the bytes per microbatch it saves (0 for a unit it never redoes). None without it."""
    if not inp.recompute_first:
        return None
    n, R, first = len(inp.time_s), inp.recomputable, inp.recompute_first
    only = set(R)
    before = list(accumulate((i in only for i in range(n)), initial=0))  # recomputable units before index i
    stop = [R[before[lo] + first - 1] + 1 if before[lo] + first <= len(R) else n for lo in range(n + 1)]
    Rt = _prefix([inp.recompute_time_s[i] if i in only else 0.0 for i in range(n)])
    Rb = _prefix([inp.recompute_saves[i] if i in only else 0.0 for i in range(n)])
    return stop, Rt, Rb


def _recompute_sums(inp: PartitionInput):
    """(lo, hi) -> (seconds added, bytes per microbatch saved) by partial recomputation of stage lo..hi-1 in O(1)
    (None without partial recomputation)."""
    tables = _recompute_tables(inp)
    if tables is None:
        return None
    stop, Rt, Rb = tables

    def sums(lo: int, hi: int) -> tuple[float, float]:
        e = min(hi, stop[lo])
        return Rt[e] - Rt[lo], Rb[e] - Rb[lo]

    return sums


def _stage_parts(inp: PartitionInput):
    """(j, lo, hi) -> (bytes stage j holds whatever is in flight: static, and under a split backward what its pending
    weight gradients still hold (no W pending: none); bytes one microbatch of units lo..hi-1 keeps, less what partial
    recomputation frees)."""
    S, A = _prefix(inp.static_bytes), _prefix(inp.activation_bytes)
    Wb = _prefix(inp.weight_bytes) if inp.weight_bytes else [0.0] * len(S)
    pend = inp.w_pending if inp.weight_bytes else (0.0,) * len(inp.inflight)
    sums = _recompute_sums(inp)
    if sums is None:
        return lambda j, lo, hi: (S[hi] - S[lo] + pend[j] * (Wb[hi] - Wb[lo]), A[hi] - A[lo])
    return lambda j, lo, hi: (S[hi] - S[lo] + pend[j] * (Wb[hi] - Wb[lo]), A[hi] - A[lo] - sums(lo, hi)[1])


def _stage_bytes(inp: PartitionInput):
    """(j, lo, hi) -> bytes stage j holds with units lo..hi-1: static, activations in flight (less what partial
    recomputation frees), and under a split backward what the pending weight gradients still hold."""
    parts, fl = _stage_parts(inp), inp.inflight

    def held(j: int, lo: int, hi: int) -> float:
        fixed, act = parts(j, lo, hi)
        return fixed + fl[j] * act

    return held


def _stage_time(inp: PartitionInput):
    """(lo, hi) -> seconds of stage lo..hi-1 per microbatch, partial recomputation included. It never grows as the
    stage loses its first unit (the recomputation moves to a later unit of the same cost, or goes)."""
    T, sums = _prefix(inp.time_s), _recompute_sums(inp)
    if sums is None:
        return lambda lo, hi: T[hi] - T[lo]
    return lambda lo, hi: T[hi] - T[lo] + sums(lo, hi)[0]


def _segments(inp: PartitionInput):
    """j -> (fits(lo, hi): whether units lo..hi-1 fit stage j's cap; time(lo, hi): their seconds, over stage j's
    time share if any), each one flat call (the partition's inner loop makes O(stages x units) of them)."""
    S, A, T = _prefix(inp.static_bytes), _prefix(inp.activation_bytes), _prefix(inp.time_s)
    W = _prefix(inp.weight_bytes) if inp.weight_bytes else S
    tables = _recompute_tables(inp)

    def segment(j: int):
        w = inp.w_pending[j] if inp.weight_bytes else 0.0
        cap, fl, share = inp.cap_bytes[j], inp.inflight[j], 1 / inp.time_share[j] if inp.time_share else 1.0
        if tables is None:
            return (lambda lo, hi: S[hi] - S[lo] + w * (W[hi] - W[lo]) + fl * (A[hi] - A[lo]) <= cap,
                    lambda lo, hi: (T[hi] - T[lo]) * share)
        stop, Rt, Rb = tables

        def fits(lo: int, hi: int) -> bool:
            e = stop[lo] if stop[lo] < hi else hi
            return S[hi] - S[lo] + w * (W[hi] - W[lo]) + fl * (A[hi] - A[lo] - (Rb[e] - Rb[lo])) <= cap

        def time(lo: int, hi: int) -> float:
            e = stop[lo] if stop[lo] < hi else hi
            return (T[hi] - T[lo] + (Rt[e] - Rt[lo])) * share

        return fits, time

    return segment


def partition(inp: PartitionInput) -> Partition:
    n, k = len(inp.time_s), len(inp.inflight)
    best = [[INF] * (n + 1) for _ in range(k + 1)]
    choice = [[-1] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    # each row's loop with _segments' two tests written out (the search's hottest code: no calls)
    S = _prefix(inp.static_bytes)
    sums = (S, _prefix(inp.activation_bytes), _prefix(inp.time_s), _prefix(inp.weight_bytes) if inp.weight_bytes else S)
    tables = _recompute_tables(inp)
    for j in range(1, k + 1):
        if tables is None:
            _plain_stage(inp, sums, j, n, k, best[j - 1], best[j], choice[j])
        else:
            _recompute_stage(inp, sums, tables, j, n, k, best[j - 1], best[j], choice[j])
    if best[k][n] == INF:
        raise NoFeasiblePartition(f"no split of {n} units into {k} stages fits the memory caps")
    bounds = [n]
    for j in range(k, 0, -1):
        bounds.append(choice[j][bounds[-1]])
    bounds.reverse()
    return _result(tuple(bounds), _stage_time(inp), _stage_bytes(inp))


def _plain_stage(inp: PartitionInput, sums: tuple[list[float], ...], j: int, n: int, k: int, prev: list[float],
                 row: list[float], pick: list[int]) -> None:
    """partition's row j without partial recomputation: `_segments`' fits and time inlined, in the same arithmetic
    (`sums`: the prefix sums of static bytes, activation bytes, time and weight bytes, or static bytes again). Both
    pointers only move right as i grows: a longer segment fits from no earlier split, and its time crosses the rising
    prev no earlier."""
    S, A, T, W = sums
    w = inp.w_pending[j - 1] if inp.weight_bytes else 0.0
    cap, fl = inp.cap_bytes[j - 1], inp.inflight[j - 1]
    share = 1 / inp.time_share[j - 1] if inp.time_share else 1.0
    lo = cross = j - 1
    for i in range(j, n - (k - j) + 1):
        Si, Wi, Ai, Ti = S[i], W[i], A[i], T[i]
        ok = Si - S[lo] + w * (Wi - W[lo]) + fl * (Ai - A[lo]) <= cap
        while not ok and lo < i - 1:  # the smallest split whose segment fits
            lo += 1
            ok = Si - S[lo] + w * (Wi - W[lo]) + fl * (Ai - A[lo]) <= cap
        if not ok:
            continue
        # among splits s in [lo, i-1]: minimize max(prev[s], T(s, i)); prev rises, segment falls
        if cross < lo:
            cross = lo
        while cross < i - 1 and prev[cross] < (Ti - T[cross]) * share:  # the first s where prev[s] >= the segment
            cross += 1
        a, b = prev[cross], (Ti - T[cross]) * share
        s, slowest = cross, (a if a > b else b)
        if cross > lo:  # ties: the earlier
            a, b = prev[cross - 1], (Ti - T[cross - 1]) * share
            if (before := a if a > b else b) <= slowest:
                s, slowest = cross - 1, before
        row[i], pick[i] = slowest, s


def _recompute_stage(inp: PartitionInput, sums: tuple[list[float], ...],
                     tables: tuple[list[int], list[float], list[float]], j: int, n: int, k: int, prev: list[float],
                     row: list[float], pick: list[int]) -> None:
    """partition's row j under partial recomputation: `_segments`' fits and time (`tables`: _recompute_tables')
    inlined, in the same arithmetic (as _plain_stage)."""
    S, A, T, W = sums
    stop, Rt, Rb = tables
    w = inp.w_pending[j - 1] if inp.weight_bytes else 0.0
    cap, fl = inp.cap_bytes[j - 1], inp.inflight[j - 1]
    share = 1 / inp.time_share[j - 1] if inp.time_share else 1.0
    lo = cross = j - 1
    S_lo, A_lo, W_lo, Rb_lo, stop_lo = S[lo], A[lo], W[lo], Rb[lo], stop[lo]
    for i in range(j, n - (k - j) + 1):
        Si, Wi, Ai, Ti = S[i], W[i], A[i], T[i]
        ok = Si - S_lo + w * (Wi - W_lo) + fl * (Ai - A_lo - (Rb[stop_lo if stop_lo < i else i] - Rb_lo)) <= cap
        while not ok and lo < i - 1:  # the smallest split whose segment fits
            lo += 1
            S_lo, A_lo, W_lo, Rb_lo, stop_lo = S[lo], A[lo], W[lo], Rb[lo], stop[lo]
            ok = Si - S_lo + w * (Wi - W_lo) + fl * (Ai - A_lo - (Rb[stop_lo if stop_lo < i else i] - Rb_lo)) <= cap
        if not ok:
            continue
        # among splits s in [lo, i-1]: minimize max(prev[s], T(s, i)); prev rises, segment falls
        if cross < lo:
            cross = lo
        while cross < i - 1:  # the first s where prev[s] >= the segment
            e = stop[cross]
            if not prev[cross] < (Ti - T[cross] + (Rt[e if e < i else i] - Rt[cross])) * share:
                break
            cross += 1
        e = stop[cross]
        a, b = prev[cross], (Ti - T[cross] + (Rt[e if e < i else i] - Rt[cross])) * share
        s, slowest = cross, (a if a > b else b)
        if cross > lo:  # ties: the earlier
            e = stop[cross - 1]
            a, b = prev[cross - 1], (Ti - T[cross - 1] + (Rt[e if e < i else i] - Rt[cross - 1])) * share
            if (before := a if a > b else b) <= slowest:
                s, slowest = cross - 1, before
        row[i], pick[i] = slowest, s


def _result(bounds: tuple[int, ...], T, held) -> Partition:
    times = tuple(T(a, b) for a, b in zip(bounds, bounds[1:]))
    mem = tuple(held(j, a, b) for j, (a, b) in enumerate(zip(bounds, bounds[1:])))
    return Partition(bounds=bounds, stage_time_s=times, stage_bytes=mem)


def chunk_shares(n: int, static: float, act: float, ranks: Sequence[Sequence[int]],
                 peaks: Sequence[Sequence[Sequence[float]]], cap: float) -> tuple[tuple[float, ...], ...] | None:
    """Per stage (time share, memory cap, microbatches in flight) for `partition` when a rank's stages share its
    memory `cap`: how n units that each keep `static` bytes and `act` bytes per microbatch in flight are best
    spread over the ranks' chunks (chunk c of rank r holding peaks[r][i][c] microbatches at the rank's i-th
    possible peak). The least units U on the busiest rank for which the ranks hold all n, each rank filling the
    chunk whose peak grows least, then trimmed from the fullest ranks' dearest chunks; a stage's time share is its
    units over U and its cap its part of the rank's bytes at the binding peak. None if no spread fits."""
    def held(L: list[int], peak_of: Sequence[Sequence[float]]) -> tuple[float, Sequence[float]]:
        return max((static * sum(L) + act * sum(x * y for x, y in zip(pk, L)), pk) for pk in peak_of)

    def fill(r: int, most: int) -> list[int]:
        L = [1] * len(ranks[r])
        if held(L, peaks[r])[0] > cap:
            return []
        while sum(L) < most:  # as many as fit: each unit where the peak grows least
            grown = min((held(L[:c] + [L[c] + 1] + L[c + 1:], peaks[r])[0], c) for c in range(len(L)))
            if grown[0] > cap:
                break
            L[grown[1]] += 1
        total, k = sum(L), len(L)
        even = [total // k + (c >= k - total % k) for c in range(k)]  # then as evenly as fits (the schedule's
        while (peak := held(even, peaks[r]))[0] > cap:  # bubble is a chunk's), moving units to cheaper chunks
            pk = peak[1]
            dear = max((c for c in range(k) if even[c] > 1), key=lambda c: pk[c], default=None)
            cheap = min(range(k), key=lambda c: pk[c])
            if dear is None or pk[dear] <= pk[cheap]:
                return L
            even[dear] -= 1
            even[cheap] += 1
        return even

    v = len(ranks[0])
    most = [sum(fill(r, n)) for r in range(len(ranks))]  # the greedy to U is the greedy to n stopped at U
    if not all(most) or sum(most) < n:
        return None
    lo = next(u for u in range(-(-n // len(ranks)), n + 1) if sum(min(u, x) for x in most) >= n)
    counts = [fill(r, lo) for r in range(len(ranks))]
    for _ in range(sum(map(sum, counts)) - n):  # trim the fullest rank's chunk that holds the most microbatches
        r = max(range(len(ranks)), key=lambda r: (sum(counts[r]), held(counts[r], peaks[r])[0]))
        pk = held(counts[r], peaks[r])[1]
        c = max((c for c in range(v) if counts[r][c] > 1), key=lambda c: pk[c])
        counts[r][c] -= 1
    out = {}
    for r, js in enumerate(ranks):
        total, pk = held(counts[r], peaks[r])
        for c, j in enumerate(js):
            part = (static + act * pk[c]) * counts[r][c]
            out[j] = (counts[r][c] / lo, cap * part / total if total else cap / v, pk[c])
    return tuple(zip(*(out[j] for j in range(len(out)))))


def rank_load(inp: PartitionInput, ranks: Sequence[Sequence[int]], peaks: Sequence[Sequence[Sequence[float]]],
              cap: float):
    """(bounds, r) -> (seconds of rank r's stages `ranks[r]` per microbatch, bytes it holds over `cap`), its chunk c
    holding peaks[r][i][c] microbatches at its i-th possible peak."""
    T, parts, seen, stages = _stage_time(inp), _stage_parts(inp), {}, {}
    ends = [itemgetter(*(j + d for j in js for d in (0, 1))) for js in ranks]  # a rank's stages' bounds

    def load(bounds: Sequence[int], r: int) -> tuple[float, float]:
        key = (r, ends[r](bounds))
        got = seen.get(key)
        if got is None:  # the rank's stages' (seconds, fixed bytes, bytes per microbatch), each computed once
            time = fixed = 0.0
            acts = []
            for j in ranks[r]:
                lo, hi = bounds[j], bounds[j + 1]
                st = stages.get((j, lo, hi))
                if st is None:
                    st = stages[j, lo, hi] = (T(lo, hi), *parts(j, lo, hi))
                time, fixed = time + st[0], fixed + st[1]
                acts.append(st[2])
            over = fixed + max(sum(map(mul, peak, acts)) for peak in peaks[r]) - cap
            got = seen[key] = (time, over if over > 0.0 else 0.0)
        return got

    return load


def rebalance(inp: PartitionInput, part: Partition, ranks: Sequence[Sequence[int]],
              peaks: Sequence[Sequence[Sequence[float]]], cap: float) -> Partition:
    """`part` (optimal per stage, each under a cap of its own) repaired where a rank's chunks together hold more than
    `cap`, and its slowest rank (the sum of its stages, `ranks[r]`) made faster: chunk c of rank r holds
    peaks[r][i][c] microbatches at the rank's i-th possible peak. Moves one unit at a time from a stage of the rank
    most over `cap` (none over: of the slowest rank) to its neighbours, to the rank's other chunks, to the nearest
    stage on each side whose rank has room, or to the fastest rank's stages (the stages between shift by one unit)
    while the bytes over the caps, then the slowest stage's time (an interleaved pipeline fills and drains at its
    slowest stage), then the slowest rank's, then the sum of squared rank times fall."""
    T, load = _stage_time(inp), rank_load(inp, ranks, peaks, cap)
    owner = [0] * (len(part.bounds) - 1)
    for r, js in enumerate(ranks):
        for j in js:
            owner[j] = r

    def key(stage: list[float], times: list[float], over: list[float]) -> tuple[float, float, float, float]:
        return (round(sum(over) / cap, 9), max(stage), max(times),
                sum(t * t for t in times))  # bytes over to a billionth of the cap: not the sums' rounding

    bounds = list(part.bounds)
    stage = [T(a, b) for a, b in zip(bounds, bounds[1:])]
    times, over = map(list, zip(*(load(bounds, r) for r in range(len(ranks)))))
    now = key(stage, times, over)
    for _ in range(4 * len(owner)):
        src = max(range(len(ranks)), key=lambda r: (over[r], times[r]))
        fast = min(range(len(ranks)), key=times.__getitem__)
        best = None
        for s in ranks[src]:
            if bounds[s + 1] - bounds[s] < 2:
                continue
            near = [next((t for t in side if not over[owner[t]]), None)
                    for side in (range(s - 1, -1, -1), range(s + 1, len(owner)))]
            for t in {s - 1, s + 1, *ranks[src], *ranks[fast], *near} - {s, None, -1, len(owner)}:
                trial, lo, hi = bounds[:], min(s, t), max(s, t)  # stages lo..hi change
                for b in range(lo + 1, hi + 1):
                    trial[b] += 1 if t < s else -1
                new_s, new_t, new_o = stage[:], times[:], over[:]
                for j in range(lo, hi + 1):
                    new_s[j] = T(trial[j], trial[j + 1])
                for r in {owner[j] for j in range(lo, hi + 1)}:
                    new_t[r], new_o[r] = load(trial, r)
                k = key(new_s, new_t, new_o)
                if k < now and (best is None or k < best[0]):
                    best = (k, trial, new_s, new_t, new_o)
        if best is None:
            break
        now, bounds, stage, times, over = best
    return _result(tuple(bounds), T, _stage_bytes(inp))


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
