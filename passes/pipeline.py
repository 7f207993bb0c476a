"""The one named pipeline: load -> build (meta) -> trace -> shapes -> costs -> units.

Each pass is a function of a `Context`; the runner records every pass's name and wall time, and an
error names the passes that had already run.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.fx as fx

from .costs import annotate_costs
from .errors import UserError
from .load import ModelFile, file_sha256, load_model_file
from .shapes import propagate_shapes
from .trace import trace_model
from .units import Unit, lower_units

__all__ = ["Context", "ModelProfile", "PASSES", "analyze", "DTYPES"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(kw_only=True)
class Context:
    path: Path
    kwargs: dict[str, Any]
    leaves: tuple[str, ...] = ()
    dtype: torch.dtype = torch.bfloat16
    model_file: ModelFile | None = None
    model: torch.nn.Module | None = None
    gm: fx.GraphModule | None = None
    units: list[Unit] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelProfile:
    """What the planner needs of a model: plain data, no fx objects."""

    name: str
    path: str
    sha256: str
    kwargs: dict[str, Any]
    dtype: str
    total_params: int  # unique parameters (tied weights once)
    units: tuple[Unit, ...]
    pass_times: tuple[tuple[str, float], ...]


def _load(ctx: Context) -> None:
    ctx.model_file = load_model_file(ctx.path, ctx.kwargs)


def _build(ctx: Context) -> None:
    ctx.model = ctx.model_file.build("meta", ctx.dtype)
    ctx.model.train()


def _trace(ctx: Context) -> None:
    ctx.gm = trace_model(ctx.model, ctx.leaves)


def _shapes(ctx: Context) -> None:
    propagate_shapes(ctx.gm, lambda b: ctx.model_file.inputs(b, "meta"))


def _costs(ctx: Context) -> None:
    annotate_costs(ctx.gm)


def _units(ctx: Context) -> None:
    ctx.units = lower_units(ctx.gm, ctx.model)


PASSES: tuple[tuple[str, Callable[[Context], None]], ...] = (
    ("load", _load), ("build", _build), ("trace", _trace), ("shapes", _shapes),
    ("costs", _costs), ("units", _units),
)


def run_passes(ctx: Context, passes=PASSES, progress: Callable[[str], None] | None = None) -> list[tuple[str, float]]:
    times: list[tuple[str, float]] = []
    for name, fn in passes:
        if progress:
            progress(name)
        start = time.perf_counter()
        try:
            fn(ctx)
        except UserError as exc:
            done = ", ".join(n for n, _ in times) or "none"
            raise type(exc)(f"{exc} [pass '{name}'; passes done: {done}]") from exc
        times.append((name, time.perf_counter() - start))
    return times


def analyze(path: str | Path, kwargs: dict[str, Any] | None = None, *, leaves: tuple[str, ...] = (),
            dtype: str = "bf16", progress: Callable[[str], None] | None = None) -> tuple[ModelProfile, Context]:
    """Run every pass over a model file; returns the plain profile and the context (graph etc.)."""
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    ctx = Context(path=Path(path), kwargs=dict(kwargs or {}), leaves=tuple(leaves), dtype=DTYPES[dtype])
    times = run_passes(ctx, progress=progress)
    profile = ModelProfile(name=ctx.path.stem, path=str(ctx.path), sha256=file_sha256(ctx.path),
                           kwargs=dict(ctx.kwargs), dtype=dtype,
                           total_params=sum(p.numel() for p in ctx.gm.parameters()),
                           units=tuple(ctx.units), pass_times=tuple(times))
    return profile, ctx
