"""Fill in the bubbles of Megatron-LM's pipeline schedules (megatron-core 0.16: 1F1B and interleaved 1F1B).

Megatron's schedules (megatron/core/pipeline_parallel/schedules.py: `forward_backward_pipelining_without_interleaving`,
`forward_backward_pipelining_with_interleaving`) have no bubble and no hook: a rank idles inside a pipeline receive.
Every receive goes through `P2PCommunicator._communicate` (p2p_communication.py: recv_forward, recv_backward,
send_forward_recv_backward, send_backward_recv_forward, send_forward_recv_forward, send_backward_recv_backward,
send_forward_backward_recv_forward_backward), with recv_prev (activations from the previous rank) or recv_next
(gradients from the next one). It waits its requests before returning (and with batch_p2p_comm and batch_p2p_sync,
the 1F1B default, synchronizes the device); with overlap_p2p_comm (interleaved only) it returns the requests and the
schedule waits them later (`recv_prev_wait_handles`, `recv_next_wait_handles`). Each schedule call builds a new
P2PCommunicator, so the adapter patches the class.

Which receive ends which bubble: `bubble_receives` replays the `_communicate` calls Megatron makes on a rank in one
training step (its warm-up, steady and cool-down loops, `recv_tensor_from_previous_stage` included) and names what
each receives: the n-th receive into model chunk c in a direction is microbatch n of that chunk (Megatron queues
them per chunk: `input_tensors[c]`, `output_tensor_grads[c]`). Each BUBBLE<id> of the plan's rank order maps to the
receive of the RECV after it; the bubble after OPT is the trailing one. Megatron receives in the same order in each
direction whether or not it overlaps its p2p communication, so at run time the adapter counts the receives of each
direction in the step and opens a bubble at the one the plan ends it with: before a blocking `_communicate` call
(closed after it), or at the wait of the receive's request under overlap_p2p_comm. On CUDA the host closes a bubble
after synchronizing the stream: NCCL's wait only orders the compute stream after the receive.

Step boundaries: the adapter wraps the two schedule functions (the module attributes, which
`get_forward_backward_func` returns). A training step (forward_only False; evaluation runs as Megatron runs it)
begins at the call; when it returns, the rank opens its trailing bubble and ends it at a barrier over the pipeline
group, so the trailing bubble lasts until the slowest pipeline rank is done (Megatron's optimizer step waits for it
anyway, in the gradient-norm all-reduce over the model-parallel group); every rank joins the barrier, with or without
a trailing bubble. What the schedule function itself synchronizes before it returns (finalize_model_grads_func: the
data-parallel reduction, the all-reduce of tied embedding gradients between the first and last stage) is Megatron's
work, not a bubble: a wait there shortens what the trailing bubble measures.

Step 0 runs without fill and measures every bubble (planner/runtime/bubbles.py: durations, memory, the CUDA ready
event); the fill executor starts before step 1, then a barrier over all ranks starts step 1 together.

`python -m planner.engines.megatron_fill PLAN.json pretrain_gpt.py ARGS...` runs a Megatron-LM script with the
adapter attached; each rank writes its report to fill/rank<N>.json. The fill executor starts with multiprocessing's
'spawn', which re-imports the running script: keep its work under `if __name__ == "__main__":` (Megatron-LM's do).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import runpy
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..plan import Plan
from ..runtime.bubbles import Bubbles, NullFill, load_fill_client, start_fill
from ..runtime.fill_executor import GRACE_S
from ..schedule_ir import Action, Op
from ..schedules.interleaved import group_size as plan_group_size

__all__ = ["MegatronFill", "Receive", "bubble_receives", "main"]

_SCHEDULES = {"forward_backward_pipelining_without_interleaving": False,
              "forward_backward_pipelining_with_interleaving": True}
"""The schedule functions of megatron.core.pipeline_parallel.schedules the adapter wraps -> interleaved."""
_RECEIVES = (("recv_prev", "F"), ("recv_next", "B"))
"""`_communicate`'s receive flags (and the request keys of `_p2p_ops`) -> the plan's RECV direction."""


@dataclass(frozen=True, slots=True)
class Receive:
    """One receive of a rank's Megatron schedule in a training step."""

    call: int
    """Which of the rank's receiving `_communicate` calls carries it, counted from 0 in the step (without
    overlap_p2p_comm; send_forward_backward_recv_forward_backward carries two receives)."""
    direction: str
    """"F": activations from the previous rank (recv_prev); "B": gradients from the next rank (recv_next)."""
    stage: int
    """The plan's stage that receives."""
    microbatch: int
    bubble: int | None
    """The plan's bubble this receive ends, or None."""


