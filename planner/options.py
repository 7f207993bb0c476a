"""The plan command's options and their checks (the pins, the engines, the fill packers' names), importable without
torch: the CLI answers --help and its argument errors from here before it imports the search (planner.search re-exports
these)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, make_dataclass
from typing import Any

from passes.errors import UserError

from .config import FIELDS, async_tp_error, field_error, options_error, replicate_error
from .engines import ENGINES
from .layout import layout_stages

__all__ = ["ENGINES", "PACKER_NAMES", "Pins", "check_cluster", "check_fill_value", "check_main_slack", "check_fill_time_limit",
           "parse_model_args"]

PACKER_NAMES = ("greedy", "cpsat")
"""The names of planner.fill.assign.PACKERS (which imports torch), for --fill-solver's help and check; a test keeps
them equal."""

@dataclass(frozen=True, kw_only=True, slots=True)
class _SearchPins:
    """What the user tells the search beside the configuration's own fields (Pins)."""

    schedules: tuple[str, ...] | None = None  # the kinds the search may choose (None: every registered kind), e.g.
    # the ones an engine runs (Megatron-LM: gpipe, 1f1b, interleaved)
    engine: str = "fxplanner"  # what runs the plan (ENGINES): its launch commands, and what it can run
    layout: str | None = None  # the partition as stated (planner.layout: Megatron-Core's layout string, or "even")
    max_microbatch: int = 16
    max_v: int = 8
    allow_cross_node_tp: bool = False

    def __post_init__(self) -> None:
        for name in _PINS:  # each value as ParallelConfig checks it, named by its flag; "auto": the engine's FP8 recipe
            value = getattr(self, name)
            if value is not None and (name, value) != ("fp8", "auto") and (why := field_error(name, value, cli=True)):
                raise UserError(why)
        for name in self.schedules or ():
            if why := field_error("schedule", name, cli=True):
                raise UserError(why)
        def say(name: str) -> str:  # a field as its flag
            return FIELDS[name].metadata["flag"]

        if why := options_error(self.fp8, self.fp8_params, self.precision, self.expert_load, self.moe_capacity,
                                say=say):
            raise UserError(why)
        if self.dp_replicate is not None and (why := replicate_error(self.dp_replicate, self.zero, self.dp, say=say)):
            raise UserError(why)
        if self.async_tp and (why := async_tp_error(self.sp, self.compile is not False, self.tp_comm_overlap, say=say)):
            raise UserError(why)
        if self.recompute_layers is not None and (self.recompute_layers < 1 or self.recompute not in (None, "block")):
            raise UserError(f"--recompute-layers {self.recompute_layers} counts the blocks of each model chunk that "
                            "recompute \"block\" redoes: a positive number, with --recompute block")
        if self.engine not in ENGINES:
            raise UserError(f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        stages = layout_stages(self.layout) if self.layout else None
        if stages is not None and self.pp is not None and self.v is not None and self.pp * self.v != stages:
            raise UserError(f"the pipeline layout states {stages} virtual stages; --pp {self.pp} x --vp {self.v} is "
                            f"{self.pp * self.v}")
        if stages is not None and self.pp is not None and stages % self.pp:
            raise UserError(f"the pipeline layout states {stages} virtual stages, not a multiple of --pp {self.pp}")

    def pinned(self) -> list[str]:
        return [k for k in ("tp", "pp", "dp", "cp", "ep", "b", "v", "recompute", "schedule", "sp", "layout")
                if getattr(self, k) is not None]


_PINS = [name for name, f in FIELDS.items() if f.metadata["flag"]]
Pins = make_dataclass("Pins", [(name, f"{FIELDS[name].type} | None", field(default=None))
                               if FIELDS[name].metadata["unpinned"] else
                               (name, FIELDS[name].type, field(default=FIELDS[name].default)) for name in _PINS],
                      bases=(_SearchPins,), namespace={"__module__": __name__}, frozen=True, kw_only=True, slots=True)
Pins.__doc__ = """What the user fixes for the search: a pin for each ParallelConfig field with a CLI flag (planner.config),
under the field's name; None where the search chooses (the field's `unpinned` says what it does), else the field's
default. And what _SearchPins adds (the schedules to choose among, the engine, the layout, the search's bounds)."""


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
