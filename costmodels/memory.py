"""Device memory of a pipeline rank: weights, gradients, optimizer state, activations in flight.

Bytes per parameter come from the training precision (costmodels.precision); the optimizer part is
divided over its shards when the configuration shards it (zero >= 1). Activations per microbatch
depend on the recomputation mode (costmodels.recompute); how many microbatches are in flight
depends on the schedule kind (planner.schedules).
"""
from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING

from passes.units import Unit

from .fp8 import runs_fp8
from .holding import DEFAULT_MEMORY, EngineMemory
from .hardware import Hardware
from .recompute import RECOMPUTE, weight_grad_bytes

if TYPE_CHECKING:
    from planner.config import ParallelConfig

__all__ = ["DEFAULT_MEMORY", "EngineMemory", "StageMemory", "UnitBytes", "activation_bytes",
           "expert_count", "fp8_param_count", "fp8_weight_bytes", "held_bytes", "held_numerics", "in_flight_bytes",
           "param_count",
           "rank_param_count", "stage_memory", "static_bytes", "static_of", "sweeps_grads", "unit_bytes"]



ADAM_MOMENTS_BYTES = 8.0
"""Adam's exp_avg and exp_avg_sq in fp32, per parameter (costmodels.precision: the optimizer bytes beyond them are
the fp32 master weight of mixed precision)."""


def held_numerics(cfg: ParallelConfig, held: EngineMemory = DEFAULT_MEMORY) -> tuple[float, float, float]:
    """(Bytes per parameter of a rank's kept weights, gradients and optimizer state) as the engine holds them: under
    EngineMemory.master_shard and ZeRO-3 the kept weight is the fp32 master and the optimizer holds the moments
    only."""
    num = cfg.numerics
    if held.master_shard and cfg.zero >= 3:
        master = max(0.0, num.optimizer_bytes - ADAM_MOMENTS_BYTES)
        return max(num.weight_bytes, master), num.grad_bytes, num.optimizer_bytes - master
    return num.weight_bytes, num.grad_bytes, num.optimizer_bytes


def sweeps_grads(cfg: ParallelConfig, held: EngineMemory = DEFAULT_MEMORY) -> bool:
    """No gradient is held before the backward: the engine frees them each step and the step has one microbatch (with
    more, the first microbatch's gradients are held through the next one's forward and backward)."""
    return held.step_frees_grads and cfg.m == 1


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
    """Parameters of the unit one rank holds: the sharded part over t, experts over ep."""
    kv = unit.kv.params * (1 / unit.kv_heads - 1 / cfg.tp) if 0 < unit.kv_heads < cfg.tp else 0.0
    return (unit.sharded.params / cfg.tp + unit.replicated.params + kv  # GQA: kv heads replicated past kv_heads
            - unit.moe.params * (1 - 1 / cfg.ep))


def expert_count(unit: Unit, cfg: ParallelConfig) -> float:
    """Of param_count, the experts' parameters (1/ep of the layer's), whose gradients are reduced and whose optimizer
    state is sharded over the expert-data-parallel ranks (cfg.expert_dp), not over d x cp."""
    return unit.moe.params / cfg.ep


def rank_param_count(units: list[Unit], cfg: ParallelConfig, counts: Sequence[float] | None = None) -> float:
    """Parameters one tensor-parallel rank holds of `units` (the stages of one pipeline rank): a weight tied
    between the embedding and the LM head is held once. (Repeated blocks may be priced from one traced
    block and share its weight names: blocks are never deduplicated.) `counts`: each unit's param_count, if known."""
    total, seen = 0.0, set()
    for k, u in enumerate(units):
        total += param_count(u, cfg) if counts is None else counts[k]
        if u.kind == "block":
            continue
        for part, div in ((u.sharded, cfg.tp), (u.replicated, 1)):
            for name, n in part.weights:
                if name in seen:
                    total -= n / div
                seen.add(name)
    return total