def bubble_receives(plan: Plan, pipeline_rank: int, *, overlap_p2p_comm: bool = False,
                    group_size: int | None = None) -> list[Receive]:
    """The receives of the rank's Megatron schedule in one training step, in the order Megatron issues them, each
    with the plan bubble it ends. `overlap_p2p_comm`: Megatron waits each receive by itself (interleaved only); else
    two bubbles ending at one call are refused. `group_size`: Megatron's microbatch_group_size_per_vp_stage (default:
    the one the plan's export passes)."""
    c = plan.config
    at, _ = _planned(plan, pipeline_rank)
    stages = sorted(s.stage for s in plan.partition if s.rank == pipeline_rank)
    if c.schedule == "1f1b":
        calls = _calls_1f1b(c.pp, pipeline_rank, c.microbatches)
    else:
        calls = _calls_interleaved(c.pp, pipeline_rank, c.vp, c.microbatches,
                                   group_size or plan_group_size(c.pp, c.microbatches))
    queued: dict[tuple[str, int], int] = {}
    out = []
    for i, received in enumerate(calls):
        for direction, chunk in received:
            mb = queued[direction, chunk] = queued.get((direction, chunk), -1) + 1
            key = (direction, stages[chunk], mb)
            out.append(Receive(i, direction, stages[chunk], mb, at.pop(key, None)))
        ends = [r.bubble for r in out[-len(received):] if r.bubble is not None]
        if len(ends) > 1 and not overlap_p2p_comm:
            raise ValueError(f"pipeline rank {pipeline_rank}: bubbles {ends[0]} and {ends[1]} end at one Megatron "
                             "receive (send_forward_backward_recv_forward_backward waits both): run with p2p overlap "
                             "(Megatron-LM's default for the interleaved schedule)")
    if at:
        (direction, stage, mb), bubble = next(iter(at.items()))
        raise ValueError(f"pipeline rank {pipeline_rank}: bubble {bubble} precedes {stage}RECV_{direction}{mb}, which "
                         "Megatron-Core's schedule does not receive on this rank")
    return out


def _planned(plan: Plan, pipeline_rank: int) -> tuple[dict[tuple[str, int, int], int], int | None]:
    """The rank's bubbles: (direction, stage, microbatch) of the RECV right after each -> its id, and the trailing
    bubble (after OPT) or None."""
    _check_schedule(plan)
    at: dict[tuple[str, int, int], int] = {}
    pending: int | None = None
    trailing: int | None = None
    opt = False
    for action in map(Action.parse, plan.actions[pipeline_rank]):
        if pending is not None and action.op in (Op.RECV_F, Op.RECV_B):
            at[action.op.value[-1], action.stage, action.mb] = pending
            pending = None
        elif pending is not None:
            raise ValueError(f"pipeline rank {pipeline_rank}: bubble {pending} precedes {action}, not a receive, so "
                             "no Megatron receive ends it")
        elif action.op is Op.BUBBLE and opt and trailing is None:
            trailing = action.mb
        elif action.op is Op.BUBBLE:
            pending = action.mb
        opt = opt or action.op is Op.OPT
    if pending is not None:
        raise ValueError(f"pipeline rank {pipeline_rank}: bubble {pending} is followed by no receive, so no Megatron "
                         "receive ends it")
    return at, trailing


def _check_schedule(plan: Plan) -> None:
    if plan.config.schedule not in ("1f1b", "interleaved"):
        raise ValueError(f"Megatron-Core runs the 1f1b and interleaved schedules, not the plan's "
                         f"'{plan.config.schedule}'")


def _calls_1f1b(p: int, r: int, m: int) -> list[list[tuple[str, int]]]:
    """Per receiving `_communicate` call of forward_backward_pipelining_without_interleaving on rank r, its receives
    as (direction, model chunk)."""
    first, last = r == 0, r == p - 1
    warmup = min(p - r - 1, m)
    fwd, bwd = [] if first else [("F", 0)], [] if last else [("B", 0)]
    calls = [fwd] * warmup  # recv_forward (then send_forward)
    calls += [fwd] if m > warmup else []  # recv_forward before the steady state
    for i in range(m - warmup):
        calls.append(bwd)  # send_forward_recv_backward
        if i < m - warmup - 1:
            calls.append(fwd)  # send_backward_recv_forward (the last one is a send_backward)
    calls += [bwd] * warmup  # recv_backward
    return [c for c in calls if c]


