"""Pipeline schedule kinds, one module each, registered by name.

Each module builds a `ScheduleKind`: its compute-only program (F, B, or I and W), its placement, the
activations a rank holds in flight, its analytic iteration time and its validity rule. Adding a schedule is
adding a module here (imported below) and a test; the search, the plan file, the CLI's choices, the simulator,
the exports and the runtime read the registry. A kind kept outside this package is a module named in
``FXPLANNER_SCHEDULES`` (comma-separated module names, imported here: by the planner and by every rank the
plan's launch starts, which inherit the environment).
"""
from __future__ import annotations

import importlib
import os
import sys

from .base import SCHEDULES, ScheduleKind, get_schedule, register, unregister
from . import gpipe, one_f_one_b, interleaved, zero_bubble  # noqa: E402,F401  (each registers itself)

for _name in filter(None, (n.strip() for n in os.environ.get("FXPLANNER_SCHEDULES", "").split(","))):
    try:
        importlib.import_module(_name)
    except ImportError as exc:  # at import time, before any command's error handling: one line, no traceback
        sys.exit(f"error: FXPLANNER_SCHEDULES names module {_name!r}, which does not import ({exc}); fix the "
                 "name or PYTHONPATH")

__all__ = ["SCHEDULES", "ScheduleKind", "get_schedule", "register", "unregister"]
