"""Calibration files: measured corrections to the cost models for one target.

`planner calibrate` writes one; `planner plan --calibration file.json` applies it: a per-unit-kind
factor (measured / predicted, forward and backward apart) on compute time, and the measured
latency and bandwidth of the collective backend in place of the target's link figures.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from passes.errors import UserError, invalid_file
from targets.specs import ClusterSpec

from .hardware import Hardware

__all__ = ["Calibration", "UnitFactor", "CommFit", "load_calibration", "apply_calibration"]

SCHEMA = "fxplanner.calibration/v1"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class UnitFactor(_Model):
    fwd: float = Field(gt=0, description="measured / predicted forward time")
    bwd: float = Field(gt=0, description="measured / predicted backward time")
    units: int = Field(ge=1, description="units of this kind measured")


class CommFit(_Model):
    backend: str
    latency_s: float = Field(ge=0)
    bandwidth: float = Field(gt=0, description="bytes/s, fitted alpha-beta")


class Calibration(_Model):
    schema_version: Literal["fxplanner.calibration/v1"] = Field(default=SCHEMA, alias="schema")
    target: str
    device: str
    dtype: str
    model_file: str
    batch: int
    unit_factors: dict[str, UnitFactor]
    comm: Optional[CommFit] = None
    action_overhead_s: float = Field(0.0, ge=0, description="runtime cost of one F or B action beyond its units "
                                     "(framework, autograd, messaging), fitted from a measured run")


def load_calibration(path: str | Path) -> Calibration:
    path = Path(path)
    try:
        return Calibration.model_validate(json.loads(path.read_text()))
    except FileNotFoundError:
        raise UserError(f"calibration file {path} does not exist; make one with `planner calibrate MODEL.py`") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"calibration file {path} is not valid JSON (line {exc.lineno})") from None
    except ValidationError as exc:
        raise invalid_file("calibration file", path, exc) from None


def apply_calibration(cal: Calibration, hw: Hardware) -> Hardware:
    """The hardware with the calibration's unit factors, per-action overhead and measured links."""
    if cal.target != hw.name:
        raise UserError(f"calibration was measured for target {cal.target!r}, not {hw.name!r}; "
                        "calibrate on this target or pass the matching --target")
    factors = tuple((kind, f.fwd, f.bwd) for kind, f in sorted(cal.unit_factors.items()))
    hw = hw.with_eff(unit_factors=factors, action_overhead_s=cal.action_overhead_s)
    if cal.comm is not None:  # measured figures are achieved ones: no further link efficiency
        c, link = hw.cluster, hw.eff.link
        cluster = ClusterSpec(gpus_per_node=c.gpus_per_node, nvlink_bw=cal.comm.bandwidth / link,
                              nvlink_latency_s=cal.comm.latency_s, internode_bw=cal.comm.bandwidth / link,
                              internode_latency_s=cal.comm.latency_s)
        hw = replace(hw, target=replace(hw.target, cluster=cluster))
    return hw
