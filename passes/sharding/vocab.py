"""The uses of a vocabulary weight that the fxplanner runtime splits by rows over the tensor-parallel ranks (planner/
runtime/vocab_parallel.py, Megatron's VocabParallelEmbedding and column-parallel output layer): a lookup (an
nn.Embedding, F.embedding, an exported graph's aten.embedding) or a product (the LM head: an nn.Linear, F.linear with
the weight of an embedding it is tied to, aten.linear). Anything else reads the weight whole, which a rank holding V/t
of its rows cannot: `vocab_refusal` finds it at trace time, so that the search leaves tensor parallelism out (or a
pinned --tp is refused in one sentence) rather than the runtime refusing the plan when it builds its stages."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.fx as fx
from torch import nn

from ..costs import node_kind
from ..units import embedding_weight
from .check import refused_op
from .walk import Refusal

__all__ = ["VOCAB_STYLES", "plain_lookup", "vocab_use", "vocab_refusal"]

VOCAB_STYLES = ("vocab", "vocab_colwise")
"""The plan's styles of the vocabulary split (an embedding's rows, an nn.Linear head's outputs: passes.units)."""


def plain_lookup(n: fx.Node) -> bool:
    """An embedding op without max_norm, scale_grad_by_freq or sparse gradients (a lookup of one rank's rows can
    neither count the other ranks' ids nor renormalize their rows)."""
    if isinstance(n.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):  # (weight, ids, pad, scale, sparse)
        extra = [*n.args[3:5], n.kwargs.get("scale_grad_by_freq"), n.kwargs.get("sparse")]
    else:  # F.embedding(ids, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse)
        extra = [n.args[3] if len(n.args) > 3 else None, *n.args[5:7], n.kwargs.get("max_norm"),
                 n.kwargs.get("scale_grad_by_freq"), n.kwargs.get("sparse")]
    return not any(x not in (None, False) for x in extra)


def vocab_use(n: fx.Node, module: nn.Module | None, weight_of: Callable[[Any], nn.Parameter | None],
              split: Callable[[nn.Parameter], bool]) -> str | None:
    """How `n` reads the vocabulary weights (`split` says which parameters are; `weight_of`, which parameter an
    argument node is), where the runtime splits it so: "lookup", "product", or None (it reads them whole, or reads
    none). `module`: what a call_module node calls."""
    if module is not None:
        owned = [p for p in module.parameters() if split(p)]
        if not owned or any(weight_of(a) is not None for a in n.all_input_nodes):
            return None
        if isinstance(module, nn.Embedding):
            return "lookup" if module.max_norm is None and not module.scale_grad_by_freq and not module.sparse else None
        if isinstance(module, nn.Linear) and split(module.weight):
            return "product" if module.bias is None or split(module.bias) else None
        return None
    kind = node_kind(n, n.graph.owning_module)
    reads = [a for a in n.all_input_nodes if weight_of(a) is not None]
    if kind == "embedding":
        return "lookup" if reads == [embedding_weight(n)] and plain_lookup(n) else None
    if kind == "linear_fn" and len(n.args) > 1 and weight_of(n.args[1]) is not None:
        bias = n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")
        if weight_of(n.args[0]) is None and (bias is None or weight_of(bias) is not None):
            return "product"  # (a bias of the V outputs: the head's, split by the same rows)
    return None


def vocab_refusal(gm: fx.GraphModule, root: nn.Module, paths: Iterable[str], model_file: str | Path) -> str | None:
    """The first op of the graph the runtime runs (`gm`, its modules `root`'s) that reads the weight of one of the
    modules at `paths` (the plan's vocab / vocab_colwise) otherwise than as a lookup or a product, with its source line
    (as passes.sharding.check.refused_op names one), or None."""
    split = {id(p) for path in paths for name in ("weight", "bias")
             if isinstance(p := getattr(root.get_submodule(path), name, None), nn.Parameter)}

    def weight_of(a: Any) -> nn.Parameter | None:
        if not isinstance(a, fx.Node) or a.op != "get_attr":
            return None
        value: Any = gm
        for part in str(a.target).split("."):
            value = getattr(value, part, None)
        return value if id(value) in split else None

    for n in gm.graph.nodes:
        if n.op not in ("call_module", "call_function", "call_method"):
            continue
        module = gm.get_submodule(str(n.target)) if n.op == "call_module" else None
        reads = any(weight_of(a) is not None for a in n.all_input_nodes) or \
            (module is not None and any(id(p) in split for p in module.parameters()))
        if reads and vocab_use(n, module, weight_of, lambda p: id(p) in split) is None:
            return refused_op(Refusal(node=n, why=f"{n.name}: it reads a vocabulary weight split over the "
                                                  "tensor-parallel ranks whole"), model_file)
    return None