def _calls_interleaved(p: int, r: int, v: int, m: int, g: int) -> list[list[tuple[str, int]]]:
    """The same for forward_backward_pipelining_with_interleaving without overlap_p2p_comm (its
    get_schedule_table, get_pp_rank_microbatches and recv_tensor_from_previous_stage)."""
    table = [c for start in range(0, m, g) for c in range(v) for _ in range(start, min(start + g, m))]
    total = m * v
    warmup = min((p - r - 1) * 2 + (v - 1) * g, total)
    remaining = total - warmup

    def chunk(k: int, forward: bool) -> int:
        return table[k % total] if forward else v - 1 - table[k % total]

    def recv_from(k: int, forward: bool) -> tuple[bool, int]:
        """Whether iteration k receives for the next one in that direction, and into which chunk."""
        if r != (0 if forward else p - 1):
            return True, chunk(k + 1, forward)
        if k < p - 1:  # the leading rank: the other end of the ring has produced nothing yet
            return False, 0
        sent = chunk(k - (p - 1), forward)  # what the ending rank produced p-1 iterations ago
        return sent != (v - 1 if forward else 0), sent + (1 if forward else -1)

    def calls_of(recv_prev: bool, fwd_chunk: int, recv_next: bool, bwd_chunk: int) -> list[list[tuple[str, int]]]:
        got = [("F", fwd_chunk)] * recv_prev + [("B", bwd_chunk)] * recv_next
        return [got] if got else []

    calls = [] if r == 0 else [[("F", 0)]]  # recv_forward of the first microbatch
    for k in range(warmup):  # send_forward_recv_forward; the last one also receives the first gradient
        recv_prev, into = recv_from(k, True)
        calls += calls_of(recv_prev and k != total - 1, into,
                          k == warmup - 1 and remaining > 0 and r != p - 1, v - 1)
    for k in range(remaining):  # send_forward_backward_recv_forward_backward
        recv_prev, fwd_into = recv_from(k + warmup, True)
        recv_next, bwd_into = recv_from(k, False)
        calls += calls_of(recv_prev and k != remaining - 1, fwd_into, recv_next, bwd_into)
    if remaining == 0 and r != p - 1:  # recv_backward when every forward ran in the warm-up
        calls.append([("B", v - 1)])
    for k in range(remaining, total):  # send_backward_recv_backward
        recv_next, into = recv_from(k, False)
        calls += calls_of(False, 0, recv_next and k != total - 1, into)
    return calls


@dataclass(slots=True)
class _Step:
    t0: float
    count: dict[str, int] = field(default_factory=lambda: {"F": 0, "B": 0})
    """Receives so far in the step, per direction."""
    seen: list[dict[str, Any]] = field(default_factory=list)


class _BubbleWait:
    """A receive's request (a torch.distributed Work) under overlap_p2p_comm whose wait is a bubble."""

    def __init__(self, work: Any, adapter: "MegatronFill", bubble: int) -> None:
        self.work, self.adapter, self.bubble = work, adapter, bubble

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        self.adapter.bubbles.begin(self.bubble)
        try:
            return self.work.wait(*args, **kwargs)
        finally:
            self.adapter._close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


