"""Pipeline schedule kinds, one module each, registered by name.

Each module builds a `ScheduleKind`: its generator, the activations a rank holds in flight, its
analytic iteration time and its validity rule. Adding a schedule is adding a module here (imported
below) and a test; the search, the plan file, the CLI's choices and the runtime read the registry.
"""
from __future__ import annotations

from .base import SCHEDULES, ScheduleKind, get_schedule, register, unregister
from . import gpipe, one_f_one_b, interleaved, zero_bubble  # noqa: E402,F401  (each registers itself)

__all__ = ["SCHEDULES", "ScheduleKind", "get_schedule", "register", "unregister"]
