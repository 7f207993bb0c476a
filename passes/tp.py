"""Tensor-parallel roles of nodes, read from the data flow as Megatron splits a transformer block.

Inside a unit, the nodes between linears form regions (connected through the ops that do not
multiply by a weight). A region is *shardable* when every op in it works per feature or per head:
no normalization or reduction over the full width of the linears feeding it, and no input that
needs a gradient from outside the region other than those linears (the residual stream is one such
input: the region after an output projection, holding the residual add and the next norm, is not
shardable). In a shardable region the linears that feed it are column-parallel (weight split by
output features: q, k, v, gate, up) and the linears it feeds are row-parallel (split by input
features: the attention output projection, down); every op inside works on a 1/t shard. This
holds however many linears a block has (Llama's seven, fused or separate q/k/v, GQA). A region
costs one all-reduce of the row output forward and one of the column input's gradient backward
(thesis 4.3.2: 2+2 per transformer layer).

Outside such regions, the widest linear of a unit whose output is wider than its input and at
least VOCAB_MIN features (the LM head) is column-parallel with a parallel cross-entropy, and a
vocabulary embedding is split by rows and all-reduces its output. Everything else is replicated.

Per unit, the number of attention heads (and key/value heads, fewer under grouped-query attention)
is recorded: tensor parallelism must divide the heads.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch.fx as fx
from torch import nn

from .costs import node_kind
from .meta_keys import COST, MODULE, TP
from .shapes import tensor_info
from .sharding.ops import FEATURE_REDUCTIONS, NORMS

__all__ = ["annotate_tp_roles", "activation_input", "linear_shape", "VOCAB_MIN", "Heads"]

VOCAB_MIN = 1024  # an embedding or head at least this wide is split over the vocabulary


@dataclass(frozen=True, slots=True)
class Heads:
    heads: int = 0  # attention heads of the unit (0: none found)
    kv_heads: int = 0  # key/value heads (= heads without grouped-query attention)
    kv_width: int = 0  # output features of a key or value projection (kv_heads x head dim)


def _param(node: object, gm: fx.GraphModule) -> nn.Parameter | None:
    if isinstance(node, fx.Node) and node.op == "get_attr":
        obj = gm
        for part in str(node.target).split("."):
            obj = getattr(obj, part, None)
        return obj if isinstance(obj, nn.Parameter) else None
    return None


def linear_shape(node: fx.Node, gm: fx.GraphModule) -> tuple[int, int] | None:
    """(in_features, out_features) when `node` multiplies an activation by a weight matrix."""
    kind = node_kind(node, gm)
    if node.op == "call_module" and kind == "linear":
        mod = gm.get_submodule(str(node.target))
        return mod.in_features, mod.out_features
    if kind not in ("linear_fn", "matmul") or node.op != "call_function":
        return None
    name = str(getattr(node.target, "__name__", node.target))
    if kind == "linear_fn":  # F.linear / aten.linear: weight (out, in)
        w = _param(node.args[1], gm) if len(node.args) > 1 else None
        return (w.shape[1], w.shape[0]) if w is not None and w.dim() == 2 else None
    idx = 2 if name.startswith("addmm") else 1  # addmm(bias, x, w) / mm(x, w) / matmul(x, w): weight (in, out)
    w = _param(node.args[idx], gm) if len(node.args) > idx else None
    return (w.shape[0], w.shape[1]) if w is not None and w.dim() == 2 else None


def activation_input(node: fx.Node) -> fx.Node | None:
    """The activation a linear multiplies (not its weight or bias, whatever the argument order)."""
    return next((a for a in node.all_input_nodes if a.op != "get_attr"), None)


def _roots(nodes: list[fx.Node], linears: set[fx.Node]) -> dict[fx.Node, fx.Node]:
    """Union-find over the unit's non-linear nodes, joined along data edges: node -> region root."""
    parent = {n: n for n in nodes if n not in linears and n.op not in ("get_attr", "placeholder", "output")}

    def find(n: fx.Node) -> fx.Node:
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for n in parent:
        for a in n.all_input_nodes:
            if a in parent:
                parent[find(a)] = find(n)
    return {n: find(n) for n in parent}


