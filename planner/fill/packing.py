"""Pack a fill job's linearized graph into a rank's repeating bubble cycle.

`greedy_pack` is PipeFill's Algorithm 1 (Executor, §4.3); `cpsat_pack` is an exact CP-SAT model of
the same problem over a bounded horizon of bubble cycles; `validate_packing` checks any packing.

Model. The job's units form an unbounded stream (unit ``g`` is ``units[g % n]``, i.e. iterations
replicated back to back). Bubbles are visited in order, ``cycles`` times. Each bubble runs at most
one chunk, a contiguous run of the stream starting exactly where the previous chunk ended. A chunk
``[a, b)`` in slot ``s`` must satisfy::

    launch + swap(a) + sum(time[a:b] + unit_overhead) + swap(b) <= duration_s * (1 - safety_margin)
    max(mem[a:b]) + resident_bytes               <= free_bytes

``swap(p)`` is zero unless ``state_swap_bw`` is given (see below). All times are quantized to whole
nanoseconds first, so greedy, CP-SAT and validation agree exactly.

Greedy is optimal in the plain model (no state swap). Let ``g_k``/``o_k`` be the stream positions
after bubble ``k`` for greedy and for any feasible packing. If ``g_{k-1} >= o_{k-1}`` then either
``g_{k-1} >= o_k`` or ``[g_{k-1}, o_k)`` is a sub-interval of the feasible chunk ``[o_{k-1}, o_k)``
and so fits too (times are >= 0, max(mem) only shrinks, launch is the same), and greedy, which
extends while the chunk fits, reaches at least ``o_k``. By induction greedy is ahead after *every*
bubble, so no packing completes more units, nor more FLOPs (FLOPs done are a function of the
position). Leaving a bubble empty or splitting chunks differently can never help there; CP-SAT
can only certify greedy's result.

What breaks that argument is a cost that depends on *where* a chunk boundary falls. A training
fill job suspended mid-iteration holds activations saved for its backward pass; PipeFill's
Executor must hand the memory back to the main job when the bubble ends, so that state
(``FillUnit.state_bytes`` after the last unit of the chunk) is offloaded to the host at the end of
the chunk and reloaded at the start of the next one, each costing ``state_bytes / state_swap_bw``
inside the bubble. Then stopping early at a cheap boundary (e.g. an iteration end), or leaving a
bubble empty rather than strand state that no later bubble can afford to reload, can let later
bubbles do more. Greedy cannot see that and CP-SAT can (``tests/planner/test_packing.py`` has
both cases). ``greedy_pack(farthest_fit=True)`` takes the farthest end that fits instead of
stopping at the first unit that does not, which recovers much of the gap cheaply.
"""

from __future__ import annotations

import bisect

import dataclasses
import time
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Callable, Iterator, Literal, Sequence

__all__ = [
    "DEFAULT_LAUNCH_OVERHEAD_S",
    "BubbleSlot",
    "Chunk",
    "EmptyBubble",
    "FillUnit",
    "Packing",
    "PackingError",
    "PackingParams",
    "cpsat_pack",
    "cpsat_budget",
    "CpsatBudget",
    "greedy_pack",
    "validate_packing",
]

NS_PER_S = 1_000_000_000
DEFAULT_LAUNCH_OVERHEAD_S = 1e-3
"""Per-chunk cost: the Executor waits for the bubble signal, sets its memory cap and launches."""

EmptyReason = Literal["too_short", "no_memory", "too_short_and_no_memory", "skipped"]
"""Why the next unit of the stream did not run; "skipped": it would have fit (a solver's choice)."""


class PackingError(ValueError):
    """A packing violates a bubble's time or memory limit, or runs work out of order."""


