"""Tensor-parallel roles of nodes, as Megatron splits a transformer block.

Inside a unit, linears pair up in order: the first of a pair is column-parallel (its weight split
by output features), the second row-parallel (split by input features); every node between them
works on a 1/t shard. A pair costs one all-reduce of the row output forward and one of the column
input's gradient backward (thesis 4.3.2: 2+2 per transformer layer). A lone vocabulary-sized
linear (the LM head) is column-parallel with a parallel cross-entropy; a vocabulary embedding is
split by rows and all-reduces its output. Everything else is replicated.
"""
from __future__ import annotations

from typing import Iterable

import torch.fx as fx

from .costs import node_kind
from .meta_keys import COST, TP

__all__ = ["annotate_tp_roles", "VOCAB_MIN"]

VOCAB_MIN = 1024  # an embedding or lone linear at least this wide is split over the vocabulary


def _out_features(node: fx.Node, gm: fx.GraphModule) -> int:
    if node.op == "call_module":
        return gm.get_submodule(str(node.target)).out_features
    info = node.meta.get("fxp.tensor")
    return int(info.shape[-1]) if info is not None else 0


def annotate_tp_roles(gm: fx.GraphModule, units: Iterable[list[fx.Node]]) -> None:
    """Write node.meta[TP] for the nodes of each unit (a unit is a list of nodes in order)."""
    for nodes in units:
        for n in nodes:
            n.meta[TP] = "replicated"
        kinds = [node_kind(n, gm) for n in nodes]
        linears = [i for i, k in enumerate(kinds) if k in ("linear", "linear_fn")]
        if len(linears) >= 2 and len(linears) % 2 == 0:
            for col, row in zip(linears[::2], linears[1::2]):
                nodes[col].meta[TP], nodes[row].meta[TP] = "col", "row"
                for n in nodes[col + 1:row]:
                    if n.meta[COST].kind != "none":
                        n.meta[TP] = "sharded"
        elif len(linears) == 1 and _out_features(nodes[linears[0]], gm) >= VOCAB_MIN:
            nodes[linears[0]].meta[TP] = "vocab-col"
        for n, k in zip(nodes, kinds):
            if k == "embedding" and gm.get_submodule(str(n.target)).num_embeddings >= VOCAB_MIN:
                n.meta[TP] = "vocab-emb"
        for n in nodes:  # a weight read through get_attr is split like the op that uses it
            if n.op == "get_attr" and n.users and all(u.meta.get(TP, "replicated") != "replicated" for u in n.users):
                n.meta[TP] = "sharded"