def _shardable(region: list[fx.Node], sources: set[fx.Node], widths: set[int], gm: fx.GraphModule,
               broadcast: set[fx.Node] = frozenset()) -> bool:
    """Whether the region's ops can each work on 1/t of the features of its sources' outputs; `broadcast`: operands
    from outside it, replicated, that it may read (each rank reads them whole)."""
    inside = set(region)
    for n in region:
        if _reduces_features(n, gm, widths):
            return False
        for a in n.all_input_nodes:
            if a in inside or a in sources or a in broadcast or a.op == "get_attr":
                continue
            ainfo = tensor_info(a)
            if ainfo is not None and ainfo.requires_grad:
                return False
    return True


def _reduces_features(n: fx.Node, gm: fx.GraphModule, widths: set[int]) -> bool:
    """The op normalizes or reduces over features a split would divide: a norm, a reduction over a source's whole
    width, or a normalization written out in ops (an RMSNorm class) over features that are not whole heads of every
    source (a per-head q/k norm is: each rank normalizes its own heads; a latent's norm is not)."""
    kind = node_kind(n, gm)
    if kind in NORMS:
        return True
    info = tensor_info(n.args[0]) if n.args else None
    if kind not in FEATURE_REDUCTIONS or info is None or not info.shape or not info.shape[-1].is_number:
        return False
    d = int(info.shape[-1])
    return d in widths or (_in_norm(n, gm) and not all(w % d == 0 and w > d for w in widths))


def _per_head_part(region: list[fx.Node], sources: set[fx.Node], shapes: dict[fx.Node, tuple[int, int]],
                   gm: fx.GraphModule) -> tuple[list[fx.Node], set[fx.Node]] | None:
    """The part of a region that cannot be split whole (multi-head latent attention: the keys' latent is normalized
    over its features and their rotary part is one head shared by all) which can: what the sources whose outputs
    never reach a normalization lead to. What it reads from the rest of the region must be broadcast over the heads
    (an `expand` of a tensor with a dimension of 1); the rest stays replicated, as Megatron-Core keeps MLA's
    down-projections and their norms. None when no such part exists."""
    inside = set(region)

    def reach(start: fx.Node) -> set[fx.Node]:
        seen, todo = set(), [u for u in start.users if u in inside]
        while todo:
            n = todo.pop()
            if n not in seen:
                seen.add(n)
                todo.extend(u for u in n.users if u in inside)
        return seen

    widths = {shapes[s][1] for s in sources}
    reached = {s: reach(s) for s in sources}
    keep = {s for s, r in reached.items() if not any(_reduces_features(n, gm, widths) for n in r)}
    if not keep or keep == sources:
        return None
    part = set().union(*(reached[s] for s in keep))
    outside = {a for n in part for a in n.all_input_nodes if a in inside and a not in part}
    if not all(node_kind(a, gm) == "expand" and (i := tensor_info(a.args[0])) is not None and 1 in i.shape
               for a in outside if (t := tensor_info(a)) is not None and t.requires_grad):
        return None
    ordered = [n for n in region if n in part]
    if not _shardable(ordered, keep, {shapes[s][1] for s in keep}, gm, broadcast=outside):
        return None
    return ordered, keep


def _in_norm(n: fx.Node, gm: fx.GraphModule) -> bool:
    """The op is part of a normalization module written out in ops (an RMSNorm class of a model file)."""
    stack = n.meta.get("nn_module_stack") or {}
    if stack:
        kind = list(stack.values())[-1][1]
        name = getattr(kind, "__name__", str(kind))
    else:
        try:
            name = type(gm.get_submodule(n.meta.get(MODULE, ""))).__name__ if n.meta.get(MODULE) else ""
        except AttributeError:
            name = ""
    return "norm" in name.rsplit(".", 1)[-1].lower()


def _feeders(n: fx.Node, sources: set[fx.Node], gm: fx.GraphModule) -> set[fx.Node]:
    """The sources whose outputs reach `n` through no other linear (the projections of an attention's q, k, v; not
    the MLP's)."""
    seen, todo, out = set(), list(n.all_input_nodes), set()
    while todo:
        a = todo.pop()
        if a in seen:
            continue
        seen.add(a)
        if a in sources:
            out.add(a)
        elif linear_shape(a, gm) is None:
            todo.extend(a.all_input_nodes)
    return out


