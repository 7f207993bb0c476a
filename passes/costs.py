"""Per-node forward/backward FLOPs, bytes moved, parameters and bytes saved for backward.

Each quantity is a sympy expression in the microbatch size b (from the symbolic shapes). FLOPs
count a multiply-add as 2. Matrix products: backward = 2x forward (input and weight gradients).
The backward splits into the input gradient (I) and the parameters' gradients (W), which zero-bubble
pipeline schedules run apart (Qi et al. 2024): `wgrad_flops` is the W part.
Every other op is counted for what it does, forward and backward separately (table below); the
per-element constants are the arithmetic of PyTorch's reference kernels, rounded.
Bytes saved for backward are named per tensor so a unit counts a tensor saved by two ops once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch import nn

from .measure import Measured
from .meta_keys import COST, MEASURED
from .shapes import TensorInfo, tensor_info

__all__ = ["NodeCost", "annotate_costs", "node_kind", "storage_of"]

ZERO = sympy.Integer(0)


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeCost:
    kind: str  # matmul | linear | conv | embedding | elementwise | norm | view | opaque | none
    fwd_flops: sympy.Expr = ZERO
    bwd_flops: sympy.Expr = ZERO
    mm_flops: sympy.Expr = ZERO  # forward FLOPs done in matrix products (runs at tensor-core rate)
    wgrad_flops: sympy.Expr = ZERO  # of bwd_flops, the parameters' gradients (W): each weight operand's dW
    # product, a bias's sum over rows, an embedding table's scatter-add. A norm's weight and bias gradients are
    # left in the input gradient (a simplification: a few FLOPs per element inside the norm's backward kernel)
    wgrad_mm_flops: sympy.Expr = ZERO  # of wgrad_flops, the dW matrix products' (at the product's rate)
    fwd_bytes: sympy.Expr = ZERO  # read + written, forward
    bwd_bytes: sympy.Expr = ZERO
    out_bytes: sympy.Expr = ZERO
    params: int = 0
    param_names: tuple[str, ...] = ()
    saved: tuple[tuple[str, sympy.Expr], ...] = ()  # (tensor name, bytes) kept for backward
    full_mm_flops: sympy.Expr | None = None  # mm_flops with causal attention counted in full (None: the same)
    op: str = ""  # the op's name (passes.costs.node_kind): which eager kernel runs it (costmodels.eager)
    copy_bytes: sympy.Expr = ZERO  # forward layout copies the node dispatched (passes.measure), each written once
    # and read once by copy kernels (one launch counted per node): memory-bound work beside the node's own (their
    # backward is not charged: the gradient of a copy is passed on as it is)


# op name -> (forward FLOPs per output element, backward FLOPs per output element, saves)
# saves: "in" = first tensor input, "out" = output, "mask" = 1 byte per element, "" = nothing.
ELEMENTWISE: dict[str, tuple[int, int, str]] = {
    "add": (1, 0, ""), "sub": (1, 0, ""), "iadd": (1, 0, ""), "neg": (1, 1, ""),
    "mul": (1, 2, "operands"), "truediv": (1, 2, "operands"), "div": (1, 2, "operands"),
    "gelu": (8, 12, "in"), "relu": (1, 1, "out"), "silu": (5, 8, "in"), "tanh": (4, 3, "out"),
    "sigmoid": (4, 3, "out"), "exp": (1, 1, "out"), "pow": (2, 3, "in"), "sqrt": (1, 2, "out"),
    "rsqrt": (2, 3, "out"), "masked_fill": (1, 1, ""), "where": (1, 1, ""),
    "softmax": (5, 4, "out"), "log_softmax": (5, 4, "out"), "dropout": (2, 1, "mask"),
    "layer_norm": (8, 14, "in"), "batch_norm": (8, 14, "in"), "group_norm": (8, 14, "in"),
    "rms_norm": (5, 9, "in"), "adaptive_avg_pool2d": (1, 1, ""), "avg_pool2d": (1, 1, ""),
    "max_pool2d": (1, 1, "in"), "mean": (1, 1, ""), "sum": (1, 1, ""), "cross_entropy": (8, 6, "in"),
    "square": (1, 2, "in"), "abs": (1, 1, "in"), "clamp": (1, 1, "in"), "erf": (8, 8, "in"),
    "reciprocal": (1, 2, "out"), "log": (1, 1, "in"), "cos": (4, 4, "in"), "sin": (4, 4, "in"),
}
# torch function / aten op names that mean the same as a name above
ATEN_NAMES = {"linear": "linear_fn", "bmm": "matmul", "baddbmm": "matmul", "mm": "matmul", "addmm": "matmul",
              "addbmm": "matmul", "einsum": "matmul", "conv2d": "conv", "conv1d": "conv", "conv3d": "conv",
              "convolution": "conv", "cross_entropy_loss": "cross_entropy", "native_dropout": "dropout",
              "softmax": "softmax", "to_copy": "to", "unsafe_view": "view", "and": "logical", "or": "logical",
              "eq": "logical", "ne": "logical", "le": "logical", "lt": "logical", "ge": "logical", "gt": "logical",
              "scaled_dot_product_attention": "attention"}
VIEWS = {"view", "reshape", "permute", "transpose", "unbind", "getitem", "flatten", "split", "chunk",
         "squeeze", "unsqueeze", "expand", "size", "getattr", "contiguous", "t", "arange", "to", "type_as",
         "float", "half", "bfloat16", "detach", "clone", "floordiv", "cat", "stack", "slice", "select", "alias",
         "unflatten", "sym_size", "assert_tensor_metadata", "lift_fresh_copy", "new_ones", "new_zeros", "zeros",
         "ones", "full", "empty", "scalar_tensor", "pad", "constant_pad_nd", "repeat_interleave", "index",
         "logical", "cumsum", "diff", "lt", "sym_numel", "item", "gather", "index_select", "masked_select",
         "roll", "flip", "tril", "triu", "zeros_like", "ones_like", "full_like", "empty_like", "copy",
         "view_as_complex", "view_as_real"}  # (a complex view of pairs of reals and back: the same storage)
MODULE_OPS: dict[type, str] = {
    nn.ReLU: "relu", nn.GELU: "gelu", nn.SiLU: "silu", nn.Tanh: "tanh", nn.Sigmoid: "sigmoid",
    nn.Dropout: "dropout", nn.LayerNorm: "layer_norm", nn.BatchNorm1d: "batch_norm",
    nn.BatchNorm2d: "batch_norm", nn.GroupNorm: "group_norm", nn.Softmax: "softmax",
    nn.AdaptiveAvgPool2d: "adaptive_avg_pool2d", nn.AvgPool2d: "avg_pool2d", nn.MaxPool2d: "max_pool2d",
    nn.Flatten: "flatten", nn.Identity: "view", nn.CrossEntropyLoss: "cross_entropy",
}


def node_kind(node: fx.Node, gm: fx.GraphModule) -> str:
    """A short op name for a node: 'linear', 'matmul', 'gelu', ... or the module class name."""
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        if isinstance(mod, nn.Linear):
            return "linear"
        if isinstance(mod, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            return "conv"
        if isinstance(mod, nn.Embedding):
            return "embedding"
        return MODULE_OPS.get(type(mod), type(mod).__name__)
    if node.op in ("call_function", "call_method"):
        target = node.target
        if isinstance(target, torch._ops.OpOverload):
            target = target.overloadpacket
        name = target if isinstance(target, str) else getattr(target, "__name__", str(target))
        name = name.strip("_")
        return ATEN_NAMES.get(name, name)
    return node.op


def _inputs(node: fx.Node) -> list[tuple[fx.Node, TensorInfo]]:
    out = []
    for a in [*node.args, *node.kwargs.values()]:
        items = a if isinstance(a, (tuple, list)) else (a,)
        out.extend((x, tensor_info(x)) for x in items if tensor_info(x) is not None)
    return out


ALIASING = {"view", "reshape", "permute", "transpose", "flatten", "squeeze", "unsqueeze", "contiguous",
            "t", "to", "type_as", "detach", "dropout", "Identity", "expand"}


def storage_of(node: fx.Node) -> fx.Node:
    """Name of the tensor a saved value really is: follow views and no-op dropouts to their source,
    so a tensor saved by two ops (softmax output, read by the next matmul) is counted once."""
    gm = node.graph.owning_module
    while node.op in ("call_function", "call_method", "call_module") and node_kind(node, gm) in ALIASING:
        if node_kind(node, gm) == "dropout" and _dropout_active(node):
            break
        srcs = [a for a in node.all_input_nodes if tensor_info(a) is not None]
        if len(srcs) != 1 or tensor_info(srcs[0]).numel != tensor_info(node).numel:
            break
        node = srcs[0]
    return node


def _is_param(node: fx.Node, gm: fx.GraphModule) -> bool:
    if node.op != "get_attr":
        return False
    return isinstance(_attr(gm, str(node.target)), nn.Parameter)


def _attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _module_params(mod: nn.Module, prefix: str) -> tuple[int, tuple[str, ...]]:
    named = list(mod.named_parameters(prefix=prefix))
    return sum(p.numel() for _, p in named), tuple(n for n, _ in named)


def _matmul_flops(a: TensorInfo, b: TensorInfo, out: TensorInfo) -> sympy.Expr:
    k = a.shape[-1] if a.shape else sympy.Integer(1)
    return 2 * out.numel * k


def _cost_of(node: fx.Node, gm: fx.GraphModule) -> NodeCost:
    out = tensor_info(node)
    kind = node_kind(node, gm)
    if node.op in ("placeholder", "output") or out is None:
        return NodeCost(kind="none")
    if node.op == "get_attr":
        obj = _attr(gm, str(node.target))
        n = obj.numel() if isinstance(obj, nn.Parameter) else 0
        return NodeCost(kind="view", params=n, param_names=(str(node.target),) if n else ())
    measured = node.meta.get(MEASURED)
    if measured is not None and measured.weight_gather:
        return NodeCost(kind="view", out_bytes=out.nbytes)  # no copy: the grouped GEMM reads the weights
    ins = _inputs(node)
    read = sum((_read_bytes(n, info) for n, info in (ins[:1] if kind in LIKE else ins)), ZERO)
    io = read + out.nbytes
    acts = [(n, i) for n, i in ins if not _is_param(n, gm) and i.requires_grad]
    saved_inputs = tuple((storage_of(n).name, i.nbytes) for n, i in acts)
    weights = _weight_operands(node, gm, kind, ins)
    cost = replace(_table_cost(node, gm, kind, out, ins, io, acts, saved_inputs, weights), op=kind)
    return _with_measured(cost, measured, kind, ins, weights) if measured is not None else cost


def _weight_operands(node: fx.Node, gm: fx.GraphModule, kind: str, ins: list[tuple[fx.Node, TensorInfo]]) -> int:
    """Operands of a product (or an embedding's table) that are parameters needing a gradient: a Linear or
    Conv module's weight, or a parameter read through get_attr (torch.export's graphs), transposed or viewed on
    the way, or experts' weights gathered for a grouped GEMM. Each adds a dW product the size of the forward."""
    if node.op == "call_module":
        weight = getattr(gm.get_submodule(str(node.target)), "weight", None)
        return int(kind in ("linear", "conv", "embedding") and isinstance(weight, nn.Parameter)
                   and weight.requires_grad)
    return sum(1 for n, i in ins[:2] if i.requires_grad and (_is_param(src := storage_of(n), gm) or (
        (m := src.meta.get(MEASURED)) is not None and m.weight_gather)))


