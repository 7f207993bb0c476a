"""Sharding rules, one per op family, registered by op name (`passes.costs.node_kind`), as DTensor registers its
op strategies. A rule says how a tensor-parallel split (of heads, of a projection's features) passes through the op:
where the split dim lands in the output and what of the op's arguments must be rewritten for the rank's shard, or
that it refuses (a `Refuse` naming the node and why). The op-name sets the pricing and the runtime share are in
`ops`.

The runtime's Megatron layout (planner/runtime/megatron_tp.py) walks each stage's graph with these rules. Adding an
op is adding its rule to the family's module (or a new module imported below) and a test
(tests/runtime/test_sharding_rules.py; the registry itself: tests/passes/test_sharding_registry.py).
"""
from __future__ import annotations

from .base import RULES, Div, Refuse, Rows, Rule, Split, call, register, shard_rows, size_args, swap, unregister
from . import heads, pointwise, select, views  # noqa: E402,F401  (each registers its rules)

__all__ = ["RULES", "Div", "Refuse", "Rows", "Rule", "Split", "call", "register", "rule_for", "shard_rows", "size_args", "swap",
           "unregister"]


def rule_for(kind: str) -> Rule | None:
    return RULES.get(kind)
