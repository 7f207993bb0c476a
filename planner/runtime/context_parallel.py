"""Context parallelism as Megatron-Core runs it (--context-parallel-size), on the traced pieces.

Each of the cp ranks of a context-parallel group holds 1/cp of every sequence: chunks r and 2cp-1-r of
2cp equal chunks (Megatron's load balance under a causal mask: every rank gets the same attention work).
The model's inputs and targets are cut so before the first stage; every op that works position by
position then runs on the local tokens unchanged. What the traced code says about the sequence is
rewritten by the rules of passes/sharding/context.py (`ContextWalk`, which the trace-time check runs too), guided by
the shapes of a meta pass over the whole sequence; this module supplies what the walk inserts: this rank's positions
of a replicated tensor spanning the sequence (``index_select``; its gradient is scattered back, and summed over the
group with the others) and ring attention in place of each attention. An op the rules do not place is refused with
a clear message, never run wrongly.

The attention is ring attention as Transformer Engine runs it (and the planner prices): keys and values
travel around the group, sent on while a flash kernel runs each pair of query and key chunks, merged by
log-sum-exp; the backward passes them around again with their gradients. A rank keeps what the kernel
keeps (its q, k, v, the output, the log-sum-exp). CPU: torch's CPU flash kernel (tested); CUDA: the flash
kernel (bf16/fp16), written but not run here (no GPU was lent).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from passes.errors import UserError
from passes.sharding.context import ContextWalk, Unsupported

__all__ = ["ContextParallel", "ContextParallelAttention", "positions"]


def positions(seq: int, cp: int, rank: int) -> torch.Tensor:
    """Global positions of the tokens context-parallel rank `rank` holds: chunks rank and 2cp-1-rank."""
    c = seq // (2 * cp)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)])


@dataclass(kw_only=True)
class ContextParallel:
    """One rank's place in its context-parallel group, and the whole-sequence shapes to rewrite from."""

    size: int
    rank: int
    seq: int
    group: Any = None
    specs: dict[str, Any] = field(default_factory=dict)
    """Top-level value -> TensorSpec (or int) of the whole-sequence meta pass."""
    inner: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Piece name -> node name -> shape (or int) of the same pass."""

    def __post_init__(self) -> None:
        if self.seq % (2 * self.size):
            raise UserError(f"cp={self.size} does not split the {self.seq}-token sequence into 2*cp equal chunks; "
                            "re-plan with a cp that divides it")
        self.local = positions(self.seq, self.size, self.rank)

    def attention(self, *, k_transposed: bool, scale: Any, layout: tuple[int, ...] | None = None) -> nn.Module:
        """What replaces an attention (passes.sharding.context.ContextModules): ring attention over the group, its
        output laid out in memory with its dims in `layout`'s order (outermost first), as the attention it replaces."""
        return ContextParallelAttention(self, k_transposed=k_transposed, scale=scale, layout=layout)

    def positions(self, dim: int) -> nn.Module:
        """What selects this rank's positions of a replicated tensor spanning the sequence along `dim`."""
        return _Positions(self, dim)

    def shard(self, x: Any) -> Any:
        """This rank's tokens of a batch-first model input or target (b, S, ...); anything else as is."""
        if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[1] == self.seq:
            return x.index_select(1, self.local.to(x.device))
        return x

    def apply(self, split: fx.GraphModule) -> None:
        """Rewrite every piece of the split for this rank's tokens (see the module docstring)."""
        state: dict[str, Any] = {}
        for node in split.graph.nodes:
            if node.op == "placeholder":
                spec = self.specs.get(node.name)
                shape = getattr(spec, "shape", ())
                state[node.name] = 1 if len(shape) >= 2 and shape[1] == self.seq else None
            elif node.op == "call_module":
                piece = split.get_submodule(str(node.target))
                given = [state.get(a.name) if isinstance(a, fx.Node) else None for a in node.args]
                try:
                    outs = ContextWalk(piece, self.inner.get(str(node.target), {}), self, given).run()
                except Unsupported as exc:
                    raise UserError(f"the plan runs context parallelism (cp={self.size}), but {node.target} of the "
                                    f"model's graph does something to the split sequence that the runtime cannot "
                                    f"place ({exc}); re-plan with --cp 1 to run it here, or export the plan to "
                                    "Megatron-LM or torchtitan (`planner export`)") from None
                out = next(n for n in piece.graph.nodes if n.op == "output")
                state[node.name] = tuple(outs) if isinstance(out.args[0], (tuple, list)) else outs[0]
            elif node.op == "call_function" and node.target is operator.getitem and \
                    isinstance(state.get(node.args[0].name), tuple):
                state[node.name] = state[node.args[0].name][node.args[1]]


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> tuple:
    """One block of attention by the flash kernel: (output, fp32 log-sum-exp per query, what its backward needs)."""
    if q.is_cuda:  # CUDA-only, untested here (no GPU lent): flash needs bf16/fp16
        out, lse, cq, ck, mq, mk, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale)
        return out, lse, (cq, ck, mq, mk, seed, offset)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse, ()


