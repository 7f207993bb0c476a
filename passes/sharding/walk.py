"""Walking a graph with the sharding rules: which values a tensor-parallel split (Megatron's layout) and sequence
parallelism leave split, and how, from the plan's column- and row-parallel linears; what to rewrite for the rank's
shard; or the first op no rule places (a `Refusal`). The runtime applies what it returns
(planner/runtime/megatron_tp.py `apply_shards`); the planner walks the same graph at trace time (passes/sharding/
check.py) so the search never proposes a split the runtime refuses. Nothing here changes the graph."""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch.fx as fx

from ..costs import node_kind
from . import rule_for
from .base import Refuse, Rows, Split
from .ops import ELEMENTWISE, PER_POSITION, SEQ_POINTWISE

__all__ = ["Refusal", "plan_shards"]


@dataclass(frozen=True, slots=True)
class Refusal:
    """Where the Megatron layout's rules stop: the piece's node and why."""

    node: fx.Node | None
    why: str


def plan_shards(piece: fx.GraphModule, shapes: dict[str, Any], styles: dict[str, str], paths: dict[int, str],
                t: int, heads: set[int], colwise: dict[str, Rows], inputs: list, sp: bool = False,
                leaving: frozenset[int] = frozenset(), weights: dict[str, str] | None = None) -> tuple[list, list] | Refusal:
    """How to shard `piece`: its argument rewrites, and per output which dim is sharded (and from which
    column-parallel linear), given the same for its inputs; row groups of column-parallel linears go into
    `colwise`. A Refusal where an op on a sharded tensor is not one the rules know. Changes nothing. `weights`: the
    parameters the piece reads as inputs (an exported graph's), {input node: the parameter's name}."""
    try:
        return _propagate(piece, shapes, styles, paths, t, heads, colwise, inputs, sp, leaving, weights)
    except Refuse as exc:
        name = str(exc).split(":")[0]
        return Refusal(node=next((n for n in piece.graph.nodes if n.name == name), None), why=str(exc))


