"""The fill executor: one process per main-job rank that runs fill jobs inside the pipeline bubbles.

It is FreeRide's side-task manager and worker for one GPU (§3.1, §3.2, appendix A.1-A.2) executing
PipeFill's bubble signals (§4.2-4.3). Each fill job is a side task with its own process
(planner/runtime/fill_task.py) and walks the state machine

    SUBMITTED -CreateSideTask-> CREATED -InitSideTask-> PAUSED <-StartSideTask / PauseSideTask-> RUNNING
    RUNNING -RunNextStep-> RUNNING;  CREATED | PAUSED | RUNNING -StopSideTask-> STOPPED

CreateSideTask starts the task process, which builds the model with real weights (and its optimizer)
in host memory; InitSideTask moves it to the device and times every linearized unit. It runs at
setup, while the main job waits for "ready" between its steps with the device idle: run in a bubble
(A.2), a move-and-profile longer than the bubble plus the grace period, as it is for a bubble that
holds a few chunks, would get the task killed before it did any work. Only a task not initialized
by its first bubble (the main job stopped waiting) is initialized there, under a step's limit.
StartSideTask and PauseSideTask follow the bubbles; StopSideTask ends it when its work is done, it
raised or its process died, it was killed, or at shutdown.

Two interfaces (A.1). *iterative*: the manager sends one linearized unit at a time ("step") and
starts it only if the bubble's usable time (duration x (1 - safety margin)) still covers the unit's
profiled (or recently observed, if longer) duration: the program-directed limit of §3.2.3. An
observation's excess over the profile halves with every bubble the unit is not started in. On a time-sliced GPU
(CUDA, the plan's gpu_sharing timeslice) a run of short units (physics.batched) goes as one request and ends
in one synchronize, each unit still admitted by its estimate (planner/fill/physics.py: BATCH_WORK_S).
*imperative*: the task loops over its units on its own; the manager resumes it with SIGCONT and
stops it with SIGSTOP at the end of the usable time, and counts it paused once /proc shows it
stopped. Framework-enforced limit: a task not paused by the pause point (bubble end or deadline,
whichever is first) plus the grace period is SIGKILLed (for the iterative interface that is the
process running the late step; an InitSideTask run in a bubble is protected the same way) and recorded; its job is
STOPPED. The main job never waits for any of it.

Protocols (all over one-way pipes; writes below PIPE_BUF are atomic, so a stopped or killed task
never leaves half a message):
  client -> executor: BubbleBegin, BubbleEnd, Request("report" | "close")
  executor -> client: ("ready", {job: state}), ("report", dict), ("closed", None), ("crashed", text)
  executor -> task:   ("init", free_bytes), ("step", pos, release, free_bytes), ("steps", pos, n, free_bytes): n
                      units back to back, one synchronize, ("run", free_bytes), ("stop",),
                      ("unload",): a streamed job's weights leave the device (the bubble ended)
  task -> executor:   ("created", info), ("inited", [unit seconds] | None), ("failed", text),
                      ("step" | "unit", pos, start, end, start_mono, end_mono, iteration_done, info), ("steps",
                      [such "step" tuples, one per unit run]), ("done",),
                      ("wait", pos): the unit (a data-parallel optimizer step) waits on the replicas' gradients

Work and turns (planner/fill/assign.py). A rank's jobs run one at a time: the current one keeps the bubbles until
it stops, then the plan's policy picks the next among those that have arrived (planner.fill.job_scheduler.next_on_rank,
the function the planner predicted the turns with). A bubble the current job has no chunk in (too short for its
units, or too little memory) goes to the first arrived job the plan packed into it. This GPU runs only its share
of each job: replica k of the stage's R GPUs takes batches first + k, first + k + R, ... of the rank's shard
(FillShard); a training job's R replicas are data parallel, averaging gradients in host memory over gloo while the main job runs, so no
collective ever waits inside a bubble: the optimizer step is only started once the average has arrived.
Two paired training jobs (plan.fill.pairs, Waterwave) share one turn: their units are interleaved by the pair's
rule, each admitted only while the two stay within the pair's memory budget.

This module never imports torch: the manager stays light and starts fast.
"""
from __future__ import annotations

import enum
import math
import multiprocessing as mp
import os
import signal
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing import connection
from typing import Any, Literal

from planner.fill.physics import BATCH_WORK_S, STEP_ALLOWANCE_S, STEP_SAFETY, batched
from planner.fill.job_scheduler import JobView, next_on_rank, resolve_policy
from planner.fill.waterwave import PairLedger
from planner.plan import FillJob, Plan

__all__ = ["GRACE_S", "State", "Transition", "TRANSITIONS", "IllegalTransition", "SideTaskState",
           "FillExecutorOptions", "TaskOptions", "BubbleBegin", "BubbleEnd", "Request", "Occurrence", "TaskHandle",
           "FillExecutor", "executor_main"]

Interface = Literal["iterative", "imperative"]
GRACE_S = 0.05
"""How long past a bubble's pause point a fill task may run before it is killed (FreeRide 3.2.3's grace period):
the default of the runtime's --fill-grace."""
LOADS_KEPT = 200
"""Weight loads of a streamed job kept for the report (the count goes on)."""
WAIT_POLL_S = 2e-3
"""How soon a task whose optimizer step waits on its data-parallel replicas' gradients is asked again."""
MAX_BATCH_UNITS = 64
"""The most units one batch request carries (its reply lists each)."""


class State(str, enum.Enum):
    SUBMITTED = "SUBMITTED"
    CREATED = "CREATED"
    PAUSED = "PAUSED"
    RUNNING = "RUNNING"
    STOPPED = "STOPPED"


class Transition(str, enum.Enum):
    CREATE = "CreateSideTask"
    INIT = "InitSideTask"
    START = "StartSideTask"
    RUN_NEXT_STEP = "RunNextStep"
    PAUSE = "PauseSideTask"
    STOP = "StopSideTask"


