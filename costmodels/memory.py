"""Device memory of a pipeline rank: weights, gradients, optimizer state, activations in flight.

Bytes per parameter come from the training precision (costmodels.precision); the optimizer part is
divided over its shards when the configuration shards it (zero >= 1). Activations per microbatch
depend on the recomputation mode (costmodels.recompute); how many microbatches are in flight
depends on the schedule kind (planner.schedules).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from passes.units import Unit

from .hardware import Hardware
from .recompute import RECOMPUTE, weight_grad_bytes

if TYPE_CHECKING:
    from planner.config import ParallelConfig

__all__ = ["StageMemory", "activation_bytes", "param_count", "rank_param_count", "stage_memory", "static_bytes_per_param"]


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


def param_count(unit: Unit, cfg: ParallelConfig) -> float:
    """Parameters of the unit one tensor-parallel rank holds."""
    kv = unit.kv.params * (1 / unit.kv_heads - 1 / cfg.tp) if 0 < unit.kv_heads < cfg.tp else 0.0
    return unit.sharded.params / cfg.tp + unit.replicated.params + kv  # GQA: kv heads replicated past kv_heads


def rank_param_count(units: list[Unit], cfg: ParallelConfig) -> float:
    """Parameters one tensor-parallel rank holds of `units` (the stages of one pipeline rank): a weight tied
    between the embedding and the LM head is held once. (Repeated blocks may be priced from one traced
    block and share its weight names: blocks are never deduplicated.)"""
    total, seen = 0.0, set()
    for u in units:
        total += param_count(u, cfg)
        if u.kind == "block":
            continue
        for part, div in ((u.sharded, cfg.tp), (u.replicated, 1)):
            for name, n in part.weights:
                if name in seen:
                    total -= n / div
                seen.add(name)
    return total


def activation_bytes(unit: Unit, cfg: ParallelConfig) -> float:
    """Bytes one microbatch leaves on the device from the unit's forward until its backward."""
    return cfg.recompute_mode.kept_bytes(unit, cfg.local_b, cfg.tp, cfg.sp_degree, cfg.cp)


def static_bytes_per_param(cfg: ParallelConfig) -> float:
    """Weights + gradients + (sharded) optimizer state per parameter."""
    return cfg.numerics.bytes_per_param(cfg.optimizer_shards)


def stage_memory(units: list[Unit], hw: Hardware, cfg: ParallelConfig, rank: int) -> StageMemory:
    """Peak memory of pipeline rank `rank` holding `units` (all its model chunks)."""
    num = cfg.numerics
    params = rank_param_count(units, cfg)
    mode = cfg.recompute_mode
    acts = sum(mode.kept_bytes(u, cfg.local_b, cfg.tp, cfg.sp_degree, cfg.cp) for u in units) * cfg.inflight(rank)
    if pending := cfg.w_pending(rank):  # split backward: what the weight gradients still owed keep
        acts += sum(weight_grad_bytes(u, cfg.local_b, cfg.tp, cfg.sp_degree, cfg.cp) for u in units) * pending
    if mode.working_set:  # the unit being recomputed holds its full activations during its backward
        plain = RECOMPUTE["none"].kept_bytes
        acts += max((plain(u, cfg.local_b, cfg.tp, cfg.sp_degree, cfg.cp) for u in units), default=0.0)
    return StageMemory(weights=params * num.weight_bytes, grads=params * num.grad_bytes,
                       optimizer=params * num.optimizer_bytes / cfg.optimizer_shards, activations=acts,
                       reserve=hw.reserve_bytes)
