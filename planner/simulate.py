"""Discrete-event simulation of one training iteration of a pipeline schedule.

Each rank runs its actions in list order. A forward of stage k > 0 starts when the rank is free and
the activation of F(k-1, mb) has arrived (its end, + p2p_s when stage k-1 lives on another rank); a
backward (B, or its input-gradient half I) of stage k < last waits for the gradient of B/I(k+1, mb) the
same way; the last stage's backward waits for its own forward; a weight-gradient step W waits for its
own I. Sends are asynchronous and never occupy the compute timeline; SEND/RECV/BUBBLE actions take no
time. ALLREDUCE follows the rank's last backward, OPT follows ALLREDUCE, and the iteration ends
when the last rank finishes OPT.

Memory is a ledger of each action's change: F adds its stage's activations, B frees them, I frees all
but what W still needs (weight_bytes), W frees that; `SimResult.memory` is each rank's bytes over the
iteration. Every idle gap on a rank becomes a Bubble:

- 'A' (fill/drain): before the rank's first compute, or after its last backward up to the end of
  the iteration (including the wait while other ranks finish their all-reduce/optimizer step);
- 'B' (fwd-bwd): a gap that ends in a backward (waiting for a gradient from later stages);
- 'C' (misaligned F/B): a gap that ends in a forward in the middle of the iteration.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from planner.schedule_ir import Action, Op, Schedule, ScheduleError, _action, gc_paused

__all__ = ["Bubble", "Interval", "SimCosts", "SimResult", "simulate", "simulate_time", "with_bubbles"]

GAP_EPS_S = 1e-12
"""Idle gaps shorter than this are not bubbles (float noise)."""

_F, _B, _I, _W, _ALLREDUCE, _OPT, _BUBBLE = Op.F, Op.B, Op.I, Op.W, Op.ALLREDUCE, Op.OPT, Op.BUBBLE
_RECV = frozenset({Op.RECV_F, Op.RECV_B})
_COMPUTE = frozenset({_F, _B, _I, _W})


@dataclass(frozen=True, kw_only=True, slots=True)
class SimCosts:
    """Plain-data costs of one schedule's stages and ranks."""

    forward_s: tuple[float, ...]
    """Per virtual stage: seconds of one microbatch's forward."""
    backward_s: tuple[float, ...]
    """Per virtual stage: seconds of one microbatch's backward (including any recompute)."""
    p2p_s: float
    """One activation (or gradient) transfer between adjacent stages on different ranks."""
    allreduce_s: tuple[float, ...]
    """Per rank: data-parallel gradient all-reduce at the end of the iteration (0 if d == 1)."""
    optimizer_s: tuple[float, ...]
    """Per rank: optimizer step."""
    static_bytes: tuple[int, ...]
    """Per rank: weights + gradients + optimizer state."""
    activation_bytes: tuple[int, ...]
    """Per virtual stage: bytes stashed per microbatch from its forward until its backward."""
    capacity_bytes: int
    """Device memory."""
    weight_s: tuple[float, ...] = ()
    """Per virtual stage: of backward_s, what a split backward's W step takes (I takes the rest); needed
    only by schedules that split the backward."""
    weight_bytes: tuple[int, ...] = ()
    """Per virtual stage: of activation_bytes, what one microbatch still holds between its I and its W."""

    def __post_init__(self) -> None:
        for name in ("forward_s", "backward_s", "allreduce_s", "optimizer_s", "static_bytes",
                     "activation_bytes", "weight_s", "weight_bytes"):
            values = tuple(getattr(self, name))
            bad = [x for x in values if not x >= 0]  # also catches NaN
            if bad:
                raise ValueError(f"SimCosts.{name} must be >= 0, got {bad[0]!r}")
            object.__setattr__(self, name, values)
        for name in ("p2p_s", "capacity_bytes"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"SimCosts.{name} must be >= 0, got {getattr(self, name)!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Interval:
    """A span of one rank's timeline."""

    start: float
    end: float
    action: str
    """Action string (``1F0``, ``ALLREDUCE``, ``BUBBLE3``)."""
    kind: str
    """'compute' (F, B, OPT), 'comm' (ALLREDUCE) or 'bubble'."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Bubble:
    """An idle interval on one rank (the plan file stores these as they are)."""

    __pydantic_config__: ClassVar[dict] = {"extra": "forbid"}  # strict when read back from a plan file
    id: int
    """Unique per rank, in time order; the runtime sees it as action ``BUBBLE{id}``."""
    rank: int
    start_s: float
    """Offset from the start of the iteration."""
    duration_s: float
    kind: Literal["A", "B", "C"]
    """'A' (fill/drain), 'B' (ends in a backward), 'C' (ends in a forward mid-iteration)."""
    free_bytes: int
    """capacity - static - activations in flight on the rank at the bubble start, at least 0."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SimResult:
    """Timeline and bubbles of one simulated iteration."""

    iteration_s: float
    """When the last rank finishes OPT."""
    timelines: tuple[tuple[Interval, ...], ...]
    """Per rank, in time order, covering [0, iteration_s] (gaps under GAP_EPS_S aside)."""
    bubbles: tuple[Bubble, ...]
    """All bubbles, ordered by rank then time."""
    busy_s: tuple[float, ...]
    """Per rank: F + B + ALLREDUCE + OPT time."""
    bubble_fraction: float
    """Total bubble time over p * iteration_s."""
    peak_bytes: tuple[int, ...]
    """Per rank: static bytes + the most activation bytes in flight at once."""
    memory: tuple[tuple[tuple[float, int], ...], ...] = ()
    """Per rank, the ledger: (time, bytes held from then on: static + activations) at the start and after
    each change, in time order."""


def _check_costs(s: Schedule, c: SimCosts) -> None:
    stages, p = s.num_stages, s.p
    for name, want in (
        ("forward_s", stages),
        ("backward_s", stages),
        ("activation_bytes", stages),
        ("allreduce_s", p),
        ("optimizer_s", p),
        ("static_bytes", p),
    ):
        got = len(getattr(c, name))
        if got != want:
            raise ValueError(f"SimCosts.{name} has {got} entries, schedule needs {want}")
    split = any(a.op is _W for acts in s.ranks for a in acts)
    for name in ("weight_s", "weight_bytes") if split else ():
        if len(getattr(c, name)) != stages:
            raise ValueError(f"SimCosts.{name} has {len(getattr(c, name))} entries; a schedule with split "
                             f"backwards needs {stages}")


# One busy record per executed F/B/I/W/ALLREDUCE/OPT: (start, end, action).
_Record = tuple[float, float, Action]
_TIMED = frozenset({_F, _B, _I, _W, _ALLREDUCE, _OPT})


def _execute(s: Schedule, c: SimCosts) -> list[list[_Record]]:
    """Start/end of every timed action, found by running ranks until they block on an input.

    A blocked rank records the key it waits for; the producer of that key wakes it, so every
    action is visited about once (no global event queue needed: start times only depend on the
    end times of an action's inputs and of the previous action on the rank).
    """
    p, m, last = s.p, s.m, s.num_stages - 1
    rank_of = s.placement.rank_of
    n = s.num_stages * m
    fend = [-1.0] * n  # end time of F(k, mb) at index k*m + mb; -1 = not run yet
    bend = [-1.0] * n  # end of B(k, mb) or I(k, mb): the input's gradient exists
    hop = c.p2p_s
    fwd, bwd = c.forward_s, c.backward_s
    wgt = c.weight_s or (0.0,) * s.num_stages
    inp = tuple(b - w for b, w in zip(bwd, wgt))
    timed = [[a for a in acts if a.op in _TIMED] for acts in s.ranks]
    ptr, free, blocked = [0] * p, [0.0] * p, [-1] * p  # blocked: encoded key the rank waits on
    records: list[list[_Record]] = [[] for _ in range(p)]
    ready = list(range(p))
    while ready:
        r = ready.pop()
        acts, rec, t, j = timed[r], records[r], free[r], ptr[r]
        add, nacts = rec.append, len(acts)
        while j < nacts:
            a = acts[j]
            op = a.op
            if op is _F:
                k = a.stage
                idx = k * m + a.mb
                if k > 0:
                    arrive = fend[idx - m]
                    if arrive < 0.0:
                        blocked[r] = idx - m
                        break
                    if rank_of[k - 1] != r:
                        arrive += hop
                    if arrive > t:
                        t = arrive
                end = t + fwd[k]
                add((t, end, a))
                t = fend[idx] = end
                if k < last:
                    nxt = rank_of[k + 1]
                    if blocked[nxt] == idx:
                        blocked[nxt] = -1
                        ready.append(nxt)
            elif op is _B or op is _I:
                k = a.stage
                idx = k * m + a.mb
                if k < last:
                    arrive = bend[idx + m]
                    if arrive < 0.0:
                        blocked[r] = n + idx + m
                        break
                    if rank_of[k + 1] != r:
                        arrive += hop
                else:
                    arrive = fend[idx]
                    if arrive < 0.0:
                        blocked[r] = -2  # its own forward comes later: never resolves
                        break
                if arrive > t:
                    t = arrive
                end = t + (bwd[k] if op is _B else inp[k])
                add((t, end, a))
                t = bend[idx] = end
                if k > 0:
                    prv = rank_of[k - 1]
                    if blocked[prv] == n + idx:
                        blocked[prv] = -1
                        ready.append(prv)
            elif op is _W:  # after its own I on this rank (validate checks the order)
                end = t + wgt[a.stage]
                add((t, end, a))
                t = end
            else:
                end = t + (c.allreduce_s[r] if op is _ALLREDUCE else c.optimizer_s[r])
                add((t, end, a))
                t = end
            j += 1
        ptr[r], free[r] = j, t
    _raise_if_stuck(s, timed, ptr)
    return records


def _raise_if_stuck(s: Schedule, timed: list[list[Action]], ptr: list[int]) -> None:
    stuck = [r for r in range(s.p) if ptr[r] < len(timed[r])]
    if stuck:
        where = "; ".join(
            f"rank {r}, step {s.ranks[r].index(timed[r][ptr[r]])} ({timed[r][ptr[r]]})"
            for r in stuck[:4]
        )
        raise ScheduleError(f"simulation cannot finish, ranks wait forever: {where}")


_new_interval = Interval.__new__
_set_start, _set_end = Interval.start.__set__, Interval.end.__set__  # type: ignore[attr-defined]
_set_action, _set_kind = Interval.action.__set__, Interval.kind.__set__  # type: ignore[attr-defined]


def _interval(start: float, end: float, action: str, kind: str) -> Interval:
    """Same object as ``Interval(...)`` at a third of the cost: a 64-rank simulation builds >100k
    of them and the generated frozen __init__ (~2 us each) dominated the run time."""
    obj = _new_interval(Interval)
    _set_start(obj, start)
    _set_end(obj, end)
    _set_action(obj, action)
    _set_kind(obj, kind)
    return obj


_new_bubble = Bubble.__new__
_BUBBLE_SETTERS = tuple(
    getattr(Bubble, f).__set__ for f in ("id", "rank", "start_s", "duration_s", "kind", "free_bytes")
)


def _bubble(bid: int, rank: int, start: float, duration: float, kind: str, free: int) -> Bubble:
    """Same object as ``Bubble(...)``, cheaper for the same reason as _interval (uneven stage
    costs can leave one bubble per step: ~65k on p=64, v=2, m=512)."""
    obj = _new_bubble(Bubble)
    set_id, set_rank, set_start, set_duration, set_kind, set_free = _BUBBLE_SETTERS
    set_id(obj, bid)
    set_rank(obj, rank)
    set_start(obj, start)
    set_duration(obj, duration)
    set_kind(obj, kind)
    set_free(obj, free)
    return obj


def _bubble_kind(op: Op | None, started: bool) -> str:
    """FreeRide kinds. ALLREDUCE/OPT (and the tail, op None) come after the rank's last
    backward, so a gap ending there is drain (A), like the gap before the first compute."""
    if not started or op is None:
        return "A"
    return "B" if op is _B else ("C" if op is _F else "A")


def _rank_timeline(
    r: int, rec: list[_Record], iteration: float, c: SimCosts
) -> tuple[list[Interval], list[Bubble], list[tuple[float, int]]]:
    """Intervals (busy and bubble) of one rank, its bubbles, and its memory ledger. An action's activations
    count from its start (F) and are freed at its end (B, I, W)."""
    static = c.static_bytes[r]
    free_base = c.capacity_bytes - static
    act_bytes = c.activation_bytes
    keep = c.weight_bytes or (0,) * len(act_bytes)
    intervals: list[Interval] = []
    bubbles: list[Bubble] = []
    ledger: list[tuple[float, int]] = [(0.0, static)]
    add = intervals.append
    held = 0
    prev, started = 0.0, False  # started: some action already ran on this rank

    def gap(until: float, op: Op | None) -> None:
        bid = len(bubbles)
        kind = _bubble_kind(op, started)
        bubbles.append(_bubble(bid, r, prev, until - prev, kind, max(free_base - held, 0)))
        add(_interval(prev, until, f"BUBBLE{bid}", "bubble"))

    for start, end, a in rec:
        op = a.op
        if start - prev > GAP_EPS_S:
            gap(start, op)
        if op is _F:
            held += act_bytes[a.stage]
            ledger.append((start, static + held))
        elif op is _B or op is _I or op is _W:
            k = a.stage
            held -= act_bytes[k] if op is _B else act_bytes[k] - keep[k] if op is _I else keep[k]
            ledger.append((end, static + held))
        if op in _COMPUTE:
            add(_interval(start, end, f"{a.stage}{op.value}{a.mb}", "compute"))
        else:
            add(_interval(start, end, str(a), "comm" if op is _ALLREDUCE else "compute"))
        prev, started = end, True
    if iteration - prev > GAP_EPS_S:
        gap(iteration, None)
    return intervals, bubbles, ledger


def simulate(schedule: Schedule, costs: SimCosts) -> SimResult:
    """Simulate one iteration; raises ScheduleError if the schedule cannot run to completion."""
    _check_costs(schedule, costs)
    with gc_paused():  # >100k small acyclic objects: GC passes would find nothing to free
        return _simulate(schedule, costs)


def simulate_time(schedule: Schedule, costs: SimCosts) -> tuple[float, float]:
    """(iteration_s, bubble_fraction) of `simulate(schedule, costs)`, the same numbers in the same arithmetic, without
    the timelines, bubbles and memory ledgers it builds (all the search needs of its runners-up, at ~40% of the cost).
    Only the schedule's timed actions are read (schedule.lower_timed's schedule will do)."""
    _check_costs(schedule, costs)
    with gc_paused():
        records = _execute(schedule, costs)
    iteration = max((rec[-1][1] for rec in records if rec), default=0.0)
    gaps = []  # every bubble's duration, rank by rank in time order, as _rank_timeline makes them
    for rec in records:
        prev = 0.0
        for start, end, _ in rec:
            if start - prev > GAP_EPS_S:
                gaps.append(start - prev)
            prev = end
        if iteration - prev > GAP_EPS_S:
            gaps.append(iteration - prev)
    idle = sum(gaps)
    return iteration, (idle / (schedule.p * iteration) if iteration > 0 else 0.0)


def _simulate(schedule: Schedule, costs: SimCosts) -> SimResult:
    records = _execute(schedule, costs)
    iteration = max((rec[-1][1] for rec in records if rec), default=0.0)
    timelines, bubbles, busy, ledgers = [], [], [], []
    for r, rec in enumerate(records):
        intervals, rank_bubbles, ledger = _rank_timeline(r, rec, iteration, costs)
        timelines.append(tuple(intervals))
        bubbles.extend(rank_bubbles)
        busy.append(sum(end - start for start, end, _ in rec))
        ledgers.append(tuple(ledger))
    idle = sum(b.duration_s for b in bubbles)
    fraction = idle / (schedule.p * iteration) if iteration > 0 else 0.0
    return SimResult(
        iteration_s=iteration,
        timelines=tuple(timelines),
        bubbles=tuple(bubbles),
        busy_s=tuple(busy),
        bubble_fraction=fraction,
        peak_bytes=tuple(max(b for _, b in ledger) for ledger in ledgers),
        memory=tuple(ledgers),
    )


def _insert_at(acts: list[Action], step: int) -> int:
    """Bubble goes before the RECVs that feed the compute ending it (a blocking recv is the wait)."""
    while step > 0 and acts[step - 1].op in _RECV:
        step -= 1
    return step


def with_bubbles(schedule: Schedule, result: SimResult) -> Schedule:
    """Insert ``BUBBLE{id}`` actions where each simulated bubble occurs (old ones are dropped)."""
    if len(result.timelines) != schedule.p:
        raise ValueError(f"result has {len(result.timelines)} ranks, schedule has p={schedule.p}")
    with gc_paused():
        return _with_bubbles(schedule, result)


def _with_bubbles(schedule: Schedule, result: SimResult) -> Schedule:
    ranks = []
    for r, timeline in enumerate(result.timelines):
        base = [a for a in schedule.ranks[r] if a.op is not _BUBBLE]
        step_of = {str(a): i for i, a in enumerate(base) if a.op in _TIMED}
        inserts: dict[int, list[Action]] = {}
        pending: list[Action] = []
        for iv in timeline:
            if iv.kind == "bubble":  # "BUBBLE{id}", as _rank_timeline names it
                pending.append(_action(None, _BUBBLE, int(iv.action[6:])))
                continue
            if iv.action not in step_of:
                raise ValueError(f"rank {r}: simulated action {iv.action} is not in the schedule")
            if pending:
                inserts.setdefault(_insert_at(base, step_of[iv.action]), []).extend(pending)
                pending = []
        inserts.setdefault(len(base), []).extend(pending)
        ranks.append(_merge(base, inserts))
    return Schedule(kind=schedule.kind, p=schedule.p, v=schedule.v, m=schedule.m, ranks=tuple(ranks))


def _merge(base: list[Action], inserts: dict[int, list[Action]]) -> tuple[Action, ...]:
    out: list[Action] = []
    for i, a in enumerate(base):
        out.extend(inserts.get(i, ()))
        out.append(a)
    out.extend(inserts.get(len(base), ()))
    return tuple(out)
