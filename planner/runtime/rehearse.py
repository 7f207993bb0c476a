"""Rehearse one pipeline rank of a plan on this machine's one device: its real stages, its peers replayed.

A p >= 2 pipeline needs p devices (NCCL refuses two ranks on one GPU). A rehearsal runs one rank of it for real and
replays everything outside it from the plan, so that a user learns before booking the cluster whether rank R fits
in memory, how long its forwards and backwards really take, and how much its fill jobs slow it:

- The rank's stages are built by the runtime's own ``prepare`` (the same code, dtype, recomputation, tensor-parallel
  shard and ZeRO shard) inside a process group of the plan's whole world made of torch's *fake* backend
  (``torch.testing._internal.distributed.fake_pg``): every collective and p2p call returns at once, shapes intact, so
  the rank runs as rank (R, dp 0, cp 0, tp 0) of the real world without its peers.
- It executes the rank's action list in the plan's order (``Executor``). A receive from another rank waits until the
  arrival time of the plan's simulation (on CPU a sleep; on CUDA a spinning kernel holds the GPU as NCCL's receive
  kernel does, and the host waits for it), then yields a tensor of the planned shape and dtype made once (or, with
  ``boundary``, the tensor a real launch recorded: the runtime's hidden ``--record-boundary``). Sends cost the sender
  nothing (asynchronous, as simulated). The data-parallel (and tied-weight) reduction takes its priced time
  (``predictions.allreduce_s``); under tensor parallelism each compute takes its stage's share of the priced
  tensor-parallel communication (``predictions.tp_comm_s``, half in the forward, half in the input-gradient backward).
  The step ends when the plan's slowest rank would end it, so the trailing bubble is a real wait.
- The peers' times are the plan's; this rank's own, in the simulation that gives the arrivals, are the plan's in
  the first step and then the medians of what it measured in its steps without fill: a rank slower here than on the
  target shifts what depends on it, as it would in the pipeline. Once a step has run with fill they are frozen, so
  fill and no-fill runs see the same peers.
- BUBBLE actions are real waits handed to the real fill executor (admission, memory cap, grace kill, turns, ...),
  with the same durations the runtime hands it; a fill fraction F offers the executor F of each bubble (its usable
  time, after the plan's safety margin, is F of the bubble). One rehearsal runs the rank once per fill fraction asked
  for (and first without fill, to compare), building it once.

Numerics: with the fake backend a collective leaves each tensor as this rank holds it, so under data, tensor or
context parallelism the values differ from a real run's (the times, shapes and memory do not); at d = t = 1, with the
recorded boundary tensors, the stage computes exactly what it computes in a launch. Context parallelism (ring
attention between the rank's cp peers) is refused: its communication is not priced per stage in the plan.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from passes.errors import UserError

from ..chart import plan_simulation
from ..plan import Plan
from ..schedule_ir import Action, Op
from .executor import Executor, NullFill, RunOptions, _Step
from .stage import TensorSpec

__all__ = ["RehearseOptions", "Replay", "Rehearsal", "rehearse", "check_rehearsal"]

_COMPUTE = (Op.F, Op.B, Op.I, Op.W)


@dataclass(frozen=True, kw_only=True, slots=True)
class RehearseOptions:
    rank: int
    steps: int = 5
    fill: bool = True
    compare_no_fill: bool = False
    fill_fractions: tuple[float | None, ...] = (None,)
    """One run with fill per entry, offering the fill executor that fraction of each bubble (None: the bubble as the
    runtime offers it, the plan's safety margin kept free)."""
    device: str = "cpu"
    boundary: Path | None = None
    """A launch's recorded boundary tensors (``python -m planner.runtime --record-boundary``): rank file to replay."""
    seed: int = 0
    dump: Path | None = None
    """Debug: write the rank's parameters and gradients after the last step (as the runtime's --dump-params)."""
    optimizer: str = "adam"
    lr: float = 1e-3
    fill_grace_s: float | None = None


def check_rehearsal(plan: Plan, options: RehearseOptions) -> None:
    """One sentence for what a rehearsal of this plan cannot take."""
    c = plan.config
    if not 0 <= options.rank < c.pp:
        raise UserError(f"--rank {options.rank} is out of range: the plan has {c.pp} pipeline rank(s), 0 to {c.pp - 1}")
    for f in options.fill_fractions:
        if f is not None and not 0 < f <= 1:
            raise UserError(f"--fill-fraction must lie in (0, 1], got {f:g}")
    if not options.fill_fractions:
        raise UserError("a rehearsal with fill needs at least one fill fraction")
    if options.steps < 2:
        raise UserError(f"--steps must be at least 2 (step 0 runs without fill and measures), got {options.steps}")
    if c.cp > 1:
        raise UserError(f"the plan runs context parallelism (cp = {c.cp}), whose ring attention between the rank's "
                        "peers a rehearsal cannot replay yet; rehearse a plan made with --cp 1")
    if options.compare_no_fill and not options.fill:
        raise UserError("--compare-no-fill runs once with fill and once without; drop --no-fill")


class Replay:
    """The rest of the pipeline, as the plan's simulation has it: when each of the rank's receives arrives (seconds
    after the step's start), when the step ends, what each collective takes."""

    def __init__(self, plan: Plan, rank: int) -> None:
        self.plan, self.rank = plan, rank
        self.stages = [s for s in plan.partition if s.rank == rank]
        self.samples: dict[tuple[int, Op], list[tuple[bool, float]]] = {}  # (stage, F/B/I/W) -> (first step?, s)
        self.frozen = False
        self.planned = self._timeline(plan_simulation(plan))
        self.arrivals, self.end_s = self._arrivals(plan)
        self.planned_arrivals = self.arrivals
        c = plan.config
        total = sum(s.forward_s + s.backward_s for s in plan.partition)
        # a stage's share of the priced tensor-parallel communication per microbatch (in its forward_s / backward_s)
        self.tp_s = {s.stage: (plan.predictions.tp_comm_s * (s.forward_s + s.backward_s) / total / 2
                               if c.tp > 1 and total > 0 else 0.0) for s in self.stages}
        self.allreduce_s = plan.predictions.allreduce_s[rank]

    def _timeline(self, sim: Any) -> dict[str, tuple[float, float]]:
        """This rank's planned (start, end) of each action of the simulation (compute, ALLREDUCE, OPT, bubbles)."""
        return {iv.action: (iv.start, iv.end) for iv in sim.timelines[self.rank]}

    def _arrivals(self, plan: Plan) -> tuple[dict[tuple[Op, int, int], float], float]:
        """(RECV_F or RECV_B, stage, mb) -> when the plan's simulation has it arrive; and the step's end."""
        sim = plan_simulation(plan)
        p2p, rank_of = plan.predictions.p2p_s, {s.stage: s.rank for s in plan.partition}
        ends: dict[tuple[Op, int, int], float] = {}
        for timeline in sim.timelines:
            for iv in timeline:
                if iv.kind != "compute" or iv.action == "OPT":
                    continue
                a = Action.parse(iv.action)
                ends[(a.op, a.stage, a.mb)] = iv.end
        out = {}
        for a in (Action.parse(x) for x in plan.actions[self.rank]):
            if a.op is Op.RECV_F and rank_of.get(a.stage - 1) != self.rank:
                out[(a.op, a.stage, a.mb)] = ends[(Op.F, a.stage - 1, a.mb)] + p2p
            elif a.op is Op.RECV_B and rank_of.get(a.stage + 1) != self.rank:
                done = ends.get((Op.B, a.stage + 1, a.mb), ends.get((Op.I, a.stage + 1, a.mb)))
                out[(a.op, a.stage, a.mb)] = done + p2p
        return out, sim.iteration_s

    def measured(self, trace: list[dict[str, Any]], fill: bool, first: bool) -> None:
        """A step's actions as the rank ran them ("action", "start_s", "end_s"); a step without fill, while not frozen,
        re-times the rank in the simulation that gives the arrivals: each of its stages' forward and backward is the
        median of what that action took in the steps without fill (the first step, a warm-up, only until there are
        others)."""
        if fill:
            self.frozen = True
        if self.frozen:
            return
        for x in trace:
            a = Action.parse(x["action"])
            if a.op in _COMPUTE:
                self.samples.setdefault((a.stage, a.op), []).append((first, x["end_s"] - x["start_s"]))
        parts = []
        for s in self.plan.partition:
            got = {op: _median_after_first(self.samples[(s.stage, op)]) for op in _COMPUTE
                   if (s.stage, op) in self.samples}
            if s.rank == self.rank and Op.F in got and (Op.B in got or Op.I in got):
                if Op.B in got:  # a whole backward: its weight-gradient part in the plan's proportion
                    bwd, weight = got[Op.B], got[Op.B] * s.weight_s / s.backward_s if s.backward_s else 0.0
                else:  # split into I and W
                    bwd, weight = got[Op.I] + got.get(Op.W, 0.0), got.get(Op.W, 0.0)
                s = s.model_copy(update={"forward_s": got[Op.F], "backward_s": bwd, "weight_s": weight})
            parts.append(s)
        self.arrivals, self.end_s = self._arrivals(self.plan.model_copy(update={"partition": parts}))


def _median_after_first(xs: list[tuple[bool, float]]) -> float:
    """The median of the samples, the first step's (a warm-up) left out once there are others."""
    later = [x for first, x in xs if not first]
    return statistics.median(later or [x for _, x in xs])


class _Hold:
    """Wait until a moment: on CPU the host sleeps; on CUDA a spinning kernel holds the GPU (as NCCL's receive kernel
    does) and the host waits for it."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self._cycles_per_s: float | None = None

    def until(self, deadline: float) -> None:
        left = deadline - time.perf_counter()
        if left <= 0:
            return
        if not self.cuda:
            time.sleep(left)
            return
        torch.cuda._sleep(max(1, int(left * self.cycles_per_s())))
        torch.cuda.synchronize()

    def cycles_per_s(self) -> float:
        """The spin kernel's clock, timed once with CUDA events."""
        if self._cycles_per_s is None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(1_000_000)  # warm-up
            start.record()
            torch.cuda._sleep(50_000_000)
            end.record()
            end.synchronize()
            self._cycles_per_s = 50_000_000 / (start.elapsed_time(end) / 1e3)
        return self._cycles_per_s


class _OfferedShare:
    """Fill hooks that offer the fill executor `fraction` of each bubble's usable time (before its safety margin)."""

    def __init__(self, fill: Any, fraction: float, margin: float) -> None:
        self.fill, self.scale = fill, fraction / max(1e-9, 1.0 - margin)

    def bubble_begin(self, bubble_id: int, duration_s: float, free_bytes: int, **kw: Any) -> None:
        self.fill.bubble_begin(bubble_id, duration_s * self.scale, free_bytes, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fill, name)


class Rehearsal(Executor):
    """The runtime's executor for one rank, its peers replayed (see the module's doc)."""

    def __init__(self, *, replay: Replay, recorded: dict[str, torch.Tensor] | None, **kw: Any) -> None:
        super().__init__(**kw)
        from .fill_executor import FillExecutorOptions

        self.replay, self.recorded_in = replay, recorded
        self.steps_recorded = 1 + max((int(k.split(":")[0]) for k in recorded or {}), default=0)
        self.fill_fraction: float | None = None  # this run's share of each bubble offered to the fill executor
        self.fill_options = FillExecutorOptions(replicas=1)  # this rank's fill runs on this one device
        self.held = _Hold(self.cuda)
        self._made: dict[tuple[tuple[int, ...], torch.dtype], torch.Tensor] = {}
        self.trace: list[list[dict[str, Any]]] = []  # per step, each action: (action, start_s, end_s)
        self._pending_recv = Action(stage=0, op=Op.RECV_F, mb=0)  # the receive being waited for
        self._depth = 0

    def run_step(self, index: int) -> dict[str, Any]:
        self.trace.append([])
        record = super().run_step(index)
        self.replay.measured(self.trace[-1], record["fill"], first=index == 0)
        if self.cuda:
            record["reserved_bytes"] = torch.cuda.max_memory_reserved()
        return record

    def _do(self, st: _Step, a: Action) -> None:
        self._depth += 1  # a hand-over between the rank's own stages runs actions inside one: not the plan's
        start = time.perf_counter()
        try:
            super()._do(st, a)
        finally:
            self._depth -= 1
        if not self._depth:
            self.trace[-1].append({"action": str(a), "start_s": start - st.t0, "end_s": time.perf_counter() - st.t0})

    def _compute_done(self, a: Action) -> None:
        super()._compute_done(a)
        share = self.replay.tp_s.get(a.stage, 0.0)
        if share and a.op in (Op.F, Op.B, Op.I):  # the priced tensor-parallel collectives of the rest of the group
            self.held.until(time.perf_counter() + share)

    def _recv_remote(self, st: _Step, spec: TensorSpec, peer: int, tag: int) -> torch.Tensor:
        a = self._pending_recv
        self.held.until(st.t0 + self.replay.arrivals[(a.op, a.stage, a.mb)])
        if self.recorded_in is not None:
            key = f"{st.index % self.steps_recorded}:{tag}"
            if key not in self.recorded_in:
                raise UserError(f"the recorded boundary tensors hold nothing for step {st.index}, tag {tag}: record "
                                "them from a launch of this very plan")
            return self.recorded_in[key].to(self.options.device)
        key = (tuple(spec.shape), spec.dtype)
        if key not in self._made:  # made once: what a receive yields costs nothing to produce
            self._made[key] = torch.randn(spec.shape, device=self.options.device).to(spec.dtype) \
                if spec.dtype.is_floating_point else torch.zeros(spec.shape, dtype=spec.dtype, device=self.options.device)
        return self._made[key]

    def _recv_forward(self, st: _Step, k: int, mb: int) -> None:
        self._pending_recv = Action(stage=k, op=Op.RECV_F, mb=mb)
        super()._recv_forward(st, k, mb)

    def _recv_backward(self, st: _Step, k: int, mb: int) -> None:
        self._pending_recv = Action(stage=k, op=Op.RECV_B, mb=mb)
        super()._recv_backward(st, k, mb)

    def _allreduce(self, st: _Step, a: Action) -> None:
        start = time.perf_counter()
        super()._allreduce(st, a)
        self.held.until(start + self.replay.allreduce_s)

    def _step_end(self, st: _Step) -> None:
        self.held.until(st.t0 + self.replay.end_s)  # the slowest rank's OPT, as the barrier waits for it

    def _start_fill(self, client: Any) -> Any:
        fill = super()._start_fill(client)
        if self.fill_fraction is not None and not isinstance(fill, NullFill):
            return _OfferedShare(fill, self.fill_fraction, self.plan.fill.safety_margin)
        return fill


_ACTION_ROWS = {Op.F: "forward", Op.B: "backward", Op.I: "backward (input)", Op.W: "backward (weights)"}


def rehearse(plan_path: str | Path, options: RehearseOptions, log: Any = print) -> dict[str, Any]:
    """Run the rehearsal (one process: this one); returns the report (and the metrics document under "metrics")."""
    from ..metrics import MetricsDocument
    from . import check_plan, load_runtime_model_file
    from .fill_executor import GRACE_S
    from .executor import prepare
    from .groups import global_rank
    from ..plan import run_key
    from ..validate import DTYPES

    checked = check_plan(plan_path, world_size=_world(plan_path))
    plan = checked.plan
    check_rehearsal(plan, options)
    mf = load_runtime_model_file(checked)
    recorded = _load_boundary(options.boundary) if options.boundary else None
    c = plan.config.to_config()
    device = options.device
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    me = global_rank(options.rank, 0, 0, dp_size=c.dp, tp_size=c.tp, cp=0, cp_size=c.cp)
    dist.init_process_group("fake", store=FakeStore(), rank=me, world_size=c.world)
    threads = torch.get_num_threads()
    if not device.startswith("cuda") and c.world > 1:
        torch.set_num_threads(1)  # one thread, as torchrun runs each rank of a CPU launch (OMP_NUM_THREADS=1)
    try:
        run_opts = RunOptions(steps=options.steps, fill=options.fill, seed=options.seed, optimizer=options.optimizer,
                              lr=options.lr, device=device,
                              fill_grace_s=GRACE_S if options.fill_grace_s is None else options.fill_grace_s)
        ex = prepare(plan, mf, run_opts, executor=Rehearsal, replay=Replay(plan, options.rank), recorded=recorded)
        runs = []
        filled = options.fill and plan.fill is not None and any(ch.rank == options.rank for ch in plan.fill.chunks)
        if options.fill and not filled:
            log(f"rank {options.rank} runs no fill in this plan (no fill chunk is placed in its bubbles): one run "
                "without fill")
        fills = [(True, f) for f in options.fill_fractions] if filled else [(False, None)]
        for fill, fraction in ([(False, None)] if options.compare_no_fill and filled else []) + fills:
            ex.options, ex.fill_fraction = replace(run_opts, fill=fill), fraction
            ex.bubbles.reset()
            ex.trace = []
            ex.replay.frozen = fill and options.compare_no_fill  # the peers the run without fill saw
            label = _label(fill, fraction)
            record = ex.run(log=lambda text, label=label: log(f"rank {options.rank} ({label}): {text}"))
            runs.append((fill, fraction, record, ex.trace))
        if options.dump is not None:
            ex.dump(options.dump)
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)
    report = _report(plan, options, runs, device, ex.replay)
    entries = []
    for fill, _, record, _ in runs:
        steps = [{k: v for k, v in s.items() if k != "reserved_bytes"} for s in record["steps"]]
        entries.append({"plan": str(checked.path), "plan_key": run_key(plan), "config": plan.config.model_dump(),
                        "world": c.world, "device": device, "steps": options.steps, "fill": fill,
                        "optimizer": options.optimizer, "lr": options.lr, "seed": options.seed,
                        "dtype": DTYPES[c.precision], "rehearsed_rank": options.rank,
                        "loss": [s["loss"] for s in steps if s["loss"] is not None],
                        "predicted_iteration_s": plan.predictions.iteration_s,
                        "ranks": [{**record, "steps": steps}]})
    entries.sort(key=lambda e: not e["fill"])  # a run with fill first: the one `planner validate` reads
    report["metrics"] = MetricsDocument.model_validate({"runs": entries})
    return report


