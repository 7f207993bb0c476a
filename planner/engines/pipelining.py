"""Fill in the bubbles of torch.distributed.pipelining's schedule runtime: what torchtitan runs a plan's schedule CSV
with (`_PipelineScheduleRuntime`, torch 2.13).

torch's runtime has no bubble: it walks `pipeline_order_with_comms[rank]` (the plan's compute order, lowered to
sends and receives), and a rank idles inside the F, I or B action that consumes a receive
(`_wait_batch_p2p(self.fwd_recv_ops.pop(...))` / `bwd_recv_ops`). Its extension point,
`register_custom_function`, replaces a built-in action rather than wrapping it, and `_ComputationType` is closed,
so an action of our own cannot go in the CSV (its regex matches a prefix: `0BUBBLE1` would parse as `0B`).

So the adapter leaves the actions alone and wraps the list torch iterates: before each action it looks whether the
plan has a bubble there. Each BUBBLE<id> of the plan's rank order maps to the first compute action after it (the
one whose receive the rank waits for); a bubble after the last compute action (the trailing one) is the end of the
step. Before a mapped action whose receive has not completed, the adapter opens the bubble
(`planner.runtime.bubbles.Bubbles`: durations from the plan, then the median measured; memory; the CUDA ready
event), waits the receive itself, and closes the bubble; it leaves torch an empty list of works in its place
(waiting a gloo `Work` twice hangs). On CUDA the host would run ahead of a NCCL receive, so it synchronizes the
stream before closing the bubble. After the last action it opens the trailing bubble and ends it at a barrier over
the pipeline group: every rank ends the step together, as fxplanner's runtime does (torchtitan's gradient-norm
all-reduce over the pipeline ranks waits for the slowest rank at that point anyway).

Step 0 runs without fill and measures every bubble; the fill executor (planner/runtime/fill_executor.py, with its
admission, memory cap, grace kill, shares, turns, PipeSwitch loading and Waterwave pairing) starts before step 1.
Evaluation (`schedule.eval`, which runs without a backward) runs as torch runs it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist

from ..plan import Plan
from ..runtime.bubbles import Bubbles, NullFill, load_fill_client, start_fill
from ..runtime.fill_executor import GRACE_S
from ..schedule_ir import Action, Op

__all__ = ["PipelineFill", "attach", "bubble_actions", "check_bubbles"]

_READS = ("pipeline_order_with_comms", "fwd_recv_ops", "bwd_recv_ops", "rank", "_has_backward",
          "_step_microbatches", "stage_index_to_group_rank", "_stages")
"""What of torch's _PipelineScheduleRuntime the adapter reads or wraps (torch 2.13)."""


@dataclass(frozen=True, slots=True)
class BubbleMap:
    """Where one rank's planned bubbles fall in torch's order."""

    at: dict[tuple[int, str, int], int]
    """(stage, "F" | "B" | "I", microbatch) of the action whose receive a bubble waits for -> bubble id."""
    trailing: int | None
    """The bubble after the rank's last compute action: the end of the step."""


def bubble_actions(plan: Plan, pipeline_rank: int) -> BubbleMap:
    """Each BUBBLE of the rank's planned order, mapped to the first compute action after it (None: the trailing
    bubble). A bubble followed by a W (which waits for nothing) cannot be marked and is refused."""
    at: dict[tuple[int, str, int], int] = {}
    pending: int | None = None
    for action in (Action.parse(a) for a in plan.actions[pipeline_rank]):
        if action.op is Op.BUBBLE:
            if pending is not None:
                raise ValueError(f"rank {pipeline_rank}: bubbles {pending} and {action.mb} have no compute between "
                                 "them")
            pending = action.mb
        elif action.op in (Op.F, Op.B, Op.I, Op.W) and pending is not None:
            if action.op is Op.W:
                raise ValueError(f"rank {pipeline_rank}: bubble {pending} precedes {action}, which waits for no "
                                 "receive: torch's runtime cannot mark it")
            at[(action.stage, action.op.value, action.mb)] = pending
            pending = None
    return BubbleMap(at=at, trailing=pending)


def check_bubbles(runtime: Any, plan: Plan) -> int:
    """Every planned bubble of every rank maps to an action that blocks on a receive in torch's lowered order
    (`runtime`: a `_PipelineScheduleRuntime` with the plan's CSV loaded). Returns how many bubbles were mapped; a
    bubble that does not map is a ValueError naming rank, bubble and action."""
    found = 0
    for rank in range(plan.config.pp):
        bmap = bubble_actions(plan, rank)
        lowered = [str(a) for a in runtime.pipeline_order_with_comms[rank]]
        for (stage, op, mb), bubble in bmap.at.items():
            recv = f"{stage}RECV_{'F' if op == 'F' else 'B'}{mb}"
            action = f"{stage}{op}{mb}"
            if action not in lowered:
                raise ValueError(f"rank {rank}, bubble {bubble}: torch's order for the rank has no {action}")
            if recv not in lowered[:lowered.index(action)]:
                raise ValueError(f"rank {rank}, bubble {bubble}: {action} receives nothing in torch's order "
                                 "(its input is on the same rank), so no wait marks the bubble")
            found += 1
        found += bmap.trailing is not None
    return found


class _Marked(list):
    """A rank's lowered actions; the first iteration inside a training step announces each action to the adapter
    first."""

    def __init__(self, actions: list, adapter: "PipelineFill") -> None:
        super().__init__(actions)
        self._adapter = adapter

    def __iter__(self) -> Iterator[Any]:
        if not self._adapter.in_step:  # evaluation, or torch formatting the order for an error
            yield from super().__iter__()
            return
        self._adapter.in_step = False  # the step's own walk only (not a second iteration inside it)
        for action in super().__iter__():
            self._adapter.before(action)
            yield action


