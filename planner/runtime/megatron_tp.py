"""Tensor parallelism as Megatron runs it, on the traced pieces: local shards, attention split by heads.

Each of the plan's column-parallel linears keeps the rows of its weight that produce this rank's heads
(or its slice of the MLP's hidden features), each row-parallel linear the matching input columns; between
them every op works on local tensors. What the traced code says in global sizes is rewritten for the
shard, guided by the shapes of a meta pass over the same split:

- a ``view``/``reshape`` that splits the sharded features into (..., heads, head_dim) gets heads / t (and a
  fused q|k|v projection, split into (3, heads, d) or by ``split``, keeps q, k and v rows of the same heads:
  its rows are taken in 3 strided groups);
- a size read off a replicated tensor (``h`` of ``b, s, h = x.shape``) that sizes a sharded dim is divided
  by t; one read off a sharded tensor is local already.

The forward enters a column-parallel linear through Megatron's ``f`` (identity; all-reduce of the input
gradient) and leaves a row-parallel one through ``g`` (all-reduce; identity backward). Every other weight
is replicated and gets identical gradients on every tensor-parallel rank. An op the rules do not know
applied to a split tensor makes ``plan_shards`` (passes/sharding/walk.py, with the rules of passes/sharding/) return
a Refusal naming it, and the plan is refused: at plan time, where the planner walks the same graph (passes/sharding/
check.py), and here as a backstop.

Under sequence parallelism the values between the split linears hold 1/t of the sequence (``SeqParallel``).
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from passes.sharding import Div, Rows, call, shard_rows, swap

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "SeqParallel", "TensorParallelOp", "apply_shards", "gather_rows",
           "gather_cols"]

class _CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the gradient over the tensor-parallel group."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _gather(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """Sum over the group, keep this rank's slice along dim (all-reduce + slice: gloo has no reduce-scatter)."""
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return _slice(x, dim, group)