def _world(plan_path: str | Path) -> int:
    from ..plan import load_plan

    return load_plan(plan_path).config.to_config().world


def _load_boundary(path: Path) -> dict[str, torch.Tensor]:
    if not Path(path).is_file():
        raise UserError(f"boundary file {path} does not exist; record one with `python -m planner.runtime PLAN "
                        "--record-boundary DIR` under torchrun (DIR/0/rank<R>.pt)")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file gets one sentence
        raise UserError(f"boundary file {path} is not a recorded boundary file ({type(exc).__name__})") from None
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                             for k, v in data.items()):
        raise UserError(f"boundary file {path} is not a recorded boundary file (step:tag -> tensor)")
    return data


def _stats(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def _label(fill: bool, fraction: float | None) -> str:
    return "without fill" if not fill else "with fill" if fraction is None else f"with fill, {fraction:.0%} offered"


def _report(plan: Plan, options: RehearseOptions, runs: list[tuple[bool, float | None, dict, list]], device: str,
            replay: Replay) -> dict[str, Any]:
    """Predicted against measured, per action kind and stage, per bubble, peak memory; the runs compared. `replay`:
    the one the rank ran against (its planned timeline is the plan's; its arrivals and end, what the rank saw)."""
    c = plan.config
    rec, trace = runs[0][2:]  # the run without fill when there is one: the rank's own times and bubbles
    later = trace[1:] or trace
    actions = []
    for i, act in enumerate(trace[0]):
        name = act["action"]
        seen = [step[i] for step in later if i < len(step) and step[i]["action"] == name]
        planned = replay.planned.get(name)
        a = Action.parse(name)
        if planned is None and (a.op, a.stage, a.mb) in replay.planned_arrivals:  # a receive: the plan's arrival
            planned = (replay.planned_arrivals[(a.op, a.stage, a.mb)],) * 2
        actions.append({"action": name, "predicted_start_s": planned[0] if planned else None,
                        "predicted_s": planned[1] - planned[0] if planned else None,
                        "start_s": statistics.median(x["start_s"] for x in seen),
                        "duration_s": statistics.median(x["end_s"] - x["start_s"] for x in seen)})
    kinds = []
    for st in replay.stages:
        for op in _COMPUTE:
            seen = [x["duration_s"] for x in actions if (a := Action.parse(x["action"])).op is op and a.stage == st.stage]
            if not seen:
                continue
            predicted = {Op.F: st.forward_s, Op.B: st.backward_s, Op.I: st.backward_s - st.weight_s,
                         Op.W: st.weight_s}[op]
            kinds.append({"stage": st.stage, "kind": _ACTION_ROWS[op], "count": len(seen), "predicted_s": predicted,
                          "measured_s": statistics.median(seen)})
    bubbles = []
    steps = rec["steps"][1:] or rec["steps"]
    for b in (b for b in plan.bubbles if b.rank == options.rank):
        seen = [x["duration_s"] for s in steps for x in s["bubbles"] if x["id"] == b.id]
        bubbles.append({"id": b.id, "kind": b.kind, "predicted_start_s": b.start_s, "predicted_s": b.duration_s,
                        "measured_s": statistics.median(seen) if seen else None})
    mem = plan.predictions.memory[options.rank]
    every = [s for _, _, record, _ in runs for s in record["steps"]]
    peaks = [s["peak_memory_bytes"] for s in every if s["peak_memory_bytes"] is not None]
    reserved = [s["reserved_bytes"] for s in every if s.get("reserved_bytes") is not None]
    report: dict[str, Any] = {
        "plan": str(plan.source.model_file), "rank": options.rank, "device": device, "torch": torch.__version__,
        "cuda": torch.version.cuda if device.startswith("cuda") else None, "steps": options.steps,
        "config": plan.config.model_dump(),
        "actions": actions, "action_kinds": kinds, "bubbles": bubbles,
        "memory": {"predicted_bytes": mem.total - mem.reserve, "capacity_bytes": mem.capacity,
                   "allocated_peak_bytes": max(peaks) if peaks else None,
                   "reserved_peak_bytes": max(reserved) if reserved else None},
        "iteration": {"predicted_s": plan.predictions.iteration_s, "replayed_s": replay.end_s},
        "runs": []}
    base = None
    for fill, fraction, record, trace in runs:
        times = [s["iteration_s"] for s in record["steps"][1:]]
        step_s = _stats(times)
        base = step_s["median"] if not fill and base is None else base
        report["runs"].append({
            "label": _label(fill, fraction), "fill": fill, "fill_fraction": fraction, "step_s": step_s,
            "slowdown": step_s["median"] / base - 1 if fill and base and step_s["median"] is not None else None,
            "loss": [s["loss"] for s in record["steps"]],
            "in_plan_order": all([x["action"] for x in step] == plan.actions[options.rank] for step in trace),
            "fill_work": _fill_work(plan, options.rank, record, times)})
    return report


def _fill_work(plan: Plan, rank: int, record: dict[str, Any], step_times: list[float]) -> dict[str, Any] | None:
    """What the rank's fill jobs did over the steps after the first: units, seconds of work at the plan's prices, and
    the FLOP/s recovered, against the plan's chunks on the rank."""
    report = record.get("fill_report") or {}
    if plan.fill is None or not report:
        return None
    jobs = {j.name: j for j in plan.fill.jobs}
    flops = _unit_flops(plan)
    done_units, done_flops, done_s = 0, 0.0, 0.0
    for occ in report.get("bubbles", []):
        for step in occ.get("steps", []):
            job = jobs.get(step["job"])
            if job is None:
                continue
            i = step["pos"] % len(job.units)
            done_units += 1
            done_flops += flops.get(job.name, [0.0] * len(job.units))[i]
            done_s += job.unit_time_s[i]
    chunks = [ch for ch in plan.fill.chunks if ch.rank == rank]
    planned_units = sum(ch.units for ch in chunks)
    wall = sum(step_times)
    fills = max(len(step_times), 1)
    return {"units_per_step": done_units / fills, "planned_units_per_step": planned_units,
            "work_s_per_step": done_s / fills, "planned_work_s_per_step": sum(ch.expected_s for ch in chunks),
            "tflops": done_flops / wall / 1e12 if wall > 0 else None,
            "planned_tflops": plan.fill.predictions.fill_tflops_per_gpu,
            "overruns": len(report.get("overruns", [])), "kills": len(report.get("kills", [])),
            "errors": len(report.get("errors", []))}


def _unit_flops(plan: Plan) -> dict[str, list[float]]:
    """Each fill job's FLOPs per linearized unit, priced again from its model file (the plan keeps their times)."""
    from ..fill.profiles import profile_job
    from ..fill.spec import FillSpec
    from ..plan import plan_hardware

    hw, out = plan_hardware(plan), {}
    specs = {j.name: j for j in FillSpec.of_plan(plan.fill).jobs}
    for job in plan.fill.jobs:
        spec = specs.get(job.name.split("@")[0])
        if spec is None:
            continue
        try:
            profs = profile_job(spec, hw, plan.config.precision)
        except Exception:  # noqa: BLE001 - the FLOPs are a report's figure, not worth the rehearsal
            continue
        prof = next((p for p in profs if p.config == job.config and p.batch_size == job.batch_size), None)
        if prof is not None and len(prof.units) == len(job.units):
            out[job.name] = [u.flops for u in prof.units]
    return out
