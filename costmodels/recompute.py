"""Activation recomputation modes: a registry keyed by name.

Each mode says what one microbatch leaves on the device between a unit's forward and its backward,
what the backward redoes (time and FLOPs), whether the recomputed unit's whole working set lives
again during its backward, and what the runtime checkpoints. Adding a mode is adding one entry.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from .hardware import Hardware

if TYPE_CHECKING:
    from passes.units import Unit

__all__ = ["RecomputeMode", "RECOMPUTE", "register_recompute", "recompute_mode", "weight_grad_bytes"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RecomputeMode:
    name: str
    help: str
    kept_bytes: Callable[..., float]
    """(unit, b, t, r=1, cp=1) -> bytes one microbatch keeps from the unit's forward until its backward; the
    sharded part is split over t, the rest over r (t under sequence parallelism, else 1); b is per context-
    parallel rank (b/cp samples' worth of tokens)."""
    extra_backward_s: Callable[[Unit, float, int, Hardware, str, float], float]
    """(unit, b, t, hardware, precision, forward seconds) -> seconds the backward spends recomputing."""
    extra_flops: Callable[[Unit], float]
    """unit -> FLOPs per sample the recomputation executes."""
    working_set: bool
    """The recomputed unit holds its full activations again during its backward."""
    keeps_gemm_inputs: Callable[[Unit], bool] = lambda u: True
    """Whether the unit's weight products' inputs X are among what it keeps (an FP8 recipe keeps them in FP8)."""
    partial: bool = False
    """Per unit as mode "none"; the evaluator recomputes in full the first N blocks of every model chunk
    (ParallelConfig.recompute_layers), which depends on the partition, not on the unit alone."""


def _plain_bytes(u: Unit, b: float, t: int, r: int = 1, cp: int = 1) -> float:
    """Everything the forward saves; under context parallelism the attention core keeps what the fused ring
    kernel keeps (its inputs, output and log-sum-exp), not the scores a written-out attention would."""
    s = u.sharded
    core = s.selective_bytes(b) - s.fused_core_bytes(b) if cp > 1 else 0.0
    return (s.saved_bytes(b) - core) / t + u.replicated.saved_bytes(b) / r + u.loss_bytes(b) + _kv_copies(u, b, t)


def _kv_copies(u: Unit, b: float, t: int, kept: str = "saved_bytes") -> float:
    """Grouped-query attention with fewer kv heads than t: each rank keeps a whole kv head, not 1/t of them."""
    return getattr(u.kv, kept)(b) * (1 / u.kv_heads - 1 / t) if 0 < u.kv_heads < t else 0.0


def weight_grad_bytes(u: Unit, b: float, t: int, r: int = 1, cp: int = 1) -> float:
    """Bytes one microbatch holds from the end of the unit's input-gradient step (I) until its weight-gradient
    step (W) under a zero-bubble schedule: each weight product's input X and output gradient dY
    (Part.wgrad_bytes), split over t and r as kept_bytes splits them. I frees the rest of what kept_bytes
    counts, so this replaces kept_bytes for that stretch. The X are among what mode "none" keeps, so it is at
    most RECOMPUTE["none"].kept_bytes plus the dY, whatever the mode: a recomputing backward rebuilds X for I
    and W reads the same X (hence one function here beside the modes, not one per mode). cp: b is per context-
    parallel rank already, as kept_bytes takes it; no weight product spans the ring."""
    return (u.sharded.wgrad_bytes(b) / t + u.replicated.wgrad_bytes(b) / r
            + _kv_copies(u, b, t, "wgrad_bytes"))


def _selective_bytes(u: Unit, b: float, t: int, r: int = 1, cp: int = 1) -> float:
    s, w = u.sharded, u.replicated
    return ((s.saved_bytes(b) - s.selective_bytes(b)) / t + (w.saved_bytes(b) - w.selective_bytes(b)) / r
            + u.loss_bytes(b) + _kv_copies(u, b, t))


def _full_bytes(u: Unit, b: float, t: int, r: int = 1, cp: int = 1) -> float:
    """A block keeps its input (split over the sequence under sequence parallelism, as Megatron does)."""
    return u.input_bytes(b) / r if u.kind == "block" else _selective_bytes(u, b, t, r)


def _selective_s(u: Unit, b: float, t: int, hw: Hardware, precision: str, fwd_s: float) -> float:
    """Redo the oversized cheap tensors (attention scores, softmax, dropout) of the sharded part."""
    part, eff = u.sharded, hw.eff
    flops = part.selective_flops(b)
    if not flops:
        return 0.0
    rate = hw.matmul_rate(flops / t, precision, attention=part.fused_attention)
    return (flops / t / rate + 2 * part.selective_bytes(b) / t / (hw.gpu.hbm_bw * eff.hbm)) * eff.calibration


RECOMPUTE: dict[str, RecomputeMode] = {}


def register_recompute(mode: RecomputeMode) -> RecomputeMode:
    RECOMPUTE[mode.name] = mode
    return mode


def recompute_mode(name: str) -> RecomputeMode:
    try:
        return RECOMPUTE[name]
    except KeyError:
        raise ValueError(f"unknown recompute mode {name!r}; known: {', '.join(RECOMPUTE)}") from None


register_recompute(RecomputeMode(
    name="none", help="keep every activation the backward needs",
    kept_bytes=_plain_bytes, extra_backward_s=lambda u, b, t, hw, prec, fwd: 0.0, extra_flops=lambda u: 0.0,
    working_set=False))

register_recompute(RecomputeMode(
    name="selective", help="recompute the attention core in the backward (Korthikanti et al. 2022)",
    kept_bytes=_selective_bytes, extra_backward_s=_selective_s,
    extra_flops=lambda u: u.sharded.selective_flops(1) + u.replicated.selective_flops(1),
    working_set=False))  # the runtime checkpoints each block's attention core (planner/runtime/stage.py)

register_recompute(RecomputeMode(
    name="full", help="keep each block's input only and redo its whole forward in the backward",
    kept_bytes=_full_bytes,
    extra_backward_s=lambda u, b, t, hw, prec, fwd: fwd if u.kind == "block" else 0.0,
    extra_flops=lambda u: u.fwd_flops(1) if u.kind == "block" else 0.0,
    working_set=True, keeps_gemm_inputs=lambda u: u.kind != "block"))

register_recompute(RecomputeMode(
    name="block", help="recompute in full the first N blocks of every model chunk and keep all of the others' "
    "activations (Megatron's --recompute-method block --recompute-num-layers N; the planner takes the least N that "
    "fits, or --recompute-layers)",
    kept_bytes=_plain_bytes, extra_backward_s=lambda u, b, t, hw, prec, fwd: 0.0, extra_flops=lambda u: 0.0,
    working_set=True, partial=True))
