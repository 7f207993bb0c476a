"""The registered schedule kinds, and their generators under the argument orders the tests use."""
from __future__ import annotations

from planner.schedule_ir import Schedule
from planner.schedules import SCHEDULES

KINDS = tuple(SCHEDULES)


def gpipe(p: int, m: int) -> Schedule:
    return SCHEDULES["gpipe"].generate(p, m, 1)


def one_f_one_b(p: int, m: int) -> Schedule:
    return SCHEDULES["1f1b"].generate(p, m, 1)


def interleaved(p: int, v: int, m: int) -> Schedule:
    return SCHEDULES["interleaved"].generate(p, m, v)
