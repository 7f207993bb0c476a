"""Megatron's interleaved 1F1B (Narayanan et al. 2021, 2.2.2): v model chunks per rank, placed in a loop
(planner.schedule_ir.Placement); the bubble shrinks by v at the cost of v times the p2p messages."""
from __future__ import annotations

from functools import lru_cache
from itertools import chain, combinations, product
from operator import ge
from typing import Sequence

from planner.schedule_ir import Op, check_shape, one_f_one_b_order, placement_of

from .base import ScheduleKind, register
from .one_f_one_b import inflight as one_f_one_b_inflight

_F, _B = Op.F, Op.B  # module constants: Enum attribute access is slow in hot loops

__all__ = ["compute", "KIND"]


@lru_cache(maxsize=4096)
def group_size(p: int, m: int) -> int | None:
    """Microbatches a model chunk runs back to back (Megatron-Core's microbatch_group_size_per_vp_stage): p
    when p divides m, else the smallest g in [p, m] whose last group m % g is empty or at least p (a shorter
    one stalls the pipeline; Megatron-Core refuses it). None when there is none (m < p)."""
    return next((g for g in range(p, m + 1) if m % g == 0 or m % g >= p), None)


def _warmup(r: int, p: int, v: int, m: int) -> int:
    """Forwards rank r runs before its first backward (Megatron's interleaved schedule)."""
    if m == p:
        return m * v  # Megatron runs all forwards first when m == p
    return min((p - r - 1) * 2 + (v - 1) * group_size(p, m), m * v)


def _order(r: int, p: int, v: int, m: int) -> list[tuple[Op, int, int]]:
    g = group_size(p, m)
    groups = [range(s, min(s + g, m)) for s in range(0, m, g)]
    chunks = placement_of("loop", p, v).stages(r)
    fwd = [(_F, chunks[c], mb) for grp in groups for c in range(v) for mb in grp]
    bwd = [(_B, chunks[c], mb) for grp in groups for c in reversed(range(v)) for mb in grp]
    warmup = _warmup(r, p, v, m)
    steady = m * v - warmup
    order = fwd[:warmup]
    for i in range(steady):
        order.append(fwd[warmup + i])
        order.append(bwd[i])
    order.extend(bwd[steady:])
    return order


def compute(p: int, m: int, v: int = 1) -> list[list[tuple[Op, int, int]]]:
    """Megatron interleaved 1F1B with v chunks per rank, each running its microbatches in groups of
    `group_size(p, m)` (p when p divides m).

    With v == 1 this is plain 1F1B (Megatron only interleaves when v > 1).
    """
    check_shape(p, m, v)
    why = _check(p, v, m)
    if why is not None:
        raise ValueError(f"interleaved schedule with p={p} m={m}: {why}")
    order = one_f_one_b_order if v == 1 else _order
    return [order(r, p, v, m) for r in range(p)]


def _check(p: int, v: int, m: int) -> str | None:
    if v == 1 or group_size(p, m) is not None:
        return None
    return "interleaving needs at least p microbatches"


def inflight(p: int, v: int, m: int, rank: int) -> float:
    """Model chunks in flight at the rank's peak, divided by v: the warm-up forwards and the first steady
    one, as the generated order runs them (all m*v forwards first when m == p)."""
    if v == 1:
        return one_f_one_b_inflight(p, v, m, rank)
    return min(_warmup(rank, p, v, m) + 1, m * v) / v