def activation_bytes(unit: Unit, cfg: ParallelConfig) -> float:
    """Bytes one microbatch leaves on the device from the unit's forward until its backward (an FP8 recipe that
    saves its GEMMs' cast inputs keeps those at 1 byte per element)."""
    kept = cfg.recompute_mode.kept_bytes(unit, cfg.local_b, cfg.tp, cfg.sp_degree, cfg.cp)
    if not cfg.recompute_mode.keeps_gemm_inputs(unit):
        return kept
    busiest = (cfg.expert_load - 1) * unit.moe.saved_bytes(cfg.local_b) / cfg.sp_degree  # its experts keep more
    return kept + busiest - _fp8_input_saving(unit, cfg)


def held_bytes(unit: Unit, cfg: ParallelConfig) -> float:
    """Bytes one microbatch holds from the unit's input-gradient step to its weight-gradient step (split backward):
    recompute.weight_grad_bytes, with the FP8 inputs as activation_bytes counts them."""
    return weight_grad_bytes(unit, cfg.local_b, cfg.tp, cfg.sp_degree, cfg.cp) - _fp8_input_saving(unit, cfg)


def _fp8_input_saving(unit: Unit, cfg: ParallelConfig) -> float:
    """What keeping the weight products' inputs X in FP8 (1 byte per element, with its block scales) saves against
    keeping them at the training precision."""
    fp8 = cfg.fp8_recipe
    if fp8 is None or not fp8.saves_fp8_input or not runs_fp8(unit.kind):
        return 0.0
    b = cfg.local_b
    x = unit.sharded.gemm_input_bytes(b) / cfg.tp + unit.replicated.gemm_input_bytes(b) / cfg.sp_degree
    return x * max(0.0, 1 - (1 + fp8.scale_bytes) / cfg.numerics.weight_bytes)


def fp8_param_count(unit: Unit, cfg: ParallelConfig) -> float:
    """Of param_count, those an FP8 recipe runs in FP8: the whole unit where its kind's GEMMs run so (runs_fp8)."""
    return param_count(unit, cfg) if runs_fp8(unit.kind) else 0.0


def fp8_weight_bytes(unit: Unit, cfg: ParallelConfig) -> float:
    """The FP8 weight copies (row- and column-wise) an FP8 recipe caches for the unit on one rank; with FP8 parameters
    they are the weights, and the bf16 copy they replace is taken off."""
    fp8 = cfg.fp8_recipe
    if fp8 is None or not runs_fp8(unit.kind):
        return 0.0
    return param_count(unit, cfg) * (fp8.weight_copy_bytes() - (cfg.numerics.weight_bytes if cfg.fp8_params else 0))


def static_bytes(unit: Unit, cfg: ParallelConfig, held: EngineMemory = DEFAULT_MEMORY) -> float:
    """Weights + gradients + optimizer state of the unit one rank keeps (its shards under ZeRO), FP8 weight copies
    included, as the engine holds them (`held`; no gradients where sweeps_grads: they are the backward's)."""
    params, experts = param_count(unit, cfg), expert_count(unit, cfg)
    return static_of(params, experts, cfg, held) + fp8_weight_bytes(unit, cfg)


def static_of(params: float, experts: float, cfg: ParallelConfig, held: EngineMemory = DEFAULT_MEMORY) -> float:
    """static_bytes of `params` (`experts` of them experts'), FP8 weight copies aside."""
    weight, grad, opt = held_numerics(cfg, held)
    grads = 0.0 if sweeps_grads(cfg, held) else cfg.kept(params, experts, 2) * grad
    return cfg.kept(params, experts, 3) * weight + grads + cfg.kept(params, experts, 1) * opt


def in_flight_bytes(units: list[Unit], cfg: ParallelConfig, table: UnitBytes | None = None,
                    held: EngineMemory = DEFAULT_MEMORY) -> tuple[float, float]:
    """(weights, gradients) a rank holds whole beyond its shards while it computes: under ZeRO-3 the unit being run
    and the next one, prefetched (the two largest of the rank's), under ZeRO-2 and -3 one unit's gradient until
    its reduce-scatter (the largest); torch FSDP2 and Megatron-FSDP gather and reduce unit by unit so. `table`:
    UnitBytes of `units` under cfg (unit k at position k), if known. Under EngineMemory.master_shard a gathered unit
    is whole beside its fp32 shard, not the rest of it."""
    if table is None:
        return _in_flight([param_count(u, cfg) for u in units], [expert_count(u, cfg) for u in units],
                          [cfg.gathered_bytes(runs_fp8(u.kind)) for u in units], cfg, held)
    return _in_flight(table.params, table.experts, table.gathered, cfg, held)