CASTS = {"to", "float", "half", "bfloat16", "type_as"}
LIKE = {"type_as", "view_as", "expand_as", "reshape_as"}  # x.op(other): other's dtype or shape only, not its elements


def _read_bytes(node: fx.Node, info: TensorInfo) -> sympy.Expr:
    """Bytes an op reads from an input: experts' weights gathered per token are read once per expert
    (the parameter's bytes), as a grouped GEMM reads them."""
    src = storage_of(node)
    m = src.meta.get(MEASURED)
    if m is not None and m.weight_gather:
        weight = tensor_info(src.all_input_nodes[0]) if src.all_input_nodes else None
        return weight.nbytes if weight is not None else ZERO
    return info.nbytes


def _table_cost(node: fx.Node, gm: fx.GraphModule, kind: str, out: TensorInfo, ins: list[tuple[fx.Node, TensorInfo]],
                io: sympy.Expr, acts: list[tuple[fx.Node, TensorInfo]],
                saved_inputs: tuple[tuple[str, sympy.Expr], ...], weights: int) -> NodeCost:
    if node.op == "call_module" and kind in ("linear", "conv", "embedding"):
        return _module_cost(node, gm, kind, out, io, saved_inputs, weights)
    if kind == "embedding":  # a gather forward, a scatter-add of the output gradient (the table's W) backward
        return NodeCost(kind="embedding", bwd_flops=out.numel, wgrad_flops=out.numel if weights else ZERO,
                        fwd_bytes=2 * out.nbytes, bwd_bytes=3 * out.nbytes, out_bytes=out.nbytes)
    if kind in CASTS and ins and ins[0][1].dtype != out.dtype:  # a dtype cast copies
        return NodeCost(kind="elementwise", fwd_bytes=io, bwd_bytes=io, out_bytes=out.nbytes)
    if kind in ("matmul", "linear_fn", "conv", "attention"):
        a, b = ins[0][1], ins[1][1]
        fl = _matmul_flops(a, b, out)
        grads = sum(1 for n, i in ins[:2] if i.requires_grad)
        return NodeCost(kind="matmul", fwd_flops=fl, mm_flops=fl, bwd_flops=fl * max(grads, 1),
                        wgrad_flops=fl * weights, wgrad_mm_flops=fl * weights, fwd_bytes=io, bwd_bytes=2 * io,
                        out_bytes=out.nbytes, saved=saved_inputs)
    if kind in VIEWS:
        moved = out.nbytes * 2 if kind in ("contiguous", "cat", "stack", "clone", "index", "gather", "index_select",
                                           "roll", "flip", "copy", "repeat_interleave") else ZERO
        return NodeCost(kind="view", fwd_bytes=moved, bwd_bytes=moved, out_bytes=out.nbytes)
    return _elementwise_cost(node, kind, out, ins, io, acts)


