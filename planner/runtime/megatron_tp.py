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
applied to a sharded tensor makes ``shard_by_heads`` return None, and the caller runs the DTensor path.
"""
from __future__ import annotations

import math
import operator
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from passes.costs import node_kind

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "plan_shards", "apply_shards"]

ELEMENTWISE = {"add", "sub", "mul", "truediv", "div", "masked_fill", "softmax", "gelu", "relu", "silu", "dropout",
               "Dropout", "contiguous", "float", "to", "type_as", "neg", "exp", "tanh", "sigmoid", "clone",
               "GELU", "ReLU", "SiLU", "Identity"}


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


def _rows(n: int, t: int, rank: int, groups: int) -> torch.Tensor:
    """Indices of this rank's rows of an output dimension of n laid out as `groups` blocks of heads."""
    per = n // groups
    return torch.cat([torch.arange(g * per + rank * per // t, g * per + (rank + 1) * per // t) for g in range(groups)])


class ColumnParallelLinear(nn.Module):
    """This rank's rows of a linear (output features split over t, in `groups` strided blocks)."""

    def __init__(self, linear: nn.Linear, t: int, rank: int, groups: int, group: Any) -> None:
        super().__init__()
        self.t, self.rank, self.groups, self.group = t, rank, groups, group
        rows = _rows(linear.out_features, t, rank, groups)
        self.weight = nn.Parameter(linear.weight.detach()[rows].clone())
        self.bias = nn.Parameter(linear.bias.detach()[rows].clone()) if linear.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_CopyToTP.apply(x, self.group), self.weight, self.bias)

    def full(self, local: torch.Tensor) -> torch.Tensor:
        """The whole weight (or bias) from every rank's `local` shard, in the model's row order."""
        parts = [torch.empty_like(local) for _ in range(self.t)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        n = local.shape[0] * self.t
        out = torch.empty((n, *local.shape[1:]), dtype=local.dtype, device=local.device)
        for r, part in enumerate(parts):
            out[_rows(n, self.t, r, self.groups)] = part
        return out


class RowParallelLinear(nn.Module):
    """This rank's input columns of a linear; the partial outputs are summed over the group, then the bias."""

    def __init__(self, linear: nn.Linear, t: int, rank: int, group: Any) -> None:
        super().__init__()
        self.t, self.group = t, group
        cols = linear.in_features // t
        self.weight = nn.Parameter(linear.weight.detach()[:, rank * cols:(rank + 1) * cols].clone())
        self.bias = nn.Parameter(linear.bias.detach().clone()) if linear.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _ReduceFromTP.apply(F.linear(x, self.weight), self.group)
        return out + self.bias if self.bias is not None else out

    def full(self, local: torch.Tensor) -> torch.Tensor:
        if local.dim() == 1:
            return local  # the bias is whole on every rank
        parts = [torch.empty_like(local) for _ in range(self.t)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        return torch.cat(parts, dim=1)


class _Unsupported(Exception):
    pass


def _size_args(node: fx.Node) -> tuple[list[Any], Callable[[list[Any]], None]]:
    """The size arguments of a view/reshape and a setter writing them back."""
    if len(node.args) == 2 and isinstance(node.args[1], (tuple, list)):
        return list(node.args[1]), lambda new: setattr(node, "args", (node.args[0], tuple(new)))
    return list(node.args[1:]), lambda new: setattr(node, "args", (node.args[0], *new))


class _Div:
    """A size node to divide by t, inserted when the rewrite is applied."""

    __slots__ = ("arg",)

    def __init__(self, arg: fx.Node) -> None:
        self.arg = arg


def plan_shards(piece: fx.GraphModule, shapes: dict[str, Any], styles: dict[str, str], paths: dict[int, str],
                t: int, heads: set[int], colwise: dict[str, int], inputs: list[tuple[int, str] | None]
                ) -> tuple[list, list[tuple[int, str] | None]] | None:
    """How to shard `piece`: its argument rewrites, and per output which dim is sharded (and from which
    column-parallel linear), given the same for its inputs; row groups of column-parallel linears go into
    `colwise`. None where an op on a sharded tensor is not one the rules know. Changes nothing."""
    try:
        return _propagate(piece, shapes, styles, paths, t, heads, colwise, inputs)
    except _Unsupported:
        return None


def apply_shards(piece: fx.GraphModule, rewrites: list, colwise: dict[str, int], styles: dict[str, str],
                 paths: dict[int, str], t: int, rank: int, group: Any) -> dict[str, nn.Module]:
    """Rewrite `piece` as planned; returns {module path: its parallel replacement}."""
    for node, setter, new in rewrites:
        out = []
        for a in (new if isinstance(new, list) else [new]):
            if isinstance(a, _Div):
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
        module = (ColumnParallelLinear(linear, t, rank, colwise.get(path, 1), group) if styles[path] == "colwise"
                  else RowParallelLinear(linear, t, rank, group))
        parent, _, name = str(node.target).rpartition(".")
        setattr(piece.get_submodule(parent) if parent else piece, name, module)
        done[path] = module
    piece.recompile()
    return done


def _propagate(piece: fx.GraphModule, shapes: dict[str, tuple[int, ...]], styles: dict[str, str],
               paths: dict[int, str], t: int, heads: set[int], colwise: dict[str, int],
               inputs: list[tuple[int, str] | None]):
    sharded: dict[str, int] = {}  # node -> its sharded dim (global shape from the meta pass)
    source: dict[str, str] = {}  # sharded node -> the column-parallel linear it comes from
    tuples: dict[str, int] = {}  # unbind/split result -> sharded dim of its items
    local: set[str] = set()  # ints read off sharded tensors: already this rank's sizes
    rewrites: list[tuple[fx.Node, Callable, Any]] = []
    graph = piece.graph
    outputs: list[tuple[int, str] | None] = []
    for ph, given in zip((n for n in graph.nodes if n.op == "placeholder"), inputs):
        if given is not None:
            sharded[ph.name], source[ph.name] = given

    def shape(n: fx.Node) -> tuple[int, ...]:
        if not isinstance(shapes.get(n.name), tuple):
            raise _Unsupported(n.name)
        return shapes[n.name]

    def divided(arg: Any, node: fx.Node) -> Any:
        """arg / t: an int, or a node dividing a global size read off a replicated tensor."""
        if isinstance(arg, int):
            if arg == -1:
                return arg
            if arg % t:
                raise _Unsupported(f"{node.name}: size {arg} does not divide by {t}")
            return arg // t
        if isinstance(arg, fx.Node):
            return arg if arg.name in local else _Div(arg)
        raise _Unsupported(node.name)

    def group_of(node: fx.Node, g: int) -> None:
        src = source[node.name]
        if colwise.get(src, g) != g:
            raise _Unsupported(f"{src}: rows needed in {colwise[src]} and {g} groups")
        colwise[src] = g

    for n in list(graph.nodes):
        if n.op in ("placeholder", "get_attr"):
            continue
        if n.op == "output":
            if any(a.name in tuples for a in n.all_input_nodes):
                raise _Unsupported("a sharded tuple leaves the piece")
            results = n.args[0] if isinstance(n.args[0], (tuple, list)) else (n.args[0],)
            outputs = [(sharded[a.name], source[a.name]) if isinstance(a, fx.Node) and a.name in sharded else None
                       for a in results]
            continue
        kind = node_kind(n, piece)
        path = paths.get(id(piece.get_submodule(str(n.target)))) if n.op == "call_module" else None
        ins = [a for a in n.all_input_nodes if a.name in sharded]
        if path in styles:
            if styles[path] == "colwise":
                if ins:
                    raise _Unsupported(f"{path} reads a sharded input")
                sharded[n.name], source[n.name] = len(shape(n)) - 1, path
            else:
                if len(ins) != 1 or sharded[ins[0].name] != len(shape(ins[0])) - 1:
                    raise _Unsupported(f"{path}: its input is not split on the features")
            continue
        if n.op == "call_function" and n.target is operator.getitem and n.args[0].name in tuples:
            sharded[n.name], source[n.name] = tuples[n.args[0].name], source[n.args[0].name]
            continue
        if kind in ("getattr", "size") or (n.op == "call_function" and n.target is getattr):
            if n.args[0].name in sharded:
                local.add(n.name)
            continue
        if n.op == "call_function" and n.target is operator.getitem and n.args[0].name in local:
            local.add(n.name)
            continue
        if not ins:
            continue
        x = ins[0]
        dim = sharded[x.name]
        if kind in ("view", "reshape"):
            i_shape, o_shape = shape(x), shape(n)
            off = math.prod(i_shape[:dim])
            j = next((j for j in range(len(o_shape) + 1) if math.prod(o_shape[:j]) == off), None)
            if j is None or j == len(o_shape):
                raise _Unsupported(n.name)
            if o_shape[j] < i_shape[dim]:  # split into (..., heads, head_dim): shard the heads
                k = next((k for k in range(j, len(o_shape)) if math.prod(o_shape[j:k + 1]) == i_shape[dim]), None)
                if k is None:
                    raise _Unsupported(n.name)
                cands = [d for d in range(j, k + 1) if o_shape[d] in heads] or \
                        [d for d in range(j, k + 1) if o_shape[d] > 1 and o_shape[d] % t == 0]
                if not cands:
                    raise _Unsupported(n.name)
                group_of(x, math.prod(o_shape[j:cands[0]]))
                j = cands[0]
            args, setter = _size_args(n)
            new = list(args)
            new[j] = divided(args[j], n)
            rewrites.append((n, setter, new))
            sharded[n.name] = j
        elif kind == "permute":
            dims = [d % len(shape(x)) for d in (n.args[1] if isinstance(n.args[1], (tuple, list)) else n.args[1:])]
            sharded[n.name] = dims.index(dim)
        elif kind == "transpose":
            a, b = (d % len(shape(x)) for d in n.args[1:3])
            sharded[n.name] = b if dim == a else a if dim == b else dim
        elif kind == "unbind":
            along = (n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)) % len(shape(x))
            if along == dim:
                raise _Unsupported(n.name)
            tuples[n.name], source[n.name] = dim - (along < dim), source[x.name]
        elif kind in ("split", "chunk"):
            along = (n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", 0)) % len(shape(x))
            size = n.args[1]
            if along == dim:
                if kind == "chunk" or not isinstance(size, (int, fx.Node)):
                    raise _Unsupported(n.name)
                whole = shapes.get(size.name) if isinstance(size, fx.Node) else size
                if not isinstance(whole, int) or whole <= 0:
                    raise _Unsupported(n.name)
                group_of(x, shape(x)[dim] // whole)
                rewrites.append((n, lambda new, n=n: setattr(n, "args", (n.args[0], new, *n.args[2:])),
                                 divided(size, n)))
            tuples[n.name], source[n.name] = dim, source[x.name]
        elif kind in ("matmul", "attention") or kind in ELEMENTWISE:
            rank_ = len(shape(x))
            for other in n.all_input_nodes:
                if other in ins or other.name in local or not isinstance(shapes.get(other.name), tuple):
                    continue
                o = shapes[other.name]
                if len(o) >= rank_ - dim and o[len(o) - (rank_ - dim)] == shape(x)[dim] > 1:
                    raise _Unsupported(f"{n.name}: a replicated operand spans the sharded dim")
            if kind == "matmul" and len(ins) == 1 and dim >= rank_ - 2:
                raise _Unsupported(f"{n.name}: product over a sharded dim")
            sharded[n.name], source[n.name] = dim, source[x.name]
        else:
            raise _Unsupported(f"{n.name}: {kind}")
        source.setdefault(n.name, source[x.name])
    return rewrites, outputs