def _in_flight(params: Sequence[float], experts: Sequence[float], gathered: Sequence[float], cfg: ParallelConfig,
               held: EngineMemory = DEFAULT_MEMORY) -> tuple[float, float]:
    """in_flight_bytes from each unit's param_count, expert_count and gathered bytes per parameter."""
    whole = held.master_shard and cfg.zero >= 3
    full = sorted(((n - (0.0 if whole else cfg.kept(n, e, 3))) * g for n, e, g in zip(params, experts, gathered)
                   if cfg.zero >= 3), reverse=True)
    grads = max(params, default=0.0) if cfg.zero >= 2 else 0.0
    return sum(full[:2]), grads * cfg.numerics.grad_bytes


@dataclass(frozen=True, slots=True)
class UnitBytes:
    """What stage_memory reads of each unit under one configuration, one entry per unit: for a search that prices
    every rank of thousands of configurations from the few distinct units a model repeats."""

    params: tuple[float, ...]  # param_count
    experts: tuple[float, ...]  # expert_count
    fp8: tuple[float, ...]  # fp8_weight_bytes
    acts: tuple[float, ...]  # activation_bytes under the configuration
    full_acts: tuple[float, ...]  # activation_bytes recomputing the unit in full (what partial recomputation redoes)
    held: tuple[float, ...]  # held_bytes
    plain: tuple[float, ...]  # RECOMPUTE["none"].kept_bytes (the working set of a unit being recomputed)
    rebuilt: tuple[float, ...]  # the mode's rebuilt_bytes (what a per-op checkpointed block's backward holds again)
    loss: tuple[float, ...]  # Unit.loss_work (what the loss's backward holds at once: the last unit's)
    grads: tuple[float, ...]  # the gradient bytes a rank keeps of the unit (its shard under ZeRO-2 and -3)
    gathered: tuple[float, ...]  # bytes per parameter ZeRO-3 gathers of the unit (ParallelConfig.gathered_bytes)
    static: tuple[float, ...]  # static_bytes


def unit_bytes(units: Sequence[Unit], cfg: ParallelConfig, held: EngineMemory = DEFAULT_MEMORY) -> UnitBytes:
    """UnitBytes of `units` under cfg, as the engine holds them (`held`)."""
    full, plain = cfg.fallback(recompute="full"), RECOMPUTE["none"].kept_bytes
    return UnitBytes(params=tuple(param_count(u, cfg) for u in units),
                     experts=tuple(expert_count(u, cfg) for u in units),
                     fp8=tuple(fp8_weight_bytes(u, cfg) for u in units),
                     acts=tuple(activation_bytes(u, cfg) for u in units),
                     full_acts=tuple(activation_bytes(u, full) for u in units),
                     held=tuple(held_bytes(u, cfg) for u in units),
                     plain=tuple(plain(u, cfg.local_b, cfg.tp, cfg.sp_degree, cfg.cp) for u in units),
                     rebuilt=tuple(cfg.recompute_mode.rebuilt_bytes(u, cfg.local_b, cfg.tp, cfg.sp_degree, cfg.cp)
                                   for u in units),
                     loss=tuple(u.loss_held(cfg.local_b, cfg.tp) if held.loss_backward else 0.0 for u in units),
                     grads=tuple(_grad_bytes(u, cfg, held) for u in units),
                     gathered=tuple(cfg.gathered_bytes(runs_fp8(u.kind)) for u in units),
                     static=tuple(static_bytes(u, cfg, held) for u in units))


def _grad_bytes(unit: Unit, cfg: ParallelConfig, held: EngineMemory = DEFAULT_MEMORY) -> float:
    return cfg.kept(param_count(unit, cfg), expert_count(unit, cfg), 2) * held_numerics(cfg, held)[1]