@dataclass(frozen=True, kw_only=True, slots=True)
class FillUnit:
    """One unit of a fill job's linearized graph (a forward or backward piece)."""

    name: str
    time_s: float
    """Execution time on the target for the configured batch size."""
    mem_bytes: int
    """Peak device memory while this unit runs (activations + workspace), excluding resident."""
    flops: float
    """Useful FLOPs done by the unit."""
    state_bytes: int = 0
    """State live after this unit that must leave the device if the chunk ends here (activations
    saved for backward). Only used when the packer is given ``state_swap_bw``."""
    gpu_s: float | None = None
    """Of a unit the host takes longer to issue than the GPU to run (time_s is then the host's,
    planner/fill/physics.py HOST_UNIT_S): the GPU's seconds. None: time_s is the GPU's."""

    def __post_init__(self) -> None:
        if self.time_s < 0 or self.mem_bytes < 0 or self.flops < 0 or self.state_bytes < 0:
            raise ValueError(
                f"unit {self.name!r}: time_s={self.time_s}, mem_bytes={self.mem_bytes}, "
                f"flops={self.flops}, state_bytes={self.state_bytes} must all be >= 0"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class BubbleSlot:
    """One bubble of a rank's repeating per-iteration bubble cycle."""

    id: int
    duration_s: float
    free_bytes: int

    def __post_init__(self) -> None:
        if self.duration_s < 0 or self.free_bytes < 0:
            raise ValueError(
                f"bubble {self.id}: duration_s={self.duration_s} and "
                f"free_bytes={self.free_bytes} must be >= 0"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class PackingParams:
    """Knobs shared by the packers and the validator."""

    safety_margin: float = 0.1
    """Fraction of each bubble left unused so fill work never delays the main job."""
    launch_overhead_s: float = DEFAULT_LAUNCH_OVERHEAD_S
    """Fixed cost paid once per non-empty chunk."""
    resident_bytes: int = 0
    """Memory the job keeps on the device between bubbles (e.g. its weights)."""
    cycles: int = 1
    """Horizon: how many repetitions of the bubble cycle are packed."""
    state_swap_bw: float | None = None
    """Bytes/s for offloading/reloading ``FillUnit.state_bytes`` at chunk boundaries; None keeps
    PipeFill's model, where a boundary costs nothing beyond the launch overhead."""
    unit_overhead_s: float = 0.0
    """Fixed cost of every unit run (the runtime's request/reply round trip; planner/fill/physics.py)."""

    def __post_init__(self) -> None:
        if not 0 <= self.safety_margin < 1:
            raise ValueError(f"safety_margin={self.safety_margin} must be in [0, 1)")
        if self.launch_overhead_s < 0 or self.resident_bytes < 0 or self.unit_overhead_s < 0:
            raise ValueError(
                f"launch_overhead_s={self.launch_overhead_s}, unit_overhead_s={self.unit_overhead_s} and "
                f"resident_bytes={self.resident_bytes} must be >= 0"
            )
        if self.cycles < 1:
            raise ValueError(f"cycles={self.cycles} must be >= 1")
        if self.state_swap_bw is not None and not self.state_swap_bw > 0:
            raise ValueError(f"state_swap_bw={self.state_swap_bw} must be > 0 or None")


@dataclass(frozen=True, kw_only=True, slots=True)
class Chunk:
    """Contiguous units ``[first_unit, first_unit + num_units)`` of the stream run in one bubble."""

    bubble_id: int
    slot: int
    """Index of the bubble in the cycle (``bubble_id`` is the caller's label)."""
    cycle: int
    first_unit: int
    """Global index into the replicated unit stream."""
    num_units: int
    time_s: float
    """Sum of the units' execution times (useful work)."""
    overhead_s: float
    """Launch overhead, per-unit overhead and state reload/offload."""
    mem_bytes: int
    """Peak device memory of the fill job in this bubble, resident bytes included."""
    flops: float

    @property
    def end_unit(self) -> int:
        return self.first_unit + self.num_units


@dataclass(frozen=True, kw_only=True, slots=True)
class EmptyBubble:
    """A bubble that runs nothing, and why (judged on the next unit of the stream)."""

    bubble_id: int
    slot: int
    cycle: int
    next_unit: int
    reason: EmptyReason


@dataclass(frozen=True, kw_only=True, slots=True)
class Packing:
    """Chunks in execution order and a summary over the horizon of ``params.cycles`` cycles."""

    chunks: tuple[Chunk, ...]
    empty_bubbles: tuple[EmptyBubble, ...]
    params: PackingParams
    units_per_iteration: int
    bubbles_per_cycle: int
    units_completed: int
    units_per_cycle: float
    """Units completed over the horizon / cycles (the steady-state rate as cycles grows)."""
    iterations_per_cycle: float
    flops_per_cycle: float
    filled_fraction: float
    """Useful unit time / usable bubble time (after the safety margin) over the horizon."""
    solver: str
    """"greedy", "farthest-fit", "cp-sat" or "greedy-fallback" (CP-SAT did not beat the
    heuristics within its time limit; ``status`` then has CP-SAT's status)."""
    status: str
    solve_time_s: float


@dataclass(frozen=True, slots=True)
class _Problem:
    """Everything in integer nanoseconds; built once per call from the plain inputs."""

    n: int
    prefix_ns: tuple[int, ...]
    """Busy time from the start of an iteration: units' compute and their per-unit overhead."""
    work_ns: tuple[int, ...]
    """Compute time alone (useful work), same positions."""
    mem: tuple[int, ...]
    flops_prefix: tuple[float, ...]
    swap_ns: tuple[int, ...]
    usable_ns: tuple[int, ...]
    free: tuple[int, ...]
    ids: tuple[int, ...]
    launch_ns: int
    resident: int

    def elapsed(self, p: int) -> int:
        q, r = divmod(p, self.n)
        return q * self.prefix_ns[self.n] + self.prefix_ns[r]

    def worked(self, p: int) -> int:
        q, r = divmod(p, self.n)
        return q * self.work_ns[self.n] + self.work_ns[r]

    def flops_done(self, p: int) -> float:
        q, r = divmod(p, self.n)
        return q * self.flops_prefix[self.n] + self.flops_prefix[r]

    def swap(self, p: int) -> int:
        return 0 if p == 0 else self.swap_ns[(p - 1) % self.n]

    def busy_ns(self, a: int, b: int) -> int:
        return self.launch_ns + self.swap(a) + self.elapsed(b) - self.elapsed(a) + self.swap(b)

    def mem_fits(self, slot: int, p: int) -> bool:
        return self.mem[p % self.n] + self.resident <= self.free[slot]

    def blocked_distance(self, slot: int) -> tuple[int, ...] | None:
        """For each residue r, units until the next unit that cannot fit slot's memory."""
        blocked = [i for i in range(self.n) if not self.mem_fits(slot, i)]
        if not blocked:
            return None
        return tuple(min((j - r) % self.n for j in blocked) for r in range(self.n))


def _ns(seconds: float) -> int:
    return round(seconds * NS_PER_S)


def _build(units: Sequence[FillUnit], cycle: Sequence[BubbleSlot], params: PackingParams) -> _Problem:
    if not units:
        raise ValueError("a fill job needs at least one unit")
    if not cycle:
        raise ValueError("the bubble cycle is empty")
    ids = tuple(b.id for b in cycle)
    if len(set(ids)) != len(ids):
        raise ValueError(f"bubble ids must be unique, got {list(ids)}")
    prefix, work, flops = [0], [0], [0.0]
    per_unit = _ns(params.unit_overhead_s)
    for u in units:
        work.append(work[-1] + _ns(u.time_s))
        prefix.append(prefix[-1] + _ns(u.time_s) + per_unit)
        flops.append(flops[-1] + u.flops)
    if prefix[-1] <= 0:
        raise ValueError(f"one iteration of the fill job takes {prefix[-1]} ns; it must be > 0")
    bw = params.state_swap_bw
    swap = tuple(0 if bw is None else _ns(u.state_bytes / bw) for u in units)
    keep = 1.0 - params.safety_margin
    return _Problem(
        n=len(units), prefix_ns=tuple(prefix), work_ns=tuple(work), mem=tuple(u.mem_bytes for u in units),
        flops_prefix=tuple(flops), swap_ns=swap,
        usable_ns=tuple(int(b.duration_s * keep * NS_PER_S) for b in cycle),
        free=tuple(b.free_bytes for b in cycle), ids=ids,
        launch_ns=_ns(params.launch_overhead_s), resident=params.resident_bytes,
    )


def _chunk_end(prob: _Problem, slot: int, a: int) -> int:
    """Algorithm 1 lines 12-15: extend the chunk while the next unit fits time and memory.

    The paper tests ``dur(P') + dur(F[0]) < B[i]``; we use ``<=`` against the bubble's usable time
    (after the safety margin), which is where the margin goes.
    """
    b = a
    while prob.mem_fits(slot, b) and prob.busy_ns(a, b + 1) <= prob.usable_ns[slot]:
        b += 1
    return b


def _jump_end(prob: _Problem, slot: int, a: int, blocked: dict[int, tuple[int, ...] | None]) -> int:
    """Same result as ``_chunk_end`` when chunk boundaries cost nothing (no state swapping), in
    O(log n): the time limit by bisection on the prefix sums, memory by the next blocked unit."""
    budget = prob.usable_ns[slot] - prob.launch_ns
    if budget < 0:
        return a
    limit = prob.elapsed(a) + budget
    q, rem = divmod(limit, prob.prefix_ns[prob.n])
    by_time = q * prob.n + bisect.bisect_right(prob.prefix_ns, rem, hi=prob.n) - 1
    if slot not in blocked:
        blocked[slot] = prob.blocked_distance(slot)
    dist = blocked[slot]
    by_memory = a + dist[a % prob.n] if dist is not None else by_time
    return max(a, min(by_time, by_memory))


def _farthest_end(prob: _Problem, slot: int, a: int) -> int:
    """The farthest end whose chunk fits, scanning every end the time budget allows. Same as
    ``_chunk_end`` without state swapping (feasibility is then monotone in the end)."""
    best = b = a
    usable = prob.usable_ns[slot]
    while prob.mem_fits(slot, b) and prob.launch_ns + prob.elapsed(b + 1) - prob.elapsed(a) <= usable:
        b += 1
        if prob.busy_ns(a, b) <= usable:
            best = b
    return best


def _greedy_ends(prob: _Problem, cycles: int, *, farthest_fit: bool = False) -> list[int]:
    """Algorithm 1 lines 8-18 over ``cycles`` visits of the bubble cycle.

    Lines 1-7 replicate the graph so one plan spans about one bubble cycle, and the Executor
    reruns the plan. Packing the unbounded replicated stream over a fixed horizon is the same
    schedule, except that a rerun plan would force a chunk break at every plan boundary.
    """
    blocked: dict[int, tuple[int, ...] | None] = {}
    if not any(prob.swap_ns):  # both variants coincide and have a closed form
        end_of = lambda pr, slot, a: _jump_end(pr, slot, a, blocked)  # noqa: E731
    else:
        end_of = _farthest_end if farthest_fit else _chunk_end
    ends, pos = [], 0
    for k in range(cycles * len(prob.usable_ns)):
        pos = end_of(prob, k % len(prob.usable_ns), pos)
        ends.append(pos)
    return ends


def _empty_reason(prob: _Problem, slot: int, a: int) -> EmptyReason:
    short = prob.busy_ns(a, a + 1) > prob.usable_ns[slot]
    no_mem = not prob.mem_fits(slot, a)
    if short and no_mem:
        return "too_short_and_no_memory"
    if short:
        return "too_short"
    return "no_memory" if no_mem else "skipped"


def _make_chunk(prob: _Problem, slot: int, cyc: int, a: int, b: int) -> Chunk:
    work = prob.worked(b) - prob.worked(a)
    return Chunk(
        bubble_id=prob.ids[slot], slot=slot, cycle=cyc, first_unit=a, num_units=b - a,
        time_s=work / NS_PER_S, overhead_s=(prob.busy_ns(a, b) - work) / NS_PER_S,
        mem_bytes=max(prob.mem[p % prob.n] for p in range(a, min(b, a + prob.n))) + prob.resident,
        flops=prob.flops_done(b) - prob.flops_done(a),
    )


def _make_packing(
    prob: _Problem, params: PackingParams, ends: Sequence[int], *, solver: str, status: str,
    solve_time_s: float,
) -> Packing:
    nb, chunks, empty, a = len(prob.usable_ns), [], [], 0
    for k, b in enumerate(ends):
        slot, cyc = k % nb, k // nb
        if b > a:
            chunks.append(_make_chunk(prob, slot, cyc, a, b))
        else:
            empty.append(EmptyBubble(bubble_id=prob.ids[slot], slot=slot, cycle=cyc, next_unit=a,
                                     reason=_empty_reason(prob, slot, a)))
        a = b
    usable = params.cycles * sum(max(0, u) for u in prob.usable_ns)
    work = sum(prob.worked(c.end_unit) - prob.worked(c.first_unit) for c in chunks)
    return Packing(
        chunks=tuple(chunks), empty_bubbles=tuple(empty), params=params,
        units_per_iteration=prob.n, bubbles_per_cycle=nb, units_completed=a,
        units_per_cycle=a / params.cycles, iterations_per_cycle=a / params.cycles / prob.n,
        flops_per_cycle=prob.flops_done(a) / params.cycles,
        filled_fraction=work / usable if usable else 0.0,
        solver=solver, status=status, solve_time_s=solve_time_s,
    )


def greedy_pack(
    units: Sequence[FillUnit], cycle: Sequence[BubbleSlot], *, safety_margin: float = 0.1,
    launch_overhead_s: float = DEFAULT_LAUNCH_OVERHEAD_S, resident_bytes: int = 0, cycles: int = 1,
    state_swap_bw: float | None = None, farthest_fit: bool = False, unit_overhead_s: float = 0.0,
) -> Packing:
    """PipeFill Algorithm 1: fill each bubble in turn with as many next units as fit.

    ``farthest_fit=False`` follows the paper: stop at the first unit that does not fit.
    ``farthest_fit=True`` (our variant) takes the farthest end whose chunk fits; the two differ
    only with ``state_swap_bw``, where a longer chunk can end at a cheaper boundary.
    """
    params = PackingParams(safety_margin=safety_margin, launch_overhead_s=launch_overhead_s,
                           resident_bytes=resident_bytes, cycles=cycles, state_swap_bw=state_swap_bw,
                           unit_overhead_s=unit_overhead_s)
    prob = _build(units, cycle, params)
    start = time.perf_counter()
    ends = _greedy_ends(prob, cycles, farthest_fit=farthest_fit)
    return _make_packing(prob, params, ends, solver="farthest-fit" if farthest_fit else "greedy",
                         status="HEURISTIC", solve_time_s=time.perf_counter() - start)


def validate_packing(
    packing: Packing, units: Sequence[FillUnit], cycle: Sequence[BubbleSlot],
    params: PackingParams | None = None,
) -> None:
    """Raise PackingError on a chunk over its bubble's usable time or free memory, two chunks in
    one bubble, or work that is not contiguous and in order. Uses ``packing.params`` by default."""
    params = params or packing.params
    prob = _build(units, cycle, params)
    nb, pos, last = len(cycle), 0, (-1, -1)
    for c in packing.chunks:
        where = f"chunk at cycle {c.cycle} bubble {c.bubble_id} (units {c.first_unit}..{c.end_unit})"
        if not (0 <= c.slot < nb and 0 <= c.cycle < params.cycles and prob.ids[c.slot] == c.bubble_id):
            raise PackingError(f"{where}: no such bubble in {params.cycles} cycles of {nb} bubbles")
        if (c.cycle, c.slot) <= last:
            raise PackingError(f"{where}: bubble already used or visited out of order after {last}")
        if c.num_units < 1 or c.first_unit != pos:
            raise PackingError(f"{where}: work out of order, the previous chunk ended at unit {pos}")
        busy, usable = prob.busy_ns(pos, c.end_unit), prob.usable_ns[c.slot]
        if busy > usable:
            raise PackingError(f"{where}: needs {busy / NS_PER_S:.9f} s > usable {usable / NS_PER_S:.9f} s")
        peak = _make_chunk(prob, c.slot, c.cycle, pos, c.end_unit).mem_bytes
        if peak > prob.free[c.slot]:
            raise PackingError(f"{where}: needs {peak} bytes > free {prob.free[c.slot]} bytes")
        pos, last = c.end_unit, (c.cycle, c.slot)
    if packing.units_completed != pos:
        raise PackingError(f"units_completed={packing.units_completed} but chunks end at {pos}")


def _ends_of(packing: Packing, horizon: int) -> list[int]:
    """Stream position after each bubble of the horizon (a packing's chunks, densified)."""
    nb = packing.bubbles_per_cycle
    by_visit = {c.cycle * nb + c.slot: c.end_unit for c in packing.chunks}
    ends, pos = [], 0
    for k in range(horizon):
        pos = by_visit.get(k, pos)
        ends.append(pos)
    return ends


@dataclass(kw_only=True)
class CpsatBudget:
    """One time limit for all CP-SAT solves of a plan (there is one per rank, job, option and candidate
    configuration), and what they achieved: a solve gets what is left, at most its own limit; once the
    budget is spent the greedy packing stands. `gap_units` is the largest difference between CP-SAT's
    proven bound and its best packing (0 when every solve proved optimality)."""

    total_s: float
    progress: Callable[[int, float], None] | None = None  # (solves so far, seconds so far)
    solves: int = 0
    optimal: int = 0
    skipped: int = 0
    gap_units: int = 0
    seconds: float = 0.0
    _start: float = field(default_factory=time.perf_counter)

    def remaining_s(self) -> float:
        return self.total_s - (time.perf_counter() - self._start)

    def record(self, status: str, objective: float, bound: float, scale: int, wall_s: float) -> None:
        self.solves += 1
        self.seconds += wall_s
        if status == "OPTIMAL":
            self.optimal += 1
        elif status == "FEASIBLE":
            self.gap_units = max(self.gap_units, int(bound // scale) - int(objective // scale))
        if self.progress:
            self.progress(self.solves, self.seconds)

    def summary(self) -> str:
        if not self.solves and not self.skipped:
            return "CP-SAT: no solve needed"
        stopped = self.solves - self.optimal
        gap = ("every solve proved optimal" if not stopped else
               f"{stopped} stopped at their time limit with no unit left to gain (CP-SAT's bound)" if not self.gap_units
               else f"{stopped} stopped at their time limit, at most {self.gap_units} units below CP-SAT's bound")
        skipped = f"; {self.skipped} kept greedy (budget of {self.total_s:g} s spent)" if self.skipped else ""
        return f"CP-SAT: {self.solves} solves in {self.seconds:.1f} s, {gap}{skipped}"


BUDGET: ContextVar[CpsatBudget | None] = ContextVar("cpsat_budget", default=None)


@contextmanager
def cpsat_budget(total_s: float, progress: Callable[[int, float], None] | None = None) -> Iterator[CpsatBudget]:
    """Every cpsat_pack inside shares `total_s` seconds."""
    budget = CpsatBudget(total_s=total_s, progress=progress)
    token = BUDGET.set(budget)
    try:
        yield budget
    finally:
        BUDGET.reset(token)


def cpsat_pack(
    units: Sequence[FillUnit], cycle: Sequence[BubbleSlot], *, safety_margin: float = 0.1,
    launch_overhead_s: float = DEFAULT_LAUNCH_OVERHEAD_S, resident_bytes: int = 0, cycles: int = 1,
    state_swap_bw: float | None = None, time_limit_s: float = 2.0, hint: Packing | None = None,
    num_workers: int = 2, seed: int = 0, unit_overhead_s: float = 0.0,
) -> Packing:
    """Maximize units completed over the horizon with CP-SAT; never worse than greedy.

    FLOPs need no tie-break term: in-order work makes FLOPs done a function of units done.
    The default hint is the better of greedy and its farthest-fit variant. If CP-SAT finds
    nothing, or less than that, within the time limit, that heuristic's packing is returned with
    ``solver="greedy-fallback"``.
    """
    kwargs = dict(safety_margin=safety_margin, launch_overhead_s=launch_overhead_s,
                  resident_bytes=resident_bytes, cycles=cycles, state_swap_bw=state_swap_bw,
                  unit_overhead_s=unit_overhead_s)
    floor = max((greedy_pack(units, cycle, **kwargs, farthest_fit=ff) for ff in (False, True)),
                key=lambda p: p.units_completed)
    budget = BUDGET.get()
    if budget is not None:
        time_limit_s = min(time_limit_s, budget.remaining_s())
        if time_limit_s <= 0.01:  # the overall CP-SAT budget is spent: keep the heuristic (never worse)
            budget.skipped += 1
            return dataclasses.replace(floor, solver="greedy-fallback", status="BUDGET_SPENT", solve_time_s=0.0)
    prob = _build(units, cycle, floor.params)
    horizon = cycles * len(cycle)
    start = time.perf_counter()
    ends, status = _solve_cpsat(prob, horizon, _ends_of(hint or floor, horizon),
                                time_limit_s=time_limit_s, num_workers=num_workers, seed=seed)
    elapsed = time.perf_counter() - start
    if ends is None or ends[-1] < floor.units_completed:
        return dataclasses.replace(floor, solver="greedy-fallback", status=status,
                                   solve_time_s=elapsed)
    packing = _make_packing(prob, floor.params, ends, solver="cp-sat", status=status,
                            solve_time_s=elapsed)
    validate_packing(packing, units, cycle)
    return packing


# --- CP-SAT model -------------------------------------------------------------------------------
# One integer stream position per bubble boundary (where the chunk of each bubble ends), written
# as pos = n*q + r so that elapsed time, swap cost and memory room are element look-ups over one
# iteration (tables of size n) instead of over the whole horizon.


def _import_cp_model():  # noqa: ANN202 - the module is the return value
    try:
        from ortools.sat.python import cp_model  # noqa: PLC0415 - heavy, optional
    except ImportError as exc:
        raise ImportError("cpsat_pack needs OR-Tools: pip install ortools") from exc
    return cp_model


def _max_run(prob: _Problem, slot: int) -> int:
    """Longest chunk any start could put in this slot; swaps ignored (they only add time)."""
    budget = prob.usable_ns[slot] - prob.launch_ns
    if budget < 0:
        return 0
    dist = prob.blocked_distance(slot)
    cap = (budget // prob.prefix_ns[prob.n] + 1) * prob.n
    best = 0
    for r in range(prob.n):
        lo, hi = 0, cap if dist is None else min(cap, dist[r])
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if prob.elapsed(r + mid) - prob.elapsed(r) <= budget else (lo, mid - 1)
        best = max(best, lo)
    return best


@dataclass(frozen=True, slots=True)
class _Boundary:
    pos: object
    q: object
    r: object
    elapsed: object
    swap: object
    """An IntVar, or the constant 0 when no unit carries swappable state."""
    started: object | None


def _boundary(model: object, prob: _Problem, ub: int) -> _Boundary:
    n = prob.n
    pos, q, r = model.NewIntVar(0, ub, ""), model.NewIntVar(0, ub // n, ""), model.NewIntVar(0, n - 1, "")
    model.Add(pos == n * q + r)
    pre = model.NewIntVar(0, prob.prefix_ns[n - 1], "")
    model.AddElement(r, list(prob.prefix_ns[:n]), pre)
    elapsed = model.NewIntVar(0, prob.elapsed(ub), "")
    model.Add(elapsed == prob.prefix_ns[n] * q + pre)
    if not any(prob.swap_ns):
        return _Boundary(pos, q, r, elapsed, 0, None)
    table = [prob.swap_ns[(i - 1) % n] for i in range(n)]  # state left by the unit before pos
    raw, swap = model.NewIntVar(0, max(table), ""), model.NewIntVar(0, max(table), "")
    model.AddElement(r, table, raw)
    started = model.NewBoolVar("")  # at stream position 0 there is no state to reload
    model.Add(pos >= 1).OnlyEnforceIf(started)
    model.Add(pos == 0).OnlyEnforceIf(started.Not())
    model.Add(swap == raw).OnlyEnforceIf(started)
    model.Add(swap == 0).OnlyEnforceIf(started.Not())
    return _Boundary(pos, q, r, elapsed, swap, started)


def _bubble(model: object, prob: _Problem, slot: int, a: _Boundary, b: _Boundary,
            max_run: int, room: tuple[int, ...] | None) -> object:
    """Chunk [a.pos, b.pos) in slot: in order, fits usable time if non-empty, avoids any unit
    whose memory does not fit (``room[r]`` = units before the next such unit)."""
    model.Add(b.pos >= a.pos)
    model.Add(b.pos <= a.pos + max_run)
    used = model.NewBoolVar("")
    model.Add(b.pos >= a.pos + 1).OnlyEnforceIf(used)
    model.Add(b.pos == a.pos).OnlyEnforceIf(used.Not())
    busy = b.elapsed - a.elapsed + prob.launch_ns + a.swap + b.swap
    model.Add(busy <= prob.usable_ns[slot]).OnlyEnforceIf(used)
    if room is not None:
        free_run = model.NewIntVar(0, prob.n - 1, "")
        model.AddElement(a.r, list(room), free_run)
        model.Add(b.pos - a.pos <= free_run)
    return used


def _add_hint(model: object, prob: _Problem, bounds: list[_Boundary], used: list[object],
              ends: Sequence[int]) -> None:
    for bound, pos in zip(bounds, [0, *ends]):
        q, r = divmod(pos, prob.n)
        for var, value in ((bound.pos, pos), (bound.q, q), (bound.r, r),
                           (bound.elapsed, prob.elapsed(pos)), (bound.swap, prob.swap(pos)),
                           (bound.started, int(pos > 0))):
            if not isinstance(var, int) and var is not None:
                model.AddHint(var, value)
    for var, a, b in zip(used, [0, *ends], ends):
        model.AddHint(var, int(b > a))


def _solve_cpsat(prob: _Problem, horizon: int, hint_ends: Sequence[int], *, time_limit_s: float,
                 num_workers: int, seed: int) -> tuple[list[int] | None, str]:
    cp_model = _import_cp_model()
    model, nb = cp_model.CpModel(), len(prob.usable_ns)
    runs = [_max_run(prob, s) for s in range(nb)]
    rooms = [prob.blocked_distance(s) for s in range(nb)]
    bounds, used, ub = [_boundary(model, prob, 0)], [], 0
    for k in range(horizon):
        ub += runs[k % nb]
        bounds.append(_boundary(model, prob, ub))
        used.append(_bubble(model, prob, k % nb, bounds[-2], bounds[-1], runs[k % nb], rooms[k % nb]))
    # Units completed first; among equals, progress as early as possible (greedy-like, stable).
    model.Maximize((horizon * ub + 1) * bounds[-1].pos + sum(b.pos for b in bounds))
    _add_hint(model, prob, bounds, used, hint_ends)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = num_workers
    solver.parameters.random_seed = seed
    code = solver.Solve(model)
    if BUDGET.get() is not None:
        BUDGET.get().record(solver.StatusName(code), solver.ObjectiveValue(), solver.BestObjectiveBound(),
                            horizon * ub + 1, solver.WallTime())
    if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None, solver.StatusName(code)
    return [solver.Value(b.pos) for b in bounds[1:]], solver.StatusName(code)
