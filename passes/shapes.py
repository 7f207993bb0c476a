"""Tensor shapes with every size written as a polynomial in the microbatch b.

`passes.measure` runs the graph twice on meta tensors (b = 2 and b = 3; nothing is allocated). A
size that differs between the runs is linear in b and becomes `c0 + c1*b`; the FLOP and byte rules
downstream then yield sympy expressions that can be evaluated at any b without tracing again.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.fx as fx

from .meta_keys import TENSOR

__all__ = ["B", "TensorInfo", "tensor_info"]

B = sympy.Symbol("b", positive=True, integer=True)
_PROBES = (2, 3)


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorInfo:
    shape: tuple[sympy.Expr, ...]
    dtype: torch.dtype
    requires_grad: bool

    @property
    def numel(self) -> sympy.Expr:
        return sympy.Mul(*self.shape) if self.shape else sympy.Integer(1)

    @property
    def nbytes(self) -> sympy.Expr:
        return self.numel * self.dtype.itemsize


def _describe(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype, value.requires_grad)
    if isinstance(value, (tuple, list)):
        return tuple(_describe(v) for v in value)
    return None


def _merge(a: Any, b: Any) -> Any:
    """Combine the descriptions at b=2 and b=3 into symbolic TensorInfo (or tuples of them)."""
    if a is None or b is None:
        return None
    if isinstance(a[0], tuple) and len(a) == 3 and isinstance(a[1], torch.dtype):
        (sa, dtype, rg), (sb, _, _) = a, b
        if len(sa) != len(sb):
            return None
        return TensorInfo(shape=tuple(_size(x, y) for x, y in zip(sa, sb)), dtype=dtype, requires_grad=rg)
    if len(a) != len(b):
        return None
    return tuple(_merge(x, y) for x, y in zip(a, b))


def _size(at2: int, at3: int) -> sympy.Expr:
    slope = at3 - at2
    return sympy.Integer(at2 - 2 * slope) + slope * B if slope else sympy.Integer(at2)


def tensor_info(node: Any) -> TensorInfo | None:
    """TensorInfo of a node argument (None for constants and non-tensor values)."""
    if isinstance(node, fx.Node):
        info = node.meta.get(TENSOR)
        return info if isinstance(info, TensorInfo) else None
    return None
