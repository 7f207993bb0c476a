"""Event-driven cluster simulator for fill jobs in pipeline bubbles (PipeFill §5.1).

As in PipeFill's simulator, the only events are fill-job arrivals and completions ("since these
are when the state of the system can change"); between events every rank runs its job's plan
(:class:`~planner.fill.job_scheduler.RankPlan`, profiled chunk times) in the rank's repeating bubble
cycle. At each event the Scheduler (:func:`~planner.fill.job_scheduler.choose`) submits pending jobs
to idle ranks.

Execution rules. A job submitted at time t starts at the first bubble that begins at or after t
and from then on runs the chunk its plan holds for each (cycle mod plan.cycles, slot) it visits;
the plan's cycle phase is the absolute main-job iteration, so every chunk runs in the bubble it
was packed for and never exceeds it. The last chunk is cut to the work left (its overhead is
kept whole). Chunks never run past ``horizon_s``. Work done is the sum of executed chunks'
work, by construction and as checked by the tests.

Metrics (sources in the seeds folder, file 001 = PipeFill, 000 = FreeRide):

- recovered fill TFLOP/s per GPU: fill FLOPs executed / (GPUs x horizon), PipeFill 6.1 (001 l.219:
  "total FLOPs executed ... divide this by the simulated fill-job completion times (wall-clock
  time); we average this value across all GPUs across the duration of the main job").
- relative performance P and GPUs saved, PipeFill 6.2 (001 l.241, 245, 253): P compares a job's
  speed while executing in bubbles, measured over "the total duration that they are executed (sum
  of all bubble durations used to complete the fill-job)" (l.241), with "their performance if they
  were run on separate, exclusive GPUs" (l.245). So P = dedicated seconds of the work done / sum of
  the durations of the bubbles the jobs ran in, and "for a main job using C GPUs with a bubble
  ratio of B and fill-job relative performance of P, we can approximate the GPUs saved by filling
  as C * B * P" (l.253). We also report ``gpus_worth``: dedicated seconds done / horizon, which is
  C*B*P discounted by the bubbles that went unused.
- time increase I and cost savings S, FreeRide A.3 (000 l.507-528), with T = horizon and the
  dedicated side-task time taken from ``TraceJob.dedicated_s_per_work``.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Sequence

from planner.fill.job_scheduler import (
    TIME_EPS_S,
    ExecutorState,
    TraceJob,
    JobView,
    Rank,
    RankPlan,
    SchedulerState,
    ScoreFn,
    Unplaceable,
    choose,
    job_view,
    placement,
    resolve_policy,
)

__all__ = [
    "CostReport",
    "ExecutedChunk",
    "JobOutcome",
    "Prices",
    "SimReport",
    "cost_savings",
    "gpus_saved",
    "run_job",
    "simulate",
]

WORK_EPS = 1e-9
"""Relative slack on work left below which a job counts as complete (float sums)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ExecutedChunk:
    """One chunk that ran in one bubble."""

    job: str
    rank: int
    cycle: int
    """Absolute main-job iteration."""
    slot: int
    start_s: float
    busy_s: float
    work: float
    flops: float
    bubble_s: float
    """Duration of the bubble it ran in."""
    overhead_s: float = 0.0
    """Part of busy_s that does no work (launch, load, state swap)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class JobOutcome:
    name: str
    kind: str
    rank: int | None
    """None if the job never started."""
    arrival_s: float
    start_s: float | None
    completion_s: float | None
    """None if the job did not finish within the horizon."""
    work: float
    work_done: float
    flops_done: float
    bubble_s_used: float
    """Sum of the durations of the bubbles the job ran chunks in."""
    dedicated_s: float
    """Seconds the whole job takes on a dedicated GPU."""
    deadline_s: float | None

    @property
    def jct_s(self) -> float | None:
        return None if self.completion_s is None else self.completion_s - self.arrival_s

    @property
    def slowdown(self) -> float | None:
        """Run time in bubbles (completion - start) over dedicated run time."""
        if self.completion_s is None or self.start_s is None or self.dedicated_s <= 0:
            return None
        return (self.completion_s - self.start_s) / self.dedicated_s

    @property
    def deadline_met(self) -> bool | None:
        if self.deadline_s is None:
            return None
        return self.completion_s is not None and self.completion_s <= self.deadline_s + TIME_EPS_S


@dataclass(frozen=True, kw_only=True, slots=True)
class Prices:
    """FreeRide A.3 prices: Server-I runs the main job, Server-II would run the side tasks."""

    main_per_gpu_hour: float
    side_per_gpu_hour: float
    main_time_increase: float = 0.0
    """Measured or assumed I; chunks here never overrun a bubble, so the simulator itself adds 0."""

    def __post_init__(self) -> None:
        if self.main_per_gpu_hour <= 0 or self.side_per_gpu_hour < 0 or self.main_time_increase < 0:
            raise ValueError(f"prices main={self.main_per_gpu_hour} must be > 0, side="
                             f"{self.side_per_gpu_hour} and main_time_increase="
                             f"{self.main_time_increase} >= 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class CostReport:
    time_increase: float
    """I = (T_with - T_no) / T_no."""
    savings: float
    """S = (C_side - (C_with - C_no)) / C_no."""
    cost_no_side: float
    cost_with_side: float
    cost_side_dedicated: float


@dataclass(frozen=True, kw_only=True, slots=True)
class SimReport:
    policy: str
    jobs: tuple[JobOutcome, ...]
    unplaceable: tuple[Unplaceable, ...]
    chunks: tuple[ExecutedChunk, ...]
    horizon_s: float
    gpus: int
    """C: GPUs the simulated ranks stand for (ranks x gpus_per_rank)."""
    bubble_s_total: float
    """Bubble time of all ranks within [0, horizon]."""
    bubble_s_used: float
    """Sum of executed chunks' busy time."""
    bubble_ratio: float
    """B: bubble time / (ranks x period), over whole cycles."""
    work_done: float
    fill_tflops_per_gpu: float
    relative_perf: float
    """P (PipeFill 6.2)."""
    gpus_saved: float
    """C * B * P (PipeFill 6.2)."""
    gpus_worth: float
    """Dedicated GPU-seconds of fill work done / horizon, scaled to C GPUs."""
    cost: CostReport | None
    busy_tflops_per_gpu: float = 0.0
    """Fill TFLOP/s per GPU while each rank has fill work (from a job's submission to its completion), averaged over
    the ranks (a rank without any counts 0): the plan's figure (FillPredictions.fill_tflops_per_gpu), where
    fill_tflops_per_gpu also counts the time a rank waits for arrivals or has finished its jobs."""
    busy_bubble_time_used: float = 0.0
    """Bubble time the chunks' work occupies (their overheads left out) while each rank has fill work, over all
    bubble time, weighted the same way: the plan's FillPredictions.bubble_time_used."""

    @property
    def finished(self) -> tuple[JobOutcome, ...]:
        return tuple(j for j in self.jobs if j.completion_s is not None)

    @property
    def mean_jct_s(self) -> float:
        done = self.finished
        return sum(j.jct_s for j in done) / len(done) if done else math.nan

    @property
    def makespan_s(self) -> float:
        """Last completion minus first arrival, over finished jobs."""
        done = self.finished
        if not done:
            return math.nan
        return max(j.completion_s for j in done) - min(j.arrival_s for j in self.jobs)

    @property
    def deadlines_met(self) -> int:
        return sum(1 for j in self.jobs if j.deadline_met)


