"""Ops that select or join along a dim: indexing, slices, cat, unbind, split and chunk. Along any dim but the split one
the split passes through; along it, a projection's fused output may be cut into its parts (q | k | v, gate | up),
each part dealt to the ranks the same way."""
from __future__ import annotations

from typing import Any

import torch.fx as fx

from .base import Refuse, Rows, Rule, Split, dims_arg, register

BIG = 2**62  # a slice's "to the end" (sys.maxsize in torch.export's graphs)


def _segment(s: Split, n: fx.Node, x: fx.Node, dim: int, start: Any, end: Any) -> tuple[int, int]:
    """n is x[start:end] along the split dim: one part of a fused projection's output (Phi-3's q, k and v of
    qkv_proj). The source's rows are dealt in segments at these bounds, each split over the ranks, so the rank holds
    [start/t, end/t) of its shard; returns those local bounds."""
    width = s.shape(x)[dim]
    start = 0 if start is None else start
    end = width if end is None or (isinstance(end, int) and end >= min(width, BIG)) else end
    if not (isinstance(start, int) and isinstance(end, int)) or not 0 <= start < end <= width:
        raise Refuse(f"{n.name}: a slice of the split dim by a computed bound")
    if start % s.t or end % s.t:
        raise Refuse(f"{n.name}: a slice of the split dim at {start}:{end}, not a multiple of {s.t}")
    src = s.source[x.name]
    rows = s.colwise.get(src, Rows(segments=(width,)))
    if x.name in s.factor or x.name in s.segments or rows.groups != 1 or rows.replicas != 1 or \
            sum(rows.segments) != width:
        raise Refuse(f"{n.name}: slices a projection whose rows are dealt otherwise")
    bounds = sorted({0, *(sum(rows.segments[:i + 1]) for i in range(len(rows.segments))), start, end})
    s.colwise[src] = Rows(segments=tuple(b - a for a, b in zip(bounds, bounds[1:])))
    s.passes(n, x, dim)
    s.segments.add(n.name)
    return start // s.t, end // s.t


def _slice(s: Split, n: fx.Node, x: fx.Node, dim: int, kind: str) -> None:
    """aten.slice(x, dim, start, end[, step]) (exported graphs)."""
    along = dims_arg(n, 1, 0) % len(s.shape(x))
    if along != dim:
        s.passes(n, x, dim)  # a slice along another dim keeps the split
        return
    step = n.args[4] if len(n.args) > 4 else n.kwargs.get("step", 1)
    if step != 1:
        raise Refuse(f"{n.name}: a strided slice of the split dim")
    start = n.args[2] if len(n.args) > 2 else n.kwargs.get("start")
    end = n.args[3] if len(n.args) > 3 else n.kwargs.get("end")
    lo, hi = _segment(s, n, x, dim, start, end)
    s.rewrites.append((n, lambda new, n=n: setattr(n, "args", (*n.args[:2], *new, *n.args[4:])), [lo, hi]))


def _cat(s: Split, n: fx.Node, x: fx.Node, dim: int, kind: str) -> None:
    along = (n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)) % len(s.shape(x))
    if along == dim:
        raise Refuse(n.name)
    s.passes(n, x, dim)


def _getitem(s: Split, n: fx.Node, x: fx.Node, dim: int, kind: str) -> None:
    """Indexing: ints drop dims, full slices keep them, None adds one; a slice of the split dim cuts a fused
    projection into its parts."""
    if n.args[0] is not x:
        raise Refuse(f"{n.name}: getitem")
    given = n.args[1] if isinstance(n.args[1], tuple) else (n.args[1],)
    ndim, index, at, fill = len(s.shape(x)), given, len(given), 1
    if any(i is Ellipsis for i in given):
        at = given.index(Ellipsis)
        fill = ndim - sum(1 for i in given if i is not None and i is not Ellipsis)
        index = (*given[:at], *([slice(None)] * fill), *given[at + 1:])
    src, out = 0, 0
    for pos, i in enumerate(index):
        if i is None:
            out += 1
            continue
        if src == dim:
            if not isinstance(i, slice):
                raise Refuse(f"{n.name}: indexes the split dim")
            if i != slice(None):
                if i.step not in (None, 1):
                    raise Refuse(f"{n.name}: a strided slice of the split dim")
                if at <= pos < at + fill:
                    raise Refuse(f"{n.name}: indexes the split dim")  # (an ellipsis stands for it)
                lo, hi = _segment(s, n, x, dim, i.start, i.stop)
                pos -= fill - 1 if pos > at else 0  # where it is in the index as written
                new = (*given[:pos], slice(lo, hi), *given[pos + 1:])
                s.rewrites.append((n, lambda v, n=n: setattr(n, "args", (n.args[0], v if len(v) > 1 else v[0])), new))
            s.passes(n, x, out)
            return
        if isinstance(i, int):
            src += 1
        elif isinstance(i, slice):
            src, out = src + 1, out + 1
        else:
            raise Refuse(f"{n.name}: index {i!r}")
    s.passes(n, x, out + (dim - src))


def _unbind(s: Split, n: fx.Node, x: fx.Node, dim: int, kind: str) -> None:
    along = (n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)) % len(s.shape(x))
    if along == dim:
        raise Refuse(n.name)
    s.tuples[n.name] = dim - (along < dim)
    s.source.setdefault(n.name, s.source[x.name])


def _split(s: Split, n: fx.Node, x: fx.Node, dim: int, kind: str) -> None:
    """split(size) or chunk(k): along the split dim, the fused features cut into equal parts (q | k | v), each of
    which the rank holds 1/t of: its rows in strided groups, the size / t."""
    chunk = kind == "chunk"
    along = (n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", 0)) % len(s.shape(x))
    size = n.args[1] if len(n.args) > 1 else None
    if along == dim:
        whole = s.shapes.get(size.name) if isinstance(size, fx.Node) else size
        if not isinstance(whole, int) or whole <= 0:
            raise Refuse(n.name)
        parts = whole if chunk else s.shape(x)[dim] // whole
        s.group_of(x, parts)
        if not chunk:
            s.rewrites.append((n, lambda new, n=n: setattr(n, "args", (n.args[0], new, *n.args[2:])),
                               s.divided(size, n)))
        s.factor[n.name] = s.factor.get(x.name, 1) * parts  # q | k | v, each of its heads
    s.tuples[n.name] = dim
    s.source.setdefault(n.name, s.source[x.name])


register(Rule(("slice",), _slice, "a slice: along another dim, or one part of a fused projection"))
register(Rule(("cat",), _cat, "a join along another dim"))
register(Rule(("getitem",), _getitem, "indexing: the split dim kept whole, or one part of a fused projection"))
register(Rule(("unbind",), _unbind, "items along another dim"))
register(Rule(("split", "chunk"), _split, "parts along another dim, or the equal parts of a fused projection"))
