"""Conservation checks on a priced model: nothing priced at zero silently, nothing counted twice.

The units' forward FLOPs are compared with the model's forward counted independently, by
`torch.utils.flop_counter.FlopCounterMode` around the module itself (around the captured graph run
as a whole when the module cannot run on meta tensors, e.g. it calls `.item()`): they must agree
within 1%, or the plan is refused as a pricing error. The parameters the graph uses are
compared with the module's; ops the cost tables do not know are listed with their share of the
forward's memory traffic.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from .costs import node_kind
from .errors import UserError
from .meta_keys import COST
from .shapes import B
from .units import Unit

__all__ = ["Conservation", "PricingError", "conservation", "TOLERANCE"]

TOLERANCE = 0.01
_B = 2  # the microbatch size both counts are taken at


class PricingError(UserError):
    """The cost model contradicts itself or physics: a bug in pricing, not a property of the plan."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Conservation:
    priced_flops: float  # forward FLOPs of the units (attention in full), at b = 2
    counted_flops: float  # the module's forward under FlopCounterMode, at b = 2
    largest_unit: str  # the unit with the most forward FLOPs (where a discrepancy most likely lies)
    unpriced: tuple[tuple[str, float], ...]  # (op, share of the forward's bytes) priced by the opaque rule
    notes: tuple[str, ...]

    @property
    def flops_ok(self) -> bool:
        return abs(self.priced_flops - self.counted_flops) <= TOLERANCE * max(self.counted_flops, 1.0)

    def flops_message(self) -> str:
        off = (self.priced_flops - self.counted_flops) / max(self.counted_flops, 1.0)
        return (f"pricing error: the units' forward FLOPs ({self.priced_flops:.4g} at b={_B}) differ from the "
                f"model's forward counted by torch.utils.flop_counter ({self.counted_flops:.4g}) by {off:+.1%} "
                f"(largest unit: {self.largest_unit}); please report this model")


def _used_params(gm: fx.GraphModule) -> dict[int, tuple[str, int]]:
    used: dict[int, tuple[str, int]] = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr" and n.users:
            obj: Any = gm
            for part in str(n.target).split("."):
                obj = getattr(obj, part)
            if isinstance(obj, nn.Parameter):
                used[id(obj)] = (str(n.target), obj.numel())
        elif n.op == "call_module":
            for name, p in gm.get_submodule(str(n.target)).named_parameters(prefix=str(n.target)):
                used[id(p)] = (name, p.numel())
    return used


def conservation(model: nn.Module, gm: fx.GraphModule, units: list[Unit], inputs: tuple[Any, ...]) -> Conservation:
    """Check `units` (priced from `gm`, captured from `model`) against the module itself."""
    counter = FlopCounterMode(display=False)
    try:
        with counter, torch.enable_grad():
            model(*inputs)
    except Exception:  # noqa: BLE001 - code that needs real data (.item()) runs only as captured
        counter = FlopCounterMode(display=False)
        with counter, torch.enable_grad():
            gm(*inputs)
    priced = sum(u.sharded.model_flops(_B) + u.replicated.model_flops(_B) for u in units)
    largest = max(units, key=lambda u: u.fwd_flops(_B)).name if units else ""
    notes = []
    used = _used_params(gm)
    unused = [(name, p.numel()) for name, p in model.named_parameters() if id(p) not in used]
    if unused:
        notes.append(f"{len(unused)} parameter tensors ({sum(n for _, n in unused):,} values) are never used by "
                     f"the forward (e.g. {unused[0][0]}); they are held in memory by no unit")
    shares: Counter[str] = Counter()
    total = 0.0
    for n in gm.graph.nodes:
        cost = n.meta.get(COST)
        if cost is None:
            continue
        nbytes = float(sympy.sympify(cost.fwd_bytes).subs(B, _B))
        total += nbytes
        if cost.kind == "opaque":
            shares[node_kind(n, gm)] += nbytes
    unpriced = tuple((op, b / total if total else 0.0) for op, b in shares.most_common())
    return Conservation(priced_flops=priced, counted_flops=float(counter.get_total_flops()), largest_unit=largest,
                        unpriced=unpriced, notes=tuple(notes))
