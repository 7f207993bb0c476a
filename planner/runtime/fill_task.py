"""A fill job's side-task process: its model split into the planning units, run one linearized unit
at a time.

The model is traced and grouped exactly as planning does (passes.trace.trace_model, then
passes.split.unit_of_nodes + split_by) so the units here are the units the plan packed. A train
job's linearized sequence is forward units 0..n-1, backward units n-1..0, then the optimizer step;
an infer job's is the forward units. Between units the runner keeps each unit's output and, for
every value a unit takes from an earlier one, a detached leaf that collects its gradient; a
backward unit calls torch.autograd.backward on its outputs with the summed gradients of their
consumers' leaves (and on the loss for the last unit). Data come from the model file's
`sample_batch(batch_size, step, **model_args)`, the loss from its `loss_fn(output, targets)`; iteration i takes
batch `batch_first + i * batch_stride` (this GPU's share of the job). A training job run data parallel over a stage's
GPUs averages its gradients over gloo in host memory (UnitRunner._send_grads).

The job runs in the plan's precision, the one its units were priced in: an inference job's weights and floating
inputs take the dtype (2 bytes a weight, as priced and as streamed); a training job keeps fp32 weights and runs each
unit under torch.autocast to the dtype (its GEMMs at the half-precision rate; fp32 weights, gradients and Adam's two
moments are the 16 bytes a parameter the planner counts for mixed precision), fp16 with torch.amp's dynamic loss
scale. The loss is taken in fp32.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import functools
import operator
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch.utils.checkpoint import checkpoint

from passes.errors import ModelFileError
from passes.load import file_sha256, load_model_file, user_frame
from passes.split import split_by, unit_of_nodes
from passes.trace import trace_model
from passes.units import group_nodes
from planner.plan import FillJob

from .fill_executor import TaskOptions
from .optim import SavedBytes
from .stage import DTYPES

__all__ = ["linearize", "UnitRunner", "cap_memory", "task_main"]

REPLICA_TIMEOUT_S = 120.0
"""How long a data-parallel fill job's replicas wait for one another (to meet, and for a gradient average)."""


def linearize(unit_names: list[str], kind: str) -> list[str]:
    """A fill job's linearized units, named as planner.fill.profiles names them: 'F:U' per unit, then
    (train) 'B:U' in reverse and 'OPT'."""
    fwd = [f"F:{u}" for u in unit_names]
    return fwd if kind == "infer" else fwd + [f"B:{u}" for u in reversed(unit_names)] + ["OPT"]