def gpus_saved(gpus: float, bubble_ratio: float, relative_perf: float) -> float:
    """PipeFill 6.2: C * B * P."""
    return gpus * bubble_ratio * relative_perf


def cost_savings(*, main_gpus: int, main_time_s: float, side_dedicated_gpu_s: float,
                 prices: Prices) -> CostReport:
    """FreeRide A.3: C_no = P_I T_no, C_with = P_I T_with, C_side = sum P_II W / Th (per GPU)."""
    t_no = main_time_s
    t_with = t_no * (1.0 + prices.main_time_increase)
    c_no = prices.main_per_gpu_hour * main_gpus * t_no / 3600.0
    c_with = prices.main_per_gpu_hour * main_gpus * t_with / 3600.0
    c_side = prices.side_per_gpu_hour * side_dedicated_gpu_s / 3600.0
    savings = (c_side - (c_with - c_no)) / c_no if c_no > 0 else math.nan
    return CostReport(time_increase=(t_with - t_no) / t_no if t_no > 0 else 0.0, savings=savings,
                      cost_no_side=c_no, cost_with_side=c_with, cost_side_dedicated=c_side)


# --- executing one job on one rank ---------------------------------------------------------------


def _first_visit(rank: Rank, plan: RankPlan, t: float) -> tuple[int, int]:
    """(plan period index, chunk index) of the first plan chunk whose bubble starts at or after t."""
    k = max(0, math.floor(t / rank.period_s) - 1)
    q, base = divmod(k, plan.cycles)
    while True:
        for i, c in enumerate(plan.chunks):
            cycle = q * plan.cycles + c.cycle
            if cycle * rank.period_s + rank.starts_s[c.slot] >= t - TIME_EPS_S:
                return q, i
        q += 1


