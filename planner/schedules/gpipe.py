"""GPipe (Huang et al. 2019): every forward, then every backward; all m microbatches in flight."""
from __future__ import annotations

from typing import Callable, Sequence

from planner.schedule_ir import Op, check_shape

from .base import ScheduleKind, register

_F, _B = Op.F, Op.B  # module constants: Enum attribute access is slow in hot loops

__all__ = ["compute", "KIND"]


def compute(p: int, m: int, v: int = 1) -> list[list[tuple[Op, int, int]]]:
    """All forwards, then all backwards (in microbatch order)."""
    check_shape(p, m)
    if v != 1:
        raise ValueError(f"schedule kind 'gpipe' has one chunk per rank; got v={v}")
    return [[(_F, r, mb) for mb in range(m)] + [(_B, r, mb) for mb in range(m)] for r in range(p)]


def flush_analytic_s(f_s: Sequence[float], b_s: Sequence[float], p: int, v: int, m: int, p2p: float,
                     w_s: Sequence[float] = ()) -> float:
    """Fill, m - 1 steady slots of the slowest stage, drain: one activation and one gradient hop per boundary."""
    stage = [f + b for f, b in zip(f_s, b_s)]
    return sum(stage) + (m - 1) * max(stage) + 2 * (p - 1) * p2p


def one_chunk(name: str) -> Callable[[int, int, int], str | None]:
    """The validity rule of a schedule with one model chunk per rank."""
    return lambda p, v, m: None if v == 1 else f"{name} runs one model chunk per rank"


KIND = register(ScheduleKind(
    name="gpipe", help="GPipe: all forwards, then all backwards (m microbatches in flight)",
    compute=compute, inflight=lambda p, v, m, rank: float(m), analytic_s=flush_analytic_s,
    check=one_chunk("gpipe"), v_choices=lambda p, max_v: (1,)))
