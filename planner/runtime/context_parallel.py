"""Context parallelism as Megatron-Core runs it (--context-parallel-size), on the traced pieces.

Each of the cp ranks of a context-parallel group holds 1/cp of every sequence: chunks r and 2cp-1-r of
2cp equal chunks (Megatron's load balance under a causal mask: every rank gets the same attention work).
The model's inputs and targets are cut so before the first stage; every op that works position by
position then runs on the local tokens unchanged. What the traced code says about the sequence is
rewritten, guided by the shapes of a meta pass over the whole sequence:

- a ``view``/``reshape``/``expand`` that keeps the sequence dim gets the local length there (a literal S of
  an exported graph becomes S/cp; a length read off a local tensor is local already);
- a length read off a local tensor that sizes anything else (``arange(tokens.shape[1])`` for positions, a
  causal mask) becomes the whole sequence's, ``cp * s``: such values are computed whole, replicated;
- a replicated operand spanning the sequence (learned position embeddings, RoPE's cos/sin) that meets the
  local tokens in an elementwise op keeps this rank's positions (``index_select``; its gradient is
  scattered back, and summed over the group with the others);
- attention (a fused ``scaled_dot_product_attention``, or the written-out Q Kᵀ → mask → softmax → · V)
  becomes ``ContextParallelAttention``: ring attention (below), each rank's queries attending under the causal
  mask of their global positions.

An op on the local tokens that these rules do not place (a product over the sequence, a slice along it)
is refused with a clear message, never run wrongly. Attention is assumed causal (a decoder LM, as
Megatron's and torchtitan's context parallelism assume); dropout inside attention is refused.

The attention is ring attention as Transformer Engine runs it (and the planner prices): keys and values
travel around the group, sent on while a flash kernel runs each pair of query and key chunks, merged by
log-sum-exp; the backward passes them around again with their gradients. A rank keeps what the kernel
keeps (its q, k, v, the output, the log-sum-exp). CPU: torch's CPU flash kernel (tested); CUDA: the flash
kernel (bf16/fp16), written but not run here (no GPU was lent).
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from passes.costs import node_kind
from passes.errors import UserError
from passes.sharding import size_args
from passes.sharding.ops import CP_REDUCTIONS, NO_TENSOR, POSITIONWISE

from .megatron_tp import call

__all__ = ["ContextParallel", "ContextParallelAttention", "positions"]


def positions(seq: int, cp: int, rank: int) -> torch.Tensor:
    """Global positions of the tokens context-parallel rank `rank` holds: chunks rank and 2cp-1-rank."""
    c = seq // (2 * cp)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)])


class _Unsupported(Exception):
    pass


@dataclass(frozen=True, slots=True)
class _Items:
    """The result of an unbind/split of a local tensor: each item's sequence dim."""

    dim: int


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
                    outs = _Piece(piece, self.inner.get(str(node.target), {}), self, given).run()
                except _Unsupported as exc:
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

    def __init__(self, cp: ContextParallel, *, k_transposed: bool, scale: float | None) -> None:
        super().__init__()
        self.k_transposed, self.scale, self.group = k_transposed, scale, cp.group
        self.chunks = (cp.rank, 2 * cp.size - 1 - cp.rank)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.k_transposed:
            k = k.transpose(-2, -1)
        if q.is_meta:  # the shape pass: no communication
            return q.new_empty((*q.shape[:-1], v.shape[-1]))
        scale = self.scale if self.scale is not None else q.shape[-1] ** -0.5
        return _RingAttention.apply(q, k, v, self.chunks, scale, self.group)


