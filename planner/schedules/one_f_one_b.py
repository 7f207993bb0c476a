"""1F1B / PipeDream-Flush (Narayanan et al. 2021): warm-up forwards, then one forward one backward."""
from __future__ import annotations

from planner.schedule_ir import Op, check_shape, one_f_one_b_order

from .base import ScheduleKind, register
from .gpipe import flush_analytic_s, one_chunk

__all__ = ["compute", "inflight", "KIND"]


def compute(p: int, m: int, v: int = 1) -> list[list[tuple[Op, int, int]]]:
    """Rank r runs min(p-r-1, m) warm-up forwards, then alternates F and B."""
    check_shape(p, m)
    if v != 1:
        raise ValueError(f"schedule kind '1f1b' has one chunk per rank; got v={v}")
    return [one_f_one_b_order(r, p, 1, m) for r in range(p)]


def inflight(p: int, v: int, m: int, rank: int) -> float:
    """Rank r holds at most p - r microbatches (its warm-up plus the one in steady state)."""
    return float(min(p - rank, m))


KIND = register(ScheduleKind(
    name="1f1b", help="1F1B (PipeDream-Flush): at most p - rank microbatches in flight",
    compute=compute, inflight=inflight, analytic_s=flush_analytic_s, check=one_chunk("1f1b"),
    v_choices=lambda p, max_v: (1,)))
