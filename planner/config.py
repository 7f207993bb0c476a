"""One training configuration, from the search to the runtime.

`ParallelConfig` is the only spelling of a configuration: the search enumerates them, the evaluator
and the cost models price them, the plan file stores one (`planner.plan.ConfigModel`, converted by
`ConfigModel.of` / `ConfigModel.to_config`) and the runtime runs it. Its names follow Megatron-LM:

tp, pp, dp, cp  tensor-, pipeline-, data- and context-parallel degrees (ranks ordered tp, cp, dp, pp)
ep              expert-parallel degree: the experts of each mixture-of-experts layer divided over ep ranks of a stage
                that hold different tokens (Megatron-Core with --expert-tensor-parallel-size 1: the ep ranks are
                drawn from the tp x cp x dp ranks, tensor-parallel ones only under sequence parallelism, where each
                dispatches its share of the tokens); the experts' gradients are reduced over the rest
sp              sequence parallelism on top of tensor parallelism (Korthikanti et al. 2022)
zero            sharding stage over the data-parallel replicas (dp x cp): 1 = the optimizer state (ZeRO-1, Megatron's
                distributed optimizer), 2 = the gradients too (ZeRO-2: reduce-scattered in every microbatch's
                backward; Megatron-FSDP optim_grads, FSDP without resharding after the forward), 3 = the parameters
                too (ZeRO-3 / FSDP: each unit's parameters all-gathered before its forward and again before its
                backward, the next one's prefetched; Megatron-FSDP optim_grads_params)
grad_fp32       gradients accumulated and reduced in fp32 under bf16/fp16 (Megatron's main_grad buffer with
                --accumulate-allreduce-grads-in-fp32: 18 bytes per parameter with Adam, not 16)
overlap_grad_reduce  data-parallel gradient reduction bucketed and launched during the backward (and, with
                zero=1, the parameter all-gather during the next forward): Megatron's --overlap-grad-reduce /
                --overlap-param-gather
tp_comm_overlap tensor-parallel all-gathers / reduce-scatters split and overlapped with the linears' GEMMs
                (Megatron's --tp-comm-overlap, Transformer Engine userbuffers; needs sp)
b, m, v         microbatch size, microbatches per iteration, model chunks per pipeline rank
recompute       activation recomputation mode (registry: costmodels.recompute)
recompute_layers  under recompute "block": the blocks of every model chunk recomputed in full, its first ones (Megatron's
                --recompute-method block --recompute-num-layers); the others keep everything
schedule        pipeline schedule kind (registry: planner.schedules)
precision       training precision (registry: costmodels.precision)
fp8             FP8 recipe of the linear layers' GEMMs under bf16/fp16 mixed precision ("": none; registry:
                costmodels.fp8 -- Megatron's --fp8-format hybrid --fp8-recipe, torchao's float8)
expert_load     tokens the busiest expert-parallel rank computes and exchanges, as a multiple of the balanced share:
                dropless routing, the router's balance (1: balanced); under moe_capacity, that capacity factor
moe_capacity    0: dropless routing (every token reaches its experts; the dispatcher needs each expert's count on the
                host, which drains the stream every MoE layer: costmodels.compute.MEGATRON_MOE_HOST_S); c > 0: each
                expert's input dropped and padded to c times its balanced share (Megatron --moe-expert-capacity-factor c
                --moe-pad-expert-input-to-capacity): the counts are known, no drain, and expert_load is c
moe_dispatcher  how tokens reach their experts: "alltoall" (Megatron's all-to-all, one copy per routed expert) or
                "deepep" / "hybridep" (the flex dispatcher: one copy per other node, fanned out over NVLink there)
moe_a2a_overlap the expert all-to-alls of one microbatch overlapped with another's compute in 1F1B (Megatron's
                --overlap-moe-expert-parallel-comm with --delay-wgrad-compute)
fp8_params      the linear layers' weights kept in FP8 only (row- and column-wise), no bf16 copy beside them; the fp32
                master weights stay in the optimizer (Megatron's --fp8-param-gather, NeMo's fp8_params)
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from functools import cache
from typing import TYPE_CHECKING

from costmodels.fp8 import FP8_RECIPES, Fp8Recipe
from costmodels.precision import PRECISIONS, Precision
from costmodels.recompute import RECOMPUTE, RecomputeMode
from passes.errors import UserError
from planner.schedule import Placement, placement_of

if TYPE_CHECKING:
    from planner.schedules import ScheduleKind

__all__ = ["ParallelConfig", "ConfigError", "MOE_DISPATCHERS", "ZERO_STAGES"]

MOE_DISPATCHERS = ("alltoall", "deepep", "hybridep")
"""Megatron-Core's token dispatchers priced: its all-to-all, and the flex dispatcher's backends."""

ZERO_STAGES = (0, 1, 2, 3)
"""Sharding stages the cost models price (0: replicated; 1: optimizer state; 2: and gradients; 3: and parameters)."""


class ConfigError(UserError, ValueError):
    """A configuration breaks a rule; the message carries the numbers."""


@cache
def _numerics(precision: str, grad_fp32: bool) -> Precision:
    num = PRECISIONS[precision]
    return replace(num, grad_bytes=4.0) if grad_fp32 else num


def _positive(name: str, what: str, value: object) -> None:
    if type(value) is not int or value < 1:
        raise ConfigError(f"{what} {name} must be a positive integer, got {value!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelConfig:
    tp: int
    pp: int
    dp: int
    b: int
    m: int
    v: int = 1
    cp: int = 1
    ep: int = 1
    sp: bool = False
    zero: int = 0
    grad_fp32: bool = False
    overlap_grad_reduce: bool = False
    tp_comm_overlap: bool = False
    recompute: str = "none"
    recompute_layers: int = 0
    schedule: str = "1f1b"
    precision: str = "bf16"
    fp8: str = ""
    fp8_params: bool = False
    expert_load: float = 1.0
    moe_capacity: float = 0.0
    moe_dispatcher: str = "alltoall"
    moe_a2a_overlap: bool = False

    def __post_init__(self) -> None:
        for name, what in (("tp", "tensor-parallel degree"), ("pp", "pipeline-parallel degree"),
                           ("dp", "data-parallel degree"), ("cp", "context-parallel degree"),
                           ("b", "microbatch size"), ("m", "microbatch count"), ("v", "model chunks per rank"),
                           ("ep", "expert-parallel degree")):
            _positive(name, what, getattr(self, name))
        if self.ep > 1 and self.tp > 1 and not self.sp:
            raise ConfigError("expert parallelism with tensor parallelism needs sequence parallelism (sp): each "
                              "tensor-parallel rank then dispatches its own share of the tokens (Megatron-Core)")
        if self.expert_ranks % self.ep:
            raise ConfigError(f"expert-parallel degree ep={self.ep} does not divide the {self.expert_ranks} ranks of a "
                              f"stage that hold different tokens (sp_degree*cp*dp)")
        if type(self.sp) is not bool:
            raise ConfigError(f"sequence parallelism sp must be true or false, got {self.sp!r}")
        if self.sp and self.tp == 1:
            raise ConfigError("sequence parallelism (sp) splits activations over the tensor-parallel group: it "
                             "needs tp > 1, got tp=1")
        if type(self.overlap_grad_reduce) is not bool:
            raise ConfigError(f"overlap_grad_reduce must be true or false, got {self.overlap_grad_reduce!r}")
        if type(self.tp_comm_overlap) is not bool:
            raise ConfigError(f"tp_comm_overlap must be true or false, got {self.tp_comm_overlap!r}")
        if self.tp_comm_overlap and not self.sp:
            raise ConfigError("tensor-parallel communication overlap (tp_comm_overlap) splits the all-gathers and "
                              "reduce-scatters of sequence parallelism: it needs sp (and tp > 1)")
        if type(self.grad_fp32) is not bool:
            raise ConfigError(f"grad_fp32 must be true or false, got {self.grad_fp32!r}")
        if self.zero not in ZERO_STAGES:
            raise ConfigError(f"optimizer sharding stage zero={self.zero!r} is not one of {ZERO_STAGES}")
        if self.recompute not in RECOMPUTE:
            raise ConfigError(f"recompute mode {self.recompute!r} is not one of {', '.join(RECOMPUTE)}")
        if type(self.recompute_layers) is not int or self.recompute_layers < 0 or (
                self.recompute_layers and not RECOMPUTE[self.recompute].partial):
            raise ConfigError(f"recompute_layers={self.recompute_layers!r}: the blocks of each model chunk recomputed "
                              "under recompute \"block\", a count >= 0 (0 with any other mode)")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision {self.precision!r} is not one of {', '.join(PRECISIONS)}")
        if self.fp8 and self.fp8 not in FP8_RECIPES:
            raise ConfigError(f"FP8 recipe {self.fp8!r} is not one of {', '.join(FP8_RECIPES)}")
        if not (isinstance(self.moe_capacity, (int, float)) and (not self.moe_capacity or 1 <= self.moe_capacity <= 64)):
            raise ConfigError(f"moe_capacity is 0 (dropless) or a capacity factor of at least 1, got "
                              f"{self.moe_capacity!r}")
        if not (isinstance(self.expert_load, (int, float)) and 1 <= self.expert_load <= 64):
            raise ConfigError(f"expert_load is the busiest rank's tokens over the balanced share, at least 1, got "
                              f"{self.expert_load!r}")
        if self.moe_capacity and self.expert_load != self.moe_capacity:
            raise ConfigError(f"experts padded to capacity factor {self.moe_capacity:g} load the busiest rank with "
                              f"exactly that share, not expert_load {self.expert_load:g}")
        if self.moe_dispatcher not in MOE_DISPATCHERS:
            raise ConfigError(f"moe_dispatcher {self.moe_dispatcher!r} is not one of {', '.join(MOE_DISPATCHERS)}")
        if self.fp8_params and not (self.fp8 and FP8_RECIPES[self.fp8].weight_cache):
            raise ConfigError("FP8 parameters (fp8_params) are Transformer Engine's: they need one of its FP8 recipes")
        if self.fp8 and self.precision == "fp32":
            raise ConfigError(f"the FP8 recipe {self.fp8} runs under bf16 or fp16 mixed precision, not fp32")
        from planner.schedules import SCHEDULES

        kind = SCHEDULES.get(self.schedule)
        if kind is None:
            raise ConfigError(f"schedule {self.schedule!r} is not one of {', '.join(SCHEDULES)}")
        why = kind.check(self.pp, self.v, self.m)
        if why is not None:
            raise ConfigError(f"schedule {self.schedule} with pp={self.pp} v={self.v} m={self.m}: {why}")

    def fallback(self, *, recompute: str | None = None, zero: int | None = None) -> ParallelConfig:
        """This configuration recomputing `recompute` (no layer count) or sharding at ZeRO stage `zero`: checked for
        those two fields only, as nothing else changes (the search makes tens of thousands of these per plan, and
        dataclasses.replace checks every rule again)."""
        if recompute is not None and recompute not in RECOMPUTE:
            raise ConfigError(f"recompute mode {recompute!r} is not one of {', '.join(RECOMPUTE)}")
        if zero is not None and zero not in ZERO_STAGES:
            raise ConfigError(f"optimizer sharding stage zero={zero!r} is not one of {ZERO_STAGES}")
        new = object.__new__(ParallelConfig)
        for name in _FIELDS:
            object.__setattr__(new, name, getattr(self, name))
        if recompute is not None:
            object.__setattr__(new, "recompute", recompute)
            object.__setattr__(new, "recompute_layers", 0)
        if zero is not None:
            object.__setattr__(new, "zero", zero)
        return new

    # -- derived ---------------------------------------------------------------------------------

    @property
    def world(self) -> int:
        """GPUs the configuration occupies."""
        return self.tp * self.cp * self.dp * self.pp

    @property
    def global_batch(self) -> int:
        return self.dp * self.b * self.m

    @property
    def stages(self) -> int:
        """Virtual pipeline stages p * v."""
        return self.pp * self.v

    @property
    def optimizer_shards(self) -> int:
        """Replicas the optimizer state is divided over (Megatron shards over dp x cp)."""
        return self.dp * self.cp if self.zero >= 1 else 1

    @property
    def expert_optimizer_shards(self) -> int:
        """Replicas the experts' optimizer state is divided over: the expert-data-parallel ranks (Megatron-Core's
        distributed optimizer over its expert-data-parallel group)."""
        return self.expert_dp if self.zero >= 1 else 1

    def optimizer_owned(self, params: float, experts: float) -> float:
        """Of `params` held by a rank (of which `experts` are experts'), those whose optimizer state it owns: the
        dense ones over optimizer_shards, the experts' over expert_optimizer_shards."""
        return (params - experts) / self.optimizer_shards + experts / self.expert_optimizer_shards

    def kept(self, params: float, experts: float, stage: int) -> float:
        """Of `params` a rank computes with, those whose optimizer state (stage 1), gradients (2) or weights (3) it
        keeps between uses: its shard from that ZeRO stage on, else all of them."""
        return self.optimizer_owned(params, experts) if self.zero >= stage else params

    @property
    def schedule_kind(self) -> ScheduleKind:
        from planner.schedules import SCHEDULES

        return SCHEDULES[self.schedule]

    @property
    def recompute_mode(self) -> RecomputeMode:
        return RECOMPUTE[self.recompute]

    @property
    def numerics(self) -> Precision:
        """Bytes per parameter and the peak FLOP/s key of the training precision (4-byte gradients under
        grad_fp32)."""
        return _numerics(self.precision, self.grad_fp32)

    @property
    def fp8_recipe(self) -> Fp8Recipe | None:
        """The FP8 recipe the linear layers' GEMMs run under, or None."""
        return FP8_RECIPES[self.fp8] if self.fp8 else None

    @property
    def peak_dtype(self) -> str:
        """The peak MFU is measured against: the precision's, or under an FP8 recipe the FP8 rate its GEMMs run at
        (so that MFU stays a share of what the hardware could do)."""
        return self.fp8_recipe.gemm_dtype if self.fp8 else self.precision

    @property
    def placement(self) -> Placement:
        """Which pipeline rank holds each virtual stage (the schedule kind's placement)."""
        return placement_of(self.schedule_kind.placement, self.pp, self.v)

    def inflight(self, rank: int) -> float:
        """Microbatches (of a whole stage) whose activations pipeline rank `rank` holds at its peak."""
        return self.schedule_kind.inflight(self.pp, self.v, self.m, rank)

    def chunk_peaks(self, rank: int) -> tuple[tuple[float, ...], ...]:
        """Microbatches each of pipeline rank `rank`'s v chunks holds at each moment that can be its peak."""
        return self.schedule_kind.peaks(self.pp, self.v, self.m, rank)

    def w_pending(self, rank: int) -> float:
        """Microbatches (of a whole stage) whose weight gradient pipeline rank `rank` still owes at its peak
        (split-backward schedules; 0 otherwise)."""
        return self.schedule_kind.w_pending(self.pp, self.v, self.m, rank)

    @property
    def expert_ranks(self) -> int:
        """Ranks of a pipeline stage that hold different tokens at a mixture-of-experts layer: what expert
        parallelism divides, ep of them sharing each layer's experts."""
        return self.sp_degree * self.cp * self.dp

    @property
    def expert_dp(self) -> int:
        """Ranks each expert is replicated over (its gradients reduced, its optimizer state sharded over them)."""
        return self.expert_ranks // self.ep

    @property
    def local_b(self) -> float:
        """Samples' worth of tokens one rank works on per microbatch: context parallelism gives each of its
        cp ranks 1/cp of every sequence (Megatron's load-balanced split: equal attention work per rank)."""
        return self.b / self.cp

    @property
    def sp_degree(self) -> int:
        """What divides the activations outside the tensor-parallel regions (norms, dropout, residual):
        t under sequence parallelism, else 1."""
        return self.tp if self.sp else 1

    def unit_key(self, recompute: str | None = None) -> tuple:
        """The fields a unit's own time and memory depend on (the evaluator caches by it; cached FP8 weights' casts,
        spread over the m microbatches, are added apart: UnitTime.weight_cast_s). A partial recomputation mode prices
        each unit as "none" does (RecomputeMode.partial). `recompute`: the key of this configuration recomputing that
        instead."""
        recompute = recompute or ("none" if self.recompute_mode.partial else self.recompute)
        return (self.b, self.tp, self.cp, self.sp, self.tp_comm_overlap, recompute, self.precision, self.fp8,
                self.ep, self.expert_load, self.moe_capacity, self.moe_dispatcher, self.moe_a2a_overlap)

    def __str__(self) -> str:
        extra = "".join([f" cp={self.cp}" if self.cp > 1 else "", f" ep={self.ep}" if self.ep > 1 else "", " sp" if self.sp else "",
                         f" zero={self.zero}" if self.zero else "", " grad-fp32" if self.grad_fp32 else "",
                         " overlap" if self.overlap_grad_reduce else "",
                         " tp-overlap" if self.tp_comm_overlap else "", f" fp8={self.fp8}" if self.fp8 else "",
                         " fp8-params" if self.fp8_params else "",
                         f" {self.moe_dispatcher}" if self.moe_dispatcher != "alltoall" and self.ep > 1 else "",
                         " a2a-overlap" if self.moe_a2a_overlap and self.ep > 1 else "",
                         f" capacity={self.moe_capacity:g}" if self.moe_capacity else
                         f" load={self.expert_load:g}" if self.expert_load != 1 else ""])
        layers = f"({self.recompute_layers} per chunk)" if self.recompute_mode.partial else ""
        return (f"t={self.tp} p={self.pp} d={self.dp}{extra} b={self.b} m={self.m} v={self.v} "
                f"{self.schedule} recompute={self.recompute}{layers}")


_FIELDS = tuple(f.name for f in fields(ParallelConfig))