def _slice(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    n, r = dist.get_world_size(group), dist.get_rank(group)
    return x.narrow(dim, r * (x.shape[dim] // n), x.shape[dim] // n).contiguous()


class _SeqOp(torch.autograd.Function):
    """Sequence-parallel regions (Korthikanti et al. 2022): forward and backward collectives along dim."""

    OPS = {"reduce_scatter": (_reduce_scatter, _gather),  # out of a row-parallel linear
           "gather": (_gather, _slice),  # to a consumer that needs the whole sequence, replicated
           "scatter": (_slice, _gather)}  # a replicated value joining the sharded sequence

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, kind: str, dim: int, group: Any) -> torch.Tensor:
        ctx.kind, ctx.dim, ctx.group = kind, dim, group
        return _SeqOp.OPS[kind][0](x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _SeqOp.OPS[ctx.kind][1](grad, ctx.dim, ctx.group), None, None, None


class TensorParallelOp(nn.Module):
    """Megatron's f (before a column-parallel product) or g (after a row-parallel one), inserted into a piece."""

    def __init__(self, kind: str, group: Any) -> None:
        super().__init__()
        self.fn, self.group = {"f": _CopyToTP, "g": _ReduceFromTP}[kind], group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn.apply(x, self.group)


def gather_rows(local: torch.Tensor, t: int, rows: Rows, group: Any) -> torch.Tensor:
    """The whole tensor from every rank's rows (dealt as `rows` says), in the model's order; rows held by
    `rows.replicas` consecutive ranks each (kv heads fewer than t) are taken once."""
    parts = [torch.empty_like(local) for _ in range(t)]
    dist.all_gather(parts, local.contiguous(), group=group)
    parts, t = parts[::rows.replicas], t // rows.replicas
    n = local.shape[0] * t
    out = torch.empty((n, *local.shape[1:]), dtype=local.dtype, device=local.device)
    for r, part in enumerate(parts):
        out[shard_rows(n, t, r, rows.groups, rows.segments)] = part
    return out


def gather_cols(local: torch.Tensor, t: int, group: Any) -> torch.Tensor:
    parts = [torch.empty_like(local) for _ in range(t)]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, dim=1)


class SeqParallel(nn.Module):
    """One sequence-parallel collective, inserted into a traced piece."""

    def __init__(self, kind: str, dim: int, group: Any) -> None:
        super().__init__()
        self.kind, self.dim, self.group = kind, dim, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SeqOp.apply(x, self.kind, self.dim, self.group)


class GlobalShape(nn.Module):
    """The whole sequence's shape of a sequence-sharded tensor (what the traced code read as x.shape)."""

    def __init__(self, dim: int, t: int) -> None:
        super().__init__()
        self.dim, self.t = dim, t

    def forward(self, x: torch.Tensor) -> torch.Size:
        shape = list(x.shape)
        shape[self.dim] *= self.t
        return torch.Size(shape)


class _GatheredLinear(torch.autograd.Function):
    """A column-parallel linear on a sequence-parallel input, as Megatron runs it: the input is all-gathered
    along the sequence for the product, only this rank's part is kept for the backward (gathered again
    there), and the input gradient leaves reduce-scattered. A `replicated` linear (whole weight on every rank,
    the same output everywhere) takes its part of the input gradient instead of summing it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dim: int,
                group: Any, replicated: bool = False) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.dim, ctx.group, ctx.bias, ctx.replicated = dim, group, bias is not None, replicated
        return F.linear(_gather(x, dim, group), weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, weight = ctx.saved_tensors
        full = _gather(x, ctx.dim, ctx.group)
        grad_x = (_slice if ctx.replicated else _reduce_scatter)(grad @ weight, ctx.dim, ctx.group)
        grad_w = grad.reshape(-1, grad.shape[-1]).t() @ full.reshape(-1, full.shape[-1])
        grad_b = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.bias else None
        return grad_x, grad_w, grad_b, None, None, None


class ColumnParallelLinear(nn.Module):
    """This rank's rows of a linear (output features split over t / replicas, in blocks as `rows` deals them)."""

    def __init__(self, linear: nn.Linear, t: int, rank: int, rows: Rows, group: Any,
                 seq_dim: int | None = None) -> None:
        super().__init__()
        self.t, self.rows, self.group = t, rows, group
        self.seq_dim = seq_dim  # the input is split along this dim (sequence parallelism): gathered here
        mine = shard_rows(linear.out_features, t // rows.replicas, rank // rows.replicas, rows.groups, rows.segments)
        self.weight = nn.Parameter(linear.weight.detach()[mine].clone())
        self.bias = nn.Parameter(linear.bias.detach()[mine].clone()) if linear.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.seq_dim is not None:
            return _GatheredLinear.apply(x, self.weight, self.bias, self.seq_dim, self.group)
        return F.linear(_CopyToTP.apply(x, self.group), self.weight, self.bias)

    def full(self, local: torch.Tensor) -> torch.Tensor:
        """The whole weight (or bias) from every rank's `local` shard, in the model's row order."""
        return gather_rows(local, self.t, self.rows, self.group)


class RowParallelLinear(nn.Module):
    """This rank's input columns of a linear; the partial outputs are summed over the group, then the bias."""

    def __init__(self, linear: nn.Linear, t: int, rank: int, group: Any, seq_dim: int | None = None) -> None:
        super().__init__()
        self.t, self.group, self.seq_dim = t, group, seq_dim  # seq_dim: reduce-scatter along it (SP)
        cols = linear.in_features // t
        self.weight = nn.Parameter(linear.weight.detach()[:, rank * cols:(rank + 1) * cols].clone())
        self.bias = nn.Parameter(linear.bias.detach().clone()) if linear.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        out = (_ReduceFromTP.apply(out, self.group) if self.seq_dim is None
               else _SeqOp.apply(out, "reduce_scatter", self.seq_dim, self.group))
        return out + self.bias if self.bias is not None else out

    def full(self, local: torch.Tensor) -> torch.Tensor:
        if local.dim() == 1:
            return local  # the bias is whole on every rank
        return gather_cols(local, self.t, self.group)


def apply_shards(piece: fx.GraphModule, rewrites: list, colwise: dict[str, Rows], styles: dict[str, str],
                 paths: dict[int, str], t: int, rank: int, group: Any) -> tuple[dict[str, nn.Module], list, list]:
    """Rewrite `piece` as planned; returns {module path: its parallel replacement}, the (parameter, ranks)
    whose gradients are partial sums over each `ranks` consecutive tensor-parallel ranks (a weight applied to
    part of the sequence: all t; a replicated kv head: its replicas), and the (path, style, rows) of weights the
    piece reads as inputs, for the caller to shard."""
    gathered, row_seq, partial, bias_of, attr_partial = {}, {}, [], [], []
    weights: list[tuple[str, str, Rows]] = []  # exported graphs: (path, style, rows) of weights to shard
    for entry in rewrites:
        if isinstance(entry[0], str):
            what = entry[0]
            if what == "weight":  # a linear reading its weight (and bias) as inputs, on dim's sequence shard if any
                _, path, node, dim = entry
                _exported_linear(piece, node, styles[path], dim, group)
                weights.append((path, styles[path], colwise.get(path, Rows())))
                continue
            if what == "partial_attr":  # a weight the stage reads as an attribute, applied to part of the sequence
                attr_partial.append(entry[1])
                continue
            if what == "replicated_linear":  # gathers its sequence-parallel input, keeps only this rank's part
                _, node, dim = entry
                if node.op == "call_module":
                    swap(piece, node, _GatheredReplicatedLinear(piece.get_submodule(str(node.target)), dim, group),
                         (node.args[0],))
                else:
                    swap(piece, node, _GatheredLinearOp(dim, group, replicated=True), tuple(node.args[:3]))
                continue
            if what == "wrap":
                _, consumer, arg, kind, dim = entry
                consumer.replace_input_with(arg, call(piece, SeqParallel(kind, dim, group), (arg,), before=consumer))
            elif what == "gathered":
                gathered[entry[1]] = entry[2]
            elif what == "row_sp":
                row_seq[entry[1]] = entry[2]
            elif what == "partial":
                partial.append((entry[1], t))
            elif what == "partial_bias":
                bias_of.append(entry[1])
            elif what == "shape":
                _, node, dim = entry
                swap(piece, node, GlobalShape(dim, t), (node.args[0],))
            continue
        node, setter, new = entry
        out = []
        for a in (new if isinstance(new, list) else [new]):
            if isinstance(a, Div):
                with piece.graph.inserting_before(node):
                    a = piece.graph.call_function(operator.floordiv, (a.arg, t))
            out.append(a)
        setter(out if isinstance(new, list) else out[0])
    done: dict[str, nn.Module] = {}
    for node in piece.graph.nodes:
        if node.op != "call_module":
            continue
        linear = piece.get_submodule(str(node.target))
        path = paths.get(id(linear))
        if path not in styles:
            continue
        rows = colwise.get(path, Rows())
        module = (ColumnParallelLinear(linear, t, rank, rows, group, gathered.get(path))
                  if styles[path] == "colwise" else RowParallelLinear(linear, t, rank, group, row_seq.get(path)))
        if styles[path] == "colwise" and rows.replicas > 1:  # each replica sees only its ranks' queries
            partial.extend((p, rows.replicas) for p in module.parameters())
        parent, _, name = str(node.target).rpartition(".")
        setattr(piece.get_submodule(parent) if parent else piece, name, module)
        done[path] = module
        if path in bias_of and module.bias is not None:
            partial.append((module.bias, t))
    piece.recompile()
    return done, partial, weights, attr_partial


class _GatheredLinearOp(nn.Module):
    """A linear whose weight (and bias) are inputs (an exported graph's, a tied LM head's) on a sequence-parallel
    input: column-parallel, or `replicated` (whole on every rank)."""

    def __init__(self, dim: int, group: Any, replicated: bool = False) -> None:
        super().__init__()
        self.dim, self.group, self.replicated = dim, group, replicated

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return _GatheredLinear.apply(x, weight, bias, self.dim, self.group, self.replicated)


class _GatheredReplicatedLinear(nn.Module):
    """An nn.Linear outside the tensor-parallel layout (whole on every rank) reading a sequence-parallel input."""

    def __init__(self, linear: nn.Linear, dim: int, group: Any) -> None:
        super().__init__()
        self.linear, self.dim, self.group = linear, dim, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _GatheredLinear.apply(x, self.linear.weight, self.linear.bias, self.dim, self.group, True)


def _exported_linear(piece: fx.GraphModule, node: fx.Node, style: str, dim: int | None, group: Any) -> None:
    """Megatron's collectives around ``aten.linear(x, w[, b])`` whose w (and b) are this rank's shards: a column-
    parallel one gets f before it (or gathers a sequence-parallel input itself); a row-parallel one is followed by
    g (or a reduce-scatter along dim), its bias added after the reduction, once."""
    if style == "colwise":
        if dim is None:
            node.replace_input_with(node.args[0], call(piece, TensorParallelOp("f", group), (node.args[0],), before=node))
        else:
            swap(piece, node, _GatheredLinearOp(dim, group), tuple(node.args[:3]))
        return
    bias = node.args[2] if len(node.args) > 2 else None
    node.args = tuple(node.args[:2])
    reduce = TensorParallelOp("g", group) if dim is None else SeqParallel("reduce_scatter", dim, group)
    reduced = out = call(piece, reduce, (node,), after=node)
    if bias is not None:
        with piece.graph.inserting_after(reduced):
            out = piece.graph.call_function(operator.add, (reduced, bias))
    node.replace_all_uses_with(out, delete_user_cb=lambda u: u is not reduced)
