"""Trace and price one representative of each repeated block, and reuse it for its repeats.

A block container (see `passes.units`) of L blocks is cut, while the model is captured and
measured, to the first block of each distinct kind (class and parameter shapes) plus a second
block, so that a 126-layer model costs two traced blocks, not 126. After pricing, the units of the
left-out blocks are copies of their representative's unit under their own names. This is exact
when a block's computation is determined by its class and parameter shapes (true of the
transformer stacks of GPT, Llama, Mistral, Qwen2, BERT, and of ResNet stages).
"""
from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Iterator

from torch import nn

from .units import Unit, block_containers, stacked

__all__ = ["Cut", "representatives", "expand"]


@dataclass(frozen=True, slots=True)
class Cut:
    container: str  # qualified name of the block container
    length: int  # blocks it really has
    rep_of: tuple[int, ...]  # block i -> position of its representative among the kept blocks


def _signature(block: nn.Module) -> tuple:
    return type(block), tuple((n, tuple(p.shape)) for n, p in block.named_parameters())


@contextmanager
def representatives(root: nn.Module) -> Iterator[list[Cut]]:
    """While open, each block container of `root` holds its representatives only."""
    cuts: list[Cut] = []
    saved: list[tuple[nn.Module, dict]] = []
    for name in block_containers(root):
        container = root.get_submodule(name) if name else root
        blocks = stacked(container)
        sigs = [_signature(b) for b in blocks]
        common = Counter(sigs).most_common(1)[0][0]
        kept: dict[tuple, int] = {}  # signature -> position among the kept blocks (its last representative)
        order: list[int] = []
        rep_of = []
        for i, sig in enumerate(sigs):  # the first of each kind, and a second of the commonest (still a container)
            if sig not in kept or (sig == common and sigs[:i].count(sig) == 1):
                kept[sig] = len(order)
                order.append(i)
            rep_of.append(kept[sig])
        if len(order) == len(blocks):
            continue
        saved.append((container, dict(container._modules)))
        container._modules.clear()
        container._modules.update((str(k), blocks[i]) for k, i in enumerate(order))
        cuts.append(Cut(name, len(blocks), tuple(rep_of)))
    try:
        yield cuts
    finally:
        for container, modules in saved:
            container._modules.clear()
            container._modules.update(modules)


def expand(units: list[Unit], cuts: list[Cut]) -> list[Unit]:
    """The units of the whole model: each cut container's blocks, priced by their representatives."""
    for cut in cuts:
        prefix = f"{cut.container}." if cut.container else ""
        reps = {u.name: u for u in units if u.kind == "block" and u.name.startswith(prefix)
                and u.name[len(prefix):].isdigit()}
        first = min((k for k, u in enumerate(units) if u.name in reps), default=None)
        if first is None:
            continue
        out = units[:first]
        for i, j in enumerate(cut.rep_of):
            rep = reps[f"{prefix}{j}"]
            old, new = f"{prefix}{j}", f"{prefix}{i}"
            out.append(replace(rep, name=new, nodes=rep.nodes if i == j else (),
                               tp_layout=tuple((new + path[len(old):], style) for path, style in rep.tp_layout)))
        units = out + units[first + len(reps):]
    return [replace(u, index=k) for k, u in enumerate(units)]
