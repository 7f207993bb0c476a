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
    extra_backward_s: Callable[..., float]
    """(unit, b, t, hardware, precision, forward seconds, fp8=recipe or None, compiled=bool, collectives_s=seconds)
    -> seconds the backward spends recomputing (its weight products under the FP8 recipe the unit runs, compiled where
    the block is; collectives_s: the forward's expert all-to-alls, which a rerun that does not keep their outputs
    repeats; the forward seconds already hold them)."""
    extra_flops: Callable[[Unit], float]
    """unit -> FLOPs per sample the recomputation executes."""
    working_set: bool
    """The recomputed unit holds its full activations again during its backward."""
    keeps_gemm_inputs: Callable[[Unit], bool] = lambda u: True
    """Whether the unit's weight products' inputs X are among what it keeps (an FP8 recipe keeps them in FP8)."""
    partial: bool = False
    """Per unit as mode "none"; the evaluator recomputes in full the first N blocks of every model chunk
    (ParallelConfig.recompute_layers), which depends on the partition, not on the unit alone."""
    rebuilt_bytes: Callable[..., float] = lambda u, b, t, r=1, cp=1: 0.0
    """(unit, b, t, r=1, cp=1) -> where working_set is False, the bytes the unit's backward holds again beyond what
    it kept: what its recomputation rebuilds (per-op checkpointing reruns most of the block's forward)."""


def _plain_bytes(u: Unit, b: float, t: int, r: int = 1, cp: int = 1) -> float:
    """Everything the forward saves; under context parallelism the attention core keeps what the fused ring
    kernel keeps (its inputs, output and log-sum-exp), not the scores a written-out attention would."""
    s = u.sharded
    core = s.selective_bytes(b) - s.fused_core_bytes(b) if cp > 1 else 0.0
    return (s.saved_bytes(b) - core) / t + u.replicated.saved_bytes(b) / r + u.loss_kept(b, t) + _kv_copies(u, b, t)


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
    if u.checkpoint == "op":
        return _op_bytes(u, b, t, r, cp)
    s, w = u.sharded, u.replicated
    return ((s.saved_bytes(b) - s.selective_bytes(b)) / t + (w.saved_bytes(b) - w.selective_bytes(b)) / r
            + u.loss_kept(b, t) + _kv_copies(u, b, t))


def _op_bytes(u: Unit, b: float, t: int, r: int = 1, cp: int = 1) -> float:
    """Per-op checkpointing (passes.units.op_checkpoint): a block keeps its inputs and the saved ops' outputs; a unit
    torchtitan does not checkpoint (embedding, head: only its blocks are wrapped) keeps everything."""
    op = u.op_checkpoint
    if op is None:
        return _plain_bytes(u, b, t, r, cp)
    return op.kept_sharded(b) / t + op.kept(b) / r + u.loss_kept(b, t)


def _op_rebuilt(u: Unit, b: float, t: int, r: int = 1, cp: int = 1) -> float:
    """What a per-op checkpointed block's backward holds again: its rerun forward saves for autograd what the block
    saves without checkpointing, the kept outputs handed over to it (torch.utils.checkpoint's selective cache pops
    each as the rerun reaches it)."""
    if u.checkpoint != "op" or u.op_checkpoint is None:
        return 0.0
    return max(0.0, _plain_bytes(u, b, t, r, cp) - _op_bytes(u, b, t, r, cp))


def _full_bytes(u: Unit, b: float, t: int, r: int = 1, cp: int = 1) -> float:
    """A block keeps its input (split over the sequence under sequence parallelism, as Megatron does)."""
    return u.input_bytes(b) / r if u.kind == "block" else _selective_bytes(u, b, t, r)


def _selective_s(u: Unit, b: float, t: int, hw: Hardware, precision: str, fwd_s: float, fp8=None,
                 compiled: bool = False, collectives_s: float = 0.0) -> float:
    """Redo the oversized cheap tensors (attention scores, softmax, dropout) of the sharded part; under per-op
    checkpointing, the forward of every op the block did not keep, priced as its forward is (its GEMMs under the
    unit's FP8 recipe, which the rerun module runs too; the replicated part whole, as without sequence parallelism:
    the mode is not told r). Eager, torchtitan's per-op policy also reruns a MoE layer's dispatch and combine: its
    token dispatcher exchanges them with spmd_types' all_to_all (torch.distributed.all_to_all over lists, c10d's
    alltoall_), which the save list does not hold (it holds _c10d_functional.all_to_all_single, the collective the
    dispatcher issues under torch.compile: torchtitan/models/common/token_dispatcher.py, torchtitan 0.3)."""
    if u.checkpoint == "op":
        if u.op_checkpoint is None:
            return 0.0
        from .compute import part_forward_s  # (here: compute imports memory, which imports this registry)
        op = u.op_checkpoint
        return part_forward_s(op.redo_sharded, b, t, hw, precision, fp8, compiled) + \
            part_forward_s(op.redo, b, 1, hw, precision, fp8, compiled) + (0.0 if compiled else collectives_s)
    part, eff = u.sharded, hw.eff
    flops = part.selective_flops(b)
    if not flops:
        return 0.0
    rate = hw.matmul_rate(flops / t, precision, attention=part.fused_attention)
    return (flops / t / rate + 2 * part.selective_bytes(b) / t / (hw.gpu.hbm_bw * eff.hbm)) * eff.calibration


def _op_flops(u: Unit) -> float:
    op = u.op_checkpoint
    return 0.0 if op is None else op.redo_sharded.fwd_flops(1) + op.redo.fwd_flops(1)


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
    kept_bytes=_plain_bytes, extra_backward_s=lambda u, b, t, hw, prec, fwd, **_: 0.0, extra_flops=lambda u: 0.0,
    working_set=False))

register_recompute(RecomputeMode(
    name="selective", help="recompute the attention core in the backward (Korthikanti et al. 2022); under --engine "
    "torchtitan, its per-op selective activation checkpointing (every op but the matrix products it saves and the "
    "attention kernel)",
    kept_bytes=_selective_bytes, extra_backward_s=_selective_s, extra_flops=lambda u: _op_flops(u) if u.checkpoint ==
    "op" else u.sharded.selective_flops(1) + u.replicated.selective_flops(1),
    working_set=False, rebuilt_bytes=_op_rebuilt))  # the runtime checkpoints each block's attention core
# (planner/runtime/stage.py); torchtitan's selective activation checkpointing, per op (Unit.checkpoint "op")

register_recompute(RecomputeMode(
    name="full", help="keep each block's input only and redo its whole forward in the backward",
    kept_bytes=_full_bytes,
    extra_backward_s=lambda u, b, t, hw, prec, fwd, **_: fwd if u.kind == "block" else 0.0,
    extra_flops=lambda u: u.fwd_flops(1) if u.kind == "block" else 0.0,
    working_set=True, keeps_gemm_inputs=lambda u: u.kind != "block"))

register_recompute(RecomputeMode(
    name="block", help="recompute in full the first N blocks of every model chunk and keep all of the others' "
    "activations (Megatron's --recompute-method block --recompute-num-layers N; the planner takes the least N that "
    "fits, or --recompute-layers)",
    kept_bytes=_plain_bytes, extra_backward_s=lambda u, b, t, hw, prec, fwd, **_: 0.0, extra_flops=lambda u: 0.0,
    working_set=True, partial=True))