class MegatronFill:
    """The fill adapter of one Megatron-LM process: `attach()` before training; the pipeline rank, device and
    schedule are read at the first training step."""

    def __init__(self, plan: Plan, *, device: str | None = None, global_rank: int | None = None,
                 grace_s: float = GRACE_S, options: Any = None, client: Any = None) -> None:
        _check_schedule(plan)
        self.plan, self.device, self.global_rank = plan, device, global_rank
        self.grace_s, self.options = grace_s, options
        self.client = client if client is not None else load_fill_client()
        self.rank: int | None = None
        """The pipeline rank, once the first training step has run."""
        self.bubbles: Any = None
        self.steps: list[dict[str, Any]] = []
        self._group: Any = None
        self._order: dict[str, list[Receive]] = {}
        self._trailing: int | None = None
        self._step: _Step | None = None
        self._saved: list[tuple[Any, str, Any]] = []

    # ---- patching megatron-core ---------------------------------------------------------------------

    def attach(self) -> "MegatronFill":
        """Patch megatron-core's receive (P2PCommunicator._communicate) and its two pipeline schedules."""
        p2p, schedules = _megatron()
        if self._saved:
            return self
        communicate = p2p.P2PCommunicator._communicate

        @functools.wraps(communicate)
        def _communicate(comm: Any, **kwargs: Any) -> Any:
            return self._communicate(communicate, comm, kwargs)

        self._patch(p2p.P2PCommunicator, "_communicate", _communicate)
        for name, interleaved in _SCHEDULES.items():
            self._patch(schedules, name, self._wrap(getattr(schedules, name), interleaved))
        return self

    def detach(self) -> None:
        """Give megatron-core back its own functions."""
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved = []

    def _patch(self, owner: Any, name: str, new: Any) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, new)

    def _wrap(self, schedule: Callable[..., Any], interleaved: bool) -> Callable[..., Any]:
        @functools.wraps(schedule)
        def run(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("forward_only"):  # evaluation: none of the plan's bubbles is in it
                return schedule(*args, **kwargs)
            return self._run_step(schedule, interleaved, args, kwargs)
        return run

    # ---- a training step ----------------------------------------------------------------------------

    def _run_step(self, schedule: Callable[..., Any], interleaved: bool, args: tuple, kwargs: dict[str, Any]) -> Any:
        self._resolve(interleaved, kwargs)
        if len(self.steps) == 1 and self.client is not None:
            self.bubbles.fill = start_fill(self.client, self.plan, self.rank, self.global_rank, self.device,
                                           grace_s=self.grace_s, options=self.options)
            dist.barrier()  # ranks with and without fill jobs (and slower loads) start step 1 together
        self._step = step = _Step(t0=time.perf_counter())
        try:
            out = schedule(*args, **kwargs)
        finally:
            self._step = None
        if self._trailing is not None:
            self.bubbles.begin(self._trailing)
        dist.barrier(group=self._group)  # the trailing bubble lasts until the slowest pipeline rank is done
        self._close(step)
        self.bubbles.measured(step.seen)
        self.steps.append({"step": len(self.steps), "iteration_s": time.perf_counter() - step.t0,
                           "fill": self.bubbles.filling, "bubbles": step.seen})
        return out

    def _resolve(self, interleaved: bool, kwargs: dict[str, Any]) -> None:
        """At each training step: the run is the plan's; at the first, the rank's receives and bubbles."""
        from megatron.core import parallel_state
        from megatron.core.utils import get_model_config

        comm, model = kwargs.get("p2p_communicator"), kwargs["model"]
        group = comm.pp_group if comm is not None else parallel_state.get_pipeline_model_parallel_group()
        chunks = model if isinstance(model, list) else [model]
        c = self.plan.config
        ran = ("interleaved" if interleaved else "1f1b", group.size(), len(chunks), kwargs["num_microbatches"])
        if ran != (c.schedule, c.pp, c.vp, c.microbatches):
            raise ValueError(f"Megatron runs {ran[0]} with pp={ran[1]}, vp={ran[2]} and {ran[3]} microbatches, the "
                             f"plan {c.schedule} with pp={c.pp}, vp={c.vp} and {c.microbatches}: run the plan's export")
        if self.rank is not None:
            return
        config = get_model_config(chunks[0])
        overlap = bool(interleaved and getattr(config, "overlap_p2p_comm", False))
        receives = bubble_receives(self.plan, group.rank(), overlap_p2p_comm=overlap,
                                   group_size=getattr(config, "microbatch_group_size_per_vp_stage", None))
        self.rank, self._group = group.rank(), group
        self._order = {d: [r for r in receives if r.direction == d] for d in ("F", "B")}
        self._trailing = _planned(self.plan, self.rank)[1]
        if self.device is None:
            self.device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        if self.global_rank is None:
            env = os.environ.get("RANK")  # torchrun's
            self.global_rank = int(env) if env is not None else (dist.get_rank() if dist.is_initialized() else 0)
        self.bubbles = Bubbles(self.plan, self.rank, self.device)

    def _communicate(self, communicate: Callable[..., Any], comm: Any, kwargs: dict[str, Any]) -> Any:
        """One `_communicate` call: a bubble around it, or around the wait of its receive's request."""
        step = self._step
        if step is None:
            return communicate(comm, **kwargs)
        ends = []
        for flag, direction in _RECEIVES:
            if kwargs.get(flag):
                n = step.count[direction]
                step.count[direction] += 1
                order = self._order[direction]
                if n < len(order) and order[n].bubble is not None:
                    ends.append((flag, order[n].bubble))
        if not ends:
            return communicate(comm, **kwargs)
        if not kwargs.get("wait_on_reqs", True) and not comm.config.use_ring_exchange_p2p:
            recv_prev, recv_next, reqs = communicate(comm, **kwargs)  # overlap_p2p_comm: the schedule waits later
            for flag, bubble in ends:
                reqs[flag] = _BubbleWait(reqs[flag], self, bubble)
            return recv_prev, recv_next, reqs
        self.bubbles.begin(ends[0][1])
        try:
            return communicate(comm, **kwargs)
        finally:
            self._close()

    def _close(self, step: _Step | None = None) -> None:
        """The rank resumes: close the open bubble, once the data has arrived."""
        step = step or self._step
        if self.bubbles.open is not None and self.bubbles.cuda:  # NCCL's waits and barrier only order the stream
            torch.cuda.current_stream().synchronize()
        if (record := self.bubbles.end(step.t0 if step else None)) is not None and step is not None:
            step.seen.append(record)

    # ---- the end ------------------------------------------------------------------------------------

    def report(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """What ran: per step its bubbles (id, start and duration in seconds, the plan's), and the fill executor's
        report (planner.metrics.FillReport's fields; {} without fill)."""
        fill = self.bubbles.fill if self.bubbles is not None else NullFill()
        return {"rank": self.rank, "global_rank": self.global_rank, "steps": self.steps,
                "fill_report": fill.report(timeout_s) if not isinstance(fill, NullFill) else {}}

    def close(self) -> None:
        """Stop the fill executor and detach."""
        if self.bubbles is not None:
            self.bubbles.fill.close()
            self.bubbles.fill = NullFill()
        self.detach()


def _megatron() -> tuple[Any, Any]:
    """megatron-core's p2p_communication and schedules modules, refused where they lack what the adapter patches."""
    try:
        from megatron.core.pipeline_parallel import p2p_communication, schedules
    except ImportError as exc:
        raise RuntimeError(f"megatron-core {_version()} has no pipeline schedules to fill ({exc})") from exc
    missing = [] if hasattr(getattr(p2p_communication, "P2PCommunicator", None), "_communicate") else [
        "P2PCommunicator._communicate"]
    missing += [f"schedules.{name}" for name in _SCHEDULES if not callable(getattr(schedules, name, None))]
    if missing:
        raise RuntimeError(f"megatron-core {_version()} has no {' or '.join(missing)}, which the fill adapter "
                           "patches (it follows megatron-core 0.16's pipeline_parallel)")
    return p2p_communication, schedules


def _version() -> str:
    try:
        from megatron.core import __version__
        return str(__version__)
    except ImportError:
        from importlib.metadata import PackageNotFoundError, version
        try:
            return version("megatron-core")
        except PackageNotFoundError:
            return "(version unknown)"


def main(argv: list[str] | None = None) -> int:
    """Run a Megatron-LM training script with the plan's fill jobs in its pipeline bubbles."""
    from passes.errors import UserError

    from ..plan import load_plan

    ap = argparse.ArgumentParser(prog="python -m planner.engines.megatron_fill",
                                 description="Run a Megatron-LM script (under torchrun) with a plan's fill jobs in "
                                             "its pipeline bubbles.")
    ap.add_argument("--out", default="fill", help="where each rank writes its report, rank<N>.json (default fill)")
    ap.add_argument("--fill-grace", type=float, default=GRACE_S, metavar="SECONDS",
                    help=f"how long past a bubble's end a fill task may run before it is killed (default {GRACE_S})")
    ap.add_argument("plan", help="the plan (JSON) the script runs, as its Megatron export")
    ap.add_argument("script", help="the Megatron-LM script: pretrain_gpt.py, ...")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    a = ap.parse_args(argv)
    try:
        plan = load_plan(a.plan)
        for rank in range(plan.config.pp):  # refuse before training what no run can map
            bubble_receives(plan, rank, overlap_p2p_comm=True)
        fill = MegatronFill(plan, grace_s=a.fill_grace).attach()
    except (UserError, ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    sys.argv = [a.script, *a.args]
    sys.path.insert(0, str(Path(a.script).resolve().parent))  # as `python pretrain_gpt.py` has it
    try:
        runpy.run_path(a.script, run_name="__main__")
    finally:
        if fill.rank is not None:
            out = Path(a.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / f"rank{fill.global_rank}.json").write_text(json.dumps(fill.report(), indent=1))
        fill.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