TRANSITIONS: dict[Transition, tuple[frozenset[State], State]] = {
    Transition.CREATE: (frozenset({State.SUBMITTED}), State.CREATED),
    Transition.INIT: (frozenset({State.CREATED}), State.PAUSED),
    Transition.START: (frozenset({State.PAUSED}), State.RUNNING),
    Transition.RUN_NEXT_STEP: (frozenset({State.RUNNING}), State.RUNNING),
    Transition.PAUSE: (frozenset({State.RUNNING}), State.PAUSED),
    Transition.STOP: (frozenset({State.CREATED, State.PAUSED, State.RUNNING}), State.STOPPED),
}
"""FreeRide Figure 3(a): transition -> (states it may start from, state it leads to)."""


class IllegalTransition(RuntimeError):
    """A transition that FreeRide's state machine does not allow from the task's current state."""


@dataclass(kw_only=True, slots=True)
class SideTaskState:
    """One side task's state and the shared log every transition is appended to."""

    job: str
    state: State = State.SUBMITTED
    log: list[dict[str, Any]] = field(default_factory=list)

    def can(self, transition: Transition) -> bool:
        return self.state in TRANSITIONS[transition][0]

    def apply(self, transition: Transition, *, reason: str = "", at: float | None = None) -> State:
        sources, target = TRANSITIONS[transition]
        if self.state not in sources:
            allowed = " or ".join(sorted(s.value for s in sources))
            raise IllegalTransition(f"{transition.value} is not allowed from {self.state.value} (fill job "
                                    f"{self.job!r}); it starts from {allowed}")
        self.log.append({"t": time.time() if at is None else at, "job": self.job, "transition": transition.value,
                         "from": self.state.value, "to": target.value, "reason": reason})
        self.state = target
        return target


@dataclass(frozen=True, kw_only=True, slots=True)
class FillExecutorOptions:
    """How the executor runs its fill jobs (the plan says which jobs and bubbles, not these)."""

    interface: dict[str, Interface] = field(default_factory=dict)
    """Fill job name -> side-task interface; jobs not named use `default_interface`."""
    default_interface: Interface = "iterative"
    iterations: dict[str, int] = field(default_factory=dict)
    """Fill job name -> iterations after which its work is done (STOPPED); absent: the plan's
    FillJob.iterations (the fill spec's amount of work), else it runs until shutdown."""
    profile_reps: int = 3
    """Timed passes over the linearized units during InitSideTask (after one warm-up pass)."""
    step_safety: float = STEP_SAFETY
    """A step starts only if usable time left >= profiled (or recently observed) time x this + overhead (the
    planner prices chunks with the same numbers: planner/fill/physics.py)."""
    step_overhead_s: float = STEP_ALLOWANCE_S
    cpu_threads: int = 1
    """torch threads of a task process on CPU, so fill work does not crowd the main job's cores."""
    seed: int = 0
    batch_work_s: float | None = None
    """Run a resident, unpaired iterative job's short units (physics.batched) in batches of up to this much
    of their profiled work, one synchronize per batch (planner/fill/physics.py: BATCH_WORK_S, runtime_unit_s); 0:
    one unit per request. None: the plan decides (batches on CUDA where its fill is time-sliced)."""
    replicas: int | None = None
    """GPUs of the pipeline rank that run its fill jobs, dividing them (None: all of them, the plan's dp x cp x tp; a
    rehearsal of one rank runs one)."""

    def __post_init__(self) -> None:
        bad = {k: v for k, v in self.interface.items() if v not in ("iterative", "imperative")}
        if bad or self.default_interface not in ("iterative", "imperative"):
            raise ValueError(f"interfaces must be 'iterative' or 'imperative', got {bad or self.default_interface}")
        if self.batch_work_s is not None and self.batch_work_s < 0:
            raise ValueError(f"batch_work_s={self.batch_work_s} must be >= 0")
        if self.profile_reps < 1 or self.step_safety < 1 or self.cpu_threads < 1:
            raise ValueError(f"profile_reps={self.profile_reps} and cpu_threads={self.cpu_threads} must be >= 1, "
                             f"step_safety={self.step_safety} must be >= 1")

    def interface_of(self, job: str) -> Interface:
        return self.interface.get(job, self.default_interface)


