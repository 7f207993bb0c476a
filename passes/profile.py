"""Measured profile on the local device: per-unit forward and backward time, median and spread.

The model is built with real weights, traced, split into the same units the planner prices,
and each unit is timed in isolation on the inputs it sees in a real forward pass (warm-up runs
first, then `repeats` timed runs). Repeated blocks (same modules, same weight and input shapes) are
timed once and the others take that measurement. Before anything is allocated, the bytes the model
needs here (fp32 weights and gradients) are compared with what the device has free: a model that
cannot fit is refused with both numbers. On CUDA, peak memory per unit comes from the allocator.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from .errors import UserError
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


def available_bytes(dev: torch.device) -> int:
    """Memory free for the model on `dev`: the GPU's free memory, or the host's MemAvailable."""
    if dev.type == "cuda":
        return torch.cuda.mem_get_info(dev)[0]
    from .host import available_host_bytes

    return available_host_bytes()


def check_fits(mf, dev: torch.device, path: str) -> int:
    """Refuse before allocating when the model's weights and gradients cannot fit here; returns the need."""
    params = sum(p.numel() for p in mf.build("meta").parameters())
    need = int(params * 4 * 2 * 1.25)  # fp32 weights and gradients, and a quarter more for activations and buffers
    have = available_bytes(dev)
    if need > have:
        raise UserError(f"measuring {path} here needs about {need / 2**30:.1f} GiB ({params / 1e9:.2f} B parameters in "
                        f"fp32 with their gradients) but {dev} has {have / 2**30:.1f} GiB free; measure a smaller "
                        "configuration of the model (--model-arg) or on a machine with more memory")
    return need


def _signature(mod: nn.Module, args: tuple[Any, ...]) -> tuple:
    """What a unit's time depends on: its module types, weight shapes and input shapes."""
    shapes = tuple((type(m).__name__, tuple(tuple(p.shape) for p in m.parameters(recurse=False)))
                   for m in mod.modules())
    return shapes, tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else repr(a) for a in args)


def measure_units(path: str, kwargs: dict[str, Any], batch: int, *, leaves: tuple[str, ...] = (),
                  repeats: int = 5, warmup: int = 2, device: str | None = None, seed: int = 0,
                  progress: Callable[[int, int, float], None] | None = None) -> list[UnitMeasurement]:
    """Time each unit; `progress(done, total, eta_s)` after each distinct unit timed."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    mf = load_model_file(path, kwargs)
    check_fits(mf, dev, path)
    torch.manual_seed(seed)
    model = mf.build(dev).train()
    gm = trace_model(model, leaves)
    owner = unit_of_nodes(gm, model)
    split = split_by(gm, model, lambda name: owner[name])
    inputs = mf.inputs(batch, dev)
    seen = _capture_inputs(split, inputs)
    units = [(name, mod) for name, mod in split.named_children() if name.startswith("submod_")]
    sigs = [_signature(mod, seen[name]) for name, mod in units]
    distinct = len(set(sigs))
    timed: dict[tuple, UnitMeasurement] = {}
    results, start = [], time.perf_counter()
    for (name, mod), sig in zip(units, sigs):
        index = int(name.split("_")[1])
        if sig in timed:  # a repeat of a block already timed
            results.append(dataclasses.replace(timed[sig], unit=index))
            continue
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        fwd, bwd = _time_unit(mod, seen[name], dev, warmup, repeats)
        peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else 0
        timed[sig] = UnitMeasurement(unit=index, device=str(dev), fwd_median_s=statistics.median(fwd),
                                     bwd_median_s=statistics.median(bwd), fwd_spread=_spread(fwd),
                                     bwd_spread=_spread(bwd), peak_bytes=peak)
        results.append(timed[sig])
        if progress:
            spent = time.perf_counter() - start
            progress(len(timed), distinct, spent / len(timed) * (distinct - len(timed)))
    return sorted(results, key=lambda r: r.unit)
