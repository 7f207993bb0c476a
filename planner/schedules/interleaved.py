"""Megatron's interleaved 1F1B (Narayanan et al. 2021, 2.2.2): v model chunks per rank, virtual
stage k on rank k % p; the bubble shrinks by v at the cost of v times the p2p messages."""
from __future__ import annotations

from typing import Sequence

from planner.schedule import Op, Schedule, check_shape, one_f_one_b_order, with_comm, gc_paused

from .base import ScheduleKind, register
from .one_f_one_b import inflight as one_f_one_b_inflight

_F, _B = Op.F, Op.B  # module constants: Enum attribute access is slow in hot loops

__all__ = ["generate", "KIND"]


def _virtual(k: int, r: int, p: int, v: int, forward: bool) -> tuple[int, int]:
    """(stage, mb) of rank r's k-th forward (or backward) in Megatron's interleaved order."""
    in_group = k % (p * v)
    chunk = in_group // p
    if not forward:
        chunk = v - 1 - chunk
    return chunk * p + r, (k // (p * v)) * p + k % p


def _warmup(r: int, p: int, v: int, m: int) -> int:
    """Forwards rank r runs before its first backward (Megatron's interleaved schedule)."""
    if m == p:
        return m * v  # Megatron runs all forwards first when m == p
    return min((p - r - 1) * 2 + (v - 1) * p, m * v)


def _order(r: int, p: int, v: int, m: int) -> list[tuple[Op, int, int]]:
    total = m * v
    warmup = _warmup(r, p, v, m)
    fwd = [(_F, *_virtual(k, r, p, v, True)) for k in range(total)]
    bwd = [(_B, *_virtual(k, r, p, v, False)) for k in range(total)]
    steady = total - warmup
    order = fwd[:warmup]
    for i in range(steady):
        order.append(fwd[warmup + i])
        order.append(bwd[i])
    order.extend(bwd[steady:])
    return order


def generate(p: int, m: int, v: int = 1) -> Schedule:
    """Megatron interleaved 1F1B with v chunks per rank; m must be a multiple of p.

    With v == 1 this is plain 1F1B (Megatron only interleaves when v > 1).
    """
    check_shape(p, m, v)
    if m % p != 0:
        raise ValueError(
            f"interleaved schedule needs m to be a multiple of p: m={m} is not divisible by p={p}"
        )
    last = p * v - 1
    order = one_f_one_b_order if v == 1 else _order
    with gc_paused():
        ranks = tuple(with_comm(order(r, p, v, m), last) for r in range(p))
    return Schedule(kind="interleaved", p=p, v=v, m=m, ranks=ranks)


def inflight(p: int, v: int, m: int, rank: int) -> float:
    """Model chunks in flight at the rank's peak, divided by v: the warm-up forwards and the first steady
    one, as the generated order runs them (all m*v forwards first when m == p)."""
    if v == 1:
        return one_f_one_b_inflight(p, v, m, rank)
    return min(_warmup(rank, p, v, m) + 1, m * v) / v


def analytic_s(f_s: Sequence[float], b_s: Sequence[float], p: int, v: int, m: int, p2p: float) -> float:
    """m microbatches through the slowest rank, plus a fill/drain shortened v times; every chunk
    boundary is a hop."""
    k = p * v
    slowest = max(sum(f_s[j] + b_s[j] for j in range(r, k, p)) for r in range(p))
    return m * slowest + (p - 1) * slowest / v + 2 * (k - 1) * p2p


KIND = register(ScheduleKind(
    name="interleaved", help="Megatron interleaved 1F1B: v model chunks per rank, bubble / v",
    generate=generate, inflight=inflight, analytic_s=analytic_s,
    check=lambda p, v, m: None if m % p == 0 else "interleaving needs m divisible by p",
    v_choices=lambda p, max_v: range(2, max_v + 1) if p > 1 else ()))
