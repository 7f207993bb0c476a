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
applied to a split tensor makes ``plan_shards`` return a Refusal naming it, and the plan is refused (at plan time:
planner/runtime/stage.py tensor_parallel_refusal).

Under sequence parallelism the values between the split linears hold 1/t of the sequence (``SeqParallel``).
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from passes.costs import node_kind

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "Rows", "SeqParallel", "TensorParallelOp", "plan_shards",
           "apply_shards", "gather_rows", "gather_cols", "shard_rows"]

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


def gather_rows(local: torch.Tensor, t: int, groups: int, group: Any, replicas: int = 1) -> torch.Tensor:
    """The whole tensor from every rank's rows (taken in `groups` strided blocks), in the model's order; rows
    held by `replicas` consecutive ranks each (kv heads fewer than t) are taken once."""
    parts = [torch.empty_like(local) for _ in range(t)]
    dist.all_gather(parts, local.contiguous(), group=group)
    parts, t = parts[::replicas], t // replicas
    n = local.shape[0] * t
    out = torch.empty((n, *local.shape[1:]), dtype=local.dtype, device=local.device)
    for r, part in enumerate(parts):
        out[shard_rows(n, t, r, groups)] = part
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


def shard_rows(n: int, t: int, rank: int, groups: int) -> torch.Tensor:
    """Indices of this rank's rows of an output dimension of n laid out as `groups` blocks of heads."""
    per = n // groups
    return torch.cat([torch.arange(g * per + rank * per // t, g * per + (rank + 1) * per // t) for g in range(groups)])


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


@dataclass(slots=True)
class Rows:
    """How a column-parallel linear's output rows are dealt: in `groups` strided blocks (a fused q|k|v), each
    shard held by `replicas` consecutive ranks (grouped-query attention with fewer kv heads than t)."""

    groups: int = 1
    replicas: int = 1


class ColumnParallelLinear(nn.Module):
    """This rank's rows of a linear (output features split over t / replicas, in `rows.groups` strided blocks)."""

    def __init__(self, linear: nn.Linear, t: int, rank: int, rows: Rows, group: Any,
                 seq_dim: int | None = None) -> None:
        super().__init__()
        self.t, self.groups, self.replicas, self.group = t, rows.groups, rows.replicas, group
        self.seq_dim = seq_dim  # the input is split along this dim (sequence parallelism): gathered here
        rows = shard_rows(linear.out_features, t // rows.replicas, rank // rows.replicas, rows.groups)
        self.weight = nn.Parameter(linear.weight.detach()[rows].clone())
        self.bias = nn.Parameter(linear.bias.detach()[rows].clone()) if linear.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.seq_dim is not None:
            return _GatheredLinear.apply(x, self.weight, self.bias, self.seq_dim, self.group)
        return F.linear(_CopyToTP.apply(x, self.group), self.weight, self.bias)

    def full(self, local: torch.Tensor) -> torch.Tensor:
        """The whole weight (or bias) from every rank's `local` shard, in the model's row order."""
        return gather_rows(local, self.t, self.groups, self.group, self.replicas)


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


class _Unsupported(Exception):
    """An op on a sharded tensor the rules do not know: "node name" or "node name: why"."""


@dataclass(frozen=True, slots=True)
class Refusal:
    """Where the Megatron layout's rules stop: the piece's node and why."""

    node: fx.Node | None
    why: str


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
                t: int, heads: set[int], colwise: dict[str, Rows], inputs: list, sp: bool = False,
                leaving: frozenset[int] = frozenset(), weights: dict[str, str] | None = None) -> tuple[list, list] | Refusal:
    """How to shard `piece`: its argument rewrites, and per output which dim is sharded (and from which
    column-parallel linear), given the same for its inputs; row groups of column-parallel linears go into
    `colwise`. A Refusal where an op on a sharded tensor is not one the rules know. Changes nothing."""
    try:
        return _propagate(piece, shapes, styles, paths, t, heads, colwise, inputs, sp, leaving, weights)
    except _Unsupported as exc:
        name = str(exc).split(":")[0]
        return Refusal(node=next((n for n in piece.graph.nodes if n.name == name), None), why=str(exc))


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


def call(piece: fx.GraphModule, module: nn.Module, args: tuple, *, before: fx.Node | None = None,
         after: fx.Node | None = None, prefix: str = "_sp") -> fx.Node:
    """`module` added to `piece` under a fresh name, and a call of it on `args` next to a node."""
    name = f"{prefix}{len(list(piece.named_children()))}"
    piece.add_submodule(name, module)
    with piece.graph.inserting_before(before) if before is not None else piece.graph.inserting_after(after):
        return piece.graph.call_module(name, args)


def swap(piece: fx.GraphModule, node: fx.Node, module: nn.Module, args: tuple, prefix: str = "_sp") -> None:
    """Make `node` a call of `module` on `args`, in place: later rewrites that name the node (a replicated head's
    output scattered again into the sequence) find it still."""
    name = f"{prefix}{len(list(piece.named_children()))}"
    piece.add_submodule(name, module)
    node.op, node.target, node.kwargs = "call_module", name, {}
    node.args = args


ALONG = {"softmax", "log_softmax", "cumsum", "cumprod", "flip"}
"""Ops that work along given dims (each slice of the others on its own): a split on another dim passes through."""
NORMS = {"layer_norm", "LayerNorm", "rms_norm", "RMSNorm", "LlamaRMSNorm", "dropout", "Dropout", "Identity"}
SEQ_POINTWISE = {"pow", "rsqrt", "mean", "to"}  # a norm written out (exported graphs): per position (mean: of h)


def _propagate(piece: fx.GraphModule, shapes: dict[str, tuple[int, ...]], styles: dict[str, str],
               paths: dict[int, str], t: int, heads: set[int], colwise: dict[str, Rows], inputs: list,
               sp: bool = False, leaving: frozenset[int] = frozenset(), weights: dict[str, str] | None = None):
    """Walk the piece in order, tracking which values are split and how: ("tp", dim, linear) between a
    column- and a row-parallel linear, ("seq", dim) in a sequence-parallel region. Returns the rewrites and the
    state of each output; raises _Unsupported on an op it cannot place."""
    hidden = {shapes[ph][1] for ph, path in (weights or {}).items()  # what the column-parallel linears read
              if styles.get(path) == "colwise" and isinstance(shapes.get(ph), tuple) and len(shapes[ph]) == 2}
    sharded: dict[str, int] = {}  # node -> its sharded dim (global shape from the meta pass)
    source: dict[str, str] = {}  # sharded node -> the column-parallel linear it comes from
    seq: dict[str, int] = {}  # node -> its sequence dim, split over t (sequence parallelism)
    tuples: dict[str, int] = {}  # unbind/split result -> sharded dim of its items
    factor: dict[str, int] = {}  # sharded node -> row groups its source's features were split into before it
    local: set[str] = set()  # ints read off sharded tensors: already this rank's sizes
    rewrites: list = []
    graph = piece.graph
    outputs: list = []
    for ph, given in zip((n for n in graph.nodes if n.op == "placeholder"), inputs):
        if given is not None and given[0] == "tp":
            sharded[ph.name], source[ph.name] = given[1], given[2]
        elif given is not None:
            seq[ph.name] = given[1]

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

    def group_of(node: fx.Node, g: int, replicas: int = 1) -> None:
        src, g = source[node.name], g * factor.get(node.name, 1)
        rows = colwise.setdefault(src, Rows(g, replicas))
        if (rows.groups, rows.replicas) != (g, replicas):
            raise _Unsupported(f"{src}: rows needed in {rows.groups} and {g} groups")

    def seq_dim(n: fx.Node) -> int:
        dims = shape(n)
        if len(dims) < 2 or dims[1] % t:
            raise _Unsupported(f"{n.name}: no sequence dim to split")
        return 1  # traced models are batch-first: (b, s, ...)

    for n in list(graph.nodes):
        if n.op in ("placeholder", "get_attr"):
            continue
        if n.op == "output":
            if any(a.name in tuples for a in n.all_input_nodes):
                raise _Unsupported("a sharded tuple leaves the piece")
            results = n.args[0] if isinstance(n.args[0], (tuple, list)) else (n.args[0],)
            for k, a in enumerate(results):
                name = a.name if isinstance(a, fx.Node) else None
                if name in sharded:
                    if k in leaving:
                        raise _Unsupported("a tensor-parallel shard leaves the stage")
                    outputs.append(("tp", sharded[name], source[name]))
                elif name in seq and k in leaving:
                    rewrites.append(("wrap", n, a, "gather", seq[name]))
                    outputs.append(None)
                else:
                    outputs.append(("seq", seq[name]) if name in seq else None)
            continue
        kind = node_kind(n, piece)
        module = piece.get_submodule(str(n.target)) if n.op == "call_module" else None
        path = paths.get(id(module)) if module is not None else None
        exported = kind == "linear_fn" and bool(weights) and getattr(n.args[1], "name", None) in weights
        if exported:  # an exported graph's linear: its weight (and bias) are inputs, sharded by the caller
            path = weights[n.args[1].name]
        ins = [a for a in n.all_input_nodes if a.name in sharded]
        in_seq = [a for a in n.all_input_nodes if a.name in seq]
        if path in styles:
            if styles[path] == "colwise":
                if ins:
                    raise _Unsupported(f"{path} reads a sharded input")
                dims = [seq[a.name] for a in in_seq]
                x0 = n.args[0] if isinstance(n.args[0], fx.Node) else None
                if sp and not in_seq and x0 is not None and len(shape(x0)) == 3 and shape(x0)[1] % t == 0:
                    # the whole sequence (a replicated linear's output, ALBERT's shared layer called first on it):
                    # this rank's part joins the split, so every call of the module reads the sequence so
                    rewrites.append(("wrap", n, x0, "scatter", 1))
                    dims = [1]
                if exported:
                    rewrites.append(("weight", path, n, dims[0] if dims else None))
                for d in dims:  # the sequence, all-gathered into the tensor-parallel region by the linear
                    rewrites.append(("gathered", path, d))
                sharded[n.name], source[n.name] = len(shape(n)) - 1, path
            else:
                if len(ins) != 1 or sharded[ins[0].name] != len(shape(ins[0])) - 1:
                    raise _Unsupported(f"{path}: its input is not split on the features")
                if sp:  # reduce-scattered along the sequence instead of all-reduced; its bias added to a part
                    seq[n.name] = seq_dim(n)
                    rewrites.append(("row_sp", path, seq[n.name]))
                    rewrites.append(("partial_bias", path))
                if exported:
                    rewrites.append(("weight", path, n, seq.get(n.name)))
                    if sp and len(n.args) > 2 and isinstance(n.args[2], fx.Node):
                        rewrites.append(("partial_attr", f"{path}.bias"))
            continue
        if n.op == "call_function" and n.target is operator.getitem and n.args[0].name in tuples:
            sharded[n.name], source[n.name] = tuples[n.args[0].name], source[n.args[0].name]
            if n.args[0].name in factor:
                factor[n.name] = factor[n.args[0].name]
            continue
        if kind in ("assert_tensor_metadata", "sym_size"):  # checks dtype and device only / reads the batch
            continue
        if kind in ("getattr", "size") or (n.op == "call_function" and n.target is getattr):
            if n.args[0].name in sharded:
                local.add(n.name)
            elif n.args[0].name in seq:  # the code reads the whole sequence's shape
                if not (n.target is getattr and n.args[1] == "shape") and kind != "size":
                    raise _Unsupported(n.name)
                rewrites.append(("shape", n, seq[n.args[0].name]))
            continue
        if n.op == "call_function" and n.target is operator.getitem and n.args[0].name in local:
            local.add(n.name)
            continue
        if sp and not in_seq and not ins and (kind in NORMS or kind in SEQ_POINTWISE) and n.all_input_nodes:
            x0 = n.all_input_nodes[0]  # a norm, or the first op of one written out on the residual stream (export)
            x_shape = shapes.get(x0.name)
            if isinstance(x_shape, tuple) and len(x_shape) == 3 and x_shape[1] % t == 0 and \
                    (kind in NORMS or x_shape[2] in hidden):
                rewrites.append(("wrap", n, x0, "scatter", 1))  # the sequence-parallel region starts here
                seq[n.name] = 1
                if module is not None:
                    rewrites.extend(("partial", p) for p in module.parameters())
                continue
        if in_seq and not ins:
            others = [a for a in n.all_input_nodes if a.name not in seq and isinstance(shapes.get(a.name), tuple)]
            if kind in NORMS or kind in ELEMENTWISE or kind in SEQ_POINTWISE:
                dim = seq[in_seq[0].name]
                if any(seq[a.name] != dim for a in in_seq) or kind == "mean" and len(n.args) > 1 and \
                        any(d % len(shape(in_seq[0])) == dim for d in (n.args[1] if isinstance(n.args[1], (list, tuple))
                                                                       else [n.args[1]])):
                    raise _Unsupported(n.name)
                out = shape(n)
                for a in others:  # a replicated operand spanning the sequence joins the split
                    o = shapes[a.name]
                    idx = len(o) - (len(out) - dim)
                    if idx >= 0 and o[idx] == out[dim] > 1:
                        rewrites.append(("wrap", n, a, "scatter", idx))
                    if a.op == "get_attr":  # a weight applied to part of the sequence: partial gradient
                        rewrites.append(("partial", operator.attrgetter(str(a.target))(piece)))
                    elif weights and a.name in weights:  # one the stage reads as an attribute (exported graphs)
                        rewrites.append(("partial_attr", f"{weights[a.name]}.weight"))
                seq[n.name] = dim
                if module is not None:
                    rewrites.extend(("partial", p) for p in module.parameters())
                continue
            if kind == "slice" and n.args[1] % len(shape(in_seq[0])) != seq[in_seq[0].name]:
                seq[n.name] = seq[in_seq[0].name]  # a slice along another dim keeps the split
                continue
            if kind in ("linear", "linear_fn") and in_seq == [n.args[0]]:  # a weight outside the layout (LM head)
                rewrites.append(("replicated_linear", n, seq[n.args[0].name]))  # (its gradient: the whole
                continue  # sequence's on every rank)
            for a in in_seq:  # anything else sees the whole sequence
                rewrites.append(("wrap", n, a, "gather", seq[a.name]))
            continue
        if not ins:
            continue
        if in_seq:
            raise _Unsupported(f"{n.name}: mixes a tensor-parallel shard and a sequence shard")
        x = ins[0]
        dim = sharded[x.name]
        if kind in ("view", "reshape"):
            i_shape, o_shape, replicas = shape(x), shape(n), 1
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
                j, g = cands[0], math.prod(o_shape[j:cands[0]])
                replicas = t // o_shape[j] if o_shape[j] < t and t % o_shape[j] == 0 else 1
                group_of(x, g, replicas)  # fewer kv heads than t: each rank keeps one whole head (replicated)
            args, setter = _size_args(n)
            new = list(args)
            new[j] = 1 if replicas > 1 and args[j] != -1 else divided(args[j], n)
            rewrites.append((n, setter, new))
            sharded[n.name] = j
        elif kind == "permute":
            dims = [d % len(shape(x)) for d in (n.args[1] if isinstance(n.args[1], (tuple, list)) else n.args[1:])]
            sharded[n.name] = dims.index(dim)
        elif kind == "transpose":
            a, b = (d % len(shape(x)) for d in n.args[1:3])
            sharded[n.name] = b if dim == a else a if dim == b else dim
        elif kind in ("slice", "cat", "unsqueeze", "squeeze"):
            along = n.args[1] if kind in ("slice", "unsqueeze", "squeeze") and len(n.args) > 1 else \
                n.args[1] if kind == "cat" and len(n.args) > 1 else n.kwargs.get("dim", 0)
            along = along % (len(shape(n)) if kind == "unsqueeze" else len(shape(x)))
            if along == dim or kind == "squeeze" and shape(x)[dim] == 1:
                raise _Unsupported(n.name)
            sharded[n.name] = dim + (kind == "unsqueeze" and along <= dim) - (kind == "squeeze" and along < dim)
        elif kind == "unbind":
            along = (n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)) % len(shape(x))
            if along == dim:
                raise _Unsupported(n.name)
            tuples[n.name] = dim - (along < dim)
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
                factor[n.name] = factor.get(x.name, 1) * (shape(x)[dim] // whole)  # q | k | v, each of its heads
            tuples[n.name] = dim
        elif kind == "flatten":  # (..., heads, head_dim) merged back into features: the heads dim leads
            start, end = (_dims(n, 1, 0), _dims(n, 2, -1))
            start, end = start % len(shape(x)), end % len(shape(x))
            if start < dim <= end:
                raise _Unsupported(f"{n.name}: merges a split dim into the one before it")
            sharded[n.name] = dim if dim <= start else dim - (end - start)
        elif kind == "repeat_interleave":  # grouped keys/values repeated for the heads: each rank its own heads'
            along, repeats = _dims(n, 2, None), n.args[1] if len(n.args) > 1 else n.kwargs.get("repeats")
            if along is None or not isinstance(repeats, int):
                raise _Unsupported(f"{n.name}: repeats of a flattened or per-element count")
            replicas = colwise[source[x.name]].replicas if source[x.name] in colwise else 1
            if along % len(shape(x)) == dim and replicas > 1:  # one whole kv head on each of `replicas` ranks:
                if repeats % replicas:  # repeated for this rank's heads
                    raise _Unsupported(f"{n.name}: {repeats} repeats over {replicas} ranks of one kv head")
                rewrites.append((n, lambda new, n=n: _set_arg(n, 1, "repeats", new), repeats // replicas))
            sharded[n.name] = dim
        elif kind in ALONG:  # per slice along dim(s): any but the split one
            along = _dims(n, 1, -1)
            along = along if isinstance(along, (tuple, list)) else [along]
            if any(not isinstance(d, int) or d % len(shape(x)) == dim for d in along):
                raise _Unsupported(f"{n.name}: {kind} along the split dim")
            sharded[n.name] = dim
        elif kind == "getitem" and n.args[0] is x:  # indexing: ints drop dims, full slices keep them, None adds one
            sharded[n.name] = _indexed_dim(n, dim, len(shape(x)))
        elif kind in ("matmul", "attention", "ContextParallelAttention") or kind in ELEMENTWISE:
            rank_ = len(shape(x))
            for other in n.all_input_nodes:
                if other in ins or other.name in local or not isinstance(shapes.get(other.name), tuple):
                    continue
                o = shapes[other.name]
                if len(o) >= rank_ - dim and o[len(o) - (rank_ - dim)] == shape(x)[dim] > 1:
                    raise _Unsupported(f"{n.name}: a replicated operand spans the sharded dim")
            if kind == "matmul" and len(ins) == 1 and dim >= rank_ - 2:
                raise _Unsupported(f"{n.name}: product over a sharded dim")
            sharded[n.name] = dim
        else:
            raise _Unsupported(f"{n.name}: {kind}")
        source.setdefault(n.name, source[x.name])
    return rewrites, outputs


def _dims(n: fx.Node, i: int, default: Any) -> Any:
    """Positional argument i of a node (a dim), else its keyword (dim, dims, start_dim, end_dim), else the default."""
    if len(n.args) > i:
        return n.args[i]
    names = {1: ("dim", "dims", "start_dim"), 2: ("dim", "end_dim")}.get(i, ())
    return next((n.kwargs[k] for k in names if k in n.kwargs), default)


def _set_arg(n: fx.Node, i: int, key: str, value: Any) -> None:
    if len(n.args) > i:
        n.args = (*n.args[:i], value, *n.args[i + 1:])
    else:
        n.kwargs = {**n.kwargs, key: value}


def _indexed_dim(n: fx.Node, dim: int, ndim: int) -> int:
    """Where the split dim `dim` of an `ndim`-dim tensor lands after indexing it with the node's index; raises
    _Unsupported when the index selects within that dim."""
    index = n.args[1] if isinstance(n.args[1], tuple) else (n.args[1],)
    if any(i is Ellipsis for i in index):
        at = index.index(Ellipsis)
        fill = ndim - sum(1 for i in index if i is not None and i is not Ellipsis)
        index = (*index[:at], *([slice(None)] * fill), *index[at + 1:])
    src, out = 0, 0
    for i in index:
        if i is None:
            out += 1
            continue
        if src == dim:
            if not (isinstance(i, slice) and i == slice(None)):
                raise _Unsupported(f"{n.name}: indexes the split dim")
            return out
        if isinstance(i, int):
            src += 1
        elif isinstance(i, slice):
            src, out = src + 1, out + 1
        else:
            raise _Unsupported(f"{n.name}: index {i!r}")
    return out + (dim - src)