def _heads(nodes: list[fx.Node], gm: fx.GraphModule, sources: Iterable[fx.Node]) -> Heads:
    for n in nodes:
        kind = n.meta[COST].kind
        acts = [a for a in n.all_input_nodes if a.op != "get_attr"]
        if kind == "attention" or (kind == "matmul" and len(acts) >= 2 and linear_shape(n, gm) is None):
            if n.meta[TP] == "replicated":  # an attention kept whole on every rank (its region cannot be split):
                return Heads()  # no heads for tensor parallelism to divide
            q = tensor_info(acts[0])
            if q is None or len(q.shape) != 4 or not q.shape[1].is_number:
                continue
            heads, head_dim = int(q.shape[1]), int(q.shape[-1])
            widths = [linear_shape(s, gm)[1] // head_dim for s in _feeders(n, set(sources), gm)]
            kv = min([w for w in widths if w], default=heads)
            return Heads(heads, min(kv, heads), min(kv, heads) * head_dim)
    return Heads()


def annotate_tp_roles(gm: fx.GraphModule, units: Iterable[list[fx.Node]],
                      splits: Callable[[fx.Node], bool] | None = None) -> list[Heads]:
    """Write node.meta[TP] for the nodes of each unit (a unit is a list of nodes in order); return
    each unit's attention heads. `splits`: whether the engine can split a linear's weight (the fxplanner runtime
    splits nn.Linear modules only: an nn.MultiheadAttention's packed projections stay whole, and so does the region
    between them, priced replicated as it runs)."""
    heads = []
    for nodes in units:
        for n in nodes:
            n.meta[TP] = "replicated"
        shapes = {n: s for n in nodes if (s := linear_shape(n, gm)) is not None}
        roots = _roots(nodes, set(shapes))
        regions: dict[fx.Node, list[fx.Node]] = {}
        for n, r in roots.items():
            regions.setdefault(r, []).append(n)
        col: set[fx.Node] = set()
        for region in regions.values():
            inside = set(region)
            sources = {a for n in region for a in n.all_input_nodes if a in shapes}
            sinks = {lin for lin in shapes if activation_input(lin) in inside}
            widths = {shapes[s][1] for s in sources}
            taken = {lin for lin in shapes if lin.meta[TP] in ("col", "row")}
            if not sources or not sinks or (sources | sinks) & taken:
                continue
            if splits is not None and not all(map(splits, sources | sinks)):
                continue
            if not _shardable(region, sources, widths, gm):
                # a replicated branch (a latent normalized over its features, a rotary key shared by every head) may
                # feed the per-head part only as a broadcast: split off what the other sources reach, keep the rest
                split = _per_head_part(region, sources, shapes, gm)
                if split is None:
                    continue
                region, sources = split
                inside = set(region)
                sinks = {lin for lin in shapes if activation_input(lin) in inside}
                if not sinks or (sources | sinks) & taken:
                    continue
            for s in sources:
                s.meta[TP] = "col"
            for s in sinks:
                s.meta[TP] = "row"
            for n in region:
                if n.meta[COST].kind != "none":
                    n.meta[TP] = "sharded"
            col |= sources
        _vocab(nodes, shapes, gm)
        for n in nodes:  # a weight read through get_attr is split like the op that uses it
            if n.op == "get_attr" and n.users and all(u.meta.get(TP, "replicated") != "replicated" for u in n.users):
                n.meta[TP] = "sharded"
        heads.append(_heads(nodes, gm, col))
    return heads


def _vocab(nodes: list[fx.Node], shapes: dict[fx.Node, tuple[int, int]], gm: fx.GraphModule) -> None:
    last = max(shapes, key=nodes.index, default=None)  # a vocabulary projection is the unit's last product
    free = [n for n in shapes if n is last and n.meta[TP] == "replicated" and shapes[n][1] >= VOCAB_MIN
            and shapes[n][1] > shapes[n][0]]
    if free:  # and every other use of it (the logits of each multi-token-prediction depth: planner.hf)
        head = shapes[max(free, key=lambda n: shapes[n][1])]
        for n in shapes:
            if n.meta[TP] == "replicated" and shapes[n] == head:
                n.meta[TP] = "vocab-col"
    for n in nodes:
        if node_kind(n, gm) != "embedding":
            continue
        if n.op == "call_module":
            rows = gm.get_submodule(str(n.target)).num_embeddings
        else:
            w = _param(n.args[0], gm) if n.args else None
            rows = w.shape[0] if w is not None else 0
        if rows >= VOCAB_MIN:
            n.meta[TP] = "vocab-emb"