class PipelineFill:
    """The fill adapter of one pipeline rank of a torch `_PipelineScheduleRuntime` (use `attach`)."""

    def __init__(self, schedule: Any, plan: Plan, *, device: str, global_rank: int, grace_s: float,
                 options: Any = None, client: Any = None) -> None:
        self.schedule, self.plan, self.device = schedule, plan, str(device)
        self.rank = int(schedule.rank)
        self.global_rank, self.grace_s, self.options = global_rank, grace_s, options
        self.map = bubble_actions(plan, self.rank)
        self.bubbles = Bubbles(plan, self.rank, self.device)
        self.group = schedule._stages[0].group
        self.client = client if client is not None else load_fill_client()
        self.steps: list[dict[str, Any]] = []
        self.in_step = False
        self._seen: list[dict[str, Any]] = []
        self._t0 = 0.0
        self._step_microbatches = schedule._step_microbatches
        schedule._step_microbatches = self._step
        order = schedule.pipeline_order_with_comms
        order[self.rank] = _Marked(list(order[self.rank]), self)

    def _step(self, *args: Any, **kwargs: Any) -> Any:
        if not self.schedule._has_backward:  # evaluation: no bubble of the plan is in it
            return self._step_microbatches(*args, **kwargs)
        if len(self.steps) == 1 and self.client is not None and self.plan.fill is not None:
            self.bubbles.fill = start_fill(self.client, self.plan, self.rank, self.global_rank, self.device,
                                           grace_s=self.grace_s, options=self.options)
            dist.barrier(group=self.group)  # ranks with and without fill jobs start step 1 together
        self.in_step, self._seen, self._t0 = True, [], time.perf_counter()
        try:
            out = self._step_microbatches(*args, **kwargs)
        finally:
            self.in_step = False
        if self.map.trailing is not None:
            self.bubbles.begin(self.map.trailing)
        dist.barrier(group=self.group)  # the trailing bubble lasts until the slowest rank is done
        if self.bubbles.cuda:
            torch.cuda.current_stream().synchronize()
        self._close()
        self.bubbles.measured(self._seen)
        self.steps.append({"step": len(self.steps), "iteration_s": time.perf_counter() - self._t0,
                           "fill": self.bubbles.filling, "bubbles": self._seen})
        return out

    def before(self, action: Any) -> None:
        """Called before each action of a training step: where the plan has a bubble and the action's receive has
        not completed, the rank idles until it has."""
        kind = action.computation_type.value
        bubble = self.map.at.get((action.stage_index, kind, action.microbatch_index))
        if bubble is None:
            return
        works = (self.schedule.fwd_recv_ops if kind == "F" else self.schedule.bwd_recv_ops).get(
            (action.stage_index, action.microbatch_index))
        if not works or all(w.is_completed() for w in works):
            self._seen.append({"id": bubble, "start_s": time.perf_counter() - self._t0, "duration_s": 0.0,
                               "waited": False})
            return
        self.bubbles.begin(bubble)
        for w in works:
            w.wait()
        works.clear()  # torch waits the list again: now nothing (a gloo Work waited twice hangs)
        if self.bubbles.cuda:  # the host waits until the data has landed, not until the receive was queued
            torch.cuda.current_stream().synchronize()
        self._close()

    def _close(self) -> None:
        if (record := self.bubbles.end(self._t0)) is not None:
            self._seen.append({**record, "waited": True})

    def report(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """What ran: per step its bubbles (id, start and duration in seconds, whether the rank waited), and the fill
        executor's report (planner.metrics.FillReport's fields; {} without fill)."""
        fill = self.bubbles.fill
        return {"rank": self.rank, "steps": self.steps,
                "fill_report": fill.report(timeout_s) if not isinstance(fill, NullFill) else {}}

    def close(self) -> None:
        """Stop the fill executor and give torch back its own order and step."""
        self.bubbles.fill.close()
        self.bubbles.fill = NullFill()
        order = self.schedule.pipeline_order_with_comms
        order[self.rank] = list(order[self.rank])
        self.schedule._step_microbatches = self._step_microbatches


def attach(schedule: Any, plan: Plan, *, device: str = "cpu", global_rank: int | None = None,
           grace_s: float = GRACE_S, options: Any = None) -> PipelineFill:
    """Fill the bubbles of `schedule` (a torch `_PipelineScheduleRuntime` whose order is the plan's: loaded from the
    plan's schedule CSV) with the plan's fill jobs. Call it on every pipeline rank, after the schedule is built and
    before its first step."""
    missing = [name for name in _READS if not hasattr(schedule, name)]
    if missing or getattr(schedule, "pipeline_order_with_comms", None) is None:
        raise RuntimeError(f"torch {torch.__version__}'s pipeline schedule {type(schedule).__name__} has no "
                           f"{', '.join(missing) or 'lowered order (pipeline_order_with_comms)'}: the fill adapter "
                           "runs torch 2.13's _PipelineScheduleRuntime, loaded from the plan's schedule CSV")
    if len(schedule.pipeline_order_with_comms) != plan.config.pp:
        raise ValueError(f"the schedule has {len(schedule.pipeline_order_with_comms)} pipeline ranks, the plan "
                         f"{plan.config.pp}: load the plan's own schedule CSV")
    rank = global_rank if global_rank is not None else (dist.get_rank() if dist.is_initialized() else 0)
    return PipelineFill(schedule, plan, device=device, global_rank=rank, grace_s=grace_s, options=options)
