"""A pipeline partition stated as Megatron-Core states it: --pipeline-model-parallel-layout, or its default.

Megatron-Core's layout string lists the virtual stages in order (chunk c of rank r is stage c*p + r), split by '|':
E the embedding, t a transformer layer, m a multi-token-prediction layer, L the loss (final norm and output layer);
"(group)*n" and "x*n" repeat, commas are cosmetic (megatron/core/transformer/pipeline_parallel_layer_layout.py,
PipelineParallelLayerLayout.parse_str_to_list). "even" is what Megatron runs without one: the layers split evenly
over the p*v virtual stages, the embedding with the first and the loss with the last (it refuses layers that do not
divide). A planned model's units map on it as the export writes them (planner.export.layout): an embedding unit, the
repeated blocks in order, a head unit. A model's multi-token-prediction layers (_hf_models.MultiTokenPrediction) are
priced in its head unit, with the loss, where Megatron-Core runs them by default: an m belongs in the loss's stage
(of a model without them it stands for nothing).
"""
from __future__ import annotations

import re
from functools import lru_cache
from typing import Sequence

from passes.errors import UserError

__all__ = ["EVEN", "layout_stages", "layout_bounds"]

EVEN = "even"
_LETTERS = set("ELtm")


def _stages(layout: str) -> list[str]:
    text = layout.replace(",", "").replace(" ", "")
    for pattern in (r"\(([^()]+)\)\*(\d+)", r"(.)\*(\d+)"):
        text = re.sub(pattern, lambda x: x.group(1) * int(x.group(2)), text)
    stages = text.split("|")
    bad = sorted({ch for s in stages for ch in s} - _LETTERS)
    if bad:
        raise UserError(f"pipeline layout {layout!r}: {''.join(bad)!r} is not one of E, t, m, L, '|', '(...)*n' "
                        "(Megatron-Core's --pipeline-model-parallel-layout), or 'even'")
    return stages


@lru_cache(maxsize=64)
def layout_stages(layout: str) -> int | None:
    """Virtual stages (p*v) a layout string states; None for "even" (any)."""
    return None if layout == EVEN else len(_stages(layout))


def layout_bounds(layout: str, kinds: Sequence[str], stages: int) -> tuple[int, ...]:
    """Unit bounds of `stages` virtual stages laid out as `layout` states, over units of `kinds` ("embedding", then
    "block"s, then "head"). UserError in one sentence where the layout and the model disagree."""
    blocks = sum(1 for k in kinds if k == "block")
    embed, head = int(bool(kinds) and kinds[0] == "embedding"), int(bool(kinds) and kinds[-1] == "head")
    if embed + blocks + head != len(kinds):
        raise UserError("a pipeline layout needs a model of one stack of repeated blocks between an embedding and a "
                        "head; this model's units are " + ", ".join(sorted(set(kinds))))
    if layout == EVEN:
        if blocks % stages:
            raise UserError(f"Megatron's default layout splits the {blocks} layers evenly over the {stages} virtual "
                            "stages, which they do not divide: pin another --pp/--vp or state --pipeline-layout")
        return (0, *(embed + blocks // stages * j for j in range(1, stages)), len(kinds))
    rows = _stages(layout)
    if len(rows) != stages:
        raise UserError(f"pipeline layout {layout!r} states {len(rows)} virtual stages; the configuration has {stages} "
                        "(pp x vp)")
    counts = {ch: sum(r.count(ch) for r in rows) for ch in "ELt"}
    if counts["t"] != blocks or counts["E"] != embed or counts["L"] != head:
        raise UserError(f"pipeline layout {layout!r} places {counts['E']} embedding, {counts['t']} layers and "
                        f"{counts['L']} loss; the model has {embed}, {blocks} and {head}")
    if any("m" in r and "L" not in r for r in rows):
        raise UserError(f"pipeline layout {layout!r} puts multi-token prediction (m) in a stage without the loss (L); "
                        "the planner prices those layers with the loss, in its stage (e.g. ...|tt|mL)")
    order = "".join(rows).replace("m", "")
    if order != "E" * embed + "t" * blocks + "L" * head:
        raise UserError(f"pipeline layout {layout!r} does not keep the embedding first and the loss last")
    bounds, at = [0], 0
    for row in rows:
        n = sum(1 for ch in row if ch != "m")
        if not n:
            raise UserError(f"pipeline layout {layout!r} leaves a virtual stage with no layer of this model")
        at += n
        bounds.append(at)
    return tuple(bounds)
