"""The plan command's options and their checks (the pins, the engines, the fill packers' names), importable without
torch: the CLI answers --help and its argument errors from here before it imports the search (planner.search re-exports
these)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from costmodels.fp8 import FP8_RECIPES
from costmodels.precision import PRECISIONS
from costmodels.recompute import RECOMPUTE
from passes.errors import UserError

from .config import ZERO_STAGES
from .layout import layout_stages
from .schedules import SCHEDULES

__all__ = ["ENGINES", "PACKER_NAMES", "Pins", "check_cluster", "check_fill_value", "check_main_slack", "check_fill_time_limit",
           "parse_model_args"]

PACKER_NAMES = ("greedy", "cpsat")
"""The names of planner.fill.assign.PACKERS (which imports torch), for --fill-solver's help and check; a test keeps
them equal."""

ENGINES = ("fxplanner", "megatron", "torchtitan")
"""What runs a plan: fxplanner's own runtime (`python -m planner.runtime`), or an engine the plan is exported to
(Megatron-LM / Megatron-Core with Transformer Engine, torchtitan): a plan for an engine chooses among what that engine
runs, and its launch commands are the export's."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Pins:
    """Dimensions fixed by the user; None lets the search choose. Names as in ParallelConfig."""

    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    b: int | None = None
    v: int | None = None
    recompute: str | None = None
    recompute_layers: int | None = None  # under recompute "block": blocks per model chunk (None: the least that fits)
    schedule: str | None = None
    schedules: tuple[str, ...] | None = None  # the kinds the search may choose (None: every registered kind), e.g.
    # the ones an engine runs (Megatron-LM: gpipe, 1f1b, interleaved)
    cp: int | None = None  # context parallelism; None: the search tries the degrees a ring inside one node allows
    ep: int | None = None  # expert parallelism; None: the search tries every degree dividing the experts (MoE only)
    zero: int | None = None  # None: 1 wherever d*cp > 1 (it dominates: the same bytes, a shorter step, less memory)
    grad_fp32: bool | None = None  # None: the engine's default (Megatron: fp32 under bf16; fxplanner: the weights' dtype)
    overlap_grad_reduce: bool | None = None  # None: on wherever d*cp > 1 (overlap never exposes more)
    tp_comm_overlap: bool = False  # an option (Transformer Engine's userbuffers): on with every sequence-parallel config
    sp: bool | None = None  # sequence parallelism; None: the search tries both where t > 1
    precision: str = "bf16"
    fp8: str = ""  # FP8 recipe of the linear layers (costmodels.fp8); "auto": the engine's default for the GPU
    engine: str = "fxplanner"  # what runs the plan (ENGINES): its launch commands, and what it can run
    fp8_params: bool = False  # the linear layers' weights in FP8 only (Megatron --fp8-param-gather)
    expert_load: float = 1.0  # the busiest expert-parallel rank's tokens over the balanced share (ParallelConfig)
    moe_capacity: float = 0.0  # experts padded to this capacity factor (ParallelConfig); 0: dropless
    moe_dispatcher: str = "alltoall"  # ParallelConfig.moe_dispatcher
    moe_a2a_overlap: bool = False  # ParallelConfig.moe_a2a_overlap
    layout: str | None = None  # the partition as stated (planner.layout: Megatron-Core's layout string, or "even")
    max_microbatch: int = 16
    max_v: int = 8
    allow_cross_node_tp: bool = False

    def __post_init__(self) -> None:
        if self.recompute is not None and self.recompute not in RECOMPUTE:
            raise UserError(f"--recompute must be one of {', '.join(RECOMPUTE)}, got {self.recompute!r}")
        if self.recompute_layers is not None and (self.recompute_layers < 1 or self.recompute not in (None, "block")):
            raise UserError(f"--recompute-layers {self.recompute_layers} counts the blocks of each model chunk that "
                            "recompute \"block\" redoes: a positive number, with --recompute block")
        for name in ((self.schedule,) if self.schedule is not None else ()) + (self.schedules or ()):
            if name not in SCHEDULES:
                raise UserError(f"--schedule must be one of {', '.join(SCHEDULES)}, got {name!r}")
        if self.precision not in PRECISIONS:
            raise UserError(f"--dtype must be one of {', '.join(PRECISIONS)}, or fp8 (bf16 with the linear layers' "
                            f"GEMMs in FP8, as --fp8 auto), got {self.precision!r}")
        if self.engine not in ENGINES:
            raise UserError(f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.fp8 and self.fp8 != "auto" and self.fp8 not in FP8_RECIPES:
            raise UserError(f"--fp8 must be one of {', '.join(FP8_RECIPES)}, got {self.fp8!r}")
        if self.fp8 and self.precision == "fp32":
            raise UserError("FP8 recipes run under bf16 or fp16 mixed precision; drop --dtype fp32 or --fp8")
        if self.fp8_params and not self.fp8:
            raise UserError("--fp8-params keeps the weights in FP8: it needs --fp8 (or --dtype fp8)")
        if self.zero is not None and self.zero not in ZERO_STAGES:
            raise UserError(f"optimizer sharding stage must be one of {ZERO_STAGES}, got {self.zero!r}")
        for name in ("tp", "pp", "dp", "cp", "ep", "b", "v"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UserError(f"a pinned {name} must be a positive integer, got {value}")
        stages = layout_stages(self.layout) if self.layout else None
        if stages is not None and self.pp is not None and self.v is not None and self.pp * self.v != stages:
            raise UserError(f"the pipeline layout states {stages} virtual stages; --pp {self.pp} x --vp {self.v} is "
                            f"{self.pp * self.v}")
        if stages is not None and self.pp is not None and stages % self.pp:
            raise UserError(f"the pipeline layout states {stages} virtual stages, not a multiple of --pp {self.pp}")

    def pinned(self) -> list[str]:
        return [k for k in ("tp", "pp", "dp", "cp", "ep", "b", "v", "recompute", "schedule", "sp", "layout")
                if getattr(self, k) is not None]



def check_cluster(n_gpus: int, gpus_per_node: int) -> None:
    if n_gpus < 1:
        raise UserError(f"--gpus must be positive, got {n_gpus}")
    if n_gpus > gpus_per_node and n_gpus % gpus_per_node:
        raise UserError(f"{n_gpus} GPUs do not fill whole nodes of {gpus_per_node}; use a multiple of "
                        f"{gpus_per_node} (or set --gpus-per-node)")
    if n_gpus < gpus_per_node and gpus_per_node % n_gpus:
        raise UserError(f"{n_gpus} GPUs do not divide a node of {gpus_per_node}; use a divisor of "
                        f"{gpus_per_node} (or set --gpus-per-node)")


def check_fill_value(fill_value: float) -> None:
    if not (math.isfinite(fill_value) and fill_value >= 0):
        raise UserError(f"--fill-value must be a finite number >= 0 (the worth of a recovered fill GPU-second "
                        f"against a main-job one), got {fill_value:g}")


def check_main_slack(main_slack: float) -> None:
    if main_slack < 0:
        raise UserError(f"--main-slack must be >= 0, got {main_slack}")


def check_fill_time_limit(seconds: float) -> None:
    if seconds <= 0:
        raise UserError(f"--fill-time-limit must be positive, got {seconds}")


def parse_model_args(items: list[str]) -> dict[str, Any]:
    """['layers=4', 'preset=1t', 'dropout=0.0'] -> typed kwargs (int, float, bool or str)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--model-arg {item!r} is not key=value (e.g. --model-arg layers=24)")
        out[key.strip()] = _typed(raw.strip())
    return out


def _typed(raw: str) -> Any:
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    for cast in (int, float):
        try:
            return cast(raw)
        except ValueError:
            pass
    return raw
