"""Grouped keys and values repeated for the heads (grouped-query attention)."""
from __future__ import annotations

import torch.fx as fx

from .base import Refuse, Rows, Rule, Split, dims_arg, register, set_arg


def _repeat_interleave(s: Split, n: fx.Node, x: fx.Node, dim: int, kind: str) -> None:
    """Each rank repeats its own kv heads for its own query heads; where one kv head is held whole by `replicas`
    ranks (fewer kv heads than t), each repeats it for its share of that head's queries."""
    along, repeats = dims_arg(n, 2, None), n.args[1] if len(n.args) > 1 else n.kwargs.get("repeats")
    if along is None or not isinstance(repeats, int):
        raise Refuse(f"{n.name}: repeats of a flattened or per-element count")
    replicas = s.colwise.get(s.source[x.name], Rows()).replicas
    if along % len(s.shape(x)) == dim and replicas > 1:
        if repeats % replicas:
            raise Refuse(f"{n.name}: {repeats} repeats over {replicas} ranks of one kv head")
        s.rewrites.append((n, lambda new, n=n: set_arg(n, 1, "repeats", new), repeats // replicas))
    s.passes(n, x, dim)


register(Rule(("repeat_interleave",), _repeat_interleave, "kv heads repeated for each rank's own query heads"))