def stage_memory(units: list[Unit], hw: Hardware, cfg: ParallelConfig, rank: int,
                 full: Collection[int] = (), chunks: Sequence[int] = (), table: UnitBytes | None = None,
                 at: Sequence[int] = (), held: EngineMemory = DEFAULT_MEMORY) -> StageMemory:
    """Peak memory of pipeline rank `rank` holding `units` (all its model chunks, `chunks` units in each, in stage
    order); under partial recomputation the units whose index is in `full` are recomputed in full, the others keep
    everything. Without `chunks` every chunk is taken to hold the rank's average microbatches in flight. `table`:
    UnitBytes under cfg, unit k of `units` at position at[k] of it (known already: the same numbers)."""
    mode = cfg.recompute_mode
    if table is None:
        counts = [param_count(u, cfg) for u in units]
        redo = cfg.fallback(recompute="full") if full else cfg
        per_unit = [activation_bytes(u, redo if u.index in full else cfg) for u in units]
    else:
        counts = [table.params[i] for i in at]
        per_unit = [table.full_acts[i] if u.index in full else table.acts[i] for u, i in zip(units, at)] if full \
            else [table.acts[i] for i in at]
    params = rank_param_count(units, cfg, counts)
    if len(chunks) == cfg.v and sum(chunks) == len(units):
        ends = [0, *accumulate(chunks)]
        per_chunk = [sum(per_unit[a:b]) for a, b in zip(ends, ends[1:])]
        acts = max(sum(n * a for n, a in zip(peak, per_chunk)) for peak in cfg.chunk_peaks(rank))
    else:
        acts = sum(per_unit) * cfg.inflight(rank)
    if pending := cfg.w_pending(rank):  # split backward: what the weight gradients still owed keep
        acts += sum(held_bytes(u, cfg) for u in units) * pending if table is None else \
            sum([table.held[i] for i in at]) * pending
    if table is None:
        table = unit_bytes(units, cfg, held)
        at = range(len(units))
    # what one unit's backward holds beyond the kept activations, one unit at a time: the unit being recomputed its
    # full activations (working_set modes), else what its backward rebuilds (per-op checkpointing); before the last
    # unit's backward, its loss's gradients. Phases of the backward, so the most of them, not their sum
    own = [table.plain[i] if mode.working_set else table.rebuilt[i] for i in at]
    work = [max(w, table.loss[i]) for w, i in zip(own, at)]
    fp8 = sum([table.fp8[i] for i in at])
    experts_each = [table.experts[i] for i in at]
    experts = sum(experts_each)
    gathered, unreduced = _in_flight(counts, experts_each, [table.gathered[i] for i in at], cfg, held)
    weight, grad, opt = held_numerics(cfg, held)
    grads = cfg.kept(params, experts, 2) * grad + unreduced
    if sweeps_grads(cfg, held):  # one microbatch, its gradients made by the backward (EngineMemory.step_frees_grads):
        # the most over the backward's phases, from the last unit to the first: before unit k's backward every unit
        # up to k still holds its activations and those after it hold their gradients; the loss's phase holds no
        # gradient, a unit's own backward its whole gradient until its reduce-scatter
        kept = list(accumulate(per_unit))
        whole = [table.params[i] * grad if cfg.zero >= 2 else 0.0 for i in at]
        peak = [kept[k] + max(table.loss[i], own[k] + whole[k]) for k, i in enumerate(at)]  # (the compute stream's)
        if held.grad_pool and cfg.zero >= 2:  # the compute stream's peak, and the gradients' own pool beside it
            acts_k, grads = max(peak, default=0.0), sum(table.grads[i] for i in at)
        else:
            after = [0.0, *accumulate(table.grads[i] for i in reversed(at))][::-1][1:]
            phases = [(peak[k], after[k] + (whole[k] if own[k] + whole[k] > table.loss[i] else 0.0))
                      for k, i in enumerate(at)]
            acts_k, grads = max(phases, key=sum, default=(0.0, 0.0))
        acts += acts_k - sum(per_unit)
    else:
        acts += max(work, default=0.0)
    return StageMemory(weights=cfg.kept(params, experts, 3) * weight + gathered + fp8, grads=grads,
                       optimizer=cfg.kept(params, experts, 1) * opt, activations=acts, reserve=hw.reserve_bytes)
