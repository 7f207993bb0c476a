"""Fill-job scheduling across ranks: PipeFill's score-based Scheduler (§4.4) with FreeRide's placement.

Model (PipeFill §4.4, "pull"): each rank's Executor runs one fill job at a time. Whenever a job
arrives or a rank finishes its job, the Scheduler looks at every (pending job, idle rank) pair the
job can run on and submits the pair with the highest score. A score is a function
``score(job, state, rank)`` of the job's information (arrival, deadline, processing time on every
rank), the state of all Executors, and the candidate rank.

Placement (FreeRide appendix A.2): a job may only go to a rank whose bubbles have enough free
memory for it (and, here, whose packing completes any work at all); among equally scored
candidates the least-loaded rank wins. FreeRide measures load as the number of tasks waiting on a
worker; in the pull model every candidate is idle, so that ties at zero and the next measure, the
work already assigned to the rank (seconds), decides. Jobs no rank can run are reported as
:class:`Unplaceable` with the reason instead of raising.

Built-in policies (``POLICIES``): 'fifo' (earliest arrival), 'sjf' (PipeFill's
``1 / min(proc_times)``), 'makespan' (PipeFill's ``1 / max(proc_times[i], s.rem_times)``: the pair that
leaves the least time until every Executor is idle again), 'edf' (earliest
deadline; jobs without one after all jobs with one), each after the job's priority (higher first). Built-ins
return tuples compared lexicographically; user functions return a float (and see the priority in JobView).
"""

from __future__ import annotations

import importlib.util
import inspect
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal, Sequence, Union

from planner.fill.packing import BubbleSlot, Packing

__all__ = [
    "POLICIES",
    "ExecutorState",
    "TraceJob",
    "JobView",
    "PlanChunk",
    "Rank",
    "RankPlan",
    "SchedulerState",
    "ScoreFn",
    "Unplaceable",
    "choose",
    "next_on_rank",
    "job_view",
    "load_score_function",
    "placement",
    "resolve_policy",
]

