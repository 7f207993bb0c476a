"""Names of the node.meta entries that fxplanner passes write (one namespace: "fxp.")."""
from __future__ import annotations

TENSOR = "fxp.tensor"  # TensorInfo: symbolic shape (in b), dtype, bytes
COST = "fxp.cost"  # NodeCost: FLOPs and bytes as sympy expressions in b
TP = "fxp.tp"  # tensor-parallel role: "col", "row", "sharded" or "replicated"
UNIT = "fxp.unit"  # index of the partition unit the node belongs to
MODULE = "fxp.module"  # qualified name of the innermost module the node came from
MEASURED = "fxp.measured"  # Measured: FLOPs dispatched and tensors saved for backward, as run on meta tensors