def run_job(job: TraceJob, rank_index: int, rank: Rank, start_s: float, work: float,
            horizon_s: float = math.inf) -> tuple[list[ExecutedChunk], float | None]:
    """Chunks that do ``work`` of ``job`` on a rank from ``start_s``, and the completion time
    (None if the horizon cuts it off)."""
    plan = job.plans[rank_index]
    if plan is None or not plan.chunks:
        raise ValueError(f"job {job.name!r} has no plan on rank {rank_index}")
    out: list[ExecutedChunk] = []
    left, tol = work, WORK_EPS * max(1.0, work)
    q, i = _first_visit(rank, plan, start_s)
    while True:
        c = plan.chunks[i]
        cycle = q * plan.cycles + c.cycle
        begin = cycle * rank.period_s + rank.starts_s[c.slot]
        done = min(c.work, left)
        frac = done / c.work
        busy = c.overhead_s + (c.busy_s - c.overhead_s) * frac
        if begin + busy > horizon_s:
            return out, None
        out.append(ExecutedChunk(job=job.name, rank=rank_index, cycle=cycle, slot=c.slot,
                                 start_s=begin, busy_s=busy, work=done, flops=c.flops * frac,
                                 bubble_s=rank.slots[c.slot].duration_s, overhead_s=c.overhead_s))
        left -= done
        if left <= tol:
            return out, begin + busy
        i += 1
        if i == len(plan.chunks):
            q, i = q + 1, 0


# --- the event loop ------------------------------------------------------------------------------


@dataclass(slots=True)
class _Exec:
    busy_until: float = 0.0
    running: str | None = None
    assigned_s: float = 0.0