TIME_EPS_S = 1e-9


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanChunk:
    """One chunk of a job's plan on a rank: what it does in one bubble of one cycle."""

    cycle: int
    """Cycle within the plan's period, 0..cycles-1."""
    slot: int
    """Index of the bubble in the rank's cycle."""
    work: float
    """Work completed (units of the job's linearized stream)."""
    busy_s: float
    """Time the chunk occupies in its bubble: work time plus overhead."""
    overhead_s: float = 0.0
    """Part of ``busy_s`` that does no work (launch, state swap); kept whole when a chunk is cut."""
    flops: float = 0.0

    def __post_init__(self) -> None:
        if self.cycle < 0 or self.slot < 0:
            raise ValueError(f"chunk cycle={self.cycle} and slot={self.slot} must be >= 0")
        if not (self.work > 0 and self.busy_s >= self.overhead_s >= 0 and self.flops >= 0):
            raise ValueError(
                f"chunk at cycle {self.cycle} slot {self.slot}: need work > 0 (got {self.work}), "
                f"busy_s >= overhead_s >= 0 (got {self.busy_s}, {self.overhead_s}), flops >= 0"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class RankPlan:
    """A job's execution plan on one rank over ``cycles`` bubble cycles, rerun back to back
    (PipeFill Algorithm 1 replicates the graph to about one plan per bubble cycle and reruns it)."""

    chunks: tuple[PlanChunk, ...]
    cycles: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "chunks", tuple(sorted(self.chunks, key=lambda c: (c.cycle, c.slot))))
        if self.cycles < 1:
            raise ValueError(f"plan cycles={self.cycles} must be >= 1")
        keys = [(c.cycle, c.slot) for c in self.chunks]
        if len(set(keys)) != len(keys):
            raise ValueError(f"plan has two chunks in one bubble: {keys}")
        late = [c.cycle for c in self.chunks if c.cycle >= self.cycles]
        if late:
            raise ValueError(f"plan chunk in cycle {late[0]} but the plan spans {self.cycles} cycles")

    @property
    def work_per_cycle(self) -> float:
        return sum(c.work for c in self.chunks) / self.cycles

    @classmethod
    def from_packing(cls, packing: Packing) -> RankPlan:
        """Work = units of the stream; a packing's chunk cycles already lie in 0..cycles-1."""
        return cls(
            chunks=tuple(
                PlanChunk(cycle=c.cycle, slot=c.slot, work=float(c.num_units),
                          busy_s=c.time_s + c.overhead_s, overhead_s=c.overhead_s, flops=c.flops)
                for c in packing.chunks
            ),
            cycles=packing.params.cycles,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class Rank:
    """A GPU's repeating bubble cycle: one cycle per main-job iteration."""

    id: int
    slots: tuple[BubbleSlot, ...]
    period_s: float
    """Main-job iteration time."""
    starts_s: tuple[float, ...] = ()
    """Offset of each slot from the cycle start; empty means back to back from 0."""

    def __post_init__(self) -> None:
        slots = tuple(self.slots)
        starts = tuple(self.starts_s) if self.starts_s else _back_to_back(slots)
        object.__setattr__(self, "slots", slots)
        object.__setattr__(self, "starts_s", starts)
        if len(starts) != len(slots):
            raise ValueError(f"rank {self.id}: {len(starts)} start offsets for {len(slots)} slots")
        end = 0.0
        for s, start in zip(slots, starts):
            if start < end - TIME_EPS_S:
                raise ValueError(f"rank {self.id}: bubble {s.id} starts at {start} s, before the "
                                 f"previous bubble ends at {end} s")
            end = start + s.duration_s
        if not self.period_s > 0 or end > self.period_s + TIME_EPS_S:
            raise ValueError(f"rank {self.id}: bubbles end at {end} s, period_s={self.period_s} "
                             "must be > 0 and cover them")

    @property
    def bubble_s(self) -> float:
        return sum(s.duration_s for s in self.slots)

    @property
    def max_free_bytes(self) -> int:
        return max((s.free_bytes for s in self.slots), default=0)


def _back_to_back(slots: Sequence[BubbleSlot]) -> tuple[float, ...]:
    starts, t = [], 0.0
    for s in slots:
        starts.append(t)
        t += s.duration_s
    return tuple(starts)


@dataclass(frozen=True, kw_only=True, slots=True)
class TraceJob:
    """A job of a fill-job trace, with its packing plan on every rank (the cluster simulator's view; the plan
    file's record of a fill job is planner.plan.FillJob)."""

    name: str
    work: float
    """Work to do, in the units its plans count (stream units or iterations)."""
    plans: tuple[RankPlan | None, ...]
    """Per rank index: the job's plan there, or None where packing found no way to run it."""
    mem_bytes: int = 0
    """Device memory the job needs in a bubble: resident state plus its largest unit's working set."""
    arrival_s: float = 0.0
    deadline_s: float | None = None
    """Absolute time by which the job should complete."""
    priority: float = 0.0
    """Free for user score functions; the built-in policies ignore it."""
    kind: str = ""
    dedicated_s_per_work: float = 0.0
    """Seconds per unit of work on a dedicated GPU (for slowdown, GPUs saved and cost savings)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "plans", tuple(self.plans))
        if not (self.work > 0 and self.mem_bytes >= 0 and self.arrival_s >= 0
                and self.dedicated_s_per_work >= 0):
            raise ValueError(f"job {self.name!r}: work={self.work} must be > 0; mem_bytes="
                             f"{self.mem_bytes}, arrival_s={self.arrival_s} and dedicated_s_per_work="
                             f"{self.dedicated_s_per_work} must be >= 0")

    @property
    def dedicated_s(self) -> float:
        return self.work * self.dedicated_s_per_work


@dataclass(frozen=True, kw_only=True, slots=True)
class Unplaceable:
    """A job no rank can run, and why."""

    job: str
    reason: Literal["memory", "time", "unplaceable", "not chosen"]
    """'memory': no bubble has enough free memory; 'time': memory fits but no bubble is long
    enough for the job's packing to complete any work; 'unplaceable' and 'not chosen': the planner's placement
    (planner/fill/assign.py) found no bubble for it, or none beside the jobs already on the ranks it fits."""
    detail: str


@dataclass(frozen=True, kw_only=True, slots=True)
class JobView:
    """What a score function sees of a job (PipeFill: arrival, processing times, deadline): a view of it made where
    the decision is, from a trace's TraceJob (job_view), from a job's profiles while planning (planner/fill/assign.py)
    or from the plan's FillJob at run time (planner/runtime/fill_executor.py)."""

    name: str
    kind: str
    arrival_s: float
    deadline_s: float | None
    priority: float
    work: float
    proc_times: tuple[float, ...]
    """Estimated seconds to run the whole job on each rank (inf where it cannot run)."""
    index: int
    """Position of the job in the trace (a stable tie-break)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ExecutorState:
    rank: int
    busy_until_s: float
    running: str | None
    assigned_s: float
    """Estimated seconds of all jobs submitted to this rank so far (the placement load)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SchedulerState:
    """All Executors at the moment of a decision."""

    now_s: float
    executors: tuple[ExecutorState, ...]

    @property
    def rem_times(self) -> tuple[float, ...]:
        """PipeFill's ``s.rem_times``: how long each Executor stays busy from now."""
        return tuple(max(0.0, e.busy_until_s - self.now_s) for e in self.executors)


ScoreFn = Callable[[JobView, SchedulerState, int], Union[float, tuple]]


def proc_time(job: TraceJob, rank: Rank, plan: RankPlan | None) -> float:
    """Seconds to finish ``job.work`` at the plan's steady rate (inf if it does no work)."""
    if plan is None or plan.work_per_cycle <= 0:
        return math.inf
    return job.work / plan.work_per_cycle * rank.period_s


def job_view(job: TraceJob, ranks: Sequence[Rank], index: int) -> JobView:
    times = tuple(proc_time(job, r, p) if r.max_free_bytes >= job.mem_bytes else math.inf
                  for r, p in zip(ranks, job.plans))
    return JobView(name=job.name, kind=job.kind, arrival_s=job.arrival_s, deadline_s=job.deadline_s,
                   priority=job.priority, work=job.work, proc_times=times, index=index)


def placement(job: TraceJob, ranks: Sequence[Rank]) -> tuple[int, ...] | Unplaceable:
    """Ranks the job can run on (FreeRide A.2 memory filter, plus a plan that does work)."""
    if len(job.plans) != len(ranks):
        raise ValueError(f"job {job.name!r} has {len(job.plans)} plans for {len(ranks)} ranks")
    fits = [i for i, r in enumerate(ranks) if r.max_free_bytes >= job.mem_bytes]
    if not fits:
        most = max((r.max_free_bytes for r in ranks), default=0)
        return Unplaceable(job=job.name, reason="memory", detail=(
            f"it needs {job.mem_bytes / 2**30:.2f} GiB, more than any bubble has free ({most / 2**30:.2f} GiB)"))
    ok = tuple(i for i in fits if job.plans[i] is not None and job.plans[i].work_per_cycle > 0)
    if not ok:
        longest = max((s.duration_s for i in fits for s in ranks[i].slots), default=0.0)
        return Unplaceable(job=job.name, reason="time", detail=(
            f"memory fits on {len(fits)} rank(s) but no bubble there is long enough to complete "
            f"any work (longest bubble {longest * 1e3:.1f} ms)"))
    return ok


# --- policies ------------------------------------------------------------------------------------


def _least_loaded(state: SchedulerState, rank: int) -> float:
    return -state.executors[rank].assigned_s


# Every built-in policy ranks a job's priority first (higher first, as the job file says), then by its own rule:
# PipeFill's hierarchical policy (001 l.172), a user's ordering above the scheduler's.


def fifo_score(job: JobView, state: SchedulerState, rank: int) -> tuple:
    return (job.priority, -job.arrival_s, _least_loaded(state, rank))


def sjf_score(job: JobView, state: SchedulerState, rank: int) -> tuple:
    return (job.priority, -min(job.proc_times), _least_loaded(state, rank))


def makespan_score(job: JobView, state: SchedulerState, rank: int) -> tuple:
    """PipeFill 4.4 (001 l.169-172): 1 / max(j.proc_times[i], s.rem_times), the longest any Executor stays busy
    once the job starts on executor i; higher is better, so the key is its negation."""
    return (job.priority, -max((job.proc_times[rank], *state.rem_times)), _least_loaded(state, rank))


def edf_score(job: JobView, state: SchedulerState, rank: int) -> tuple:
    deadline = -math.inf if job.deadline_s is None else -job.deadline_s
    return (job.priority, deadline, -job.arrival_s, _least_loaded(state, rank))


POLICIES: dict[str, ScoreFn] = {
    "fifo": fifo_score,
    "sjf": sjf_score,
    "makespan": makespan_score,
    "edf": edf_score,
}


def resolve_policy(policy: str | ScoreFn) -> ScoreFn:
    """A built-in policy by name, or a score function as is."""
    if callable(policy):
        return policy
    if policy in POLICIES:
        return POLICIES[policy]
    raise ValueError(f"unknown policy {policy!r}; expected one of {sorted(POLICIES)} or a score "
                     "function (see load_score_function)")


def load_score_function(path: str | Path) -> ScoreFn:
    """Load ``score(job, state, rank) -> float`` from a Python file; ValueError names what is missing."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"score file {path} does not exist")
    spec = importlib.util.spec_from_file_location(f"_fill_score_{abs(hash(str(path)))}", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"score file {path} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - any error in user code is a bad file
        raise ValueError(f"score file {path} failed to load: {type(exc).__name__}: {exc}") from exc
    fn = getattr(module, "score", None)
    if fn is None:
        raise ValueError(f"score file {path} defines no function `score(job, state, rank)`")
    if not callable(fn):
        raise ValueError(f"`score` in {path} is a {type(fn).__name__}, not a function "
                         "`score(job, state, rank)`")
    try:
        inspect.signature(fn).bind(None, None, None)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"`score` in {path} must take three arguments (job, state, rank): {exc}") from exc
    return fn


def _checked(value: object, job: JobView, rank: int) -> float | tuple:
    if isinstance(value, tuple):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"score for job {job.name!r} on rank {rank} is {value!r}; "
                         "a score function must return a number (not NaN)")
    return float(value)


def choose(
    pending: Sequence[JobView], idle: Sequence[int], state: SchedulerState, score: ScoreFn,
    allowed: dict[str, tuple[int, ...]],
) -> tuple[JobView, int] | None:
    """The (job, rank) with the highest score among pending jobs and idle ranks they may run on.

    Ties go to the earlier job in ``pending`` and then the earlier rank in ``idle``.
    """
    best, best_key = None, None
    idle_set = set(idle)
    for job in pending:
        for rank in allowed[job.name]:
            if rank not in idle_set:
                continue
            key = _checked(score(job, state, rank), job, rank)
            if best_key is None or key > best_key:
                best, best_key = (job, rank), key
    return best


def next_on_rank(pending: Sequence[JobView], rank: int, ranks: int, now_s: float, score: ScoreFn) -> JobView | None:
    """The job one rank's executor runs next when its job ends: the pull model with that rank the idle Executor.
    It cannot see the other ranks (they run their own queues), so their state reads idle. The planner predicts
    each rank's turns and the runtime's fill executor picks them with this same function."""
    state = SchedulerState(now_s=now_s, executors=tuple(
        ExecutorState(rank=r, busy_until_s=now_s, running=None, assigned_s=0.0) for r in range(ranks)))
    got = choose(pending, [rank], state, score, {j.name: (rank,) for j in pending})
    return None if got is None else got[0]