@dataclass(frozen=True, kw_only=True, slots=True)
class TaskOptions:
    """How one task process runs its fill job on this GPU. The job itself is the plan's FillJob, which the process
    gets beside these (its model, batch size, configuration, units, weights resident or streamed); these are what
    this GPU and this run add: the device and interface, its share of the job's batches (FillShard) and replicas."""

    device: str
    interface: Interface
    iterations: int | None
    """This GPU's share of the job's batches, after which its work is done (None: until shutdown)."""
    profile_reps: int = 3
    cpu_threads: int = 1
    seed: int = 0
    batch_first: int = 0
    batch_stride: int = 1
    """Iteration i trains or infers on batch batch_first + i * batch_stride of the job (its share: FillShard)."""
    dp_size: int = 1
    dp_rank: int = 0
    dp_key: str = ""
    """A training job's data-parallel replicas (the GPUs of one pipeline stage) meet under this store prefix."""
    precision: str = "fp32"
    """The plan's precision, the one its fill prices were made in (planner/fill/profiles.py traces the job in the
    main job's): an inference job's weights and inputs take its dtype; a training job computes under autocast to
    it over fp32 weights (fp16 with a dynamic loss scale)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class BubbleBegin:
    seq: int
    bubble_id: int
    duration_s: float
    free_bytes: int
    called_at: float
    """time.time() when the main job called bubble_begin."""
    start_wall: float
    """When the bubble starts: the call, or the GPU going idle when a ready event was given."""
    start_mono: float
    ended: bool = False
    """bubble_end was called before the ready event fired: nothing may run."""


@dataclass(frozen=True, kw_only=True, slots=True)
class BubbleEnd:
    seq: int
    bubble_id: int
    wall: float
    mono: float


@dataclass(frozen=True, kw_only=True, slots=True)
class Request:
    kind: Literal["report", "close"]


@dataclass(kw_only=True, slots=True)
class Occurrence:
    """One occurrence of a bubble on this rank and what the fill jobs did in it."""

    bubble_id: int
    seq: int
    duration_s: float
    free_bytes: int
    called_at: float
    start_wall: float
    start_mono: float
    margin: float
    jobs: list[str]
    planned_units: dict[str, float]
    end_wall: float | None = None
    end_mono: float | None = None
    paused: bool = False
    acted: bool = False
    steps: list[dict[str, Any]] = field(default_factory=list)
    overruns: list[dict[str, Any]] = field(default_factory=list)
    kills: list[dict[str, Any]] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)
    units_done: int = 0
    samples_done: int = 0

    @property
    def deadline_mono(self) -> float:
        return self.start_mono + self.duration_s

    @property
    def usable_mono(self) -> float:
        return self.start_mono + self.duration_s * (1.0 - self.margin)

    def pause_mono(self) -> float:
        """PauseSideTask is due at the bubble's end or its deadline, whichever comes first."""
        return min(self.deadline_mono, math.inf if self.end_mono is None else self.end_mono)

    def sigstop_mono(self) -> float:
        """An imperative task is stopped at the end of the usable time (its kernels may still drain)."""
        return min(self.usable_mono, math.inf if self.end_mono is None else self.end_mono)

    def to_dict(self) -> dict[str, Any]:
        return {"bubble_id": self.bubble_id, "seq": self.seq, "main_begin": self.called_at,
                "gpu_idle": self.start_wall, "main_end": self.end_wall,
                "deadline": self.start_wall + self.duration_s,
                "usable_until": self.start_wall + self.duration_s * (1.0 - self.margin),
                "duration_s": self.duration_s, "free_bytes": self.free_bytes, "jobs": list(self.jobs),
                "planned_units": dict(self.planned_units), "units_done": self.units_done,
                "samples_done": self.samples_done, "steps": self.steps, "overruns": self.overruns,
                "kills": self.kills, "errors": self.errors}


def _task_entry(job: FillJob, options: TaskOptions, rx: Any, tx: Any) -> None:
    from planner.runtime.fill_task import task_main  # torch is imported only in the task process

    task_main(job, options, rx, tx)


def _task_context() -> Any:
    """Task processes fork from a forkserver that imported torch once (a clean, single-threaded
    process: safe to fork, CUDA untouched), so N fill jobs pay one torch import, not N."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["planner.runtime.fill_task"])
    return ctx


def _is_stopped(pid: int) -> bool:
    """Whether the kernel has the process in the stopped state ('T'); true where /proc is missing."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except FileNotFoundError:
        return not os.path.isdir("/proc/self")
    return stat[stat.rindex(b")") + 2:][:1] in (b"T", b"t")



@dataclass(kw_only=True, slots=True)
class PairRun:
    """Two paired jobs of this rank (Waterwave, plan.fill.pairs) and where their rule stands."""

    jobs: tuple[str, str]
    ledger: PairLedger
    last: int | None = None  # which of the two ran the last unit
    live: dict[str, int] = field(default_factory=dict)  # measured live bytes of each after its last unit
    refused: set[int] = field(default_factory=set)  # bubble occurrences where no unit of the pair was admitted


class TaskHandle:
    """The manager's side of one side task: its process, pipes, state machine and progress."""

    def __init__(self, job: FillJob, options: TaskOptions, log: list[dict[str, Any]]) -> None:
        self.job, self.options = job, options
        self.sm = SideTaskState(job=job.name, log=log)
        self.proc: Any = None
        self.to_task: Any = None
        self.from_task: Any = None
        self.loaded = False  # CREATED and its context (model, optimizer) is in host memory
        self.busy: dict[str, Any] | None = None  # the RPC in flight: init or one step
        self.kill_at: float | None = None  # a pause is pending: SIGKILL at this monotonic time
        self.pause_occ: Occurrence | None = None
        self.overrun: dict[str, Any] | None = None
        self.sigstopped = False
        self.looping = False  # imperative: its own loop was started
        self.pos = 0  # next position in the job's stream of linearized units
        self.iterations = 0
        self.samples = 0
        self.profile: list[float] | None = None
        self.observed: dict[int, float] = {}
        self.linearized: list[str] = list(job.units)
        self.stop_reason: str | None = None
        self.error: str | None = None
        self.retry_at: float | None = None  # the next unit waits on the replicas' gradients: ask again then
        self.info: dict[str, Any] = {}  # the task's last report at an iteration's end (UnitRunner.progress)
        self.loads: list[dict[str, Any]] = []  # a streamed job's first LOADS_KEPT weight loads (Streamer)
        self.loads_total = 0

    @property
    def name(self) -> str:
        return self.job.name

    @property
    def iterative(self) -> bool:
        return self.options.interface == "iterative"

    @property
    def live(self) -> bool:
        return self.proc is not None and self.sm.state is not State.STOPPED

    def spawn(self, ctx: Any) -> None:
        task_rx, to_task = ctx.Pipe(duplex=False)
        from_task, task_tx = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=_task_entry, args=(self.job, self.options, task_rx, task_tx),
                                name=f"fxp-fill-{self.name}", daemon=True)
        self.proc.start()
        task_rx.close()
        task_tx.close()  # else EOF never comes when the task dies
        self.to_task, self.from_task = to_task, from_task

    def send(self, msg: tuple) -> bool:
        try:
            self.to_task.send(msg)
            return True
        except (OSError, ValueError):
            return False  # the process is gone; its sentinel reports it

    def signal(self, sig: int) -> None:
        try:
            os.kill(self.proc.pid, sig)
        except (ProcessLookupError, TypeError):
            pass

    def unit_name(self, pos: int | None) -> str:
        return "init" if pos is None else self.linearized[pos % len(self.linearized)]

    def estimate(self, pos: int, opts: FillExecutorOptions) -> float:
        """Program-directed limit: the step's profiled time, or its recent time if longer, with margin."""
        k = pos % len(self.linearized)
        base = max(self.profile[k] if self.profile else 0.0, self.observed.get(k, 0.0))
        return base * opts.step_safety + opts.step_overhead_s

    def relax(self, pos: int) -> None:
        """The unit at `pos` was not started in a bubble: halve its observed time's excess over the
        profile. One slow observation (the machine was busy) then holds the unit back a few bubbles,
        not - with the whole stream behind it - for good: it is only observed again when it runs."""
        k = pos % len(self.linearized)
        if k in self.observed:
            floor = self.profile[k] if self.profile else 0.0
            self.observed[k] = floor + 0.5 * max(0.0, self.observed[k] - floor)

    def to_dict(self) -> dict[str, Any]:
        o = self.options
        return {"name": self.name, "kind": self.job.kind, "interface": o.interface,
                "batch_size": self.job.batch_size, "state": self.sm.state.value, "stop_reason": self.stop_reason,
                "error": self.error, "units_done": self.pos, "iterations_done": self.iterations,
                "samples_done": self.samples, "batch_first": o.batch_first,
                "batch_stride": o.batch_stride, "planned_iterations": o.iterations,
                "dp_size": o.dp_size, "dp_rank": o.dp_rank, "config": self.job.config,
                "resident": self.job.resident, "loads": self.loads, "loads_total": self.loads_total,
                **self.info,
                "units": self.linearized,
                "profile_s": dict(zip(self.linearized, self.profile)) if self.profile else None,
                "observed_s": {self.linearized[k]: v for k, v in sorted(self.observed.items())},
                "predicted_s": dict(zip(self.job.units, self.job.unit_time_s))}