@dataclass(slots=True)
class _Loop:
    """Mutable state of one simulation (private; results leave as frozen dataclasses)."""

    jobs: list[TraceJob]
    infos: list[JobView]
    allowed: dict[str, tuple[int, ...]]
    ranks: Sequence[Rank]
    score: ScoreFn
    horizon: float
    execs: list[_Exec]
    pending: list[JobView]
    chunks: list[ExecutedChunk]
    started: dict[str, tuple[int, float]]
    completed: dict[str, float]
    busy: list[float]
    """Per rank, seconds from each job's submission to its completion (or the horizon)."""

    def state(self, now: float) -> SchedulerState:
        return SchedulerState(now_s=now, executors=tuple(
            ExecutorState(rank=i, busy_until_s=e.busy_until, running=e.running,
                          assigned_s=e.assigned_s) for i, e in enumerate(self.execs)))

    def dispatch(self, now: float, events: list) -> None:
        while self.pending and now < self.horizon:
            idle = [i for i, e in enumerate(self.execs) if e.running is None]
            if not idle:
                return
            pick = choose(self.pending, idle, self.state(now), self.score, self.allowed)
            if pick is None:
                return
            info, r = pick
            self.pending.remove(info)
            self.start(info, r, now, events)

    def start(self, info: JobView, r: int, now: float, events: list) -> None:
        job, e = self.jobs[info.index], self.execs[r]
        chunks, end = run_job(job, r, self.ranks[r], now, job.work, self.horizon)
        self.chunks.extend(chunks)
        self.started[job.name] = (r, chunks[0].start_s if chunks else now)
        e.running, e.assigned_s = job.name, e.assigned_s + info.proc_times[r]
        e.busy_until = self.horizon if end is None else end
        self.busy[r] += e.busy_until - now
        if end is not None:
            self.completed[job.name] = end
            heapq.heappush(events, (end, 0, info.index, r))

    def run(self, placeable: Sequence[int]) -> None:
        # (time, kind, job index, rank): at a tie, completions (kind 0) free ranks before
        # arrivals (kind 1) are queued, and one dispatch then sees both.
        events = [(self.jobs[k].arrival_s, 1, k, -1) for k in placeable]
        heapq.heapify(events)
        while events:
            now = events[0][0]
            while events and events[0][0] <= now:
                _, kind, k, r = heapq.heappop(events)
                if kind == 0:
                    self.execs[r].running = None
                else:
                    self.pending.append(self.infos[k])
            self.pending.sort(key=lambda i: i.index)
            self.dispatch(now, events)


def _check_inputs(jobs: Sequence[TraceJob], ranks: Sequence[Rank]) -> None:
    if not ranks:
        raise ValueError("simulate needs at least one rank")
    names = [j.name for j in jobs]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ValueError(f"job names must be unique; {dup!r} appears {names.count(dup)} times")
    for j in jobs:
        for r, plan in enumerate(j.plans):
            bad = [] if plan is None else [c.slot for c in plan.chunks if c.slot >= len(ranks[r].slots)]
            if bad:
                raise ValueError(f"job {j.name!r}: plan on rank {r} uses slot {bad[0]}, the rank "
                                 f"has {len(ranks[r].slots)} bubbles")


def simulate(
    jobs: Sequence[TraceJob], ranks: Sequence[Rank], policy: str | ScoreFn = "fifo", *,
    horizon_s: float | None = None, gpus_per_rank: int = 1, prices: Prices | None = None,
) -> SimReport:
    """Run the trace to completion (or to ``horizon_s``) and measure it.

    Without a horizon, the horizon is the last completion. ``gpus_per_rank`` scales C when the
    ranks stand for more GPUs with the same bubbles (e.g. one pipeline slice of a larger cluster).
    """
    _check_inputs(jobs, ranks)
    score = resolve_policy(policy)
    infos = [job_view(j, ranks, k) for k, j in enumerate(jobs)]
    where = {j.name: placement(j, ranks) for j in jobs}
    unplaceable = tuple(w for w in where.values() if isinstance(w, Unplaceable))
    allowed = {n: w for n, w in where.items() if not isinstance(w, Unplaceable)}
    placeable = [k for k, j in enumerate(jobs) if j.name in allowed]
    horizon = math.inf if horizon_s is None else horizon_s
    loop = _Loop(jobs=list(jobs), infos=infos, allowed=allowed, ranks=ranks, score=score,
                 horizon=horizon, execs=[_Exec() for _ in ranks], pending=[], chunks=[],
                 started={}, completed={}, busy=[0.0] * len(ranks))
    loop.run(placeable)
    if horizon_s is None:
        horizon = max([*loop.completed.values(), 0.0])
    name = policy if isinstance(policy, str) else getattr(policy, "__name__", "custom")
    return _report(name, jobs, ranks, loop, unplaceable, horizon, gpus_per_rank, prices)


# --- measuring -----------------------------------------------------------------------------------


def _bubble_time_until(rank: Rank, horizon: float) -> float:
    """Bubble time of one rank within [0, horizon]."""
    if horizon <= 0:
        return 0.0
    full, rest = divmod(horizon, rank.period_s)
    tail = sum(min(s.duration_s, max(0.0, rest - start)) for s, start in zip(rank.slots, rank.starts_s))
    return full * rank.bubble_s + tail


