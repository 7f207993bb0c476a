"""Context parallelism's rules: what each op does to a sequence split over the cp ranks of a group, as Megatron-Core
splits it (each rank holds chunks r and 2cp-1-r of 2cp equal chunks of every sequence). One walk, read by the
fxplanner runtime, which rewrites its stage pieces with it (planner/runtime/context_parallel.py: the ring attention
and the positions it inserts), and by the trace-time check (passes/sharding/check.py: cp_refusal), which runs it on a
copy of the graph so the search never proposes a split the runtime cannot place.

What the traced code says about the sequence is rewritten, guided by the shapes of a meta pass over the whole
sequence:

- a ``view``/``reshape``/``expand`` that keeps the sequence dim gets the local length there (a literal S of
  an exported graph becomes S/cp; a length read off a local tensor is local already);
- a length read off a local tensor that sizes anything else (``arange(tokens.shape[1])`` for positions, a
  causal mask) becomes the whole sequence's, ``cp * s``: such values are computed whole, replicated;
- a replicated operand spanning the sequence (learned position embeddings, RoPE's cos/sin) that meets the
  local tokens in an elementwise op keeps this rank's positions (`ContextModules.positions`);
- attention (a fused ``scaled_dot_product_attention``, or the written-out Q Kᵀ → mask → softmax → · V)
  becomes `ContextModules.attention`: each rank's queries attending under the causal mask of their global positions.

An op on the local tokens that these rules do not place (a product over the sequence, a slice along it, dropout
inside attention, attention without a causal mask) is `Unsupported`, never run wrongly.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.fx as fx
from torch import nn

from passes.costs import node_kind

from .base import call, size_args
from .ops import CP_REDUCTIONS, NO_TENSOR, POSITIONWISE

__all__ = ["ContextModules", "ContextWalk", "Unsupported"]


class ContextModules(Protocol):
    """What the walk needs of a context-parallel split: its size, the whole sequence's length, and the modules it
    inserts (the runtime's ring attention and position selection; stand-ins for a check)."""

    size: int
    seq: int

    def attention(self, *, k_transposed: bool, scale: Any, layout: tuple[int, ...] | None = None) -> nn.Module: ...

    def positions(self, dim: int) -> nn.Module: ...


class Unsupported(Exception):
    """An op on the local tokens that no rule places: its node and why."""


@dataclass(frozen=True, slots=True)
class _Items:
    """The result of an unbind/split of a local tensor: each item's sequence dim."""

    dim: int


class ContextWalk:
    """The rewrite of one piece for one rank's tokens: walks its nodes in order, tracking the sequence dim of each
    local value; `Unsupported` where no rule places an op."""

    def __init__(self, gm: fx.GraphModule, shapes: dict[str, Any], cp: ContextModules, given: list) -> None:
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
            raise Unsupported(f"{n.name} has no traced shape")
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
                raise Unsupported(f"{n.name}: a product over the sequence")
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
                raise Unsupported(f"{n.name} merges or splits the sequence dim")
        args, setter = size_args(n)
        if j >= len(args):
            raise Unsupported(n.name)
        new = list(args)
        a = args[j]
        if isinstance(a, int):
            if a == self.S:
                new[j] = a // self.cp.size
            elif a != -1:
                raise Unsupported(f"{n.name}: size {a} at the sequence dim")
        elif isinstance(a, fx.Node) and a.name not in self.lengths:
            with self.graph.inserting_before(n):
                new[j] = self.graph.call_function(operator.floordiv, (a, self.cp.size))
        setter(new)
        for k, b in enumerate(new):  # other sizes: a local length elsewhere is the whole sequence's
            if k != j and isinstance(b, fx.Node) and b.name in self.lengths:
                raise Unsupported(f"{n.name}: the sequence length sizes another dim")
        self.seq[n.name] = j

    def pointwise(self, n: fx.Node, local: list[fx.Node], kind: str) -> None:
        out = self.shape(n)
        dims = {len(out) - (len(self.shape(a)) - self.seq[a.name]) for a in local}
        if len(dims) != 1:
            raise Unsupported(f"{n.name}: local operands disagree on the sequence dim")
        od = dims.pop()
        if kind in CP_REDUCTIONS:
            along = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
            along = [d % len(self.shape(local[0])) for d in (along if isinstance(along, (tuple, list)) else [along])
                     if isinstance(d, int)]
            dx = self.seq[local[0].name]
            if not along or dx in along:
                raise Unsupported(f"{n.name}: {kind} along the sequence")
            if len(out) < len(self.shape(local[0])):  # the reduced dims are dropped (no keepdim)
                od = dx - sum(d < dx for d in along)
        if out[od] != self.S:
            raise Unsupported(f"{n.name}: reduces the sequence")
        if kind == "cat":
            along = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)
            if along % len(out) == od:
                raise Unsupported(f"{n.name}: cat along the sequence")
        self.globalize(n)
        for a in n.all_input_nodes:  # a replicated operand spanning the sequence keeps this rank's positions
            o = self.shapes.get(a.name)
            if a in local or not isinstance(o, tuple):
                continue
            idx = len(o) - (len(out) - od)
            if idx >= 0 and o[idx] == self.S:
                n.replace_input_with(a, call(self.gm, self.cp.positions(idx), (a,), before=n, prefix="_cp"))
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
                raise Unsupported(f"{n.name}: {kind} along the sequence")
            self.seq[n.name] = dx - (along < dx and kind != "slice")
        elif kind in ("unbind", "split", "chunk"):
            along = (n.args[2] if kind != "unbind" and len(n.args) > 2 else
                     n.args[1] if kind == "unbind" and len(n.args) > 1 else n.kwargs.get("dim", 0)) % rank
            if along == dx:
                raise Unsupported(f"{n.name}: {kind} along the sequence")
            self.seq[n.name] = _Items(dx - (kind == "unbind" and along < dx))
        elif kind in ("view_as_complex", "view_as_real"):  # torchtitan's RoPE: the last dim pairs up, or splits
            if kind == "view_as_complex" and dx == rank - 1:
                raise Unsupported(f"{n.name}: {kind} of the sequence dim")
            self.seq[n.name] = dx
        elif kind == "repeat_interleave":  # grouped keys/values repeated along the heads (a dim of their own)
            along = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim")
            if along is None or along % rank == dx:
                raise Unsupported(f"{n.name}: {kind} along the sequence")
            self.seq[n.name] = dx
        elif kind == "flatten":
            start, end = ((list(n.args[1:3]) + [0, -1])[:2] if len(n.args) > 1 else [0, -1])
            start, end = start % rank, end % rank
            if start <= dx <= end and start != end:
                raise Unsupported(f"{n.name}: flattens the sequence dim")
            self.seq[n.name] = dx if dx < start else dx - (end - start)
        else:
            raise Unsupported(f"{n.name}: {kind} on the local tokens, an op the rules do not know")

    # -- attention --------------------------------------------------------------------------

    def fused_attention(self, n: fx.Node) -> None:
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        args = dict(zip(names, n.args)) | dict(n.kwargs)
        if args.get("dropout_p", 0.0):
            raise Unsupported(f"{n.name}: dropout inside attention")
        if not args.get("is_causal") and args.get("attn_mask") is None:
            raise Unsupported(f"{n.name}: attention without a mask (not causal)")
        q, k, v = args["query"], args["key"], args["value"]
        if any(self.seq.get(a.name) != len(self.shape(a)) - 2 for a in (q, k, v)):
            raise Unsupported(f"{n.name}: attention whose q, k, v do not all hold the local tokens")
        self.replace(n, (q, k, v), k_transposed=False, scale=args.get("scale"))

    def written_attention(self, first: fx.Node) -> None:
        """Q Kᵀ ... · V written out: the region from this product to the next product with V."""
        q, kt = first.args[0], first.args[1]
        if self.seq[q.name] != len(self.shape(q)) - 2 or self.seq[kt.name] != len(self.shape(kt)) - 1:
            raise Unsupported(f"{first.name}: a product over the sequence that is not Q Kᵀ")
        region, frontier, second = {first}, [first], None
        while frontier:
            node = frontier.pop()
            for user in node.users:
                if user in region:
                    continue
                if node_kind(user, self.gm) == "matmul":
                    if second is not None and user is not second:
                        raise Unsupported(f"{first.name}: scores feed two products")
                    second = user
                    continue
                region.add(user)
                frontier.append(user)
        if second is None or second.args[0] not in region:
            raise Unsupported(f"{first.name}: no product of the scores with V")
        kinds, scale = set(), 1.0
        for node in region:
            kind = node_kind(node, self.gm)
            kinds.add(kind)
            if kind in ("dropout", "Dropout"):
                p = self.gm.get_submodule(str(node.target)).p if node.op == "call_module" else \
                    (node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5))
                if p:
                    raise Unsupported(f"{node.name}: dropout inside attention")
            numbers = [x for x in (self.shapes.get(a.name) if isinstance(a, fx.Node) else a for a in node.args[1:])
                       if isinstance(x, (int, float)) and not isinstance(x, bool)]  # constants, or traced ints
            if kind in ("div", "truediv") and numbers and node.args[0] in region:
                scale /= numbers[0]
            elif kind == "mul" and numbers:
                scale *= numbers[0]
        if "softmax" not in kinds or not kinds & {"masked_fill", "where", "add"}:
            raise Unsupported(f"{first.name}: attention without a softmax and a mask (not causal)")
        if any(u not in region and u is not second for node in region for u in node.users):
            raise Unsupported(f"{first.name}: the attention scores are used outside attention")
        if self.seq.get(second.args[1].name) != len(self.shape(second.args[1])) - 2:
            raise Unsupported(f"{second.name}: V does not hold the local tokens")
        self.dead |= {node.name for node in region}
        self.replace(second, (q, kt, second.args[1]), k_transposed=True, scale=scale)

    def replace(self, end: fx.Node, qkv: tuple, *, k_transposed: bool, scale: Any) -> None:
        """`end`'s users read ring attention's output instead, laid out in memory as `end`'s was where the graph
        says (an exported graph's views after the attention assume its kernel's strides: export drops a
        `.contiguous()` that copied nothing when it was captured)."""
        val = end.meta.get("val")
        layout = None
        if isinstance(val, torch.Tensor) and val.dim() > 1:
            order = tuple(sorted(range(val.dim()), key=lambda d: -val.stride(d)))  # outermost dim first
            layout = order if list(order) != sorted(order) else None  # (None: contiguous, as the kernel returns it)
        new = call(self.gm, self.cp.attention(k_transposed=k_transposed, scale=scale, layout=layout), qkv, before=end,
                   prefix="_cp")
        end.replace_all_uses_with(new)
        self.dead.add(end.name)
        self.shapes[new.name] = self.shapes.get(end.name)
        self.seq[new.name] = self.seq[qkv[0].name]
