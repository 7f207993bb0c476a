"""Device memory of a pipeline stage: weights, gradients, optimizer state, activations in flight.

Mixed-precision Adam keeps 16 bytes per parameter by default (bf16 weight 2 + bf16 gradient 2 +
fp32 master weight, momentum and variance 12); the optimizer part can be sharded over the d
data-parallel replicas (ZeRO-1 / Megatron's distributed optimizer). Activations per microbatch
depend on the recomputation mode; how many microbatches are in flight depends on the schedule.
"""
from __future__ import annotations

from dataclasses import dataclass

from passes.units import Unit

__all__ = ["MemoryConfig", "StageMemory", "unit_activation_bytes", "unit_param_count", "inflight",
           "stage_memory"]

GiB = 1 << 30


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryConfig:
    weight_bytes: float = 2.0  # per parameter, bf16
    grad_bytes: float = 2.0
    optimizer_bytes: float = 12.0  # fp32 master + Adam m and v
    shard_optimizer: bool = False  # divide optimizer state over d
    reserve_bytes: int = 3 * GiB  # CUDA context, allocator fragmentation, communication buffers

    @property
    def bytes_per_param(self) -> float:
        return self.weight_bytes + self.grad_bytes + self.optimizer_bytes


@dataclass(frozen=True, kw_only=True, slots=True)
class StageMemory:
    weights: float
    grads: float
    optimizer: float
    activations: float
    reserve: float

    @property
    def static(self) -> float:
        return self.weights + self.grads + self.optimizer + self.reserve

    @property
    def total(self) -> float:
        return self.static + self.activations


def unit_param_count(unit: Unit, t: int) -> float:
    return unit.sharded.params / t + unit.replicated.params


def unit_activation_bytes(unit: Unit, b: float, t: int, recompute: str) -> float:
    """Bytes one microbatch leaves on the device from the unit's forward until its backward."""
    s, r = unit.sharded, unit.replicated
    if recompute == "full" and unit.kind == "block":
        return unit.input_bytes(b)
    if recompute in ("selective", "full"):
        return (s.saved_bytes(b) - s.selective_bytes(b)) / t + r.saved_bytes(b) - r.selective_bytes(b)
    return s.saved_bytes(b) / t + r.saved_bytes(b)


def inflight(schedule: str, p: int, v: int, m: int, rank: int) -> float:
    """Microbatches whose activations a rank holds at its peak, in units of a whole stage
    (for interleaving: model chunks in flight divided by v, as Megatron's warm-up counts them)."""
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b" or v == 1:
        return float(min(p - rank, m))
    warmup = min((p - rank - 1) * 2 + (v - 1) * p, m * v)
    return (warmup + 1) / v


def stage_memory(units: list[Unit], *, b: float, t: int, d: int, recompute: str, inflight_mb: float,
                 cfg: MemoryConfig = MemoryConfig()) -> StageMemory:
    params = sum(unit_param_count(u, t) for u in units)
    acts = sum(unit_activation_bytes(u, b, t, recompute) for u in units) * inflight_mb
    if recompute == "full":
        # the unit being recomputed holds its full activations during its backward
        acts += max((unit_activation_bytes(u, b, t, "none") for u in units), default=0.0)
    opt = cfg.optimizer_bytes / (d if cfg.shard_optimizer else 1)
    return StageMemory(weights=params * cfg.weight_bytes, grads=params * cfg.grad_bytes,
                       optimizer=params * opt, activations=acts, reserve=cfg.reserve_bytes)
