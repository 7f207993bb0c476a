"""torchtitan's trainer with the plan's fill jobs in its pipeline bubbles (torchtitan 0.3).

Two extension points of torchtitan need no fork. `--module` names a module whose config_registry functions return
the job's Config, and a `Trainer` subclass brings its own Config section, as torchtitan's experiments do
(torchtitan/experiments/torchft: `FaultTolerantTrainer.Config(Trainer.Config)` with a `fault_tolerance` section).
This module is both:

    torchrun ... -m torchtitan.train --module planner.engines.titan --config llama3.llama3_8b \\
        --fill.plan plan.json --parallelism.pipeline_parallel_schedule_csv plan.schedule.csv ...

- `--config MODULE.FUNCTION` is the config function torchtitan's own `--module MODULE --config FUNCTION` would run
  (`llama3.llama3_8b`, or `my_pkg.models.my_config` of your own), derived into a `FillTrainer.Config` with a `fill`
  section (plan, grace);
- `FillTrainer` builds torchtitan's trainer unchanged, then attaches the fill adapter of torch's pipeline runtime
  (planner/engines/pipelining.py) to the schedule torchtitan built from the plan's CSV. At the end each rank writes
  what its bubbles and its fill executor did to `<dump_folder>/fill/rank<N>.json`.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchtitan.trainer import Trainer

from ..runtime.fill_executor import GRACE_S

__all__ = ["FillConfig", "FillTrainer", "fill_config"]

_SEARCHED = ("torchtitan.models", "torchtitan.experiments")


@dataclass(kw_only=True, slots=True)
class FillConfig:
    plan: str = ""
    """The fxplanner plan (JSON) whose fill jobs run in the bubbles; "": the job runs without fill."""
    grace_s: float = GRACE_S
    """How long past a bubble's end a fill task may run before it is killed (FreeRide 3.2.3's grace period)."""


class FillTrainer(Trainer):
    """torchtitan's Trainer; with `--fill.plan`, the plan's fill jobs run in the pipeline bubbles."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        fill: FillConfig = field(default_factory=FillConfig)

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.attach_fill()

    def attach_fill(self) -> None:
        """Attach the fill adapter to the pipeline schedule torchtitan built (with the plan's CSV)."""
        from ..plan import load_plan
        from .pipelining import attach

        cfg, self.fill = self.config.fill, None
        if not cfg.plan:
            return
        if not self.parallel_dims.pp_enabled or not self.config.parallelism.pipeline_parallel_schedule_csv:
            raise ValueError(f"--fill.plan {cfg.plan}: fill runs in the pipeline's bubbles; run the plan's export, "
                             "which sets --parallelism.pipeline_parallel_schedule_csv to the plan's order")
        self.fill = attach(self.pp_schedule, load_plan(cfg.plan), device=str(self.device), grace_s=cfg.grace_s)

    def close(self) -> None:
        if getattr(self, "fill", None) is not None:
            out = Path(self.config.dump_folder) / "fill"
            out.mkdir(parents=True, exist_ok=True)
            report = self.fill.report()
            (out / f"rank{self.fill.global_rank}.json").write_text(json.dumps(report, indent=1))
            self.fill.close()
            self.fill = None
        super().close()


def fill_config(config: Trainer.Config) -> FillTrainer.Config:
    """torchtitan's stock Config as the fill trainer's (every section kept, `fill` added)."""
    if type(config) is not Trainer.Config:
        raise ValueError(f"the config is a {type(config).__qualname__}, not torchtitan's Trainer.Config: the fill "
                         "trainer derives stock configs only (subclass FillTrainer.Config for a trainer of your own)")
    return FillTrainer.Config(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)})


def _stock(name: str) -> Any:
    """The config function `name` names: `module.function` as torchtitan's --module and --config name them (a
    module of torchtitan's, `llama3`, or of your own, `my_pkg.models`), or a bare function of torchtitan's."""
    from torchtitan.experiments import _supported_experiments
    from torchtitan.models import _supported_models

    stock = (_supported_models, _supported_experiments)
    module, _, fn = name.rpartition(".")
    if module:  # torchtitan's ConfigManager resolves --module the same way
        candidates = [f"{prefix}.{module}.config_registry" for prefix, names in zip(_SEARCHED, stock)
                      if module in names] or [f"{module}.config_registry", module]
    else:
        fn, candidates = name, [f"{prefix}.{m}.config_registry" for prefix, names in zip(_SEARCHED, stock)
                                for m in sorted(names)]
    for path in candidates:
        try:
            registry = importlib.import_module(path)
        except ImportError:
            continue
        if callable(getattr(registry, fn, None)):
            return getattr(registry, fn)
    raise AttributeError(f"no config function {name!r}: name torchtitan's as MODULE.FUNCTION (llama3.llama3_8b) or "
                         "yours as package.module.function")


def __getattr__(name: str) -> Any:
    """torchtitan's ConfigManager looks `--config NAME` up here: NAME's stock config, derived with a fill section."""
    if name.startswith("__"):
        raise AttributeError(name)
    stock = _stock(name)

    def config() -> FillTrainer.Config:
        return fill_config(stock())

    config.__name__ = name
    return config
