"""Element-wise ops, ops along given dims, products and attention: the split passes where no operand needs the
split dim whole."""
from __future__ import annotations

import torch.fx as fx

from .base import Refuse, Rule, Split, dims_arg, register
from .ops import ALONG, ELEMENTWISE


def _along(s: Split, n: fx.Node, x: fx.Node, dim: int, kind: str) -> None:
    """Per slice along dim(s) (softmax, cumsum, flip): any but the split one."""
    along = dims_arg(n, 1, -1)
    along = along if isinstance(along, (tuple, list)) else [along]
    if any(not isinstance(d, int) or d % len(s.shape(x)) == dim for d in along):
        raise Refuse(f"{n.name}: {kind} along the split dim")
    s.passes(n, x, dim)


def _pointwise(s: Split, n: fx.Node, x: fx.Node, dim: int, kind: str) -> None:
    """Element by element, or a product over the last two dims (batched matmul, attention over its heads): every
    other operand must be one the rank holds for its part (split alike, a size, or broadcast over the split dim)."""
    rank = len(s.shape(x))
    for other in n.all_input_nodes:
        if other.name in s.sharded or other.name in s.local or not isinstance(s.shapes.get(other.name), tuple):
            continue
        o = s.shapes[other.name]
        if len(o) >= rank - dim and o[len(o) - (rank - dim)] == s.shape(x)[dim] > 1:
            raise Refuse(f"{n.name}: a replicated operand spans the sharded dim")
    products = [a for a in n.all_input_nodes if a.name in s.sharded]
    if kind == "matmul" and len(products) == 1 and dim >= rank - 2:
        raise Refuse(f"{n.name}: product over a sharded dim")
    s.passes(n, x, dim)


register(Rule(tuple(sorted(ALONG)), _along, "works along given dims: any but the split one"))
register(Rule(tuple(sorted(ELEMENTWISE - ALONG)), _pointwise, "element by element, operands broadcast"))
register(Rule(("matmul", "attention", "ContextParallelAttention"), _pointwise,
              "a product over the last two dims, split over a leading one (heads)"))