def _outcomes(jobs: Sequence[TraceJob], loop: _Loop) -> tuple[JobOutcome, ...]:
    work: dict[str, list[float]] = {j.name: [0.0, 0.0, 0.0] for j in jobs}
    for c in loop.chunks:
        acc = work[c.job]
        acc[0] += c.work
        acc[1] += c.flops
        acc[2] += c.bubble_s
    out = []
    for j in jobs:
        rank, start = loop.started.get(j.name, (None, None))
        done, flops, bubble = work[j.name]
        out.append(JobOutcome(name=j.name, kind=j.kind, rank=rank, arrival_s=j.arrival_s,
                              start_s=start, completion_s=loop.completed.get(j.name), work=j.work,
                              work_done=done, flops_done=flops, bubble_s_used=bubble,
                              dedicated_s=j.dedicated_s, deadline_s=j.deadline_s))
    return tuple(out)


def _report(policy: str, jobs: Sequence[TraceJob], ranks: Sequence[Rank], loop: _Loop,
            unplaceable: tuple[Unplaceable, ...], horizon: float, gpus_per_rank: int,
            prices: Prices | None) -> SimReport:
    outcomes = _outcomes(jobs, loop)
    per_work = {j.name: j.dedicated_s_per_work for j in jobs}
    dedicated_done = math.fsum(o.work_done * per_work[o.name] for o in outcomes)
    bubble_used_by_jobs = math.fsum(o.bubble_s_used for o in outcomes)
    perf = dedicated_done / bubble_used_by_jobs if bubble_used_by_jobs > 0 else 0.0
    ratio = sum(r.bubble_s for r in ranks) / sum(r.period_s for r in ranks)
    gpus = len(ranks) * gpus_per_rank
    flops = math.fsum(c.flops for c in loop.chunks)
    busy_flops, busy_used = _while_busy(ranks, loop)
    cost = None if prices is None or horizon <= 0 else cost_savings(
        main_gpus=gpus, main_time_s=horizon, side_dedicated_gpu_s=dedicated_done * gpus_per_rank,
        prices=prices)
    return SimReport(
        policy=policy, jobs=outcomes, unplaceable=unplaceable,
        chunks=tuple(sorted(loop.chunks, key=lambda c: (c.rank, c.start_s))),
        horizon_s=horizon, gpus=gpus,
        bubble_s_total=math.fsum(_bubble_time_until(r, horizon) for r in ranks),
        bubble_s_used=math.fsum(c.busy_s for c in loop.chunks), bubble_ratio=ratio,
        work_done=math.fsum(o.work_done for o in outcomes),
        fill_tflops_per_gpu=flops / (len(ranks) * horizon) / 1e12 if horizon > 0 else 0.0,
        relative_perf=perf, gpus_saved=gpus_saved(gpus, ratio, perf),
        gpus_worth=dedicated_done * gpus_per_rank / horizon if horizon > 0 else 0.0,
        cost=cost, busy_tflops_per_gpu=busy_flops / 1e12, busy_bubble_time_used=busy_used,
    )


def _while_busy(ranks: Sequence[Rank], loop: _Loop) -> tuple[float, float]:
    """(FLOP/s per GPU, share of bubble time worked) while each rank has fill work, averaged over the ranks as the
    planner averages its steady rates (planner/fill/assign.py FillAssignment.per_cycle)."""
    flops, work = [0.0] * len(ranks), [0.0] * len(ranks)
    for c in loop.chunks:
        flops[c.rank] += c.flops
        work[c.rank] += c.busy_s - c.overhead_s
    rate = [f / b if b > 0 else 0.0 for f, b in zip(flops, loop.busy)]
    used = [w / b if b > 0 else 0.0 for w, b in zip(work, loop.busy)]
    bubble = math.fsum(r.bubble_s / r.period_s for r in ranks)
    return math.fsum(rate) / len(ranks), math.fsum(used) / bubble if bubble > 0 else 0.0