@lru_cache(maxsize=4096)
def chunk_peaks(p: int, v: int, m: int, rank: int) -> tuple[tuple[float, ...], ...]:
    """Forwards each of the rank's chunks has run and not yet run the backward of, right after each forward of
    the order (the moments the rank's memory can peak): those whose bytes, for some bytes per microbatch of each
    chunk, no other moment's exceed (_maximizers: a rank's memory is the most over these of the sum of each chunk's
    count times its bytes). The chunks do not hold alike: Megatron's warm-up runs chunk 0's groups first, so at
    p=8 v=4 m=128 rank 0's first chunk holds 15 microbatches and the others 8 each."""
    if v == 1:
        return ((one_f_one_b_inflight(p, v, m, rank),),)
    local = {s: c for c, s in enumerate(placement_of("loop", p, v).stages(rank))}
    live, seen = [0] * v, set()
    for op, stage, _ in _order(rank, p, v, m):
        live[local[stage]] += 1 if op is _F else -1
        if op is _F:
            seen.add(tuple(live))
    top: list[tuple[int, ...]] = []  # the states no other one dominates: in descending order a state's dominators
    for a in sorted(seen, reverse=True):  # come before it, and one of those kept dominates it too (the latest kept,
        if not any(all(map(ge, b, a)) for b in reversed(top)):  # the nearest, tried first)
            top.append(a)
    return tuple(tuple(float(x) for x in a) for a in _maximizers(sorted(top)))


def _maximizers(points: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The points not at most (in every coordinate) a mix of two others: dropping them changes no maximum of a
    weighted sum with weights >= 0 (each such maximum is reached by a point that is its only maximizer for nearby
    weights, which no mix of others reaches). Of p=16 v=3 m=256's 17 non-dominated states 3 remain; a middle point
    of a run of states is a mix of its sorted neighbours, which are tried first."""
    def under_mix(q: tuple[int, ...], a: tuple[int, ...], b: tuple[int, ...]) -> bool:
        lo, hi = 0.0, 1.0  # q <= t*a + (1-t)*b for some t in [lo, hi]; lo only rises and hi only falls
        for x, y, z in zip(q, a, b):
            if y > z:
                if (t := (x - z) / (y - z)) > lo:
                    if t > hi:
                        return False
                    lo = t
            elif y < z:
                if (t := (z - x) / (z - y)) < hi:
                    if t < lo:
                        return False
                    hi = t
            elif x > y:
                return False
        return True

    keep = []
    full = (1 << len(points[0])) - 1 if points else 0
    for i, q in enumerate(points):
        if 0 < i < len(points) - 1 and under_mix(q, points[i - 1], points[i + 1]):
            continue
        # a mix of a and b reaches q only where one of them does in every coordinate: a bit per coordinate, the
        # others grouped by theirs, and only the pairs whose bits cover all are tried (the earlier point first)
        groups: dict[int, list[tuple[int, tuple[int, ...]]]] = {}
        for j, a in enumerate(points):
            if j != i:
                groups.setdefault(sum(1 << k for k, y in enumerate(map(ge, a, q)) if y), []).append((j, a))
        masks = list(groups)
        pairs = chain.from_iterable(
            combinations(groups[u], 2) if u == w else
            ((x, y) if x[0] < y[0] else (y, x) for x, y in product(groups[u], groups[w]))
            for n, u in enumerate(masks) for w in masks[n:] if u | w == full)
        if not any(under_mix(q, a, b) for (_, a), (_, b) in pairs):
            keep.append(q)
    return keep


def analytic_s(f_s: Sequence[float], b_s: Sequence[float], p: int, v: int, m: int, p2p: float,
               w_s: Sequence[float] = ()) -> float:
    """m microbatches through the slowest rank, plus a fill/drain shortened v times; every chunk
    boundary is a hop. (Groups longer than p stall a little more; the simulation has it exactly.)"""
    k, place = p * v, placement_of("loop", p, v)
    slowest = max(sum(f_s[j] + b_s[j] for j in place.stages(r)) for r in range(p))
    return m * slowest + (p - 1) * slowest / v + 2 * (k - 1) * p2p


KIND = register(ScheduleKind(
    name="interleaved", help="Megatron interleaved 1F1B: v model chunks per rank, bubble / v",
    compute=compute, inflight=inflight, chunk_peaks=chunk_peaks, analytic_s=analytic_s,
    check=lambda p, v, m: _check(p, v, m),
    v_choices=lambda p, max_v: range(2, max_v + 1) if p > 1 else ()))