def _flash_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, causal: bool, scale: float, extra: tuple) -> tuple:
    if q.is_cuda:  # CUDA-only, untested here
        cq, ck, mq, mk, seed, offset = extra
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad, q, k, v, out, lse, cq, ck, mq, mk, 0.0, causal, seed, offset, scale=scale)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, 0.0, causal, scale=scale)


class _Ring:
    """Passes a tensor to the next rank of the context-parallel group and takes the previous rank's."""

    def __init__(self, group: Any) -> None:
        n, r = dist.get_world_size(group), dist.get_rank(group)
        self.group, self.n, self.rank = group, n, r
        self.next, self.prev = dist.get_global_rank(group, (r + 1) % n), dist.get_global_rank(group, (r - 1) % n)

    def start(self, x: torch.Tensor) -> tuple[torch.Tensor, list]:
        """Send x on, receive into a new buffer; wait on the returned works before reading it."""
        buf = torch.empty_like(x)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, self.next, self.group),
                                        dist.P2POp(dist.irecv, buf, self.prev, self.group)])
        return buf, works


def _kv_chunks(kv: torch.Tensor, rep: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A rank's two (key, value) chunks from its stacked (k, v), kv heads repeated for the query heads they serve."""
    k, v = (x.repeat_interleave(rep, dim=-3) for x in kv)
    return [(a.contiguous(), b.contiguous()) for a, b in zip(k.chunk(2, dim=-2), v.chunk(2, dim=-2))]


class _RingAttention(torch.autograd.Function):
    """Causal ring attention over the context-parallel group (Transformer Engine's schedule; Liu et al. 2023): each
    rank's stacked keys and values travel around the ring, sent on while this rank runs a flash kernel for each pair
    of its two query chunks with the block it holds — whole below the diagonal, causal on it, skipped above; the
    partial results are merged by log-sum-exp. A rank keeps what the kernel keeps: its q, k, v, the output and the
    log-sum-exp. The backward passes keys and values around again, with the gradients of the block each rank holds
    travelling along and arriving home after the last step; each pair's flash backward runs from the merged output
    and log-sum-exp. `chunks`: this rank's two query chunk ids (r, 2cp-1-r) in Megatron's load-balanced split."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunks: tuple[int, int], scale: float,
                group: Any) -> torch.Tensor:
        ring, rep = _Ring(group), q.shape[-3] // k.shape[-3]
        ctx.chunks, ctx.scale, ctx.group, ctx.extra = chunks, scale, group, {}
        queries = [x.contiguous() for x in q.chunk(2, dim=-2)]
        found: list[list] = [[], []]
        held = torch.stack((k, v)).contiguous()
        for step in range(ring.n):
            src = (ring.rank - step) % ring.n  # whose keys and values this rank holds now
            passing = ring.start(held) if step < ring.n - 1 else None
            for c, (k_c, v_c) in zip((src, 2 * ring.n - 1 - src), _kv_chunks(held, rep)):
                for a, q_a in enumerate(queries):
                    if c <= chunks[a]:  # causal: later chunks are not seen at all
                        out, lse, ctx.extra[a, c] = _flash(q_a, k_c, v_c, c == chunks[a], scale)
                        found[a].append((out.float(), lse))
            if passing is not None:
                held, works = passing
                for w in works:
                    w.wait()
        outs, lses = [], []
        for parts in found:
            lse = torch.logsumexp(torch.stack([x for _, x in parts]), dim=0)
            outs.append(sum(o * (x - lse).exp().unsqueeze(-1) for o, x in parts).to(q.dtype))
            lses.append(lse)
        out = torch.cat(outs, dim=-2).transpose(-3, -2).contiguous().transpose(-3, -2)  # laid out (b, s, h, d), as
        ctx.save_for_backward(q, k, v, out, torch.cat(lses, dim=-1))  # flash writes it: o_proj reads a view of it
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        ring, rep, chunks = _Ring(ctx.group), q.shape[-3] // k.shape[-3], ctx.chunks
        pieces = [tuple(x.contiguous() for x in xs) for xs in zip(q.chunk(2, -2), grad.chunk(2, -2), out.chunk(2, -2),
                                                                   lse.chunk(2, -1))]
        dq = [torch.zeros_like(p[0], dtype=torch.float32) for p in pieces]
        held = torch.stack((k, v)).contiguous()
        d_held = torch.zeros_like(held, dtype=torch.float32)  # gradients of the block held, travelling with it
        for step in range(ring.n):
            src = (ring.rank - step) % ring.n
            passing = ring.start(held) if step < ring.n - 1 else None
            for i, (c, (k_c, v_c)) in enumerate(zip((src, 2 * ring.n - 1 - src), _kv_chunks(held, rep))):
                for a, (q_a, g_a, o_a, l_a) in enumerate(pieces):
                    if (a, c) in ctx.extra:
                        dqp, dkp, dvp = _flash_backward(g_a, q_a, k_c, v_c, o_a, l_a, c == chunks[a], ctx.scale,
                                                        ctx.extra[a, c])
                        dq[a] += dqp
                        for j, d in enumerate((dkp, dvp)):  # summed over the query heads each kv head served
                            d_held[j].chunk(2, dim=-2)[i].add_(d.unflatten(-3, (-1, rep)).sum(-3))
            d_held, works = ring.start(d_held)  # on to the next rank; after the last step, home
            for w in works + (passing[1] if passing else []):
                w.wait()
            if passing is not None:
                held = passing[0]
        return (torch.cat(dq, dim=-2).to(q.dtype), d_held[0].to(k.dtype), d_held[1].to(v.dtype), None, None, None)


class ContextParallelAttention(nn.Module):
    """Replaces a traced attention core: (q, k or kᵀ, v), batch-first, (..., seq, head_dim) each."""

    def __init__(self, cp: ContextParallel, *, k_transposed: bool, scale: float | None,
                 layout: tuple[int, ...] | None = None) -> None:
        super().__init__()
        self.k_transposed, self.scale, self.group = k_transposed, scale, cp.group
        self.layout = layout
        self.chunks = (cp.rank, 2 * cp.size - 1 - cp.rank)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.k_transposed:
            k = k.transpose(-2, -1)
        if q.is_meta or is_fake(q):  # the shape pass: no communication
            out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        else:
            scale = self.scale if self.scale is not None else q.shape[-1] ** -0.5
            out = _RingAttention.apply(q, k, v, self.chunks, scale, self.group)
        if self.layout is None:
            return out
        back = sorted(range(out.dim()), key=self.layout.__getitem__)
        return out.permute(self.layout).contiguous().permute(back)


class _Positions(nn.Module):
    """This rank's positions of a replicated tensor spanning the sequence along `dim`."""

    def __init__(self, cp: ContextParallel, dim: int) -> None:
        super().__init__()
        self.dim, self.index = dim, cp.local

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.index_select(self.dim, self.index.to(x.device))
