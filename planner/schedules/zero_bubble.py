"""Zero-bubble schedules (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"): each backward splits into I (the
gradient of the stage's input, which the previous stage waits for) and W (the weights' gradient, which nobody
waits for), and the W steps fill what would be bubbles.

- ZB-H1 (section 2.1; torch's ``ScheduleInterleavedZeroBubble``, its ZB1P, with one stage per rank): 1F1B's
  warm-up and memory, rank r delays its W steps by r microbatches; bubble (p-1)(T_F + T_I - T_W), a third of
  1F1B's (p-1)(T_F + T_I + T_W) when the three are equal.
- ZB-V (section 6; torch's ``ScheduleZBVZeroBubble``): two chunks per rank in a V placement (rank r holds stages
  r and 2p-1-r), 1F1B's peak memory, no bubble when T_F = T_I = T_W.
"""
from __future__ import annotations

from typing import Sequence

from planner.schedule_ir import Op, check_shape, placement_of

from .base import ScheduleKind, register
from .gpipe import one_chunk

_F, _I, _W = Op.F, Op.I, Op.W

__all__ = ["zbh1_compute", "zbv_compute", "ZBH1", "ZBV"]


def zbh1_compute(p: int, m: int, v: int = 1) -> list[list[tuple[Op, int, int]]]:
    """Rank r: min(p-1-r, m) warm-up forwards, then F and I alternate, each I followed by the W of the
    microbatch r steps older; the W steps left over close the iteration (torch's ZB1P at one chunk)."""
    check_shape(p, m)
    if v != 1:
        raise ValueError(f"schedule kind 'zbh1' has one chunk per rank; got v={v}")
    out = []
    for r in range(p):
        warmup = min(p - 1 - r, m)
        order = [(_F, r, mb) for mb in range(warmup)]
        w = 0
        for i in range(m):  # the i-th I; a forward runs before it while forwards remain
            if warmup + i < m:
                order.append((_F, r, warmup + i))
            order.append((_I, r, i))
            if i >= r:
                order.append((_W, r, w))
                w += 1
        order.extend((_W, r, mb) for mb in range(w, m))
        out.append(order)
    return out


def zbv_compute(p: int, m: int, v: int = 2) -> list[list[tuple[Op, int, int]]]:
    """ZB-V as torch's ScheduleZBVZeroBubble builds it: chunk 0 (stage r) warms up with 2(p-r)-1 forwards,
    then the two chunks' forwards interleave, chunk 1 (stage 2p-1-r) starts its F-I-W steps, the steady state
    runs F, I, W of each chunk in turn, and the cool-down drains the I steps before the W steps left over."""
    check_shape(p, m, v)
    if v != 2:
        raise ValueError(f"schedule kind 'zbv' runs two chunks per rank; got v={v}")
    n = max(2 * p - 1, m)  # torch fills the V with at least 2p-1 microbatches, then drops the ones past m
    out = []
    for r in range(p):
        c0, c1 = placement_of("v", p, 2).stages(r)
        cnt = {(op, k): 0 for op in (_F, _I, _W) for k in (c0, c1)}
        order: list[tuple[Op, int, int]] = []

        def step(*actions: tuple[Op, int]) -> None:
            for op, stage in actions:
                order.append((op, stage, cnt[op, stage]))
                cnt[op, stage] += 1

        f0, i0, w0, f1, i1, w1 = (_F, c0), (_I, c0), (_W, c0), (_F, c1), (_I, c1), (_W, c1)
        for _ in range(2 * (p - r) - 1):
            step(f0)
        for _ in range(r):
            step(f1, f0)
        for _ in range(p - r):
            step(f1, i1, w1)
        while cnt[f1] < cnt[f0] or cnt[f0] < n:
            if cnt[f0] < n:
                step(f0)
            step(i0, w0, f1, i1, w1)
        for _ in range(r):
            step(i0, i1)
        for _ in range(p - r):
            step(i0, w0)
        while cnt[w1] < cnt[i1]:
            step(w1)
        while cnt[w0] < cnt[i0]:
            step(w0)
        out.append([a for a in order if a[2] < m])
    return out


def _split_s(work: float, f_s: Sequence[float], b_s: Sequence[float], w_s: Sequence[float], p: int, m: int,
             fill: int, hops: int, p2p: float) -> float:
    """m microbatches of the busiest work, a bubble of (p-1)(T_F + T_I - fill T_W) (never below zero: W cannot
    fill more than the bubble), and `hops` activation and gradient hops."""
    f, b, w = (max(x) for x in (f_s, b_s, w_s or (0.0,) * len(f_s)))
    return m * work + (p - 1) * max(0.0, f + (b - w) - fill * w) + 2 * hops * p2p


def zbh1_analytic_s(f_s: Sequence[float], b_s: Sequence[float], p: int, v: int, m: int, p2p: float,
                    w_s: Sequence[float] = ()) -> float:
    """The slowest stage's m microbatches plus the paper's bubble (p-1)(T_F + T_I - T_W); a hop per boundary."""
    return _split_s(max(f + b for f, b in zip(f_s, b_s)), f_s, b_s, w_s, p, m, 1, p - 1, p2p)


def zbv_analytic_s(f_s: Sequence[float], b_s: Sequence[float], p: int, v: int, m: int, p2p: float,
                   w_s: Sequence[float] = ()) -> float:
    """Each rank runs its two chunks' m microbatches; the V's fill and drain cost about (p-1)(T_F + T_I - 2 T_W)
    (zero when the three are equal, section 6), plus a hop per boundary that crosses ranks (2p-2 of the 2p-1)."""
    place = placement_of("v", p, 2)
    work = max(sum(f_s[j] + b_s[j] for j in place.stages(r)) for r in range(p))
    return _split_s(work, f_s, b_s, w_s, p, m, 2, 2 * p - 2, p2p)


def _zbh1_inflight(p: int, v: int, m: int, rank: int) -> float:
    return float(min(p - rank, m))


def _zbh1_pending(p: int, v: int, m: int, rank: int) -> float:
    return float(max(0, min(rank, m - (p - rank))))


def _pipelined(name: str, p: int) -> str | None:
    # a zero-bubble schedule removes the pipeline's bubbles (its W steps run where 1F1B would wait): none at p = 1
    return None if p > 1 else f"{name} needs p > 1: it removes pipeline bubbles, and one stage has none"


def _zbv_check(p: int, v: int, m: int) -> str | None:
    if v != 2:
        return "zbv runs two chunks per rank"
    if m < 2 * p - 1:  # torch pads the V with idle microbatches; the bubble it meant to remove stays
        return "zbv needs at least 2p-1 microbatches to fill its V"
    return _pipelined("zbv", p)


ZBH1 = register(ScheduleKind(
    name="zbh1", help="ZB-H1 zero bubble: backward split into I and W, W delayed into 1F1B's bubbles (1F1B's memory)",
    compute=zbh1_compute, inflight=_zbh1_inflight, w_pending=_zbh1_pending, analytic_s=zbh1_analytic_s,
    check=lambda p, v, m: one_chunk("zbh1")(p, v, m) or _pipelined("zbh1", p), v_choices=lambda p, max_v: (1,),
    split_backward=True))

ZBV = register(ScheduleKind(
    name="zbv", help="ZB-V zero bubble: two chunks per rank in a V, backward split into I and W",
    compute=zbv_compute, inflight=lambda p, v, m, rank: float(p), analytic_s=zbv_analytic_s, check=_zbv_check,
    v_choices=lambda p, max_v: (2,) if p > 1 and max_v >= 2 else (), placement="v", split_backward=True))
