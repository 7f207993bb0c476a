"""The schedule-kind registry: what every pipeline schedule must say about itself."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:
    from planner.schedule_ir import Op, Schedule

__all__ = ["ScheduleKind", "SCHEDULES", "register", "get_schedule", "unregister"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ScheduleKind:
    """One pipeline schedule kind; `register` it and the search, the plan file, the CLI and the runtime
    know it."""

    name: str
    help: str
    compute: Callable[[int, int, int], Sequence[Sequence[tuple[Op, int, int]]]]
    """(p, m, v) -> every rank's compute-only program for one iteration: (op, stage, microbatch) with op F, B,
    or a backward split into I (input gradient) and W (weight gradient). `generate` lowers it."""
    inflight: Callable[[int, int, int, int], float]
    """(p, v, m, rank) -> microbatches whose activations the rank holds at its peak, in units of a
    whole stage (model chunks between their F and their B or I, divided by v)."""
    analytic_s: Callable[..., float]
    """(forward_s, backward_s per virtual stage, p, v, m, p2p_s, weight_s) -> pipeline time of one iteration
    (exact for uniform stages; the event simulator refines it); backward_s is a whole backward, weight_s the
    part of it a split backward's W runs. With uniform stages and no p2p it is the search's optimistic bound."""
    check: Callable[[int, int, int], str | None]
    """(p, v, m) -> why this kind cannot run that shape (a short, fixed reason), or None."""
    v_choices: Callable[[int, int], Sequence[int]]
    """(p, max_v) -> the chunks per rank the search tries."""
    placement: str = "loop"
    """Stage -> rank placement (planner.schedule_ir.Placement): "loop" or "v"."""
    split_backward: bool = False
    """The program splits every backward into I and W (zero-bubble schedules)."""
    w_pending: Callable[[int, int, int, int], float] = lambda p, v, m, rank: 0.0
    """(p, v, m, rank) -> at the rank's activation peak, microbatches whose I ran and whose W has not (what the
    weight gradient still needs: each linear's input and output gradient), in whole-stage units."""

    chunk_peaks: Callable[[int, int, int, int], tuple[tuple[float, ...], ...]] | None = None
    """(p, v, m, rank) -> microbatches each of the rank's v chunks holds (in its own units, chunk by chunk in stage
    order) at each moment that can be the rank's activation peak. None: every chunk holds `inflight` of them (a
    uniform average over the chunks, exact with one chunk)."""

    def peaks(self, p: int, v: int, m: int, rank: int) -> tuple[tuple[float, ...], ...]:
        if self.chunk_peaks is None:
            return ((self.inflight(p, v, m, rank),) * v,)
        return self.chunk_peaks(p, v, m, rank)

    def generate(self, p: int, m: int, v: int = 1) -> Schedule:
        """Every rank's lowered action list for one iteration."""
        from planner.schedule_ir import lower

        return lower(self.name, p, m, v, self.compute(p, m, v))


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
