"""The schedule-kind registry: what every pipeline schedule must say about itself."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:
    from planner.schedule import Schedule

__all__ = ["ScheduleKind", "SCHEDULES", "register", "get_schedule", "unregister"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ScheduleKind:
    """One pipeline schedule kind; `register` it and the search, the plan file, the CLI and the runtime
    know it."""

    name: str
    help: str
    generate: Callable[[int, int, int], Schedule]
    """(p, m, v) -> every rank's action list for one iteration."""
    inflight: Callable[[int, int, int, int], float]
    """(p, v, m, rank) -> microbatches whose activations the rank holds at its peak, in units of a
    whole stage (model chunks in flight divided by v)."""
    analytic_s: Callable[[Sequence[float], Sequence[float], int, int, int, float], float]
    """(forward_s, backward_s per virtual stage, p, v, m, p2p_s) -> pipeline time of one iteration
    (exact for uniform stages; the event simulator refines it). With uniform stages and no p2p it
    is the search's optimistic bound."""
    check: Callable[[int, int, int], str | None]
    """(p, v, m) -> why this kind cannot run that shape (a short, fixed reason), or None."""
    v_choices: Callable[[int, int], Sequence[int]]
    """(p, max_v) -> the chunks per rank the search tries."""


SCHEDULES: dict[str, ScheduleKind] = {}


def register(kind: ScheduleKind) -> ScheduleKind:
    if kind.name in SCHEDULES and SCHEDULES[kind.name] is not kind:
        raise ValueError(f"schedule kind {kind.name!r} is already registered")
    SCHEDULES[kind.name] = kind
    return kind


def unregister(name: str) -> None:
    SCHEDULES.pop(name, None)


def get_schedule(name: str) -> ScheduleKind:
    try:
        return SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown schedule kind {name!r}; known: {', '.join(SCHEDULES)}") from None