def _propagate(piece: fx.GraphModule, shapes: dict[str, tuple[int, ...]], styles: dict[str, str],
               paths: dict[int, str], t: int, heads: set[int], colwise: dict[str, Rows], inputs: list,
               sp: bool = False, leaving: frozenset[int] = frozenset(), weights: dict[str, str] | None = None):
    """Walk the piece in order, tracking which values are split and how: ("tp", dim, linear) between a
    column- and a row-parallel linear, ("seq", dim) in a sequence-parallel region. Returns the rewrites and the
    state of each output; raises Refuse on an op it cannot place."""
    weights = weights or {}  # input node -> the parameter it is (exported graphs: "layers.0.ln1.bias")
    linears = {ph: target[:-len(".weight")] for ph, target in weights.items() if target.endswith(".weight")}
    hidden = {shapes[ph][1] for ph, path in linears.items()  # what the column-parallel linears read
              if styles.get(path) == "colwise" and isinstance(shapes.get(ph), tuple) and len(shapes[ph]) == 2}
    state = Split(shapes, t, heads, colwise)
    sharded, source, tuples, factor, local, rewrites = (state.sharded, state.source, state.tuples, state.factor,
                                                        state.local, state.rewrites)
    seq: dict[str, int] = {}  # node -> its sequence dim, split over t (sequence parallelism)
    graph = piece.graph
    outputs: list = []
    for ph, given in zip((n for n in graph.nodes if n.op == "placeholder"), inputs):
        if given is not None and given[0] == "tp":
            sharded[ph.name], source[ph.name] = given[1], given[2]
        elif given is not None:
            seq[ph.name] = given[1]
    shape = state.shape

    def seq_dim(n: fx.Node) -> int:
        dims = shape(n)
        if len(dims) < 2 or dims[1] % t:
            raise Refuse(f"{n.name}: no sequence dim to split")
        return 1  # traced models are batch-first: (b, s, ...)

    def partial(n: fx.Node, module: Any, params: list[fx.Node]) -> None:
        """The parameters `n` applies to part of the sequence: their gradients are partial sums over the ranks."""
        if module is not None:
            rewrites.extend(("partial", p) for p in module.parameters())
        for a in params:
            if a.op == "get_attr":
                rewrites.append(("partial", operator.attrgetter(str(a.target))(piece)))
            elif a.name in weights:  # one the stage reads as an attribute (exported graphs)
                rewrites.append(("partial_attr", weights[a.name]))

    for n in list(graph.nodes):
        if n.op in ("placeholder", "get_attr"):
            continue
        if n.op == "output":
            if any(a.name in tuples for a in n.all_input_nodes):
                raise Refuse("a sharded tuple leaves the piece")
            results = n.args[0] if isinstance(n.args[0], (tuple, list)) else (n.args[0],)
            for k, a in enumerate(results):
                name = a.name if isinstance(a, fx.Node) else None
                if name in sharded:
                    if k in leaving:
                        raise Refuse("a tensor-parallel shard leaves the stage")
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
        exported = kind == "linear_fn" and getattr(n.args[1], "name", None) in linears
        if exported:  # an exported graph's linear: its weight (and bias) are inputs, sharded by the caller
            path = linears[n.args[1].name]
        ins = [a for a in n.all_input_nodes if a.name in sharded]
        in_seq = [a for a in n.all_input_nodes if a.name in seq]
        if path in styles:
            if styles[path] == "colwise":
                if ins:
                    raise Refuse(f"{path} reads a sharded input")
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
                    raise Refuse(f"{path}: its input is not split on the features")
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
                    raise Refuse(n.name)
                rewrites.append(("shape", n, seq[n.args[0].name]))
            continue
        if n.op == "call_function" and n.all_input_nodes and all(a.name in local for a in n.all_input_nodes) and \
                (n.target is operator.getitem or kind in ("mul", "add", "sub", "floordiv")):
            local.add(n.name)  # a size read off a split tensor, or arithmetic of such sizes (kv heads x repeats)
            continue
        if sp and not in_seq and not ins and (kind in PER_POSITION or kind in SEQ_POINTWISE) and n.all_input_nodes:
            x0 = n.all_input_nodes[0]  # a norm, or the first op of one written out on the residual stream (export)
            x_shape = shapes.get(x0.name)
            if isinstance(x_shape, tuple) and len(x_shape) == 3 and x_shape[1] % t == 0 and \
                    (kind in PER_POSITION or x_shape[2] in hidden):
                rewrites.append(("wrap", n, x0, "scatter", 1))  # the sequence-parallel region starts here
                seq[n.name] = 1
                partial(n, module, n.all_input_nodes[1:])
                continue
        if in_seq and not ins:
            others = [a for a in n.all_input_nodes if a.name not in seq and isinstance(shapes.get(a.name), tuple)]
            if kind in PER_POSITION or kind in ELEMENTWISE or kind in SEQ_POINTWISE:
                dim = seq[in_seq[0].name]
                if any(seq[a.name] != dim for a in in_seq) or kind == "mean" and len(n.args) > 1 and \
                        any(d % len(shape(in_seq[0])) == dim for d in (n.args[1] if isinstance(n.args[1], (list, tuple))
                                                                       else [n.args[1]])):
                    raise Refuse(n.name)
                out = shape(n)
                for a in others:  # a replicated operand spanning the sequence joins the split
                    o = shapes[a.name]
                    idx = len(o) - (len(out) - dim)
                    if idx >= 0 and o[idx] == out[dim] > 1:
                        rewrites.append(("wrap", n, a, "scatter", idx))
                seq[n.name] = dim
                partial(n, module, others)  # a weight applied to part of the sequence
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
            raise Refuse(f"{n.name}: mixes a tensor-parallel shard and a sequence shard")
        rule = rule_for(kind)
        if rule is None:
            raise Refuse(f"{n.name}: {kind}")
        rule.split(state, n, ins[0], sharded[ins[0].name], kind)
    return rewrites, outputs

