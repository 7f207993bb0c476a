"""Data-parallel gradient reduction and the optimizer step, as the plan prices them.

- Gradients are averaged over the data-parallel group in buckets of Megatron-Core's size
  (`costmodels.comm.megatron_bucket_params`). With ``overlap_grad_reduce`` a bucket's all-reduce is
  launched asynchronously during the last microbatch's backward of its stage, as soon as every
  gradient in it is final (DDP and Megatron-Core do the same); the ``ALLREDUCE`` action only waits.
- Parameters in bf16 or fp16 are stepped through fp32 master weights (a copy of each, or of the rank's
  shard under ZeRO-1) and copied back rounded, as Megatron's mixed-precision optimizer does; gradients
  accumulate and are reduced in the parameters' dtype, or in fp32 buffers under ``grad_fp32`` (Megatron's
  main_grad with --accumulate-allreduce-grads-in-fp32).
- With ``zero`` = 1 (ZeRO-1, Megatron's distributed optimizer) each data-parallel rank holds an fp32
  copy of 1/d of the flattened parameters and the optimizer state for it, steps that shard, and the
  updated shards are all-gathered into every replica's parameters. Adam and SGD are elementwise, so
  this equals the replicated optimizer to rounding. (gloo has no reduce-scatter: the gradients are
  all-reduced and each rank takes its slice; the bytes a rank ends up owning are the same.)
- With ``zero`` = 2 (ZeRO-2) the gradients are sharded too: every microbatch's gradients are reduced bucket by
  bucket as the backward finishes them (launched asynchronously, in every microbatch, not only the last), the
  rank adds its slice to an fp32 shard of the flattened gradient and drops the rest, so no whole gradient outlives
  its bucket; the step is ZeRO-1's on that shard.

Parameters shared between pipeline stages (a tied embedding and LM head) are first summed over their
embedding group, so they are reduced at the ``ALLREDUCE`` action, never during the backward.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as dist

from costmodels.comm import megatron_bucket_params

__all__ = ["GradSync", "SavedBytes", "local_grad"]


def local_grad(p: torch.nn.Parameter) -> torch.Tensor:
    """p's gradient; zeros where the parameter got no gradient."""
    with torch.no_grad():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        return p.grad


class _Bucket:
    __slots__ = ("params", "waiting", "flat", "work")

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params, self.waiting, self.flat, self.work = params, 0, None, None


