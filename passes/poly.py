"""Polynomials in the microbatch size b: the plain form in which units hand costs to solvers."""
from __future__ import annotations

from dataclasses import dataclass

import sympy

__all__ = ["Poly"]


@dataclass(frozen=True, slots=True)
class Poly:
    """c[0] + c[1]*b + c[2]*b**2 + ... (evaluates in microseconds, unlike a sympy expression)."""

    coeffs: tuple[float, ...] = (0.0,)

    @classmethod
    def of(cls, expr: sympy.Expr | int | float, symbol: sympy.Symbol) -> "Poly":
        expr = sympy.sympify(expr)
        if expr.is_number:
            return cls((float(expr),))
        return cls(tuple(float(c) for c in reversed(sympy.Poly(sympy.expand(expr), symbol).all_coeffs())))

    @classmethod
    def const(cls, value: float) -> "Poly":
        return cls((float(value),))

    def __call__(self, b: float) -> float:
        acc = 0.0
        for c in reversed(self.coeffs):
            acc = acc * b + c
        return acc

    def __add__(self, other: "Poly") -> "Poly":
        n = max(len(self.coeffs), len(other.coeffs))
        a = self.coeffs + (0.0,) * (n - len(self.coeffs))
        o = other.coeffs + (0.0,) * (n - len(other.coeffs))
        return Poly(tuple(x + y for x, y in zip(a, o)))

    def __mul__(self, k: float) -> "Poly":
        return Poly(tuple(c * k for c in self.coeffs))

    __rmul__ = __mul__

    def to_list(self) -> list[float]:
        return list(self.coeffs)