def _with_measured(cost: NodeCost, m: Measured, kind: str, ins: list[tuple[fx.Node, TensorInfo]],
                   weights: int) -> NodeCost:
    """The table's cost with the measured FLOPs of matrix products / convolutions / attention and the
    measured tensors saved for backward (a Linear module's bias gradient kept from the table)."""
    if kind in ("contiguous", "clone"):  # the copy itself, or nothing where the tensor was contiguous already
        return replace(cost, fwd_bytes=ZERO, copy_bytes=m.copy_bytes, saved=m.saved)
    if m.flops == 0:
        return replace(cost, saved=m.saved, copy_bytes=m.copy_bytes)
    grads = sum(1 for _, i in ins[:3 if kind == "attention" else 2] if i.requires_grad)
    # backward of a product: one product per operand that needs a gradient; flash attention's
    # backward is 5 products for the forward's 2 (torch.utils.flop_counter.sdpa_backward_flop_count)
    bwd_mm = m.flops * (sympy.Rational(5, 2) if kind == "attention" else max(grads, 1))
    other_fwd = cost.fwd_flops - cost.mm_flops if cost.kind in ("linear", "opaque") else ZERO
    other_bwd = sympy.Max(cost.bwd_flops - 2 * cost.mm_flops, 0) if cost.kind in ("linear", "opaque") else ZERO
    wgrad_mm = m.flops * weights
    return replace(cost, kind="attention" if kind == "attention" else cost.kind if cost.kind in ("linear", "conv")
                   else "matmul", fwd_flops=m.flops + other_fwd, mm_flops=m.flops, full_mm_flops=m.full_flops,
                   bwd_flops=bwd_mm + other_bwd, wgrad_flops=cost.wgrad_flops - cost.wgrad_mm_flops + wgrad_mm,
                   wgrad_mm_flops=wgrad_mm, saved=m.saved, copy_bytes=m.copy_bytes)


