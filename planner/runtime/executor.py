"""Execute one pipeline rank's action list: compute, p2p, gradient reduction, optimizer, bubbles.

torch.distributed.pipelining's schedule runtime cannot take new action kinds (BUBBLE), so the plan's
own action strings run here, one at a time, in order:

- ``kF m`` / ``kB m``: forward / backward of virtual stage k on microbatch m. The last stage
  computes ``loss_fn(output, targets) / m``; its backward starts from that loss, other stages from
  the gradient received for what they sent. Zero-bubble schedules split the backward: ``kI m`` computes
  the gradients of the stage's inputs only and keeps the autograd nodes the weights' gradients hang from,
  ``kW m`` computes those (torch.distributed.pipelining's ``stage_backward_input`` /
  ``stage_backward_weight``; the first stage, whose inputs carry no gradient, runs its whole backward at W
  as torch's does). Neighbour stages on the same rank (a V placement) hand values over directly.
- ``kSEND_F m`` / ``kSEND_B m``: asynchronous ``isend`` (gloo/nccl p2p, tagged by boundary,
  microbatch and slot); ``kRECV_F m`` / ``kRECV_B m``: ``irecv`` into a buffer shaped by the meta
  shape pass, waited at once. Sends are waited at ALLREDUCE, so the schedule's own deadlock check
  (unbounded buffers) holds.
- ``ALLREDUCE``: sum gradients of parameters shared between pipeline ranks (tied embedding/head)
  over their holders, then average all gradients over the data-parallel group.
- ``OPT``: optimizer step. ``BUBBLE<id>``: the rank would idle here; hand the time to the fill client.

Every step ends with a barrier over all ranks, so that a step's wall time (and a trailing bubble)
is measured the same way on every rank. A bubble lasts from its BUBBLE action to the start of the
next F/B/ALLREDUCE/OPT (a RECV waited on in between is part of it) or the end of the step. Step 0
runs without fill and measures every bubble; later steps hand the fill client the median of the bubble's
measured durations so far (one step's can be far off: the first step's warm-up, a descheduled process), not
the plan's (which is for the target GPU).

Precision: parameters and activations in the plan's dtype, fp32 master weights (planner/runtime/optim.py),
the loss in fp32, dynamic loss scaling under fp16 (``LossScaler``). Context parallelism: each rank's
microbatches hold its tokens of every sequence (planner/runtime/context_parallel.py); the loss and the
gradients are averaged over dp x cp. CUDA-only, untested here: nccl, the ``ready`` event passed to
``bubble_begin``, per-step peak memory, a synchronize after each F/B for timing.
"""
from __future__ import annotations

import gc
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from passes.load import ModelFile

from ..plan import Plan, plan_schedule
from ..schedule_ir import Action, Op, grid
from passes.errors import UserError

from .bubbles import Bubbles, FillHooks, NullFill, load_fill_client, start_fill
from .context_parallel import ContextParallel
from .fill_executor import GRACE_S
from .groups import Groups, make_groups, make_shared_groups
from .optim import GradSync, SavedBytes
from .stage import (DTYPES, StageModule, TensorSpec, apply_tensor_parallel, boundary_specs, build_split,
                    stage_modules, to_precision)

