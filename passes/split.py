"""Split a traced model into one submodule per partition unit (or per stage of a plan)."""
from __future__ import annotations

from typing import Callable

import torch.fx as fx
from torch import nn
from torch.fx.passes.split_module import split_module

from .units import group_nodes

__all__ = ["unit_of_nodes", "split_by"]


def unit_of_nodes(gm: fx.GraphModule, root: nn.Module) -> dict[str, int]:
    """fx node name -> unit index, grouping exactly as the planning passes do."""
    return {n.name: i for i, (_, _, nodes) in enumerate(group_nodes(gm, root)) for n in nodes}


def split_by(gm: fx.GraphModule, root: nn.Module, part_of: Callable[[str], int]) -> fx.GraphModule:
    """A GraphModule whose children submod_K run the nodes with part_of(node name) == K, in order."""
    return split_module(gm, root, lambda node: part_of(node.name), keep_original_order=True)