class FillExecutor:
    """The manager loop of one rank: bubble signals in, side-task transitions out."""

    def __init__(self, plan: Plan, pipeline_rank: int, global_rank: int, device: str,
                 measured_bubbles: dict[int, float] | None, grace_s: float, options: FillExecutorOptions,
                 cmd: Any, out: Any, run_key: str = "") -> None:
        if plan.fill is None:
            raise ValueError("the plan has no fill section")
        self.rank, self.global_rank, self.device = pipeline_rank, global_rank, device
        self.grace_s, self.options, self.cmd, self.out = grace_s, options, cmd, out
        self.margin = plan.fill.safety_margin
        sliced = device.startswith("cuda") and plan.fill.gpu_sharing == "timeslice"
        self.batch_work_s = options.batch_work_s if options.batch_work_s is not None else \
            BATCH_WORK_S if sliced else 0.0
        self.pp = plan.config.pp
        self.precision = plan.config.precision
        self.replicas = options.replicas or plan.config.to_config().gpus_per_stage
        self.replica = global_rank % self.replicas
        self.run_key = run_key
        self.policy_name, self.policy = plan.fill.policy, resolve_policy(plan.fill.policy)
        self.measured = {int(k): float(v) for k, v in (measured_bubbles or {}).items()}
        self.bubble_jobs: dict[int, list[str]] = {}  # bubble id -> its fill jobs, in the plan's order
        units: dict[int, dict[str, list[int]]] = {}
        for c in plan.fill.chunks:
            if c.rank == pipeline_rank:
                names = self.bubble_jobs.setdefault(c.bubble_id, [])
                if c.job not in names:
                    names.append(c.job)
                units.setdefault(c.bubble_id, {}).setdefault(c.job, []).append(c.units)
        self.planned = {b: {j: sum(u) / len(u) for j, u in per.items()} for b, per in units.items()}
        free = {b.id: b.free_bytes for b in plan.bubbles if b.rank == pipeline_rank}
        self.log: list[dict[str, Any]] = []
        self.plan_pairs = [p for p in plan.fill.pairs if p.rank == pipeline_rank]
        self.tasks: dict[str, TaskHandle] = {}
        self.job_free: dict[str, int] = {}
        self.views: dict[str, JobView] = {}  # what the policy sees of each job (job_scheduler.next_on_rank)
        for index, job in enumerate(plan.fill.jobs):
            bubbles = [b for b, names in self.bubble_jobs.items() if job.name in names]
            opts = self._task_options(job)
            if bubbles and (opts.iterations is None or opts.iterations > 0):
                self.tasks[job.name] = TaskHandle(job, opts, self.log)
                self.job_free[job.name] = min((free[b] for b in bubbles if b in free), default=2**62)
                proc = {s.rank: s.end_s - s.start_s for s in job.shards}
                self.views[job.name] = JobView(
                    name=job.name, kind=job.kind, arrival_s=job.arrival_s, deadline_s=job.deadline_s,
                    priority=job.priority, work=opts.iterations or 0, index=index,
                    proc_times=tuple(proc.get(r, math.inf) for r in range(self.pp)))
        self.pairs: dict[str, PairRun] = {}  # job -> its pair on this rank (Waterwave), both jobs' entries
        for fp in self.plan_pairs:
            if all(n in self.tasks for n in fp.jobs):
                run = PairRun(jobs=tuple(fp.jobs), ledger=PairLedger.of(fp))
                self.pairs.update({n: run for n in fp.jobs})
        self.current: TaskHandle | None = None
        self.turns: list[dict[str, Any]] = []
        self.t0: float | None = None  # monotonic time the main job was told 'ready': arrivals count from it
        self.occs: list[Occurrence] = []
        self.cur: Occurrence | None = None
        self.errors: list[dict[str, Any]] = []
        self.kills: list[dict[str, Any]] = []
        self.finished = False
        self.ready_sent = False
        self.started_at = time.time()
        self.offset = time.time() - time.monotonic()

    def _task_options(self, job: FillJob) -> TaskOptions:
        """How this GPU runs its share of the job (FillShard): replica k of the stage's R GPUs takes the
        shard's batches k, k + R, ...; a training job's replicas are data parallel. A plan without shards (made
        by hand) runs the whole job here."""
        o = self.options
        paired = any(job.name in p.jobs for p in self.plan_pairs)
        if o.interface_of(job.name) == "imperative" and (not job.resident or paired):
            why = "is loaded per bubble (PipeSwitch) and must unload when its bubble ends" if not job.resident else \
                "is paired (Waterwave) and runs one unit at a time by the pair's rule"
            raise ValueError(f"fill job {job.name} {why}: only the iterative interface can run it")
        shard = next((s for s in job.shards if s.rank == self.rank), None)
        first, stride, count, dp = 0, 1, job.iterations, 1
        if shard is not None:
            first, stride = shard.first_batch + self.replica, self.replicas
            count = len(range(first, shard.first_batch + shard.batches, stride))
            dp = self.replicas if job.kind == "train" else 1
        return TaskOptions(device=self.device, interface=o.interface_of(job.name),
                           iterations=o.iterations.get(job.name, count), profile_reps=o.profile_reps,
                           cpu_threads=o.cpu_threads, seed=o.seed, batch_first=first, batch_stride=stride, dp_size=dp,
                           dp_rank=self.replica if dp > 1 else 0, precision=self.precision,
                           dp_key=f"{self.run_key}/{job.name}/pp{self.rank}" if dp > 1 else "")

    def wall(self, mono: float) -> float:
        return mono + self.offset

    # ---- the loop -------------------------------------------------------------------------------

    def run(self) -> None:
        ctx = _task_context()
        for t in self.tasks.values():
            self._create(t, ctx)
        self._maybe_ready()
        try:
            while not self.finished:
                self._wait(self._timeout(time.monotonic()))
                self._tick(time.monotonic())
        finally:
            self._stop_all("executor exit")
            self._reap()

    def _create(self, t: TaskHandle, ctx: Any) -> None:
        try:
            t.spawn(ctx)
        except Exception as exc:  # noqa: BLE001 - a fill job that cannot start is recorded, never raised
            t.proc = None
            t.stop_reason, t.error = "failed", f"could not start its process: {exc}"
            self.errors.append({"job": t.name, "at": time.time(), "message": t.error, "unit": None})
            return
        t.sm.apply(Transition.CREATE, reason=f"task process {t.proc.pid} started ({t.options.interface} interface)")

    def _timeout(self, now: float) -> float:
        wake = [0.5]
        cur = self.cur
        if cur is not None and not cur.paused:
            wake.append(cur.pause_mono() - now)
            if cur.sigstop_mono() > now:
                wake.append(cur.sigstop_mono() - now)
        for t in self.tasks.values():
            if t.live and t.retry_at is not None:
                wake.append(t.retry_at - now)
            if t.live and t.kill_at is not None:
                wake.append(t.kill_at - now)
                if not t.iterative:
                    wake.append(0.002)  # poll /proc until SIGSTOP shows
        return max(0.0, min(wake))

    def _wait(self, timeout: float) -> None:
        waitables: dict[Any, TaskHandle | None] = {self.cmd: None}
        for t in self.tasks.values():
            if t.live:
                waitables[t.from_task] = t
                waitables[t.proc.sentinel] = t
        exited = []
        for obj in connection.wait(list(waitables), timeout):
            t = waitables[obj]
            if t is None:
                self._drain_cmd()
            elif obj is t.from_task:
                self._drain_task(t)
            else:
                exited.append(t)
        for t in exited:
            self._drain_task(t)
            if t.live:
                t.proc.join(timeout=0.1)
                self._failed(t, f"task process exited with code {t.proc.exitcode}")

    def _drain_cmd(self) -> None:
        while not self.finished:
            try:
                if not self.cmd.poll():
                    return
                msg = self.cmd.recv()
            except (EOFError, OSError):
                self._stop_all("the main job closed the connection")
                self.finished = True
                return
            if isinstance(msg, BubbleBegin):
                self._begin(msg)
            elif isinstance(msg, BubbleEnd):
                self._end(msg)
            elif isinstance(msg, Request):
                self._request(msg)

    def _drain_task(self, t: TaskHandle) -> None:
        while t.live:
            try:
                if not t.from_task.poll():
                    return
                msg = t.from_task.recv()
            except (EOFError, OSError):
                return  # the sentinel tells
            self._on_task(t, msg)

    def _tick(self, now: float) -> None:
        cur = self.cur
        if cur is not None and not cur.paused:
            if now >= cur.sigstop_mono():
                self._sigstop_all(cur)
            if now >= cur.pause_mono():
                self._pause(cur)
        self._check_pending(now)
        if cur is not None and not cur.paused:
            self._serve(cur, now)

    # ---- bubbles ---------------------------------------------------------------------------------

    def _begin(self, msg: BubbleBegin) -> None:
        if self.cur is not None and not self.cur.paused:
            if self.cur.end_mono is None:
                self.cur.end_mono = msg.start_mono  # bubble_end never came: the next bubble closes it
            self._pause(self.cur)
        duration = min(msg.duration_s, self.measured.get(msg.bubble_id, math.inf))
        occ = Occurrence(bubble_id=msg.bubble_id, seq=msg.seq, duration_s=max(0.0, duration),
                         free_bytes=msg.free_bytes, called_at=msg.called_at, start_wall=msg.start_wall,
                         start_mono=msg.start_mono, margin=self.margin,
                         jobs=list(self.bubble_jobs.get(msg.bubble_id, [])),
                         planned_units=dict(self.planned.get(msg.bubble_id, {})))
        if msg.ended:
            occ.end_mono = msg.start_mono
        self.occs.append(occ)
        self.cur = occ

    def _end(self, msg: BubbleEnd) -> None:
        for occ in reversed(self.occs):
            if occ.seq == msg.seq:
                occ.end_wall = msg.wall
                occ.end_mono = msg.mono if occ.end_mono is None else min(occ.end_mono, msg.mono)
                return

    def _elapsed(self, now: float) -> float:
        return now - (self.t0 if self.t0 is not None else now)

    def _arrived(self, job: str, now: float) -> bool:
        return self.views[job].arrival_s <= self._elapsed(now)

    def _current(self, now: float) -> TaskHandle | None:
        """The job this rank runs now: it keeps its turn until it stops; then the policy picks among the jobs that
        have arrived (planner.fill.job_scheduler.next_on_rank, as the planner predicted the turns)."""
        if self.current is not None and self.current.live:
            return self.current
        partner = self._partner(self.current)
        if partner is not None:  # a pair's turn lasts until both of its jobs are done
            self.current = partner
            self.turns.append({"job": partner.name, "at": self.wall(now), "elapsed_s": self._elapsed(now)})
            return partner
        pending = [self.views[t.name] for t in self.tasks.values()
                   if t.live and t.loaded and self._arrived(t.name, now)]
        elapsed = self._elapsed(now)
        job = next_on_rank(pending, self.rank, self.pp, elapsed, self.policy) if pending else None
        self.current = None if job is None else self.tasks[job.name]
        if self.current is not None:
            self.turns.append({"job": job.name, "at": self.wall(now), "elapsed_s": elapsed})
        return self.current

    def _serve(self, cur: Occurrence, now: float) -> None:
        """A.2: a new bubble inits the current task if it is CREATED, else starts it; then steps."""
        t = self._current(now)
        if t is None or t.name not in cur.jobs:  # a bubble the current job has no chunk in: the next one's
            t = next((self.tasks[n] for n in cur.jobs if n in self.tasks and self.tasks[n].live
                      and self.tasks[n].loaded and self._arrived(n, now)), None)
        if t is not None and t.name in self.pairs:
            t = self._paired(self.pairs[t.name], t, cur, now)
        if (t is None or t.busy is not None or t.kill_at is not None or now >= cur.usable_mono
                or (t.retry_at is not None and now < t.retry_at)):
            return
        if t.sm.state is State.CREATED:
            if not cur.acted and t.send(("init", cur.free_bytes)):
                t.busy = {"what": "init", "pos": None, "sent": now, "occ": cur}
            cur.acted = True
            return
        if t.sm.state is State.PAUSED:
            if not t.iterative and now >= cur.sigstop_mono():
                return
            self._start(t, cur, now)
        if t.sm.state is State.RUNNING and t.iterative and now + t.estimate(t.pos, self.options) <= cur.usable_mono:
            pair = self.pairs.get(t.name)
            release = pair is not None and pair.ledger.frees(pair.jobs.index(t.name), t.pos % len(t.linearized))
            n = 1 if pair is not None else self._batch(t, cur, now)
            msg = ("steps", t.pos, n, cur.free_bytes) if n > 1 else ("step", t.pos, release, cur.free_bytes)
            if t.send(msg):
                t.busy = {"what": "step", "pos": t.pos, "n": n, "sent": now, "occ": cur}
                last = f" .. {t.unit_name(t.pos + n - 1)} ({n} units, one synchronize)" if n > 1 else ""
                t.sm.apply(Transition.RUN_NEXT_STEP, reason=t.unit_name(t.pos) + last)

    def _batch(self, t: TaskHandle, cur: Occurrence, now: float) -> int:
        """How many units from t.pos to send at once: the run of units a batch runs cheaper than their own
        synchronizes would (physics.batched, by the task's profile), within the batch's work and the bubble's
        usable time (their estimates, charged the allowance once), at most one iteration's and MAX_BATCH_UNITS;
        1 where batches are off or the job streams its weights (loaded per unit group)."""
        if self.batch_work_s <= 0 or not t.profile or not t.job.resident:
            return 1
        work = est = 0.0
        n, units = 0, min(len(t.linearized), MAX_BATCH_UNITS)
        while n < units:
            k = (t.pos + n) % len(t.linearized)
            alone = t.profile[k]
            if not batched(alone, "timeslice") or work + alone > self.batch_work_s:
                break
            base = max(alone, t.observed.get(k, 0.0))
            if now + (est + base) * self.options.step_safety + self.options.step_overhead_s > cur.usable_mono:
                break
            work, est, n = work + alone, est + base, n + 1
        return max(n, 1)

    def _partner(self, t: TaskHandle | None) -> TaskHandle | None:
        """The live partner of a paired job (once it has arrived), else None."""
        if t is None or t.name not in self.pairs:
            return None
        other = self.tasks[next(n for n in self.pairs[t.name].jobs if n != t.name)]
        return other if other.live and other.loaded and self._arrived(other.name, time.monotonic()) else None

    def _paired(self, pair: PairRun, t: TaskHandle, cur: Occurrence, now: float) -> TaskHandle | None:
        """Waterwave: which of a pair's jobs runs its next unit, by the rule the planner simulated
        (waterwave.PairLedger.next: groups alternate, a unit only while the pair stays within its budget). A job
        whose partner is done (or has not arrived) runs alone; None: wait (a unit in flight, or none admitted)."""
        other = self._partner(t)
        if other is None:
            return t
        a, b = (self.tasks[n] for n in pair.jobs)
        if a.busy is not None or b.busy is not None:
            return None
        j = pair.ledger.next((a.pos, b.pos), pair.last, a.iterations - b.iterations)
        if j is None:
            if cur.seq not in pair.refused:
                pair.refused.add(cur.seq)
                cur.errors.append({"job": t.name, "at": self.wall(now), "unit": t.unit_name(t.pos),
                                   "message": f"pair {'+'.join(pair.jobs)}: no unit fits its budget of "
                                              f"{pair.ledger.budget} bytes"})
            return None
        return (a, b)[j]

    def _start(self, t: TaskHandle, cur: Occurrence, now: float) -> None:
        cur.acted = True
        if not t.iterative:
            if t.looping:
                t.signal(signal.SIGCONT)
            else:
                t.looping = t.send(("run", min(cur.free_bytes, self.job_free[t.name])))
            t.sigstopped = False
        left = (cur.usable_mono - now) * 1e3
        t.sm.apply(Transition.START, reason=f"bubble {cur.bubble_id}, {left:.1f} ms usable")

    def _sigstop_all(self, cur: Occurrence) -> None:
        for t in self.tasks.values():
            if t.live and not t.iterative and t.sm.state is State.RUNNING and not t.sigstopped:
                t.signal(signal.SIGSTOP)
                t.sigstopped = True
                t.kill_at, t.pause_occ = cur.pause_mono() + self.grace_s, cur

    def _pause(self, cur: Occurrence) -> None:
        """PauseSideTask for every running task; a task busy past this point gets the grace period."""
        cur.paused = True
        self._sigstop_all(cur)
        at = cur.pause_mono()
        cause = "deadline" if at >= cur.deadline_mono else "bubble end"
        for t in self.tasks.values():
            if not t.live or t.kill_at is not None:
                continue  # stopped, or already on the clock from an earlier pause
            if t.busy is not None:
                t.kill_at, t.pause_occ = at + self.grace_s, cur
                t.overrun = {"job": t.name, "unit": t.unit_name(t.busy["pos"]), "pos": t.busy["pos"],
                             "started": self.wall(t.busy["sent"]), "pause_at": self.wall(at), "cause": cause,
                             "finished_at": None, "killed": False}
                cur.overruns.append(t.overrun)
            elif t.iterative and t.sm.state is State.RUNNING:
                t.relax(t.pos)
                t.sm.apply(Transition.PAUSE, reason=f"bubble {cur.bubble_id} {cause}")
            if t.iterative and not t.job.resident and (t.busy or any(s["job"] == t.name for s in cur.steps)):
                t.send(("unload",))  # a streamed job's weights leave the device with the bubble

    def _check_pending(self, now: float) -> None:
        for t in list(self.tasks.values()):
            if not t.live or t.kill_at is None:
                continue
            if not t.iterative and t.busy is None and t.sm.state is State.RUNNING and _is_stopped(t.proc.pid):
                t.kill_at = t.pause_occ = None
                t.sm.apply(Transition.PAUSE, reason="SIGSTOP took effect")
            elif now >= t.kill_at:
                self._kill(t)

    def _kill(self, t: TaskHandle) -> None:
        """Framework-enforced limit (FreeRide 3.2.3): not paused by pause point + grace -> SIGKILL."""
        t.signal(signal.SIGKILL)
        what = t.busy["what"] if t.busy else "run"
        rec = {"job": t.name, "what": what, "unit": t.unit_name(t.busy["pos"]) if t.busy else None,
               "started": self.wall(t.busy["sent"]) if t.busy else None,
               "limit": self.wall(t.kill_at), "killed_at": time.time(), "grace_s": self.grace_s}
        if t.overrun is not None:
            t.overrun["killed"] = True
        if t.pause_occ is not None:
            t.pause_occ.kills.append(rec)
        self.kills.append(rec)
        unit = f" ({rec['unit']})" if rec["unit"] else ""
        self._stop(t, "killed", f"{what}{unit} still running {self.grace_s * 1e3:.0f} ms after the pause point")

    # ---- task messages ---------------------------------------------------------------------------

    def _on_task(self, t: TaskHandle, msg: tuple) -> None:
        kind = msg[0]
        if kind == "created":
            t.loaded, t.linearized = True, list(msg[1]["units"])
            self._init_at_setup(t)
            self._maybe_ready()
        elif kind == "inited":
            self._inited(t, msg[1])
        elif kind in ("step", "unit"):
            self._progress(t, *msg[1:])
        elif kind == "steps":  # a batch: each unit observed at its own time, all in the bubble it was sent in
            occ = t.busy["occ"] if t.busy else self.cur
            for rec in msg[1]:
                if not t.live:
                    break
                self._progress(t, *rec[1:], occ=occ, took_s=rec[5] - rec[4])
        elif kind == "wait":  # the optimizer step waits on the other replicas' gradients: nothing ran
            t.busy, t.retry_at = None, time.monotonic() + WAIT_POLL_S
            if t.kill_at is not None:
                self._late_finished(t)
                t.sm.apply(Transition.PAUSE, reason="waiting on the replicas' gradients")
        elif kind == "done":
            self._stop(t, "done", f"{t.iterations} iterations done")
        elif kind == "failed":
            self._failed(t, msg[1])

    def _init_at_setup(self, t: TaskHandle) -> None:
        """InitSideTask before any bubble, while the main job waits for 'ready' (see the module doc)."""
        if not self.ready_sent and self.cur is None and t.send(("init", self.job_free[t.name])):
            t.busy = {"what": "init", "pos": None, "sent": time.monotonic(), "occ": None}

    def _late_finished(self, t: TaskHandle) -> None:
        if t.overrun is not None:
            t.overrun["finished_at"] = time.time()
        t.kill_at = t.pause_occ = t.overrun = None

    def _inited(self, t: TaskHandle, profile: list[float] | None) -> None:
        t.busy, t.profile = None, profile
        if t.kill_at is not None:
            self._late_finished(t)
        what = f"profiled {len(profile)} units, {sum(profile) * 1e3:.1f} ms per iteration" if profile else "on device"
        t.sm.apply(Transition.INIT, reason=what)
        self._maybe_ready()

    def _progress(self, t: TaskHandle, pos: int, start: float, end: float, start_mono: float, end_mono: float,
                  iteration_done: bool, info: dict[str, Any] | None = None, *, occ: Occurrence | None = None,
                  took_s: float | None = None) -> None:
        """A unit done. Its observed time is the request's round trip, or `took_s` (a batch's unit, timed in the
        task) where given; `occ`: the bubble it ran in, where the request is no longer t.busy."""
        occ = occ or (t.busy["occ"] if t.busy else self.cur)
        if t.busy is not None or took_s is not None:
            k = pos % len(t.linearized)
            dt = took_s if took_s is not None else time.monotonic() - t.busy["sent"]
            t.observed[k] = dt if k not in t.observed else 0.7 * t.observed[k] + 0.3 * dt
        t.busy, t.retry_at = None, None
        rec = {"job": t.name, "unit": t.unit_name(pos), "pos": pos, "iteration": pos // len(t.linearized),
               "start": start, "end": end, "interface": t.options.interface}
        if iteration_done:
            rec["batch"] = t.options.batch_first + t.options.batch_stride * t.iterations
        pair = self.pairs.get(t.name)
        if info and "live_bytes" in info:
            rec["live_bytes"] = info.pop("live_bytes")
            if "allocated_bytes" in info:
                rec["allocated_bytes"] = info.pop("allocated_bytes")
            if pair is not None:
                pair.last = pair.jobs.index(t.name)
                pair.live[t.name] = rec["live_bytes"]
                if self._partner(t) is not None:
                    rec["pair_live_bytes"] = sum(pair.live.values())
                    rec["pair_budget_bytes"] = pair.ledger.budget
        if info:
            loads = info.pop("loads", [])
            t.loads_total += len(loads)
            t.loads.extend(loads[:max(0, LOADS_KEPT - len(t.loads))])
            t.info.update(info)
            if "checksum" in info:
                rec["checksum"] = info["checksum"]
        t.pos = pos + 1
        if occ is not None:
            occ.steps.append(rec)
            occ.units_done += 1
        if iteration_done:
            t.iterations += 1
            t.samples += t.job.batch_size
            if occ is not None:
                occ.samples_done += t.job.batch_size
        if t.iterative and t.kill_at is not None:
            self._late_finished(t)
            t.sm.apply(Transition.PAUSE, reason="late step finished within the grace period")
        if t.iterative and t.options.iterations is not None and t.iterations >= t.options.iterations:
            self._stop(t, "done", f"{t.iterations} iterations done")

    def _failed(self, t: TaskHandle, text: str) -> None:
        occ = t.busy["occ"] if t.busy else (self.cur if t.sm.state is State.RUNNING else None)
        rec = {"job": t.name, "at": time.time(), "message": text,
               "unit": t.unit_name(t.busy["pos"]) if t.busy else None}
        if occ is not None:
            occ.errors.append(rec)
        self.errors.append(rec)
        t.error = text
        self._stop(t, "failed", text)

    def _stop(self, t: TaskHandle, reason: str, detail: str) -> None:
        if t.sm.state is State.STOPPED:
            return
        if t.proc is not None and t.proc.is_alive():
            if t.iterative and t.loaded and t.busy is None and reason != "killed":
                t.send(("stop",))  # leaves on its own; reaped at exit
            else:
                t.signal(signal.SIGKILL)  # mid-step, still loading, or possibly SIGSTOPped
        t.busy = t.kill_at = t.pause_occ = None
        t.stop_reason = t.stop_reason or reason
        if t.sm.can(Transition.STOP):
            t.sm.apply(Transition.STOP, reason=f"{reason}: {detail}")
        self._maybe_ready()

    # ---- shutdown and report ---------------------------------------------------------------------

    def _request(self, msg: Request) -> None:
        self._stop_all(f"{msg.kind} requested")
        if msg.kind == "report":
            self._send(("report", self.report()))
        else:
            self._send(("closed", None))
            self.finished = True

    def _stop_all(self, why: str) -> None:
        if self.cur is not None and not self.cur.paused:
            self._pause(self.cur)
        for t in self.tasks.values():
            if t.sm.state is not State.STOPPED and t.proc is not None:
                self._stop(t, "shutdown", why)

    def _reap(self) -> None:
        until = time.monotonic() + 2.0
        for t in self.tasks.values():
            if t.proc is None:
                continue
            t.proc.join(timeout=max(0.0, until - time.monotonic()))
            if t.proc.is_alive():
                t.proc.kill()
                t.proc.join(timeout=1.0)

    def _maybe_ready(self) -> None:
        """'ready' once every live task is built and initialized (or its setup init failed to send)."""
        if not self.ready_sent and all(not t.live or (t.loaded and t.busy is None) for t in self.tasks.values()):
            self.ready_sent, self.t0 = True, time.monotonic()
            self._send(("ready", {t.name: t.sm.state.value for t in self.tasks.values()}))

    def _send(self, msg: tuple) -> None:
        try:
            self.out.send(msg)
        except (OSError, ValueError):
            pass  # the main job is gone

    def report(self) -> dict[str, Any]:
        return {"pipeline_rank": self.rank, "global_rank": self.global_rank, "device": self.device,
                "executor_pid": os.getpid(), "grace_s": self.grace_s, "safety_margin": self.margin,
                "started_at": self.started_at, "jobs": [t.to_dict() for t in self.tasks.values()],
                "bubbles": [o.to_dict() for o in self.occs],
                "overruns": [r for o in self.occs for r in o.overruns], "kills": self.kills,
                "errors": self.errors, "transitions": self.log, "policy": self.policy_name,
                "replica": self.replica, "replicas": self.replicas, "turns": self.turns}


def executor_main(plan_json: str, pipeline_rank: int, global_rank: int, device: str,
                  measured_bubbles: dict[int, float] | None, grace_s: float, options: FillExecutorOptions,
                  cmd: Any, out: Any, run_key: str = "") -> None:
    """Entry point of the executor process (started by FillClient.start with the spawn context)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main job's to handle; it closes us
    try:
        plan = Plan.model_validate_json(plan_json)
        FillExecutor(plan, pipeline_rank, global_rank, device, measured_bubbles, grace_s, options, cmd, out,
                     run_key).run()
    except BaseException:  # noqa: BLE001 - tell the main job why, then leave
        try:
            out.send(("crashed", traceback.format_exc()))
        except OSError:
            pass
        raise SystemExit(1) from None