class UnitRunner:
    """Builds a fill job's model (real weights, host memory) and runs its linearized units in order."""

    def __init__(self, job: FillJob, options: TaskOptions) -> None:
        self.job, self.options, self.train = job, options, job.kind == "train"
        path = Path(job.model_file)
        if path.is_file() and job.model_sha256 and file_sha256(path) != job.model_sha256:
            raise ModelFileError(f"fill model file {path} changed since the plan was made (sha256 differs); "
                                 "re-plan or restore the file")
        self.mf = load_model_file(path, job.model_args)
        torch.manual_seed(options.seed)
        root = self.mf.build("cpu")
        gm = trace_model(root, job.leaves)
        part = unit_of_nodes(gm, root)
        groups = group_nodes(gm, root)
        names = [name for name, _, _ in groups]
        self.blocks = {name for name, kind, _ in groups if kind == "block"}
        self.module = split_by(gm, root, part.__getitem__)
        self.module.train(self.train)
        self.dtype = DTYPES[options.precision]
        self.autocast = self.train and self.dtype != torch.float32
        if not self.train:
            self.module.to(self.dtype)
        self._index(names)
        self.linearized = linearize(self.unit_names, job.kind)
        if job.units and len(job.units) != len(self.linearized):
            raise ModelFileError(
                f"the plan lists {len(job.units)} linearized units for fill job {job.name!r}, but {path} splits "
                f"into {len(self.unit_names)} units, i.e. {len(self.linearized)} for a {job.kind} job "
                f"({self.linearized[0]} ... {self.linearized[-1]}); re-plan with this model file")
        self.device = torch.device("cpu")
        self.channels_last = False
        self.checkpointed = {k for k, name in enumerate(self.unit_names)
                             if self.train and job.config == "checkpoint" and name in self.blocks}
        self.host: list[torch.Tensor] | None = None  # offload: fp32 host copies of the weights the optimizer steps
        self.optimizer = self._make_optimizer() if self.train else None
        self.scaler = torch.amp.GradScaler("cuda" if options.device.startswith("cuda") else "cpu") \
            if self.train and self.dtype == torch.float16 else None
        self.saved_bytes: dict[str, int] = {}  # forward unit -> bytes it leaves for the backward (measured once)
        self.streamer: Streamer | None = None
        self.pos = 0
        self.iterations = 0
        self.profiling = False
        self.dp = _join_replicas(job.name, options) if self.train and options.dp_size > 1 else None
        self._loader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fill-batch")
        self._prefetched: dict[int, Any] = {}
        self.reduced: tuple[Any, torch.Tensor] | None = None  # (gloo work, host buffer) of this iteration's grads
        self._reset()

    def _index(self, names: list[str]) -> None:
        """Which top-level nodes of the split graph each unit evaluates."""
        self.calls: list[fx.Node] = []
        self.before: list[list[fx.Node]] = []
        self.after: list[list[fx.Node]] = []
        self.placeholders: list[fx.Node] = []
        unit_of: dict[fx.Node, int] = {}
        pending: list[fx.Node] = []
        for node in self.module.graph.nodes:
            if node.op == "placeholder":
                self.placeholders.append(node)
            elif node.op == "get_attr":
                pending.append(node)
            elif node.op == "call_module":
                unit_of[node] = len(self.calls)
                self.calls.append(node)
                self.before.append(pending)
                self.after.append([])
                pending = []
            elif node.op == "call_function" and node.target is operator.getitem and node.args[0] in unit_of:
                unit_of[node] = unit_of[node.args[0]]
                self.after[unit_of[node]].append(node)
            elif node.op == "output":
                self.output = node
            else:
                raise ModelFileError(f"unexpected top-level node {node.format_node()} after splitting into units")
        index = [int(str(c.target).rsplit("_", 1)[1]) for c in self.calls]
        self.unit_names = [names[i] if i < len(names) else str(c.target) for i, c in zip(index, self.calls)]

    def _make_optimizer(self) -> torch.optim.Optimizer:
        """The model file's build_optimizer, else AdamW(lr=1e-4). Configuration "offload" (PipeFill 4.3): over
        fp32 host copies of the weights, so its state lives in host memory and it steps there."""
        build = getattr(self.mf.module, "build_optimizer", None)
        params = list(self.module.parameters())
        if self.job.config == "offload":
            self.host = [p.detach().to("cpu", torch.float32, copy=True).requires_grad_(True) for p in params]
            params = self.host
        return build(params) if callable(build) else torch.optim.AdamW(params, lr=1e-4)

    def optimizer_state(self) -> dict[str, Any]:
        """Where the optimizer's state lives and how many bytes it holds (what "offload" promises)."""
        state = [t for st in self.optimizer.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
        module = {p.untyped_storage().data_ptr() for p in self.module.parameters()}
        stepped = [p for g in self.optimizer.param_groups for p in g["params"]]
        return {"optimizer_on": "host" if self.host is not None else str(self.device),
                "optimizer_state_bytes": sum(t.nbytes for t in state),
                "optimizer_steps_module_weights": any(p.untyped_storage().data_ptr() in module for p in stepped)}

    def _reset(self) -> None:
        self.env: dict[str, Any] = {}
        self.producer: dict[str, int] = {}
        self.consumers: dict[str, list[torch.Tensor]] = {}
        self.targets: Any = None
        self.loss: torch.Tensor | None = None

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.module.parameters())

    def to_device(self) -> None:
        """InitSideTask: move weights (and so the optimizer's parameters) to the job's device; a job that is not
        resident moves only its buffers, its weights are streamed in per bubble (Streamer)."""
        self.device = torch.device(self.options.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            # a job's shapes repeat every iteration: cuDNN's autotuner picks its convolutions' kernels once, in the
            # task's profiling passes before any bubble; and 2-d convolutions run channels-last, the layout cuDNN's
            # tensor-core kernels take (NCHW under autocast ran no faster than fp32 on an H200: bench/results/
            # README_cuda_2026-11-27.md), as torchvision's and NVIDIA's reference training scripts run them
            torch.backends.cudnn.benchmark = True
            self.channels_last = any(isinstance(m, torch.nn.Conv2d) for m in self.module.modules())
            if self.channels_last:
                self.module.to(memory_format=torch.channels_last)
        if self.job.load_groups and not self.train and not self.job.resident:
            for b in self.module.buffers():
                b.data = b.data.to(self.device)
            self.streamer = Streamer(self.module, self.calls, self.job.load_groups, self.device)
        else:
            self.module.to(self.device)

    def unload(self) -> None:
        """The bubble ended: a streamed job's weights leave the device (PipeSwitch loads them again next time)."""
        if self.streamer is not None:
            self.streamer.unload()

    def ready(self) -> bool:
        """Whether the next unit can start without waiting: false only for a data-parallel optimizer step whose
        replicas' gradients have not all arrived."""
        return self.reduced is None or self.pos % len(self.linearized) != 2 * len(self.calls) \
            or self.reduced[0].is_completed()

    def progress(self) -> dict[str, Any]:
        """What an iteration's end reports beside its timing: a training job's measured saved bytes and optimizer
        state, and (data-parallel jobs, whose replicas must agree) the sum of its weights."""
        if not self.train:
            return {"loads": self.streamer.report()} if self.streamer is not None else {}
        out = {"saved_bytes": dict(self.saved_bytes), **self.optimizer_state()}
        if self.dp is not None:
            out["checksum"] = float(sum(p.detach().double().sum() for p in self.module.parameters()))
        return out

    def live_bytes(self) -> int:
        """Activations the iteration keeps for its backward now: the saved bytes measured per forward unit, of the
        forward units whose backward has not run."""
        if not self.train:
            return 0
        n, k = len(self.calls), self.pos % len(self.linearized)
        kept = min(k, n) if k <= n else max(0, 2 * n - k)
        return sum(self.saved_bytes.get(self.linearized[i], 0) for i in range(kept))

    def step(self, sync: bool = True) -> bool:
        """Run the next linearized unit; True when it completed an iteration. `sync` False (a batch's units on
        CUDA): the unit is only queued on the device, the batch synchronizes once at its end."""
        n, k = len(self.calls), self.pos % len(self.linearized)
        if k < n:
            self._forward(k)
        elif k < 2 * n:
            self._backward(2 * n - 1 - k)
            if k == 2 * n - 1 and self.dp is not None:
                self._send_grads()
        else:
            if self.reduced is not None:
                self._take_grads()
            if self.host is not None:
                self._host_step()
            else:
                self._optimizer_step()
            self.optimizer.zero_grad(set_to_none=True)
        if sync and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the step's time is its GPU time, and ends inside the bubble
        self.pos += 1
        done = self.pos % len(self.linearized) == 0
        if done:
            self.iterations += 1
            self._reset()
        return done

    def _send_grads(self) -> None:
        """The iteration's gradients to host memory, and their sum over the replicas started on gloo: it runs in
        gloo's threads while this process waits for its next bubble, never on the device outside a bubble."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.module.parameters()]
        flat = torch.cat([g.detach().reshape(-1).float() for g in grads]).cpu()
        import torch.distributed as dist

        work = None if self.profiling else dist.all_reduce(flat, group=self.dp, async_op=True)
        self.reduced = (work, flat)

    def _take_grads(self) -> None:
        """The averaged gradients into the device weights' .grad, or (offload) straight into the host copies'."""
        work, flat = self.reduced
        if work is not None:
            work.wait()
            flat /= self.options.dp_size
        offset = 0
        for k, p in enumerate(self.module.parameters()):
            n = p.numel()
            if p.grad is not None:
                if self.host is not None:
                    self.host[k].grad, p.grad = flat[offset:offset + n].view_as(p).clone(), None
                else:
                    p.grad.copy_(flat[offset:offset + n].view_as(p))
            offset += n
        self.reduced = None

    def _host_step(self) -> None:
        """Offload: gradients down over PCIe, the optimizer steps the host copies, the weights go back up."""
        for p, h in zip(self.module.parameters(), self.host):
            if p.grad is not None:  # else already on the host (data parallel: the averaged gradients)
                h.grad = p.grad.detach().to("cpu", torch.float32)
        self._optimizer_step()
        with torch.no_grad():
            for p, h in zip(self.module.parameters(), self.host):
                p.copy_(h)
                p.grad = None

    def _optimizer_step(self) -> None:
        """The optimizer's step; under fp16 the loss scale's: unscaled gradients, a step skipped on inf or nan, the
        scale updated (torch.amp.GradScaler, as AMP and Megatron's dynamic loss scaler do)."""
        if self.scaler is None:
            self.optimizer.step()
        else:
            self.scaler.step(self.optimizer)
            self.scaler.update()

    def _host_batch(self, index: int) -> tuple[Any, Any]:
        """Batch `index` of the job on the host (pinned when the job runs on CUDA, so its copy is asynchronous)."""
        if self.mf.has("sample_batch"):
            inputs, targets = self.mf.call("sample_batch", self.job.batch_size, index)
        else:
            inputs, targets = self.mf.inputs(self.job.batch_size, "cpu"), None
        inputs = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
        if self.options.device.startswith("cuda"):
            pin = lambda x: x.pin_memory() if isinstance(x, torch.Tensor) else x  # noqa: E731
            inputs, targets = [pin(x) for x in inputs], pin(targets)
        return inputs, targets

    def _batch(self, iteration: int) -> None:
        """Iteration's batch, made on the host while the previous iteration ran (a thread of this process, as a
        DataLoader's worker would: an image batch is 50-75 ms of the host's work, bench/results/
        README_cuda_2026-11-27.md, which the first unit would otherwise spend inside a bubble); then the next one is
        started."""
        index = self.options.batch_first + self.options.batch_stride * iteration  # this GPU's share of the job
        got, following = self._prefetched.get(index), index + self.options.batch_stride
        inputs, self.targets = got.result() if got is not None else self._host_batch(index)
        made = concurrent.futures.Future()  # kept: profiling passes take iteration 0's batch again
        made.set_result((inputs, self.targets))
        self._prefetched = {index: made,
                            following: self._prefetched.get(following) or self._loader.submit(self._host_batch, following)}
        nb = self.device.type == "cuda"
        for node, value in zip(self.placeholders, inputs):
            if isinstance(value, torch.Tensor):
                value = value.to(self.device, self.dtype if value.is_floating_point() and not self.train else None,
                                 non_blocking=nb)
                if self.channels_last and value.dim() == 4:
                    value = value.contiguous(memory_format=torch.channels_last)
            self.env[node.name] = value
        if isinstance(self.targets, torch.Tensor):
            self.targets = self.targets.to(self.device, non_blocking=nb)

    def _arg(self, node: fx.Node, unit: int) -> Any:
        value = self.env[node.name]
        if self.train and node.name in self.producer and isinstance(value, torch.Tensor) and value.requires_grad:
            leaf = value.detach().requires_grad_(True)  # this unit's own input; its .grad flows back later
            self.consumers.setdefault(node.name, []).append(leaf)
            return leaf
        return value

    def _forward(self, k: int) -> None:
        if k == 0:
            self._batch(self.pos // len(self.linearized))
        with torch.set_grad_enabled(self.train):
            for node in self.before[k]:
                self.env[node.name] = _fetch(self.module, str(node.target))  # buffers, tied weights
            node = self.calls[k]
            if self.streamer is not None:
                self.streamer.ensure(k)
            args = fx.node.map_arg(node.args, lambda a: self._arg(a, k))
            kwargs = fx.node.map_arg(node.kwargs, lambda a: self._arg(a, k))
            name = self.linearized[k]
            measure = self.train and name not in self.saved_bytes
            with SavedBytes(self.module.parameters()) if measure else contextlib.nullcontext() as probe:
                start = time.time()
                self.env[node.name] = self._call(k, args, kwargs, probe)
                if self.streamer is not None:
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)  # the unit's GPU time (step() waits here anyway)
                    self.streamer.computed(start, time.time())
            if measure:
                self.saved_bytes[name] = probe.total
            self.producer[node.name] = k
            for g in self.after[k]:
                self.env[g.name] = self.env[g.args[0].name][g.args[1]]
                self.producer[g.name] = k
            if k == len(self.calls) - 1:
                output = fx.node.map_arg(self.output.args[0], lambda a: self.env[a.name])
                if self.train:
                    self.loss = self._loss(output)

    def _call(self, k: int, args: tuple, kwargs: dict, probe: SavedBytes | None) -> Any:
        """Unit k's forward; configuration "checkpoint" runs each block unit under torch.utils.checkpoint, which
        keeps only its inputs and recomputes the rest in the backward (full recomputation, as priced)."""
        fn = self.module.get_submodule(str(self.calls[k].target))
        with torch.autocast(self.device.type, self.dtype) if self.autocast else contextlib.nullcontext():
            if k in self.checkpointed and torch.is_grad_enabled():
                if probe is not None:
                    probe.keep(args)
                return checkpoint(fn, *args, use_reentrant=False, **kwargs)
            return fn(*args, **kwargs)

    def _loss(self, output: Any) -> torch.Tensor:
        fn = getattr(self.mf.module, "loss_fn", None)
        if callable(fn) and self.targets is not None:
            return fn(fx.node.map_aggregate(output, lambda x: x.float() if isinstance(x, torch.Tensor)
                                            and x.is_floating_point() else x), self.targets)
        first = output if isinstance(output, torch.Tensor) else next(x for x in output if isinstance(x, torch.Tensor))
        return first.float().pow(2).mean()  # no loss_fn / targets: a stand-in with the same backward work

    def _backward(self, j: int) -> None:
        tensors: list[torch.Tensor] = []
        grads: list[torch.Tensor | None] = []
        if j == len(self.calls) - 1 and self.loss is not None:
            tensors.append(self.loss if self.scaler is None else self.scaler.scale(self.loss))
            grads.append(None)
        for name in [n for n, unit in self.producer.items() if unit == j]:
            value = self.env.pop(name)
            del self.producer[name]
            got = [leaf.grad for leaf in self.consumers.pop(name, []) if leaf.grad is not None]
            if isinstance(value, torch.Tensor) and value.requires_grad and got:
                tensors.append(value)
                grads.append(functools.reduce(torch.add, got))
        if tensors:
            torch.autograd.backward(tensors, grads)
        if j == len(self.calls) - 1:
            self.loss = None

    def profile(self, reps: int) -> list[float]:
        """Seconds of each linearized unit: the upper median of `reps` timed passes after a warm-up pass (the
        slowest of two; of three, not a pass the OS descheduled: on a loaded host one such pass once profiled a
        2 ms unit at 300 ms, which no bubble then fitted for the rest of the run).

        Runs iteration 0's batch with a throw-away optimizer, then restores the weights, so the job's
        own trajectory is unchanged by profiling."""
        saved = {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        optimizer, host, pos, iterations = self.optimizer, self.host, self.pos, self.iterations
        scale = self.scaler.state_dict() if self.scaler is not None else None
        self.optimizer = self._make_optimizer() if self.train else None
        self.profiling = True  # the gradients' copy to the host is timed; the replicas do not meet
        times: list[list[float]] = [[] for _ in self.linearized]
        try:
            for rep in range(reps + 1):
                self.pos = 0
                self._reset()
                self.unload()  # each pass loads a streamed job's weights, as a bubble does
                for k in range(len(self.linearized)):
                    t0 = time.perf_counter()
                    self.step()
                    if rep:
                        times[k].append(time.perf_counter() - t0)
        finally:
            self.module.load_state_dict(saved)
            for p in self.module.parameters():
                p.grad = None
            self.optimizer, self.host, self.pos, self.iterations = optimizer, host, pos, iterations
            if scale is not None:
                self.scaler.load_state_dict(scale)
            self.profiling, self.reduced = False, None
            self._reset()
            if self.streamer is not None:
                self.streamer.reset()
        return [statistics.median_high(t) for t in times]


def _join_replicas(job: str, options: TaskOptions) -> Any:
    """A gloo group of the job's data-parallel replicas (one task process per GPU of the stage), met through the
    launch's own store (torchrun's MASTER_ADDR / MASTER_PORT) under a prefix unique to the run, job and stage."""
    import torch.distributed as dist
    from datetime import timedelta

    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        raise RuntimeError(f"fill job {job!r} trains data parallel over {options.dp_size} GPUs, which needs the "
                           "launch's store (MASTER_ADDR and MASTER_PORT): run it under torchrun")
    timeout = timedelta(seconds=REPLICA_TIMEOUT_S)
    store = dist.PrefixStore(f"fxp-fill/{options.dp_key}/", dist.TCPStore(host, int(port), is_master=False,
                                                                           timeout=timeout))
    dist.init_process_group("gloo", store=store, rank=options.dp_rank, world_size=options.dp_size, timeout=timeout)
    return dist.group.WORLD


class Streamer:
    """PipeSwitch's pipelined model transmission (002, 4.2) for a job that is not resident: its weights live in
    (pinned) host memory, and in a bubble they are loaded group by group (the plan's groups of forward units),
    group g + 1's transfer running while group g computes (a side stream on CUDA, a thread on CPU), the first
    group's exposed. At the bubble's end they leave the device. Every load is recorded: its group, bytes, start
    and end (time.time()), whether it was a prefetch, and how much of it overlapped the job's own compute."""

    def __init__(self, module: torch.nn.Module, calls: list[fx.Node], groups: tuple, device: torch.device) -> None:
        self.device, self.groups = device, [tuple(g) for g in groups]
        self.group_of = {k: i for i, (a, b) in enumerate(self.groups) for k in range(a, b)}
        seen: set[int] = set()
        self.params: list[list[torch.nn.Parameter]] = []
        for a, b in self.groups:  # a weight shared by several units travels with the first group that uses it
            own = []
            for k in range(a, b):
                for p in module.get_submodule(str(calls[k].target)).parameters():
                    if id(p) not in seen:
                        seen.add(id(p))
                        own.append(p)
            self.params.append(own)
        cuda = device.type == "cuda"
        self.host = {id(p): (p.data.pin_memory() if cuda else p.data) for g in self.params for p in g}
        for g in self.params:
            for p in g:
                p.data = self.host[id(p)]  # the pinned copy is the weight off the device (no second host copy)
        self.stream = torch.cuda.Stream(device) if cuda else None
        self.loaded: set[int] = set()
        self.pending: dict[int, Any] = {}  # group -> the thread (CPU) or event (CUDA) of its transfer
        self.records: list[dict[str, Any]] = []
        self.compute: list[tuple[float, float]] = []
        self.reported = 0

    def _load(self, g: int, prefetched: bool) -> None:
        rec = {"group": g, "units": list(self.groups[g]), "bytes": sum(p.nbytes for p in self.params[g]),
               "prefetched": prefetched, "start": time.time()}
        if self.stream is not None:  # timed by events on the side stream; read when reported
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(self.stream):
                start.record(self.stream)
                for p in self.params[g]:
                    p.data = self.host[id(p)].to(self.device, non_blocking=True)
                end.record(self.stream)
            self.pending[g], rec["events"] = end, (start, end)
        else:
            for p in self.params[g]:
                p.data = self.host[id(p)].clone()  # the "device" copy: a transfer of the same bytes
        rec["end"] = time.time()
        self.records.append(rec)

    def ensure(self, k: int) -> None:
        """Before forward unit k: its group on the device, and the next group's transfer started."""
        g = self.group_of.get(k)
        if g is None:
            return
        waiting = self.pending.pop(g, None)
        if waiting is not None:
            waiting.join() if self.stream is None else torch.cuda.current_stream().wait_event(waiting)
        elif g not in self.loaded:
            self._load(g, prefetched=False)
        self.loaded.add(g)
        nxt = g + 1
        if nxt < len(self.groups) and nxt not in self.loaded and nxt not in self.pending:
            if self.stream is not None:
                self._load(nxt, prefetched=True)
            else:
                self.pending[nxt] = threading.Thread(target=self._load, args=(nxt, True), daemon=True)
                self.pending[nxt].start()

    def computed(self, start: float, end: float) -> None:
        self.compute.append((start, end))

    def unload(self) -> None:
        for waiting in self.pending.values():
            waiting.join() if self.stream is None else waiting.synchronize()
        self.pending.clear()
        for g in self.loaded:
            for p in self.params[g]:
                p.data = self.host[id(p)]
        self.loaded.clear()

    def reset(self) -> None:
        """Off the device, and no record kept (after InitSideTask's profiling passes)."""
        self.unload()
        self.records, self.compute, self.reported = [], [], 0

    def report(self) -> list[dict[str, Any]]:
        """The loads since the last report, each with the compute it overlapped."""
        out = self.records[self.reported:]
        self.reported = len(self.records)
        for rec in out:
            if "events" in rec:  # CUDA: the transfer's own duration on the side stream, from its issue
                start, end = rec.pop("events")
                end.synchronize()
                rec["end"] = rec["start"] + start.elapsed_time(end) / 1e3
            rec["overlap_s"] = sum(max(0.0, min(e, rec["end"]) - max(s, rec["start"])) for s, e in self.compute)
        self.compute = [(s, e) for s, e in self.compute if e >= min((r["start"] for r in out), default=e)]
        return out


def _fetch(module: torch.nn.Module, target: str) -> Any:
    obj: Any = module
    for atom in target.split("."):
        obj = getattr(obj, atom)
    return obj


def cap_memory(device: torch.device, free_bytes: int) -> None:
    """CUDA only (PipeFill 4.3): cap this process's allocator at the bubble's free memory, so an
    overdraft is an OOM of the fill job, not of the main job. No-op on CPU."""
    if device.type != "cuda":
        return
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, max(free_bytes, 1) / total), device)


def _die_with_parent() -> None:
    """SIGKILL this process when its parent (the executor, or the forkserver that exits with the
    executor) dies, even while it is SIGSTOPped (Linux only)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() == 1:
        os._exit(0)  # the parent died before the line above


def _describe(exc: BaseException, job: FillJob) -> str:
    text = f"{type(exc).__name__}: {exc}"
    where = user_frame(exc, Path(job.model_file))
    return text if isinstance(exc, ModelFileError) or where == job.model_file else f"{text} (at {where})"


def task_main(job: FillJob, options: TaskOptions, rx: Any, tx: Any) -> None:
    """Entry point of a task process: CREATED work (build model and optimizer), then the interface."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        if options.device.startswith("cpu"):
            torch.set_num_threads(options.cpu_threads)
        runner = UnitRunner(job, options)
        tx.send(("created", {"units": runner.linearized, "params": runner.num_params}))
        (_iterative if options.interface == "iterative" else _imperative)(runner, rx, tx)
    except (EOFError, BrokenPipeError):
        return  # the executor is gone
    except BaseException as exc:  # noqa: BLE001 - OOM, a user error, anything: reported, then exit
        try:
            tx.send(("failed", _describe(exc, job)))
        except OSError:
            pass


def _timed_step(runner: UnitRunner, kind: str, release: bool = False) -> tuple:
    """Run the next unit. `release` (a paired job's deallocation group ended, Waterwave): on CUDA, what it freed goes
    back to the device, where the partner's process can allocate it."""
    pos, start, start_mono = runner.pos, time.time(), time.monotonic()
    done = runner.step()
    if release and runner.device.type == "cuda":
        torch.cuda.empty_cache()
    end, end_mono = time.time(), time.monotonic()
    return (kind, pos, start, end, start_mono, end_mono, done, _unit_info(runner, done))


def _unit_info(runner: UnitRunner, done: bool) -> dict[str, Any] | None:
    """What the executor records with a unit: a training job's live bytes (and the allocator's, on CUDA), and the
    job's progress where the unit completed an iteration."""
    info = {"live_bytes": runner.live_bytes()} if runner.train else {}
    if runner.train and runner.device.type == "cuda":
        info["allocated_bytes"] = torch.cuda.memory_allocated(runner.device)
    return {**info, **runner.progress()} if done else info or None


def _timed_steps(runner: UnitRunner, n: int) -> tuple:
    """Run up to n units back to back and synchronize once, at the end: on a time-sliced GPU the batch keeps the
    device busy, so the main job's spinning receive gets a slice per batch, not per unit. Each unit's time on CUDA
    from events recorded between the units (the batch's GPU timeline); stops early at a unit that must wait (a
    data-parallel optimizer step whose gradients have not arrived)."""
    cuda = runner.device.type == "cuda"
    wall0, mono0 = time.time(), time.monotonic()
    first = None
    if cuda:
        first = torch.cuda.Event(enable_timing=True)
        first.record()
    done_at: list[Any] = []
    units: list[tuple[int, bool, dict[str, Any] | None]] = []
    while len(units) < n and runner.ready():
        pos = runner.pos
        done = runner.step(sync=not cuda)
        if cuda:
            done_at.append(torch.cuda.Event(enable_timing=True))
            done_at[-1].record()
        else:
            done_at.append(time.monotonic())
        units.append((pos, done, _unit_info(runner, done)))
    if not units:
        return ("wait", runner.pos)
    if cuda:
        torch.cuda.synchronize(runner.device)
        ends = [first.elapsed_time(e) / 1e3 for e in done_at]
    else:
        ends = [m - mono0 for m in done_at]
    starts = [0.0, *ends[:-1]]
    return ("steps", [("step", pos, wall0 + a, wall0 + b, mono0 + a, mono0 + b, done, info)
                      for (pos, done, info), a, b in zip(units, starts, ends)])


def _iterative(runner: UnitRunner, rx: Any, tx: Any) -> None:
    """Iterative interface: one RunNextStep per ("step", pos, release, free_bytes) request, or a batch of n per
    ("steps", pos, n, free_bytes)."""
    free = None
    while True:
        msg = rx.recv()
        if msg[0] == "stop":
            return
        if msg[0] == "unload":
            runner.unload()
            continue
        if msg[0] == "init":
            runner.to_device()
        if msg[-1] != free:
            free = msg[-1]
            cap_memory(runner.device, free)
        if msg[0] == "init":
            tx.send(("inited", runner.profile(runner.options.profile_reps)))
        elif msg[0] == "step":
            if msg[1] != runner.pos:
                raise RuntimeError(f"asked for unit {msg[1]} of the stream, next is {runner.pos}")
            tx.send(_timed_step(runner, "step", msg[2]) if runner.ready() else ("wait", runner.pos))
        elif msg[0] == "steps":
            if msg[1] != runner.pos:
                raise RuntimeError(f"asked for unit {msg[1]} of the stream, next is {runner.pos}")
            tx.send(_timed_steps(runner, msg[2]))


def _imperative(runner: UnitRunner, rx: Any, tx: Any) -> None:
    """Imperative interface: after ("run", free_bytes) loop over the units; paused by SIGSTOP."""
    msg = rx.recv()
    if msg[0] != "init":
        return
    runner.to_device()
    cap_memory(runner.device, msg[1])
    tx.send(("inited", None))
    msg = rx.recv()
    if msg[0] != "run":
        return
    cap_memory(runner.device, msg[1])
    limit = runner.options.iterations
    while limit is None or runner.iterations < limit:
        tx.send(_timed_step(runner, "unit"))
    tx.send(("done",))
    rx.recv()
