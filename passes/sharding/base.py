"""The state a tensor-parallel split is tracked in, walking a graph op by op, and the record of one op's rule."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch.fx as fx
from torch import nn

__all__ = ["Div", "Refuse", "Rows", "Rule", "Split", "call", "register", "shard_rows", "swap", "unregister"]


class Refuse(Exception):
    """An op a split cannot pass: "node name" or "node name: why"."""


class Div:
    """A size node to divide by t, inserted when the rewrite is applied (a global size read off a replicated
    tensor that sizes a split dim)."""

    __slots__ = ("arg",)

    def __init__(self, arg: fx.Node) -> None:
        self.arg = arg


@dataclass(slots=True)
class Rows:
    """How a column-parallel linear's output rows are dealt: in `groups` strided blocks (a fused q|k|v cut by
    `split`), or in blocks of the given `segments` sizes (a fused q|k|v of unequal parts sliced apart, Phi-3's
    qkv_proj with grouped kv heads), each block split over the ranks; each shard held by `replicas` consecutive
    ranks (grouped-query attention with fewer kv heads than t)."""

    groups: int = 1
    replicas: int = 1
    segments: tuple[int, ...] = ()


def shard_rows(n: int, t: int, rank: int, groups: int, segments: tuple[int, ...] = ()) -> Any:
    """Indices of this rank's rows of an output dimension of n laid out as `groups` equal blocks (or blocks of
    `segments` sizes), each split over t."""
    import torch

    sizes = segments or (n // groups,) * groups
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return torch.cat([torch.arange(s + rank * m // t, s + (rank + 1) * m // t) for s, m in zip(starts, sizes)])


def size_args(node: fx.Node) -> tuple[list[Any], Callable[[list[Any]], None]]:
    """The size arguments of a view/reshape/expand and a setter writing them back."""
    if len(node.args) == 2 and isinstance(node.args[1], (tuple, list)):
        return list(node.args[1]), lambda new: setattr(node, "args", (node.args[0], tuple(new)))
    return list(node.args[1:]), lambda new: setattr(node, "args", (node.args[0], *new))


def dims_arg(n: fx.Node, i: int, default: Any) -> Any:
    """Positional argument i of a node (a dim), else its keyword (dim, dims, start_dim, end_dim), else the default."""
    if len(n.args) > i:
        return n.args[i]
    names = {1: ("dim", "dims", "start_dim"), 2: ("dim", "end_dim")}.get(i, ())
    return next((n.kwargs[k] for k in names if k in n.kwargs), default)


def set_arg(n: fx.Node, i: int, key: str, value: Any) -> None:
    if len(n.args) > i:
        n.args = (*n.args[:i], value, *n.args[i + 1:])
    else:
        n.kwargs = {**n.kwargs, key: value}


@dataclass
class Split:
    """A tensor-parallel split being walked through a graph (Megatron's layout: the features between a column- and
    a row-parallel linear held 1/t per rank). Node names map to global shapes (`shapes`, from a meta pass); a rule
    reads them and records what it decides: the split dim of its output (`sharded`), the arguments to rewrite for
    the shard (`rewrites`: (node, setter, new value), a `Div` where a size node must be divided by t), and how the
    source linear's rows must be dealt (`colwise`)."""

    shapes: dict[str, Any]
    t: int
    heads: set[int]
    colwise: dict[str, Rows]
    sharded: dict[str, int] = field(default_factory=dict)  # node -> its split dim
    source: dict[str, str] = field(default_factory=dict)  # split node -> the column-parallel linear it comes from
    tuples: dict[str, int] = field(default_factory=dict)  # unbind/split result -> the split dim of its items
    factor: dict[str, int] = field(default_factory=dict)  # node -> row groups its source was cut into before it
    segments: set[str] = field(default_factory=set)  # nodes holding one segment of their source's rows
    local: set[str] = field(default_factory=set)  # ints read off split tensors: this rank's sizes already
    rewrites: list = field(default_factory=list)

    def shape(self, n: fx.Node) -> tuple[int, ...]:
        if not isinstance(self.shapes.get(n.name), tuple):
            raise Refuse(n.name)
        return self.shapes[n.name]

    def divided(self, arg: Any, node: fx.Node) -> Any:
        """arg / t: an int, or a node dividing a global size read off a replicated tensor."""
        if isinstance(arg, int):
            if arg == -1:
                return arg
            if arg % self.t:
                raise Refuse(f"{node.name}: size {arg} does not divide by {self.t}")
            return arg // self.t
        if isinstance(arg, fx.Node):
            return arg if arg.name in self.local else Div(arg)
        raise Refuse(node.name)

    def group_of(self, node: fx.Node, g: int, replicas: int = 1) -> None:
        """The source's rows must come in g strided groups (times the groups it was cut into before), each held by
        `replicas` ranks."""
        src = self.source[node.name]
        if node.name in self.segments:  # one segment of a sliced fused projection: its rows are dealt already
            if g != 1 or replicas != 1:
                raise Refuse(f"{src}: a slice of it is cut into {g} groups over {replicas} ranks")
            return
        g *= self.factor.get(node.name, 1)
        rows = self.colwise.setdefault(src, Rows(g, replicas))
        if (rows.groups, rows.replicas, rows.segments) != (g, replicas, ()):
            raise Refuse(f"{src}: rows needed in {rows.groups} and {g} groups")

    def passes(self, n: fx.Node, x: fx.Node, dim: int) -> None:
        """n's output is split on `dim`, from x's source."""
        self.sharded[n.name] = dim
        self.source.setdefault(n.name, self.source[x.name])


@dataclass(frozen=True, slots=True)
class Rule:
    """How a tensor-parallel split of one operand passes through an op (by `passes.costs.node_kind` name).

    `split(state, node, x, dim, kind)`: `x` is the node's split operand, split on `dim`; the rule records the node's split
    (`state.passes` or `state.tuples`) and any rewrite of its arguments for the shard, or raises `Refuse`. Every rule
    here costs no communication: the collectives of Megatron's layout sit at the region's edges (the column-parallel
    linear's input gradient, the row-parallel linear's output), which passes/tp.py prices per region."""

    kinds: tuple[str, ...]
    split: Callable[[Split, fx.Node, fx.Node, int, str], None]
    help: str


RULES: dict[str, Rule] = {}


def register(rule: Rule) -> Rule:
    for kind in rule.kinds:
        if kind in RULES and RULES[kind] is not rule:
            raise ValueError(f"op kind {kind!r} already has a sharding rule ({RULES[kind].help})")
        RULES[kind] = rule
    return rule


def unregister(rule: Rule) -> None:
    for kind in rule.kinds:
        if RULES.get(kind) is rule:
            del RULES[kind]


# -- inserting modules into a piece's graph (the runtime's rewrites) -------------------------------------------

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
