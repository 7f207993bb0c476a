"""The op-name sets the sharding rules read, in one place: the pricing's tensor-parallel roles (passes/tp.py), the
runtime's Megatron layout (planner/runtime/megatron_tp.py) and its context parallelism
(planner/runtime/context_parallel.py). Names are `passes.costs.node_kind` names: a function's or method's
`__name__`, a module's class name."""
from __future__ import annotations

__all__ = ["NORMS", "FEATURE_REDUCTIONS", "ELEMENTWISE", "PER_POSITION", "ALONG", "SEQ_POINTWISE", "POSITIONWISE",
           "CP_REDUCTIONS", "NO_TENSOR", "COMPLEX_VIEWS"]

NORMS = frozenset({"layer_norm", "rms_norm", "group_norm", "batch_norm", "LayerNorm", "RMSNorm", "LlamaRMSNorm"})
"""Normalizations over the features: a tensor-parallel split of the features cannot pass through them."""
FEATURE_REDUCTIONS = frozenset({"mean", "sum", "var", "std", "var_mean", "norm", "amax", "logsumexp"})
"""Reductions that cut a tensor-parallel region where they reduce over a split's whole width (passes/tp.py)."""
ELEMENTWISE = frozenset({"add", "sub", "mul", "truediv", "div", "masked_fill", "softmax", "gelu", "relu", "silu",
                         "dropout", "Dropout", "contiguous", "float", "to", "type_as", "neg", "exp", "tanh", "sigmoid",
                         "clone", "GELU", "ReLU", "SiLU", "Identity"})
"""Ops applied element by element (or along the last dim, softmax), broadcasting their operands."""
PER_POSITION = (NORMS - {"group_norm", "batch_norm"}) | {"dropout", "Dropout", "Identity"}
"""Ops that work on each position of the sequence alone: a sequence-parallel split passes through them (a batch or
group norm mixes positions)."""
ALONG = frozenset({"softmax", "log_softmax", "cumsum", "cumprod", "flip"})
"""Ops that work along given dims (each slice of the others on its own): a split on another dim passes through."""
SEQ_POINTWISE = frozenset({"pow", "rsqrt", "mean", "to"})
"""A norm written out in ops (exported graphs): per position (mean: over the hidden features)."""
POSITIONWISE = ELEMENTWISE | PER_POSITION | {
    "pow", "rsqrt", "sqrt", "mean", "sum", "amax", "var", "cos", "sin", "abs", "log_softmax", "logical", "where",
    "layer_norm", "rms_norm", "detach", "half", "bfloat16", "alias", "reciprocal", "square", "erf", "log", "cumsum"}
"""Ops that keep each token's values to itself (context parallelism splits the tokens over ranks)."""
CP_REDUCTIONS = frozenset({"mean", "sum", "amax", "var", "softmax", "log_softmax", "cumsum"})
"""Of those, the ones that reduce along a dim (context parallelism checks that dim is not the sequence)."""
NO_TENSOR = frozenset({"assert_tensor_metadata", "GuardsFn"})
"""Checks that return nothing (dtype and device; torch.export's guards)."""
COMPLEX_VIEWS = frozenset({"view_as_complex", "view_as_real"})
"""A real tensor's last dim of 2 seen as one complex number, and back (torchtitan's rotary embedding)."""