class _Piece:
    """The rewrite of one piece: walks its nodes in order, tracking the sequence dim of each local value."""

    def __init__(self, gm: fx.GraphModule, shapes: dict[str, Any], cp: ContextParallel, given: list) -> None:
        self.gm, self.graph, self.shapes, self.cp, self.S = gm, gm.graph, dict(shapes), cp, cp.seq
        self.seq: dict[str, Any] = {}  # node -> sequence dim (an int), or _Items (unbind/split)
        self.lengths: set[str] = set()  # ints equal to the local sequence length
        self.sizes: dict[str, int] = {}  # shape tuples read off a local tensor -> its sequence dim
        self.whole: dict[str, fx.Node] = {}  # local length -> node computing the whole sequence's
        self.dead: set[str] = set()  # attention cores replaced
        for ph, g in zip([n for n in self.graph.nodes if n.op == "placeholder"], given):
            if g == "len":
                self.lengths.add(ph.name)
            elif g is not None:
                self.seq[ph.name] = g

    def shape(self, n: fx.Node) -> tuple[int, ...]:
        s = self.shapes.get(n.name)
        if not isinstance(s, tuple):
            raise _Unsupported(f"{n.name} has no traced shape")
        return s

    def run(self) -> list:
        outs: list = []
        for n in list(self.graph.nodes):
            if n.name in self.dead or n.op in ("placeholder", "get_attr"):
                continue
            if n.op == "output":
                results = n.args[0] if isinstance(n.args[0], (tuple, list)) else (n.args[0],)
                for a in results:
                    name = a.name if isinstance(a, fx.Node) else None
                    outs.append("len" if name in self.lengths else self.seq.get(name))
                continue
            self.node(n)
        for n in reversed(list(self.graph.nodes)):  # the replaced cores (an attention op counts as impure)
            if n.name in self.dead and not n.users:
                self.graph.erase_node(n)
        self.graph.eliminate_dead_code()
        self.gm.recompile()
        return outs

    # -- one node --------------------------------------------------------------------------

    def node(self, n: fx.Node) -> None:
        kind = node_kind(n, self.gm)
        local = [a for a in n.all_input_nodes if isinstance(self.seq.get(a.name), int)]
        if kind in NO_TENSOR:
            if kind == "GuardsFn" and local and not n.users:  # torch.export's guards check the traced lengths
                self.graph.erase_node(n)
            return
        if n.op == "call_function" and n.target is operator.getitem and n.args[0].name in self.sizes:
            if n.args[1] == self.sizes[n.args[0].name]:
                self.lengths.add(n.name)
            return
        if n.op == "call_function" and n.target is operator.getitem and isinstance(self.seq.get(n.args[0].name), _Items):
            self.seq[n.name] = self.seq[n.args[0].name].dim
            return
        if kind in ("size", "sym_size", "getattr") or (n.op == "call_function" and n.target is getattr):
            x = n.args[0]
            if not isinstance(self.seq.get(x.name), int):
                return
            dim = self.seq[x.name]
            if kind == "getattr" or n.target is getattr:  # x.shape (x.device, x.dtype: nothing to do)
                if n.args[1] == "shape":
                    self.sizes[n.name] = dim
            elif len(n.args) > 1 or "dim" in n.kwargs:
                if (n.args[1] if len(n.args) > 1 else n.kwargs["dim"]) % len(self.shape(x)) == dim:
                    self.lengths.add(n.name)
            else:
                self.sizes[n.name] = dim
            return
        if not local:
            self.globalize(n)
            return
        if kind == "attention":
            self.fused_attention(n)
        elif kind == "matmul" and len(local) == 2:
            self.written_attention(n)
        elif kind in ("view", "reshape", "expand"):
            self.view(n, local[0], kind)
        elif kind in ("linear", "linear_fn", "embedding", "matmul"):
            x = local[0]
            if len(local) > 1 or self.seq[x.name] >= len(self.shape(x)) - (1 if kind != "embedding" else 0):
                raise _Unsupported(f"{n.name}: a product over the sequence")
            self.globalize(n)
            self.seq[n.name] = self.seq[x.name] + len(self.shape(n)) - len(self.shape(x)) if kind == "matmul" \
                else self.seq[x.name]
        elif kind in POSITIONWISE or kind == "cat":
            self.pointwise(n, local, kind)
        else:
            self.structural(n, local[0], kind)

    def globalize(self, n: fx.Node) -> None:
        """Local lengths that size anything but the local tokens become the whole sequence's."""
        used = [a for a in n.all_input_nodes if a.name in self.lengths]
        for a in used:
            if a.name not in self.whole:
                with self.graph.inserting_after(a):
                    self.whole[a.name] = self.graph.call_function(operator.mul, (a, self.cp.size))
            n.replace_input_with(a, self.whole[a.name])

    def view(self, n: fx.Node, x: fx.Node, kind: str) -> None:
        dx, i_shape, o_shape = self.seq[x.name], self.shape(x), self.shape(n)
        if kind == "expand":
            j = dx + len(o_shape) - len(i_shape)
        else:
            before = math.prod(i_shape[:dx])
            j = next((j for j in range(len(o_shape)) if math.prod(o_shape[:j]) == before and o_shape[j] == self.S),
                     None)
            if j is None:
                raise _Unsupported(f"{n.name} merges or splits the sequence dim")
        args, setter = size_args(n)
        if j >= len(args):
            raise _Unsupported(n.name)
        new = list(args)
        a = args[j]
        if isinstance(a, int):
            if a == self.S:
                new[j] = a // self.cp.size
            elif a != -1:
                raise _Unsupported(f"{n.name}: size {a} at the sequence dim")
        elif isinstance(a, fx.Node) and a.name not in self.lengths:
            with self.graph.inserting_before(n):
                new[j] = self.graph.call_function(operator.floordiv, (a, self.cp.size))
        setter(new)
        for k, b in enumerate(new):  # other sizes: a local length elsewhere is the whole sequence's
            if k != j and isinstance(b, fx.Node) and b.name in self.lengths:
                raise _Unsupported(f"{n.name}: the sequence length sizes another dim")
        self.seq[n.name] = j

    def pointwise(self, n: fx.Node, local: list[fx.Node], kind: str) -> None:
        out = self.shape(n)
        dims = {len(out) - (len(self.shape(a)) - self.seq[a.name]) for a in local}
        if len(dims) != 1:
            raise _Unsupported(f"{n.name}: local operands disagree on the sequence dim")
        od = dims.pop()
        if kind in CP_REDUCTIONS:
            along = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
            along = [d % len(self.shape(local[0])) for d in (along if isinstance(along, (tuple, list)) else [along])
                     if isinstance(d, int)]
            dx = self.seq[local[0].name]
            if not along or dx in along:
                raise _Unsupported(f"{n.name}: {kind} along the sequence")
            if len(out) < len(self.shape(local[0])):  # the reduced dims are dropped (no keepdim)
                od = dx - sum(d < dx for d in along)
        if out[od] != self.S:
            raise _Unsupported(f"{n.name}: reduces the sequence")
        if kind == "cat":
            along = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)
            if along % len(out) == od:
                raise _Unsupported(f"{n.name}: cat along the sequence")
        self.globalize(n)
        for a in n.all_input_nodes:  # a replicated operand spanning the sequence keeps this rank's positions
            o = self.shapes.get(a.name)
            if a in local or not isinstance(o, tuple):
                continue
            idx = len(o) - (len(out) - od)
            if idx >= 0 and o[idx] == self.S:
                n.replace_input_with(a, call(self.gm, _Positions(self.cp, idx), (a,), before=n, prefix="_cp"))
        self.seq[n.name] = od

    def structural(self, n: fx.Node, x: fx.Node, kind: str) -> None:
        dx, rank = self.seq[x.name], len(self.shape(x))
        self.globalize(n)
        if kind == "permute":
            dims = n.args[1] if isinstance(n.args[1], (tuple, list)) else n.args[1:]
            self.seq[n.name] = [d % rank for d in dims].index(dx)
        elif kind == "transpose":
            a, b = (d % rank for d in n.args[1:3])
            self.seq[n.name] = b if dx == a else a if dx == b else dx
        elif kind == "unsqueeze":
            along = n.args[1] % (rank + 1)
            self.seq[n.name] = dx + (along <= dx)
        elif kind in ("squeeze", "select", "slice"):
            along = (n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)) % rank
            if along == dx:
                raise _Unsupported(f"{n.name}: {kind} along the sequence")
            self.seq[n.name] = dx - (along < dx and kind != "slice")
        elif kind in ("unbind", "split", "chunk"):
            along = (n.args[2] if kind != "unbind" and len(n.args) > 2 else
                     n.args[1] if kind == "unbind" and len(n.args) > 1 else n.kwargs.get("dim", 0)) % rank
            if along == dx:
                raise _Unsupported(f"{n.name}: {kind} along the sequence")
            self.seq[n.name] = _Items(dx - (kind == "unbind" and along < dx))
        elif kind == "flatten":
            start, end = ((list(n.args[1:3]) + [0, -1])[:2] if len(n.args) > 1 else [0, -1])
            start, end = start % rank, end % rank
            if start <= dx <= end and start != end:
                raise _Unsupported(f"{n.name}: flattens the sequence dim")
            self.seq[n.name] = dx if dx < start else dx - (end - start)
        else:
            raise _Unsupported(f"{n.name}: {kind} on the local tokens, an op the rules do not know")

    # -- attention --------------------------------------------------------------------------

    def fused_attention(self, n: fx.Node) -> None:
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        args = dict(zip(names, n.args)) | dict(n.kwargs)
        if args.get("dropout_p", 0.0):
            raise _Unsupported(f"{n.name}: dropout inside attention")
        if not args.get("is_causal") and args.get("attn_mask") is None:
            raise _Unsupported(f"{n.name}: attention without a mask (not causal)")
        q, k, v = args["query"], args["key"], args["value"]
        if any(self.seq.get(a.name) != len(self.shape(a)) - 2 for a in (q, k, v)):
            raise _Unsupported(f"{n.name}: attention whose q, k, v do not all hold the local tokens")
        self.replace(n, (q, k, v), k_transposed=False, scale=args.get("scale"))

    def written_attention(self, first: fx.Node) -> None:
        """Q Kᵀ ... · V written out: the region from this product to the next product with V."""
        q, kt = first.args[0], first.args[1]
        if self.seq[q.name] != len(self.shape(q)) - 2 or self.seq[kt.name] != len(self.shape(kt)) - 1:
            raise _Unsupported(f"{first.name}: a product over the sequence that is not Q Kᵀ")
        region, frontier, second = {first}, [first], None
        while frontier:
            node = frontier.pop()
            for user in node.users:
                if user in region:
                    continue
                if node_kind(user, self.gm) == "matmul":
                    if second is not None and user is not second:
                        raise _Unsupported(f"{first.name}: scores feed two products")
                    second = user
                    continue
                region.add(user)
                frontier.append(user)
        if second is None or second.args[0] not in region:
            raise _Unsupported(f"{first.name}: no product of the scores with V")
        kinds, scale = set(), 1.0
        for node in region:
            kind = node_kind(node, self.gm)
            kinds.add(kind)
            if kind in ("dropout", "Dropout"):
                p = self.gm.get_submodule(str(node.target)).p if node.op == "call_module" else \
                    (node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5))
                if p:
                    raise _Unsupported(f"{node.name}: dropout inside attention")
            numbers = [x for x in (self.shapes.get(a.name) if isinstance(a, fx.Node) else a for a in node.args[1:])
                       if isinstance(x, (int, float)) and not isinstance(x, bool)]  # constants, or traced ints
            if kind in ("div", "truediv") and numbers and node.args[0] in region:
                scale /= numbers[0]
            elif kind == "mul" and numbers:
                scale *= numbers[0]
        if "softmax" not in kinds or not kinds & {"masked_fill", "where", "add"}:
            raise _Unsupported(f"{first.name}: attention without a softmax and a mask (not causal)")
        if any(u not in region and u is not second for node in region for u in node.users):
            raise _Unsupported(f"{first.name}: the attention scores are used outside attention")
        if self.seq.get(second.args[1].name) != len(self.shape(second.args[1])) - 2:
            raise _Unsupported(f"{second.name}: V does not hold the local tokens")
        self.dead |= {node.name for node in region}
        self.replace(second, (q, kt, second.args[1]), k_transposed=True, scale=scale)

    def replace(self, end: fx.Node, qkv: tuple, *, k_transposed: bool, scale: Any) -> None:
        new = call(self.gm, ContextParallelAttention(self.cp, k_transposed=k_transposed, scale=scale), qkv,
                   before=end, prefix="_cp")
        end.replace_all_uses_with(new)
        self.dead.add(end.name)
        self.shapes[new.name] = self.shapes.get(end.name)
        self.seq[new.name] = self.seq[qkv[0].name]


class _Positions(nn.Module):
    """This rank's positions of a replicated tensor spanning the sequence along `dim`."""

    def __init__(self, cp: ContextParallel, dim: int) -> None:
        super().__init__()
        self.dim, self.index = dim, cp.local

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.index_select(self.dim, self.index.to(x.device))