__all__ = ["RunOptions", "NullFill", "FillHooks", "ActionError", "Executor", "prepare", "load_fill_client",
           "failure_text", "stage_parameters", "held_parameters"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RunOptions:
    """How to run a plan (the command line of ``python -m planner.runtime``)."""

    steps: int = 3
    fill: bool = True
    fill_grace_s: float = GRACE_S
    """How long past a bubble's end a fill task may run before it is killed (FreeRide 3.2.3's grace period)."""
    optimizer: str = "adam"
    lr: float = 1e-3
    seed: int = 0
    device: str = "cpu"
    dump_dir: Path | None = None
    """Debug: write each rank's parameters and gradients (canonical names) after the last step."""
    record: bool = False
    """Debug: keep every boundary tensor received from another rank ("step:tag" -> tensor), for a rehearsal of the
    rank to replay (planner/runtime/rehearse.py)."""
    characterize: tuple[int, int] | None = None
    """(pipeline rank, bubble id): after the steps, measure that bubble by doubling waits (PipeFill 4.2)."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"--steps must be at least 1, got {self.steps}")
        if not self.fill_grace_s >= 0:
            raise ValueError(f"--fill-grace must be a number of seconds >= 0, got {self.fill_grace_s}")
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"--optimizer must be adam or sgd, got {self.optimizer!r}")


class ActionError(RuntimeError):
    """An action failed; names the pipeline rank and the step index into its action list."""

    def __init__(self, pipeline_rank: int, step: int, action: Action, cause: BaseException) -> None:
        super().__init__(f"pipeline rank {pipeline_rank}, step {step} ({action}): {type(cause).__name__}: {cause}")
        self.pipeline_rank, self.step, self.action = pipeline_rank, step, action


def failure_text(plan: Plan, exc: ActionError) -> str:
    """The error and the schedule grid with the failing action marked."""
    return f"error: {exc}\n{grid(plan_schedule(plan), mark=(exc.pipeline_rank, exc.step))}"


@dataclass(kw_only=True)
class _Step:
    """Per-step state and records."""

    index: int
    t0: float
    inputs: list[tuple[Any, ...]]
    targets: list[Any]
    saved: dict[tuple[int, int], tuple[dict[str, torch.Tensor], Any]] = field(default_factory=dict)
    received: dict[tuple[int, int], dict[str, torch.Tensor]] = field(default_factory=dict)
    out_acts: dict[tuple[int, int], list[Any]] = field(default_factory=dict)
    out_grads: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    in_grads: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    pending: list[Any] = field(default_factory=list)
    weight_grads: dict[tuple[int, int], tuple[Any, ...]] = field(default_factory=dict)  # what each W step needs
    loss: torch.Tensor | None = None
    bubbles: list[dict[str, Any]] = field(default_factory=list)
    times: dict[int, list[float]] = field(default_factory=dict)


def stage_parameters(stages: list[StageModule]) -> dict[str, torch.nn.Parameter]:
    """The parameters a rank's stages train, by canonical name (a weight read by several stages, or tied, once)."""
    params: dict[str, torch.nn.Parameter] = {}
    for st in stages:
        for local, param in st.named_parameters(remove_duplicate=False):
            params.setdefault(st.names[local], param)
    return dict(sorted(params.items()))


def held_parameters(params: dict[str, torch.nn.Parameter]) -> int:
    """How many parameters a rank holds (Holdings.parameters): each tensor once."""
    return sum(p.numel() for p in {id(p): p for p in params.values()}.values())


class Executor:
    """One rank's view of a plan: its stages, groups, optimizer, and the action loop."""

    def __init__(self, *, plan: Plan, model_file: ModelFile, groups: Groups, stages: list[StageModule],
                 specs: dict[str, Any], slots: int, options: RunOptions, cp: ContextParallel | None = None) -> None:
        self.plan, self.mf, self.groups, self.options, self.cp = plan, model_file, groups, options, cp
        self.c = groups.coords
        self.stages = {st.index: st for st in stages}
        self.specs = specs
        self.actions = [Action.parse(a) for a in plan.actions[self.c.pp]]
        self.n_stages = len(plan.partition)
        self.rank_of = {s.stage: s.rank for s in plan.partition}  # the plan's placement
        self.cfg = plan.config.to_config()
        self.m = self.cfg.m
        self.params = stage_parameters(stages)
        self.sync = GradSync(self.params, shared=groups.shared, dp_group=groups.grad_group,  # dp x cp
                             dp_size=self.c.dp_size * self.c.cp_size, dp_rank=self.c.dp_cp, zero=self.cfg.zero,
                             overlap=self.cfg.overlap_grad_reduce,
                             optimizer=options.optimizer, lr=options.lr, grad_fp32=self.cfg.grad_fp32,
                             tp_partial=[p for st in stages for p in st.tp_partial], tp_group=groups.tp_group)
        self._names = {id(p): n for n, p in self.params.items()}
        # the last backward (B, or W of a split one) of each stage: its gradients are final there (overlapped
        # reduction starts)
        self._last_backward = {}
        for i, a in enumerate(self.actions):
            if a.op is Op.B or a.op is Op.W:
                self._last_backward[a.stage] = i
        self._stage_params = {k: [p for _, p in st.named_parameters()] for k, st in self.stages.items()}
        self.bubbles = Bubbles(plan, self.c.pp, options.device)
        self.fill_options: Any = None  # the fill executor's ExecutorOptions (None: its defaults)
        self.cuda = options.device.startswith("cuda")
        self._slots = slots  # tags must agree between sender and receiver: from all stages' programs
        self._mail: dict[int, torch.Tensor] = {}
        self.recorded: dict[str, torch.Tensor] = {}  # RunOptions.record
        self.hold: tuple[tuple[int, int], float] | None = None  # ((pp rank, bubble id), seconds) to occupy
        self.saved_bytes: dict[int, int] = {}  # stage -> bytes one microbatch saves for the backward (step 0)
        fp = plan.fill.predictions if plan.fill is not None else None
        self.offload_bytes = fp.offload_bytes[self.c.pp] if fp and fp.offload_optimizer and fp.offload_bytes else 0
        """PipeFill 4.2: optimizer bytes this rank keeps on the host from a step's start to its gradient reduction."""
        self.dtype = DTYPES[self.cfg.precision]
        self.scaler = LossScaler() if self.dtype == torch.float16 else None
        self._skipped = False  # this step's gradients overflowed (fp16)

    # -- one step ------------------------------------------------------------------------------

    def run_step(self, index: int) -> dict[str, Any]:
        self.sync.zero_grad()
        offloaded = self.sync.offload(self.offload_bytes) if self.options.fill else 0
        self._skipped = False
        inputs, targets = self._microbatches(index)
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        st = _Step(index=index, t0=time.perf_counter(), inputs=inputs, targets=targets)
        for i, action in enumerate(self.actions):
            try:
                if self._last_backward.get(action.stage) == i:
                    self.sync.arm(self._stage_params[action.stage])
                self._do(st, action)
            except Exception as exc:  # noqa: BLE001 - re-raised with the schedule position
                raise ActionError(self.c.pp, i, action, exc) from exc
        loss = self._step_loss(st)
        self._step_end(st)
        self._end_bubble(st)
        return {"step": index, "iteration_s": time.perf_counter() - st.t0, "loss": loss, "bubbles": st.bubbles,
                "stages": {str(k): {"forward_s": v[0], "backward_s": v[1]} for k, v in sorted(st.times.items())},
                "peak_memory_bytes": torch.cuda.max_memory_allocated() if self.cuda else None,
                "fill": self.options.fill and self.bubbles.filling,
                "loss_scale": self.scaler.applied if self.scaler else None, "skipped": self._skipped,
                "optimizer_offloaded_bytes": offloaded}

    def _do(self, st: _Step, a: Action) -> None:
        _ACTIONS[a.op](self, st, a)

    def _step_end(self, st: _Step) -> None:
        """Every rank ends the step together: a trailing bubble lasts until the slowest rank is done."""
        dist.barrier()

    def _compute(self, st: _Step, a: Action) -> None:
        """F, B, I or W of one stage and microbatch, timed; what it produces for a stage on this rank handed over."""
        self._end_bubble(st)
        start = time.perf_counter()
        op = a.op
        if op is Op.F:
            self._forward(st, a.stage, a.mb)
        elif op is Op.W:
            self._backward_weight(st, a.stage, a.mb)
        else:
            self._backward(st, a.stage, a.mb, split=op is Op.I)
        self._compute_done(a)
        st.times.setdefault(a.stage, [0.0, 0.0])[op is not Op.F] += time.perf_counter() - start
        self._hand_over(st, a)

    def _compute_done(self, a: Action) -> None:
        """After an F/B/I/W's kernels were issued, before its time is taken."""
        self._sync()

    def _allreduce(self, st: _Step, a: Action) -> None:
        self._end_bubble(st)
        self.sync.restore()  # the offloaded optimizer state comes back during the reduction
        for work in st.pending:
            work.wait()
        st.pending.clear()
        self.sync.reduce(self.groups.shared, self._names)

    def _optimizer(self, st: _Step, a: Action) -> None:
        self._end_bubble(st)
        if self.scaler is None:
            self.sync.step()
        elif self.scaler.update(self.sync.finite()):
            self.sync.step(self.scaler.applied)
        else:
            self._skipped = True

    def _send_forward(self, st: _Step, a: Action) -> None:
        self._send(st, st.out_acts.pop((a.stage, a.mb)), a.stage + 1, self._tag(0, a.stage, a.mb))

    def _send_backward(self, st: _Step, a: Action) -> None:
        self._send(st, st.in_grads.pop((a.stage, a.mb)), a.stage - 1, self._tag(1, a.stage - 1, a.mb))

    def _bubble(self, st: _Step, a: Action) -> None:
        self._begin_bubble(st, a.mb)

    def _forward(self, st: _Step, k: int, mb: int) -> None:
        stage = self.stages[k]
        received = st.received.pop((k, mb), {})
        if k in self.saved_bytes:
            sends, out = stage.run(received, st.inputs[mb])
            loss = self._loss(out, st.targets[mb]) if stage.program.last else None
        else:  # the first forward of the stage: measure what it (and the loss, on the last) leaves for the backward
            with SavedBytes(self.params.values()) as probe:
                stage.probe = probe.keep
                sends, out = stage.run(received, st.inputs[mb])
                stage.probe = None
                probe.exclude(torch.utils._pytree.tree_leaves(out))  # the output is the stage's, not the loss's
                loss = self._loss(out, st.targets[mb]) if stage.program.last else None
            self.saved_bytes[k] = probe.total
        if stage.program.last:
            loss = loss / self.m
            st.loss = loss.detach() if st.loss is None else st.loss + loss.detach()
            st.saved[(k, mb)] = (received, loss)
        else:
            st.saved[(k, mb)] = (received, sends)
            st.out_acts[(k, mb)] = [s.detach() if isinstance(s, torch.Tensor) else s for s in sends]

    def _loss(self, output: Any, targets: Any) -> torch.Tensor:
        """The model file's loss of what the model returns (a transformers ModelOutput as it is: the last stage
        rebuilds it from the exported graph's leaves), in fp32 whatever the precision (not ModelFile.call: no model
        kwargs)."""
        output = torch.utils._pytree.tree_map(
            lambda x: x.float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x, output)
        return self.mf.module.loss_fn(output, targets)

    def _backward(self, st: _Step, k: int, mb: int, split: bool = False) -> None:
        """B, or with `split` its input-gradient half I (what W needs is kept in st.weight_grads)."""
        stage = self.stages[k]
        received, outs = st.saved.pop((k, mb))
        grads: list[torch.Tensor] | None = None  # the loss's backward starts from 1
        if stage.program.last:
            outputs = [outs * self.scaler.scale if self.scaler else outs]
        else:
            pairs = [(o, g) for o, g in zip(self._grad_values(stage.program.send, outs), st.out_grads.pop((k, mb)))
                     if o.requires_grad]
            outputs, grads = [o for o, _ in pairs], [g for _, g in pairs]
        inputs = self._grad_values(stage.program.recv, received)
        if not split:
            if outputs:
                torch.autograd.backward(outputs, grads)
        elif not any(x.requires_grad for x in inputs):  # the first stage: its whole backward runs at W (torch)
            st.weight_grads[(k, mb)] = ("whole", outputs, grads)
        else:
            from torch.distributed.pipelining._backward import stage_backward_input

            weights = [p for p in self._stage_params[k] if p.requires_grad]
            # torch detaches the outputs in place once done, which a view refuses (a T5 stage hands on one):
            # such an output's backward starts at a copy of it instead (the gradient is the same)
            outputs = [o.clone() if o._is_view() else o for o in outputs]
            _, groups = stage_backward_input(outputs, grads, inputs, iter(weights))
            st.weight_grads[(k, mb)] = ("weights", weights, groups)
        if k > 0:
            st.in_grads[(k, mb)] = [x.grad if x.grad is not None else torch.zeros_like(x) for x in inputs]

    def _backward_weight(self, st: _Step, k: int, mb: int) -> None:
        """W: the weights' gradients of a backward whose I ran (torch's stage_backward_weight)."""
        what, first, second = st.weight_grads.pop((k, mb))
        if what == "weights":
            from torch.distributed.pipelining._backward import stage_backward_weight

            # groups of weights may share part of the graph (a tied weight used twice in a stage: T5's): each
            # group's grad keeps it for the next; it is freed with this microbatch's references just after
            stage_backward_weight(iter(first), second, retain_graph=True)
        elif first:
            torch.autograd.backward(first, second)

    def _hand_over(self, st: _Step, a: Action) -> None:
        """Pass what a compute produced to a neighbour stage on this rank (no SEND/RECV in the program)."""
        k, mb = a.stage, a.mb
        if a.op is Op.F and k + 1 < self.n_stages and self.rank_of[k + 1] == self.c.pp:
            self._do(st, Action(stage=k, op=Op.SEND_F, mb=mb))
            self._do(st, Action(stage=k + 1, op=Op.RECV_F, mb=mb))
        elif (a.op is Op.B or a.op is Op.I) and k > 0 and self.rank_of[k - 1] == self.c.pp:
            self._do(st, Action(stage=k, op=Op.SEND_B, mb=mb))
            self._do(st, Action(stage=k - 1, op=Op.RECV_B, mb=mb))

    def _grad_values(self, names: tuple[str, ...], values: Any) -> list[torch.Tensor]:
        """The tensors among ``names`` that carry a gradient (floating point), in order."""
        if isinstance(values, dict):
            values = [values.get(n) for n in names]
        return [v for n, v in zip(names, values) if isinstance(self.specs.get(n), TensorSpec) and self.specs[n].grad]

    # -- point to point ------------------------------------------------------------------------

    def _tag(self, direction: int, boundary: int, mb: int) -> int:
        """Unique per step: direction (0 activations, 1 gradients), boundary k (k -> k+1), mb."""
        return ((direction * self.n_stages + boundary) * self.m + mb) * self._slots

    def _peer(self, stage: int) -> int:
        return self.c.peer(self.rank_of[stage])

    def _send(self, st: _Step, tensors: list[Any], to_stage: int, tag: int) -> None:
        """Each tensor-parallel rank sends 1/t of a boundary tensor (Megatron's scatter-gather, thesis 4.4.1:
        the receiver's ranks all-gather it over their tensor-parallel group), as the plan prices the transfer."""
        peer = self._peer(to_stage)
        t, r = self.c.tp_size, self.c.tp
        for j, x in enumerate(x for x in tensors if isinstance(x, torch.Tensor)):
            x = x.detach().contiguous()
            if peer == self.c.rank:
                self._mail[tag + j] = x
                continue
            if t > 1 and x.numel() % t == 0:
                x = x.reshape(-1).chunk(t)[r]
            st.pending.append(dist.isend(x, dst=peer, tag=tag + j))

    def _recv(self, st: _Step, specs: list[TensorSpec], from_stage: int, tag: int) -> list[torch.Tensor]:
        """The boundary tensors from a stage on another rank. Inside a bubble on CUDA the host waits for them: NCCL's
        wait only orders the compute stream after the receive, and the bubble (the fill job's time) lasts until the
        data has arrived, not until the receive was queued."""
        peer = self._peer(from_stage)
        bufs = []
        for j, spec in enumerate(specs):
            if peer == self.c.rank:
                bufs.append(self._mail.pop(tag + j))
                continue
            bufs.append(self._recv_remote(st, spec, peer, tag + j))
            if self.options.record:  # debug: what this rank received, for a rehearsal to replay (planner rehearse)
                self.recorded[f"{st.index}:{tag + j}"] = bufs[-1].detach().cpu().clone()
        if self.cuda and self.bubbles.open is not None:
            torch.cuda.current_stream().synchronize()
        return bufs

    def _recv_remote(self, st: _Step, spec: TensorSpec, peer: int, tag: int) -> torch.Tensor:
        """One boundary tensor from another rank: each tensor-parallel rank receives its 1/t, then all-gathers."""
        t = self.c.tp_size
        numel = math.prod(spec.shape)
        split = t > 1 and numel % t == 0
        buf = torch.empty(numel // t if split else spec.shape, dtype=spec.dtype, device=self.options.device)
        dist.irecv(buf, src=peer, tag=tag).wait()
        if split:
            parts = [torch.empty_like(buf) for _ in range(t)]
            dist.all_gather(parts, buf, group=self.groups.tp_group)
            buf = torch.cat(parts).view(spec.shape)
        return buf

    def _recv_forward(self, st: _Step, k: int, mb: int) -> None:
        names = [n for n in self.stages[k].program.recv if isinstance(self.specs.get(n), TensorSpec)]
        bufs = self._recv(st, [self.specs[n] for n in names], k - 1, self._tag(0, k - 1, mb))
        st.received[(k, mb)] = {n: (b.requires_grad_() if self.specs[n].grad else b) for n, b in zip(names, bufs)}

    def _recv_backward(self, st: _Step, k: int, mb: int) -> None:
        names = [n for n in self.stages[k].program.send
                 if isinstance(self.specs.get(n), TensorSpec) and self.specs[n].grad]
        st.out_grads[(k, mb)] = self._recv(st, [self.specs[n] for n in names], k + 1, self._tag(1, k, mb))

    # -- gradients, loss -----------------------------------------------------------------------

    def _step_loss(self, st: _Step) -> float | None:
        """Sum over microbatches of loss/m, averaged over dp and cp (each cp rank's loss is the mean over its
        tokens, the same number on each); only the last pipeline rank has it."""
        if st.loss is None:
            return None
        loss = st.loss.detach().clone().reshape(1).to(torch.float64)
        if self.c.dp_size * self.c.cp_size > 1:
            dist.all_reduce(loss, group=self.groups.grad_group)
            loss /= self.c.dp_size * self.c.cp_size
        return float(loss.item())

    # -- bubbles -------------------------------------------------------------------------------

    def _begin_bubble(self, st: _Step, bubble_id: int) -> None:
        self._end_bubble(st)
        if self.hold is not None and self.hold[0] == (self.c.pp, bubble_id):
            self._sync()
            until = time.perf_counter() + self.hold[1]  # occupy the device inside the bubble, as fill would
            while time.perf_counter() < until:
                pass
        self.bubbles.begin(bubble_id)

    def _end_bubble(self, st: _Step) -> None:
        if (record := self.bubbles.end(st.t0)) is not None:
            st.bubbles.append(record)

    # -- data, timing, run ---------------------------------------------------------------------

    def _microbatches(self, step: int) -> tuple[list[tuple[Any, ...]], list[Any]]:
        B, d, b = self.plan.source.global_batch, self.c.dp_size, self.cfg.b
        inputs, targets = self.mf.call("sample_batch", B, step)
        inputs = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
        lo = self.c.dp * (B // d)
        shard = self.cp.shard if self.cp is not None else (lambda x: x)  # this cp rank's tokens
        take = lambda x, i: shard(x[lo + i * b: lo + (i + 1) * b]).to(  # noqa: E731 - floating inputs in the precision
            self.options.device, self.dtype if x.is_floating_point() else x.dtype) if isinstance(x, torch.Tensor) else x
        return ([tuple(take(x, i) for x in inputs) for i in range(self.m)], [take(targets, i) for i in range(self.m)])

    def _sync(self) -> None:
        if self.cuda:  # CUDA-only: make per-stage times mean kernel time, at the cost of overlap
            torch.cuda.synchronize()

    def run(self, log: Any = print) -> dict[str, Any]:
        """All steps; step 0 without fill, measuring the bubbles; returns this rank's record."""
        steps = []
        client = load_fill_client() if self.options.fill else None
        dist.barrier()  # ranks finish building at different times; step 0 measures from a common start
        for index in range(self.options.steps):
            if index == 1 and client is not None:
                self.fill = self._start_fill(client)
                dist.barrier()  # ranks with and without fill jobs start step 1 together
            record = self.run_step(index)
            self.bubbles.measured(record["bubbles"])  # each bubble's duration: the median of every step's so far
            steps.append(record)
            if record["loss"] is not None and self.c.dp == 0 and self.c.tp == 0 and self.c.cp == 0:
                log(f"step {index}: loss {record['loss']:.6f}, iteration {record['iteration_s'] * 1e3:.1f} ms")
        report = self.fill.report()
        self.fill.close()
        found = self._characterize(len(steps)) if self.options.characterize else None
        return {"rank": self.c.rank, "pp": self.c.pp, "dp": self.c.dp, "tp": self.c.tp, "cp": self.c.cp,
                "stages": sorted(self.stages), "steps": steps, "fill_report": report,
                "fill_client": type(self.fill).__name__, "characterization": found, "holds": self.holdings()}

    def holdings(self) -> dict[str, Any]:
        """What this rank holds and runs (planner.metrics.Holdings)."""
        unique = {id(p): (n, p) for n, p in self.params.items()}.values()
        sharded = sorted({m for st in self.stages.values() for m in st.tp_sharded})
        modes = {st.recompute for st in self.stages.values()}
        return {"parameters": held_parameters(self.params),
                "parameter_dtype": str(next(iter(unique))[1].dtype).removeprefix("torch.") if unique else "float32",
                "optimizer_state_bytes": self.sync.state_bytes(), "tensor_parallel": sharded,
                "recompute": next((m for m in ("full", "block", "selective") if m in modes), "none"),
                "saved_activation_bytes": {str(k): v for k, v in sorted(self.saved_bytes.items())},
                "overlapped_buckets": self.sync.overlapped}

    def _characterize(self, first_step: int) -> dict[str, Any]:
        """Every rank runs the same probe sequence: each probe is a training step whose slowest-rank
        time (all-reduced) drives the doubling search, so all ranks take the same decisions."""
        from ..characterize import characterize

        target, counter = self.options.characterize, [first_step]

        def step(wait: float) -> float:
            self.hold = (target, wait)
            record = self.run_step(counter[0])
            counter[0] += 1
            slowest = torch.tensor([record["iteration_s"]], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            return float(slowest.item())

        self.fill = NullFill()
        found = characterize(step, start_s=1e-3, min_slowdown_s=3e-3, tolerance=0.05, repeats=3, refine=5)
        self.hold = None
        return {"rank": target[0], "bubble": target[1], "duration_s": found.duration_s,
                "baseline_s": found.baseline_s, "probes": [list(p) for p in found.probes]}

    def _start_fill(self, client: Any) -> Any:
        return start_fill(client, self.plan, self.c.pp, self.c.rank, self.options.device,
                          grace_s=self.options.fill_grace_s, options=self.fill_options)

    @property
    def fill(self) -> Any:
        return self.bubbles.fill

    @fill.setter
    def fill(self, hooks: Any) -> None:
        self.bubbles.fill = hooks

    def dump(self, path: Path) -> None:
        """Debug: this rank's parameters and gradients, full tensors under canonical names."""
        gather = {k: f for st in self.stages.values() for k, f in st.tp_full.items()}

        def full(t: torch.Tensor, owner: torch.nn.Parameter) -> torch.Tensor:
            if id(owner) in gather:  # a Megatron-layout shard: gathered in the model's order
                t = gather[id(owner)](t.detach())
            return t.detach().cpu().clone()

        params, grads = {}, {}
        for name, p in self.params.items():
            params[name] = full(p, p)
            grads[name] = full(p.grad, p) if p.grad is not None else None
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"params": params, "grads": grads, "coords": [self.c.pp, self.c.dp, self.c.cp, self.c.tp]}, path)


_ACTIONS = {  # what each action of the plan's programs runs (functions of the class: no cycle through an executor)
    Op.F: Executor._compute, Op.B: Executor._compute, Op.I: Executor._compute, Op.W: Executor._compute,
    Op.SEND_F: Executor._send_forward, Op.RECV_F: lambda ex, st, a: ex._recv_forward(st, a.stage, a.mb),
    Op.SEND_B: Executor._send_backward, Op.RECV_B: lambda ex, st, a: ex._recv_backward(st, a.stage, a.mb),
    Op.ALLREDUCE: Executor._allreduce, Op.OPT: Executor._optimizer, Op.BUBBLE: Executor._bubble,
}


class LossScaler:
    """Dynamic loss scaling for fp16 (as torch.amp.GradScaler and Megatron do): the loss is multiplied by
    `scale` before the backward; a step whose gradients overflow anywhere is skipped and the scale halved;
    after `window` good steps it doubles."""

    def __init__(self, scale: float = 2.0 ** 16, window: int = 1000) -> None:
        self.scale, self.window, self.good, self.applied = scale, window, 0, scale

    def update(self, finite: bool) -> bool:
        """After the backward: whether to step (with the scale the gradients carry, `applied`)."""
        self.applied = self.scale
        if not finite:
            self.scale, self.good = self.scale / 2, 0
            return False
        self.good += 1
        if self.good % self.window == 0:
            self.scale *= 2
        return True


def prepare(plan: Plan, model_file: ModelFile, options: RunOptions, executor: type[Executor] = Executor,
            **extra: Any) -> Executor:
    """Build groups, model, stages and optimizer for this rank (collective: every rank calls it); `executor` (and
    its `extra` arguments): the class that runs them (a rehearsal's)."""
    c = plan.config.to_config()
    groups = make_groups(device_type="cuda" if options.device.startswith("cuda") else "cpu",
                         pp=c.pp, dp=c.dp, tp=c.tp, cp=c.cp)
    torch.manual_seed(options.seed)
    model = to_precision(model_file.build(options.device, torch.float32), DTYPES[c.precision])  # fp32 init, rounded
    model.train()
    split = build_split(model, plan, model_file)
    make_shared_groups(groups, split.holders)
    cp = None
    if c.cp > 1 and options.device.startswith("cuda") and c.precision == "fp32":
        raise UserError("context parallelism on CUDA runs the flash attention kernel, which takes bf16 or fp16; "
                        "re-plan with --dtype bf16")
    if c.cp > 1:  # rewritten from the whole sequence's shapes for this rank's tokens
        whole: dict[str, dict[str, Any]] = {}
        specs = boundary_specs(model_file, plan, whole, split=split.split)
        cp = ContextParallel(size=c.cp, rank=groups.coords.cp, seq=_sequence(plan, specs), group=groups.cp_group,
                             specs=specs, inner=whole)
        cp.apply(split.split)
    inner: dict[str, dict[str, Any]] | None = {} if c.tp > 1 else None
    specs = boundary_specs(model_file, plan, inner, cp, split=split.split)
    constants = {k: v for k, v in specs.items() if not isinstance(v, TensorSpec)}
    stages = stage_modules(split, groups.coords.pp, constants)
    if c.tp > 1:
        apply_tensor_parallel(stages, plan, model, groups.tp_mesh, inner)
    slots = 1 + max(len(p.send) for p in split.programs)
    ex = executor(plan=plan, model_file=model_file, groups=groups, stages=stages, specs=specs, slots=slots,
                  options=options, cp=cp, **extra)
    del model, split
    gc.collect()  # the whole model and its traced graphs are cyclic garbage now, every other stage's weights with
    # them: freed here, not whenever Python's collector next reaches its oldest generation
    return ex



def _sequence(plan: Plan, specs: dict[str, Any]) -> int:
    """The plan's sequence length: the model's, else the first batch-first input's second dim."""
    seq = plan.source.model_shape.get("seq")
    if isinstance(seq, int) and seq > 0:
        return seq
    first = next((v for v in specs.values() if isinstance(v, TensorSpec) and len(v.shape) >= 2), None)
    if first is None:
        raise UserError("the plan runs context parallelism, but the model takes no (batch, sequence) input")
    return first.shape[1]