class GradSync:
    """One rank's gradient reduction and optimizer (see the module docstring)."""

    def __init__(self, params: dict[str, torch.nn.Parameter], *, shared: Iterable[str], dp_group: Any, dp_size: int,
                 dp_rank: int, zero: bool, overlap: bool, optimizer: str, lr: float, grad_fp32: bool = False,
                 tp_partial: Iterable[tuple[torch.nn.Parameter, int]] = (), tp_group: Any = None) -> None:
        self.group, self.d, self.rank = dp_group, dp_size, dp_rank
        self._away: list[tuple[dict, str, torch.device]] = []  # optimizer state offloaded to the host
        self._stream: Any = None  # CUDA: the side stream of the offload's copies
        self._host: dict[tuple[int, str], torch.Tensor] = {}  # the offload's host buffers, reused every step
        unique: dict[int, tuple[str, torch.nn.Parameter]] = {}
        for name, p in params.items():
            unique.setdefault(id(p), (name, p))
        self.named = list(unique.values())
        shared = set(shared)
        partial = {id(p): r for p, r in tp_partial}
        self.tp_group = tp_group
        # partial sums over each r consecutive tensor-parallel ranks (SP: all t; a replicated kv head: its copies)
        self.partial = [(p, partial[id(p)]) for _, p in self.named if id(p) in partial]
        self.shared = [p for n, p in self.named if n in shared or id(p) in partial]
        self.overlap = overlap and dp_size > 1
        self.zero = zero >= 1 and dp_size > 1
        self.zero2 = zero >= 2 and dp_size > 1
        own = [p for n, p in self.named if n not in shared and id(p) not in partial]
        self.buckets = self._buckets(own[::-1])  # roughly the order the backward finishes them
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._armed: set[int] = set()
        self.overlapped = 0
        # fp32 gradient accumulation (Megatron's main_grad): each microbatch's gradient is added to an fp32
        # buffer and the parameter's own gradient dropped; the reduction and the step read the buffers
        self.grad_fp32 = grad_fp32
        self.main = {id(p): torch.zeros_like(p, dtype=torch.float32) for _, p in self.named} \
            if grad_fp32 and not self.zero2 and any(p.dtype != torch.float32 for _, p in self.named) else None
        if self.overlap or self.main is not None or self.zero2:
            for _, p in self.named:
                p.register_post_accumulate_grad_hook(self._accumulated)
        self._pending: list[tuple[_Bucket, torch.Tensor, Any]] = []  # ZeRO-2: reductions launched, not yet added
        opt = torch.optim.Adam if optimizer == "adam" else torch.optim.SGD
        self.lower = any(p.dtype != torch.float32 for _, p in self.named)  # bf16/fp16: fp32 master weights
        self.masters: list[torch.nn.Parameter] = []
        if self.zero:
            with torch.no_grad():
                flat = torch.cat([p.detach().reshape(-1).float() for _, p in self.named])
            self.shard_len = -(-flat.numel() // dp_size)
            flat = torch.nn.functional.pad(flat, (0, self.shard_len * dp_size - flat.numel()))  # to d equal shards
            lo = dp_rank * self.shard_len
            self.master = torch.nn.Parameter(flat[lo:lo + self.shard_len].clone())
            self.optimizer = opt([self.master], lr=lr)
            self.shard = torch.zeros_like(self.master.detach()) if self.zero2 else None  # the rank's summed gradients
            offsets = [0]
            for _, p in self.named:
                offsets.append(offsets[-1] + p.numel())
            self._offset = {id(p): o for (_, p), o in zip(self.named, offsets)}
        elif self.lower:
            self.masters = [torch.nn.Parameter(p.detach().float().clone()) for _, p in self.named]
            self.optimizer = opt(self.masters, lr=lr) if self.masters else None
        else:
            ps = [p for _, p in self.named]
            self.optimizer = opt(ps, lr=lr) if ps else None  # a stage may hold no weights

    def _buckets(self, params: list[torch.nn.Parameter]) -> list[_Bucket]:
        limit, out, cur, size = megatron_bucket_params(self.d), [], [], 0
        for p in params:
            cur.append(p)
            size += p.numel()
            if size >= limit:
                out.append(_Bucket(cur))
                cur, size = [], 0
        if cur:
            out.append(_Bucket(cur))
        return out

    # -- during the step -------------------------------------------------------------------------

    def finite(self) -> bool:
        """Every gradient of every rank is finite (fp16 loss scaling skips the step otherwise)."""
        bad = torch.tensor([0.0])
        whole = self.shared if self.zero2 else [p for _, p in self.named]
        if self.zero2 and not torch.isfinite(self.shard).all():
            bad.fill_(1.0)
        for p in whole:
            if (p.grad is not None or self.main is not None) and not torch.isfinite(self.grad(p)).all():
                bad.fill_(1.0)
                break
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return not bad.item()

    def zero_grad(self) -> None:
        for _, p in self.named:
            p.grad = None
        for buf in (self.main or {}).values():
            buf.zero_()
        if self.zero2:
            self.shard.zero_()
        for b in self.buckets:
            b.waiting, b.flat, b.work = len(b.params), None, None
        self._armed.clear()
        self.overlapped = 0  # buckets launched during the backward this step

    def arm(self, params: Iterable[torch.nn.Parameter]) -> None:
        """The next backward is the last one of these parameters' stage: reduce their buckets as they finish."""
        if self.overlap:
            self._armed.update(id(p) for p in params if id(p) in self._bucket_of)

    def grad(self, p: torch.nn.Parameter) -> torch.Tensor:
        """The rank's accumulated gradient of p: the fp32 buffer under grad_fp32, else p's own."""
        return self.main[id(p)] if self.main is not None else local_grad(p)

    def _accumulated(self, p: torch.nn.Parameter) -> None:
        if self.zero2:
            self._reduce_scatter_when_done(p)
            return
        if self.main is not None:
            with torch.no_grad():
                self.main[id(p)] += local_grad(p)
            p.grad = None
        if id(p) not in self._armed:
            return
        self._armed.discard(id(p))
        bucket = self._bucket_of[id(p)]
        bucket.waiting -= 1
        if bucket.waiting == 0:
            self._launch(bucket, async_op=True)
            self.overlapped += 1

    def _reduce_scatter_when_done(self, p: torch.nn.Parameter) -> None:
        """ZeRO-2, after a microbatch's gradient of p: once its bucket's are all there, launch their reduction and
        drop them (the previous reduction is added to the shard first: one in flight)."""
        bucket = self._bucket_of.get(id(p))
        if bucket is None:  # shared or partial: kept whole, reduced at the ALLREDUCE action
            return
        bucket.waiting -= 1
        if bucket.waiting == 0:
            self._scatter(bucket, async_op=True)
            self.overlapped += 1

    def _scatter(self, bucket: _Bucket, async_op: bool) -> None:
        self._drain()
        dtype = torch.float32 if self.grad_fp32 else None
        flat = torch.cat([local_grad(p).reshape(-1).to(dtype or p.dtype) for p in bucket.params])
        for p in bucket.params:
            p.grad = None
        bucket.waiting = len(bucket.params)
        self._pending.append((bucket, flat, dist.all_reduce(flat, group=self.group, async_op=async_op)))

    def _drain(self) -> None:
        """Wait for the launched ZeRO-2 reductions and add this rank's slice of each to its gradient shard."""
        for bucket, flat, work in self._pending:
            if work is not None:
                work.wait()
            at = 0
            for p in bucket.params:
                if (span := self._in_shard(p)) is not None:
                    mine, theirs = span
                    self.shard[mine] += flat[at + theirs.start:at + theirs.stop].float()
                at += p.numel()
        self._pending = []

    def _in_shard(self, p: torch.nn.Parameter) -> tuple[slice, slice] | None:
        """Where p's flattened elements meet this rank's shard of the flattened parameters: (the slice of the shard,
        the slice of p), or None."""
        lo, o = self.rank * self.shard_len, self._offset[id(p)]
        a, b = max(o, lo), min(o + p.numel(), lo + self.shard_len)
        return (slice(a - lo, b - lo), slice(a - o, b - o)) if a < b else None

    def _launch(self, bucket: _Bucket, async_op: bool) -> None:
        bucket.flat = torch.cat([self.grad(p).reshape(-1) for p in bucket.params])
        bucket.work = dist.all_reduce(bucket.flat, group=self.group, async_op=async_op)

    def reduce(self, shared_groups: dict[str, Any], names: dict[int, str]) -> None:
        """The ALLREDUCE action: shared parameters over their embedding group, then every bucket not yet
        launched; wait for all and write the averages back."""
        for p, r in self.partial:  # gradients each tensor-parallel rank computed from its part of the work
            _sum_over(self.grad(p), r, self.tp_group)
        for p in self.shared:
            if names[id(p)] in shared_groups:
                dist.all_reduce(self.grad(p), group=shared_groups[names[id(p)]])
        buckets = self.buckets + ([_Bucket(self.shared)] if self.shared else [])
        if self.zero2:  # what a microbatch left unreduced (parameters that got no gradient in it), then the rest
            for b in self.buckets:
                if b.waiting < len(b.params):
                    self._scatter(b, async_op=False)
            self._drain()
            buckets = buckets[len(self.buckets):]
        for b in buckets:
            if self.d == 1:
                for p in b.params:
                    self.grad(p)
                continue
            if b.flat is None:
                self._launch(b, async_op=False)
            else:
                b.work.wait()
            b.flat /= self.d
            offset = 0
            for p in b.params:
                g = self.grad(p)
                g.copy_(b.flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()

    def offload(self, limit: int) -> int:
        """PipeFill 4.2's main-job offload: move optimizer state tensors, in order, to host memory while their bytes
        stay within `limit` (pinned buffers filled on a side stream on CUDA, so the copies overlap the forward
        passes); they stay there until `restore`. Returns the bytes moved."""
        self._away = []
        if self.optimizer is None or limit <= 0:
            return 0
        moved, cuda = 0, None
        for st in self.optimizer.state.values():
            for key, t in st.items():
                if not isinstance(t, torch.Tensor) or t.dim() == 0:
                    continue
                if moved + t.nbytes > limit:
                    return moved
                host = self._host.get((id(st), key))
                if host is None or host.shape != t.shape or host.dtype != t.dtype:  # pinned once: allocating it
                    host = self._host[(id(st), key)] = torch.empty(  # every step costs more than the copy
                        t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
                if t.is_cuda:
                    if cuda is None:
                        cuda = self._side_stream(t.device)
                        cuda.wait_stream(torch.cuda.current_stream())  # after the last step's writes
                    with torch.cuda.stream(cuda):
                        host.copy_(t, non_blocking=True)
                    t.record_stream(cuda)  # the allocator reuses its memory only after the copy
                else:
                    host.copy_(t)
                self._away.append((st, key, t.device))
                st[key] = host
                moved += t.nbytes
        return moved

    def restore(self) -> None:
        """The offloaded state back on the device (on CUDA on the side stream; `step` waits for it)."""
        for st, key, device in self._away:
            if device.type == "cuda":
                with torch.cuda.stream(self._side_stream(device)):
                    st[key] = st[key].to(device, non_blocking=True)
            else:
                st[key] = st[key].clone()
        self._away = []

    def _side_stream(self, device: torch.device) -> Any:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def step(self, scale: float = 1.0) -> None:
        """The OPT action; gradients are divided by `scale` first (fp16 loss scaling)."""
        if self.optimizer is None:
            return
        if self._away:  # a plan without an ALLREDUCE action: bring it back now
            self.restore()
        if self._stream is not None:
            torch.cuda.current_stream().wait_stream(self._stream)  # the offloaded state is back
        if self.masters:  # fp32 master weights of bf16/fp16 parameters: step them, copy back rounded
            with torch.no_grad():
                for (_, p), m in zip(self.named, self.masters):
                    m.grad = self.grad(p).float() / scale
            self.optimizer.step()
            with torch.no_grad():
                for (_, p), m in zip(self.named, self.masters):
                    p.copy_(m)
                    m.grad = None  # (the fp32 copy of the gradient lives through the step only)
            return
        if not self.zero:
            if scale != 1.0:
                with torch.no_grad():
                    for _, p in self.named:
                        self.grad(p).div_(scale)
            self.optimizer.step()
            return
        lo = self.rank * self.shard_len
        with torch.no_grad():
            if self.zero2:  # the shard of the summed gradients, with the whole ones' (shared, partial) slices
                g = self.shard / (self.d * scale)
                for p in self.shared:
                    if (span := self._in_shard(p)) is not None:
                        mine, theirs = span
                        g[mine] = self.grad(p).reshape(-1)[theirs].float() / scale
            else:
                grads = torch.cat([self.grad(p).reshape(-1).float() for _, p in self.named]) / scale
                g = torch.zeros(self.shard_len, dtype=torch.float32, device=grads.device)
                part = grads[lo:lo + self.shard_len]
                g[:part.numel()] = part
            self.master.grad = g
        self.optimizer.step()
        self.master.grad = None  # (through the step only)
        with torch.no_grad():
            shards = [torch.empty_like(self.master) for _ in range(self.d)]
            dist.all_gather(shards, self.master.detach(), group=self.group)
            flat, offset = torch.cat(shards), 0
            for _, p in self.named:
                p.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()

    # -- what the rank holds -----------------------------------------------------------------------

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (moments; the fp32 master shard under ZeRO-1)."""
        if self.optimizer is None:
            return 0
        held = sum(t.numel() * t.element_size() for s in self.optimizer.state.values()
                   for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0)
        masters = [self.master] if self.zero else self.masters
        return held + (sum(m.numel() * m.element_size() for m in masters) if self.lower else 0)


def _sum_over(grad: torch.Tensor, r: int, group: Any) -> None:
    """Sum `grad` in place over this rank's r consecutive ranks of `group` (all of it: an all-reduce; else an
    all-gather, as ranks of different copies hold different tensors of the same shape)."""
    t = dist.get_world_size(group)
    if r == t:
        dist.all_reduce(grad, group=group)
        return
    parts = [torch.empty_like(grad) for _ in range(t)]
    dist.all_gather(parts, grad.contiguous(), group=group)
    first = dist.get_rank(group) // r * r
    grad.copy_(torch.stack(parts[first:first + r]).sum(0))


class SavedBytes:
    """Bytes a forward leaves for its backward: the storages autograd saves (each once, weights excluded), as
    saved-tensor hooks see them, plus the inputs a checkpointed piece keeps (`keep`) to recompute from."""

    def __init__(self, params: Iterable[torch.nn.Parameter]) -> None:
        self._weights = {p.untyped_storage().data_ptr() for p in params}
        self._seen: set[int] = set()
        self.total = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _count(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr and ptr not in self._weights and ptr not in self._seen:
            self._seen.add(ptr)
            self.total += storage.nbytes()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self._count(t)
        return t

    def exclude(self, tensors: Iterable[Any]) -> None:
        """Storages not to count from here on (a stage's output, saved again by its loss)."""
        self._weights.update(t.untyped_storage().data_ptr() for t in tensors
                             if isinstance(t, torch.Tensor))

    def keep(self, args: Iterable[Any]) -> None:
        for a in args:
            if isinstance(a, torch.Tensor):
                self._count(a)

    def __enter__(self) -> "SavedBytes":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