def _module_cost(node: fx.Node, gm: fx.GraphModule, kind: str, out: TensorInfo, io: sympy.Expr,
                 saved: tuple[tuple[str, sympy.Expr], ...], weights: int) -> NodeCost:
    mod = gm.get_submodule(str(node.target))
    params, names = _module_params(mod, str(node.target))
    wbytes = sum((p.numel() * p.element_size() for p in mod.parameters()), 0)
    if kind == "linear":
        rows = out.numel / mod.out_features
        mm = 2 * rows * mod.in_features * mod.out_features
        bias = out.numel if mod.bias is not None else ZERO
        return NodeCost(kind="linear", fwd_flops=mm + bias, mm_flops=mm, bwd_flops=2 * mm + bias,
                        wgrad_flops=mm * weights + bias, wgrad_mm_flops=mm * weights, fwd_bytes=io + wbytes,
                        bwd_bytes=2 * (io + wbytes), out_bytes=out.nbytes, params=params, param_names=names,
                        saved=saved)
    if kind == "conv":
        per_out = (mod.in_channels // mod.groups) * math.prod(mod.kernel_size)
        mm = 2 * out.numel * per_out
        return NodeCost(kind="conv", fwd_flops=mm, mm_flops=mm, bwd_flops=2 * mm, wgrad_flops=mm * weights,
                        wgrad_mm_flops=mm * weights, fwd_bytes=io + wbytes,
                        bwd_bytes=2 * (io + wbytes), out_bytes=out.nbytes, params=params,
                        param_names=names, saved=saved)
    # embedding: a gather forward, a scatter-add of the output gradient (the table's W) backward
    return NodeCost(kind="embedding", bwd_flops=out.numel, wgrad_flops=out.numel if weights else ZERO,
                    fwd_bytes=2 * out.nbytes, bwd_bytes=2 * out.nbytes + wbytes, out_bytes=out.nbytes,
                    params=params, param_names=names)


def _elementwise_cost(node: fx.Node, kind: str, out: TensorInfo, ins: list[tuple[fx.Node, TensorInfo]],
                      io: sympy.Expr, acts: list[tuple[fx.Node, TensorInfo]]) -> NodeCost:
    if kind not in ELEMENTWISE:
        return _opaque_cost(node, kind, out, ins, io, acts)
    fwd, bwd, saves = ELEMENTWISE[kind]
    if kind in ("add", "sub") and any(i.numel != out.numel for _, i in acts):
        bwd = 1  # the broadcast operand's gradient is a reduction
    if kind in ("mul", "truediv", "div") and len(acts) < 2:
        bwd, saves = 1, ""  # scaling by a constant: the gradient is one multiply, nothing saved
    if kind == "dropout" and not _dropout_active(node):
        return NodeCost(kind="view", out_bytes=out.nbytes)
    numel = out.numel
    saved: tuple[tuple[str, sympy.Expr], ...] = ()
    if saves == "in" and acts:
        saved = ((storage_of(acts[0][0]).name, acts[0][1].nbytes),)
    elif saves == "out":
        saved = ((storage_of(node).name, out.nbytes),)
    elif saves == "mask":
        saved = ((node.name + ".mask", numel),)
    elif saves == "operands":
        saved = tuple((storage_of(n).name, i.nbytes) for n, i in acts)
    return NodeCost(kind="norm" if kind.endswith("norm") else "elementwise", fwd_flops=fwd * numel,
                    bwd_flops=bwd * numel, fwd_bytes=io, bwd_bytes=2 * io, out_bytes=out.nbytes, saved=saved)


def _opaque_cost(node: fx.Node, kind: str, out: TensorInfo, ins: list[tuple[fx.Node, TensorInfo]],
                 io: sympy.Expr, acts: list[tuple[fx.Node, TensorInfo]]) -> NodeCost:
    """A leaf module or unknown op: priced as memory-bound, 2 FLOPs per parameter per output row. A leaf
    module's backward is left whole in the input gradient (which of its products read a weight is not seen)."""
    gm = node.graph.owning_module
    params, names = 0, ()
    if node.op == "call_module" and gm is not None:
        params, names = _module_params(gm.get_submodule(str(node.target)), str(node.target))
    rows = out.numel / out.shape[-1] if out.shape else sympy.Integer(1)
    fl = 2 * params * rows + out.numel
    return NodeCost(kind="opaque", fwd_flops=fl, bwd_flops=2 * fl, mm_flops=2 * params * rows,
                    fwd_bytes=io, bwd_bytes=2 * io, out_bytes=out.nbytes, params=params, param_names=names,
                    saved=tuple((storage_of(n).name, i.nbytes) for n, i in acts))


def _dropout_active(node: fx.Node) -> bool:
    gm = node.graph.owning_module
    if node.op == "call_module" and gm is not None:
        return gm.get_submodule(str(node.target)).p > 0
    p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)
    return not isinstance(p, (int, float)) or p > 0


def annotate_costs(gm: fx.GraphModule) -> None:
    """Write node.meta[COST] for every node (needs node.meta[TENSOR] and [MEASURED] from passes.measure)."""
    for node in gm.graph.nodes:
        node.meta[COST] = _cost_of(node, gm)
