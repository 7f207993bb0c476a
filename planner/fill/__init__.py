"""Fill pipeline bubbles with other jobs' work: packing (PipeFill) and model loading (PipeSwitch)."""

from __future__ import annotations

from planner.fill.packing import (
    DEFAULT_LAUNCH_OVERHEAD_S,
    BubbleSlot,
    Chunk,
    EmptyBubble,
    FillUnit,
    Packing,
    PackingError,
    PackingParams,
    cpsat_pack,
    greedy_pack,
    validate_packing,
)
from planner.fill.pipeswitch import (
    Grouping,
    Layer,
    TransferOverhead,
    dp_grouping,
    exhaustive_grouping,
    group_latency,
    optimal_grouping,
    per_layer_grouping,
    single_group,
)

__all__ = [
    "DEFAULT_LAUNCH_OVERHEAD_S",
    "BubbleSlot",
    "Chunk",
    "EmptyBubble",
    "FillUnit",
    "Grouping",
    "Layer",
    "Packing",
    "PackingError",
    "PackingParams",
    "TransferOverhead",
    "cpsat_pack",
    "dp_grouping",
    "exhaustive_grouping",
    "greedy_pack",
    "group_latency",
    "optimal_grouping",
    "per_layer_grouping",
    "single_group",
    "validate_packing",
]
