"""Views and layout changes: a split dim is found again in the output's shape."""
from __future__ import annotations

import math

import torch.fx as fx

from .base import Refuse, Rule, Split, dims_arg, register, size_args


def _view(s: Split, n: fx.Node, x: fx.Node, dim: int, kind: str) -> None:
    """view/reshape: the split features cut into (..., heads, head_dim) get heads / t (a fused q|k|v cut into
    (3, heads, d) deals its rows in 3 strided groups; fewer kv heads than t: each rank keeps one whole head); a split
    dim kept or merged with the dims after it is sized / t."""
    i_shape, o_shape, replicas = s.shape(x), s.shape(n), 1
    off = math.prod(i_shape[:dim])
    j = next((j for j in range(len(o_shape) + 1) if math.prod(o_shape[:j]) == off), None)
    if j is None or j == len(o_shape):
        raise Refuse(n.name)
    if o_shape[j] < i_shape[dim]:  # split into (..., heads, head_dim): shard the heads
        k = next((k for k in range(j, len(o_shape)) if math.prod(o_shape[j:k + 1]) == i_shape[dim]), None)
        if k is None:
            raise Refuse(n.name)
        cands = [d for d in range(j, k + 1) if o_shape[d] in s.heads] or \
                [d for d in range(j, k + 1) if o_shape[d] > 1 and o_shape[d] % s.t == 0]
        if not cands:
            raise Refuse(n.name)
        j, g = cands[0], math.prod(o_shape[j:cands[0]])
        replicas = s.t // o_shape[j] if o_shape[j] < s.t and s.t % o_shape[j] == 0 else 1
        s.group_of(x, g, replicas)
    args, setter = size_args(n)
    new = list(args)
    new[j] = 1 if replicas > 1 and args[j] != -1 else s.divided(args[j], n)
    s.rewrites.append((n, setter, new))
    s.passes(n, x, j)


def _permute(s: Split, n: fx.Node, x: fx.Node, dim: int, kind: str) -> None:
    dims = [d % len(s.shape(x)) for d in (n.args[1] if isinstance(n.args[1], (tuple, list)) else n.args[1:])]
    s.passes(n, x, dims.index(dim))


def _transpose(s: Split, n: fx.Node, x: fx.Node, dim: int, kind: str) -> None:
    a, b = (d % len(s.shape(x)) for d in n.args[1:3])
    s.passes(n, x, b if dim == a else a if dim == b else dim)


def _unsqueeze(s: Split, n: fx.Node, x: fx.Node, dim: int, kind: str) -> None:
    along = dims_arg(n, 1, 0) % len(s.shape(n))
    s.passes(n, x, dim + (along <= dim))


def _squeeze(s: Split, n: fx.Node, x: fx.Node, dim: int, kind: str) -> None:
    along = dims_arg(n, 1, 0) % len(s.shape(x))
    if along == dim or s.shape(x)[dim] == 1:
        raise Refuse(n.name)
    s.passes(n, x, dim - (along < dim))


def _flatten(s: Split, n: fx.Node, x: fx.Node, dim: int, kind: str) -> None:
    """(..., heads, head_dim) merged back into features: the heads dim leads."""
    start, end = dims_arg(n, 1, 0) % len(s.shape(x)), dims_arg(n, 2, -1) % len(s.shape(x))
    if start < dim <= end:
        raise Refuse(f"{n.name}: merges a split dim into the one before it")
    s.passes(n, x, dim if dim <= start else dim - (end - start))


def _expand(s: Split, n: fx.Node, x: fx.Node, dim: int, kind: str) -> None:
    """A broadcast (HF's repeat_kv: kv heads given a dim of n_rep to expand into): new leading dims shift the split;
    its size, given in global terms, is the local one (-1, or read off the split tensor) or divided by t."""
    args, setter = size_args(n)
    at = dim + len(args) - len(s.shape(x))
    if s.shape(x)[dim] == 1 and s.shape(n)[at] > 1:
        raise Refuse(f"{n.name}: expands the split dim")
    new = list(args)
    new[at] = s.divided(args[at], n)
    s.rewrites.append((n, setter, new))
    s.passes(n, x, at)


def _same(s: Split, n: fx.Node, x: fx.Node, dim: int, kind: str) -> None:
    s.passes(n, x, dim)


def _complex(s: Split, n: fx.Node, x: fx.Node, dim: int, kind: str) -> None:
    """view_as_complex takes the last dim (of 2) as one number; view_as_real gives it back: a split on another dim
    stays where it is."""
    if dim >= len(s.shape(n)) or dim == len(s.shape(x)) - 1:
        raise Refuse(f"{n.name}: the split dim is the complex pair")
    s.passes(n, x, dim)


register(Rule(("view", "reshape", "unsafe_view"), _view, "a view cutting or keeping the split dim"))
register(Rule(("permute",), _permute, "a permutation carries the split dim along"))
register(Rule(("transpose",), _transpose, "a transposition carries the split dim along"))
register(Rule(("unsqueeze",), _unsqueeze, "a dim of 1 added"))
register(Rule(("squeeze",), _squeeze, "a dim of 1 dropped, not the split one"))
register(Rule(("flatten",), _flatten, "dims merged after the split one"))
register(Rule(("expand",), _expand, "a broadcast to a larger size, the split dim kept"))
register(Rule(("alias",), _same, "the same tensor (torch.export's no-op views)"))
register(Rule(("view_as_complex", "view_as_real"), _complex, "a complex view of a real pair (torchtitan's RoPE)"))
