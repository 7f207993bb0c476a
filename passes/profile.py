"""Measured profile on the local device: per-unit forward and backward time, median and spread.

The model is built with real weights, traced, split into the same units the planner prices,
and each unit is timed in isolation on the inputs it sees in a real forward pass (warm-up runs
first, then `repeats` timed runs). On CUDA, peak memory per unit comes from the allocator.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .load import load_model_file
from .split import split_by, unit_of_nodes
from .trace import trace_model

__all__ = ["UnitMeasurement", "measure_units"]


@dataclass(frozen=True, kw_only=True, slots=True)
class UnitMeasurement:
    unit: int
    device: str
    fwd_median_s: float
    bwd_median_s: float
    fwd_spread: float  # (max - min) / median over the timed runs
    bwd_spread: float
    peak_bytes: int  # CUDA only; 0 on CPU


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _capture_inputs(split: torch.fx.GraphModule, inputs: tuple[Any, ...]) -> dict[str, tuple[Any, ...]]:
    seen: dict[str, tuple[Any, ...]] = {}
    hooks = [mod.register_forward_pre_hook(lambda m, a, name=name: seen.setdefault(name, a))
             for name, mod in split.named_children() if name.startswith("submod_")]
    try:
        with torch.no_grad():
            split(*inputs)
    finally:
        for h in hooks:
            h.remove()
    return seen


def _leafify(args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(a.detach().requires_grad_(a.is_floating_point()) if isinstance(a, torch.Tensor) else a
                 for a in args)


def _float_outputs(out: Any) -> list[torch.Tensor]:
    items = out if isinstance(out, (tuple, list)) else (out,)
    return [o for o in items if isinstance(o, torch.Tensor) and o.requires_grad]


def _time_unit(mod: nn.Module, args: tuple[Any, ...], device: torch.device, warmup: int,
               repeats: int) -> tuple[list[float], list[float]]:
    fwd, bwd = [], []
    for i in range(warmup + repeats):
        leaf_args = _leafify(args)
        _sync(device)
        t0 = time.perf_counter()
        outs = _float_outputs(mod(*leaf_args))
        _sync(device)
        t1 = time.perf_counter()
        if outs:
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        _sync(device)
        t2 = time.perf_counter()
        if i >= warmup:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
        mod.zero_grad(set_to_none=True)
    return fwd, bwd


def _spread(xs: list[float]) -> float:
    med = statistics.median(xs)
    return (max(xs) - min(xs)) / med if med > 0 else 0.0


def measure_units(path: str, kwargs: dict[str, Any], batch: int, *, leaves: tuple[str, ...] = (),
                  repeats: int = 5, warmup: int = 2, device: str | None = None, seed: int = 0) -> list[UnitMeasurement]:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    mf = load_model_file(path, kwargs)
    torch.manual_seed(seed)
    model = mf.build(dev).train()
    gm = trace_model(model, leaves)
    owner = unit_of_nodes(gm, model)
    split = split_by(gm, model, lambda name: owner[name])
    inputs = mf.inputs(batch, dev)
    seen = _capture_inputs(split, inputs)
    results = []
    for name, mod in split.named_children():
        if not name.startswith("submod_"):
            continue
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        fwd, bwd = _time_unit(mod, seen[name], dev, warmup, repeats)
        peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else 0
        results.append(UnitMeasurement(unit=int(name.split("_")[1]), device=str(dev),
                                       fwd_median_s=statistics.median(fwd), bwd_median_s=statistics.median(bwd),
                                       fwd_spread=_spread(fwd), bwd_spread=_spread(bwd), peak_bytes=peak))
    return sorted(results, key=lambda r: r.unit)
