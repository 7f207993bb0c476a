"""One training configuration, from the search to the runtime.

`ParallelConfig` is the only spelling of a configuration: the search enumerates them, the evaluator and the cost models
price them, the plan file stores one and the runtime runs it. Its names follow Megatron-LM (ranks ordered tp, cp, dp,
pp). Each field says what it is once, in its metadata (`_field`), and is read from there by

- the plan file: `planner.plan.ConfigModel` is made from the fields (`plan`: the name there where it differs; `help`:
  its description) and converts to and from a ParallelConfig (`of`, `to_config`);
- the search's pins: `planner.options.Pins` holds a pin for each field with a CLI `flag`, None by default where the
  search chooses (`unpinned` says what it does then), else the field's default;
- the CLI: `planner plan`'s option `flag` for that pin, its help `help`, the `choices`, what the CLI takes beside them
  (`more`) and `unpinned` (planner.cli_plan.pin_option).

The checks are here, each once: a field's own (`field_error`: its `choices`, its `valid` rule, else a positive integer
or a bool by its type) and the rules across fields (`ParallelConfig.__post_init__`, and the pins' share of them:
`options_error`). Adding a field is adding it below with its metadata, and pricing it.
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields, replace
from functools import cache
from typing import TYPE_CHECKING, Any, Callable, Collection

from costmodels.fp8 import FP8_RECIPES, Fp8Recipe
from costmodels.precision import PRECISIONS, Precision
from costmodels.recompute import RECOMPUTE, RecomputeMode
from passes.errors import UserError
from planner.schedule_ir import Placement, placement_of

if TYPE_CHECKING:
    from planner.schedules import ScheduleKind

__all__ = ["ParallelConfig", "ConfigError", "MOE_DISPATCHERS", "ZERO_STAGES", "FIELDS", "choices_text", "field_error",
           "options_error", "replicate_error", "async_tp_error"]

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


@cache
def _schedules() -> dict[str, ScheduleKind]:
    from planner.schedules import SCHEDULES  # (the registry, its plug-ins imported: not at this module's import)

    return SCHEDULES


def _field(default: Any = MISSING, *, help: str, flag: str | None = None, plan: str | None = None,
           choices: Collection | Callable[[], Collection] | None = None, more: str = "",
           valid: tuple[Callable[[Any], bool], str] | None = None, unpinned: str | None = None) -> Any:
    """A field and what it is: see the module's docstring."""
    return field(default=default, metadata=dict(help=help, flag=flag, plan=plan or None, choices=choices, more=more,
                                                valid=valid, unpinned=unpinned))


def _number(low: float, zero: bool = False) -> Callable[[Any], bool]:
    return lambda x: type(x) in (int, float) and (zero and not x or low <= x <= 64)


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelConfig:
    tp: int = _field(help="tensor-parallel degree t", flag="--tp",
                     unpinned="the search chooses one within a node (any with --allow-cross-node-tp)")
    pp: int = _field(help="pipeline-parallel degree p", flag="--pp", unpinned="the search chooses")
    dp: int = _field(help="data-parallel degree d", flag="--dp", unpinned="the search chooses")
    cp: int = _field(1, help="context-parallel degree (ring attention: each of cp ranks computes 1/cp of every "
                     "sequence)", flag="--cp", unpinned="the search tries every degree whose ring stays inside a node "
                     "and splits the sequence into 2*cp equal chunks")
    ep: int = _field(1, help="expert-parallel degree: the experts of each mixture-of-experts layer divided over ep of "
                     "a stage's t x cp x d ranks that hold different tokens (tensor-parallel ones only under sequence "
                     "parallelism), their gradients reduced over the rest (Megatron-Core's --expert-model-parallel-size "
                     "with --expert-tensor-parallel-size 1)", flag="--ep",
                     unpinned="the search tries every degree dividing the experts (mixture-of-experts models)")
    sp: bool = _field(False, help="sequence parallelism on top of tensor parallelism (Korthikanti et al. 2022): the "
                      "norms', dropouts' and residuals' activations split over t",
                      flag="--sequence-parallel/--no-sequence-parallel", unpinned="the search tries both where t > 1")
    zero: int = _field(0, help="sharding over the data-parallel replicas (d x cp): 0 none, 1 the optimizer state "
                       "(ZeRO-1, Megatron's distributed optimizer), 2 and the gradients (ZeRO-2: reduce-scattered in "
                       "every microbatch's backward), 3 and the parameters (ZeRO-3 / FSDP: each unit's all-gathered "
                       "before its forward and again before its backward, the next one's prefetched)", flag="--zero",
                       choices=ZERO_STAGES,
                       unpinned="1 wherever there are replicas (2 under torchtitan, whose FSDP2 shards the "
                       "gradients with the optimizer state), more only where less does not fit")
    dp_replicate: int = _field(1, help="under zero 3, hybrid-sharded data parallelism (HSDP): the d data-parallel "
                               "ranks as dp_replicate replicas of a group of d/dp_replicate ranks (x cp) that shards "
                               "the parameters, gradients and optimizer state; each parameter all-gathered and each "
                               "gradient reduce-scattered within the group, the gradient shards all-reduced over the "
                               "replicas (torchtitan's --parallelism.data_parallel_replicate_degree, FSDP2 over a 2-D "
                               "mesh; Megatron-FSDP's --num-distributed-optimizer-instances); 1: FSDP over all d",
                               flag="--dp-replicate",
                               unpinned="1, and where the engine runs HSDP and the search may take zero 3, each count "
                               "whose shard group fills 1, 2, 4 or 8 whole nodes")
    grad_fp32: bool = _field(False, help="gradients accumulated and reduced in fp32 under bf16/fp16 (Megatron's "
                             "main_grad buffer, --accumulate-allreduce-grads-in-fp32: 18 bytes per parameter with "
                             "Adam, not 16), else in the weights' dtype", flag="--grad-fp32/--grad-reduce-in-bf16",
                             unpinned="as the engine does (--engine megatron and torchtitan: fp32 under bf16)")
    overlap_grad_reduce: bool = _field(False, help="data-parallel gradient reduction bucketed and launched during the "
                                       "backward (and, with a sharded optimizer, the parameter all-gather during the "
                                       "next forward): Megatron's --overlap-grad-reduce / --overlap-param-gather",
                                       flag="--overlap-grad-reduce/--no-overlap-grad-reduce",
                                       unpinned="overlapped wherever there are replicas")
    tp_comm_overlap: bool = _field(False, help="tensor-parallel all-gathers / reduce-scatters split and overlapped "
                                   "with the linears' GEMMs (Megatron's --tp-comm-overlap, Transformer Engine's "
                                   "userbuffers); it needs sp, and the search runs it wherever sp is on",
                                   flag="--tp-comm-overlap")
    async_tp: bool = _field(False, help="async tensor parallelism: torch.compile's micro-pipelined TP (Inductor's "
                            "micro_pipeline_tp pass over symmetric memory: each sequence-parallel all-gather / "
                            "reduce-scatter split into t per-rank chunks, each copied while the previous chunk's "
                            "matrix product runs; torchtitan's --compile.enable_async_tensor_parallel); it needs sp "
                            "and compile", flag="--async-tp/--no-async-tp",
                            unpinned="the search tries both where the engine runs it (torchtitan, under compile "
                            "and sp)")
    b: int = _field(help="microbatch size b", flag="--microbatch", plan="microbatch", unpinned="the search chooses")
    m: int = _field(help="microbatches per iteration m = B / (d b)", plan="microbatches")
    v: int = _field(1, help="model chunks per pipeline rank v (interleaving)", flag="--vp", plan="vp",
                    unpinned="the search chooses")
    recompute: str = _field("none", help="activation recomputation mode (registry: costmodels.recompute)",
                            flag="--recompute", choices=RECOMPUTE, unpinned="the search chooses")
    recompute_layers: int = _field(0, help="under recompute block: the first blocks of each model chunk recomputed "
                                   "in full, the others keeping everything (Megatron's --recompute-method block "
                                   "--recompute-num-layers)", flag="--recompute-layers",
                                   valid=(lambda x: type(x) is int and x >= 0, "a count of blocks >= 0"),
                                   unpinned="the least that fits")
    schedule: str = _field("1f1b", help="pipeline schedule kind (registry: planner.schedules)", flag="--schedule",
                           choices=_schedules, unpinned="the search chooses among those the engine runs")
    precision: str = _field("bf16", help="training precision (registry: costmodels.precision)", flag="--dtype",
                            choices=PRECISIONS, more=", or fp8 (bf16 with the linear layers' GEMMs in FP8, as --fp8 "
                            "auto)")
    fp8: str = _field("", help="FP8 recipe of the linear layers' GEMMs under bf16/fp16 mixed precision, empty for none "
                      "(registry: costmodels.fp8; Megatron's --fp8-format hybrid --fp8-recipe, torchao's float8)",
                      flag="--fp8", choices=FP8_RECIPES, more=", or auto (the engine's default for the GPU)")
    fp8_params: bool = _field(False, help="the linear layers' weights kept in FP8 only (row- and column-wise), no "
                              "bf16 copy beside them; the fp32 master weights stay in the optimizer (Megatron's "
                              "--fp8-param-gather; Transformer Engine's recipes)", flag="--fp8-params")
    compile: bool = _field(False, help="each repeated block compiled with torch.compile (torchtitan's "
                           "--compile.enable: Inductor fuses the elementwise and normalization ops between the matrix "
                           "products and attention into one kernel each); only where the engine compiles",
                           flag="--compile/--no-compile",
                           unpinned="on where the engine compiles (torchtitan): in every configuration its fused "
                           "kernels take no longer and its checkpointed blocks keep no more than eager ones")
    moe_dispatcher: str = _field("alltoall", help="how tokens reach their experts: Megatron's all-to-all (one copy "
                                 "per routed expert), or the flex dispatcher's DeepEP / HybridEP (one copy per other "
                                 "node, fanned out over NVLink there)", flag="--moe-dispatcher",
                                 choices=MOE_DISPATCHERS)
    moe_a2a_overlap: bool = _field(False, help="the expert all-to-alls of one microbatch overlapped with another's "
                                   "compute in 1F1B, with ep > 1 (Megatron's --overlap-moe-expert-parallel-comm with "
                                   "--delay-wgrad-compute)", flag="--moe-a2a-overlap")
    expert_load: float = _field(1.0, help="tokens the busiest expert-parallel rank computes and exchanges, over the "
                                "balanced share: under dropless routing the router's balance (1: balanced), under "
                                "moe_capacity that capacity factor", flag="--expert-load",
                                valid=(_number(1), "at least 1 (the busiest rank's tokens over the balanced share)"),
                                unpinned="balanced, or the capacity factor under --moe-capacity")
    moe_capacity: float = _field(0.0, help="0: dropless routing (every token reaches its experts; the dispatcher "
                                 "needs each expert's count on the host, which drains the stream every MoE layer: "
                                 "costmodels.compute.MEGATRON_MOE_HOST_S); c > 0: each expert's input dropped and "
                                 "padded to c times its balanced share (Megatron's --moe-expert-capacity-factor c "
                                 "--moe-pad-expert-input-to-capacity): the counts are known, no drain, and expert_load "
                                 "is c", flag="--moe-capacity",
                                 valid=(_number(1, zero=True), "0 (dropless) or a capacity factor of at least 1"))

    def __post_init__(self) -> None:
        for name, ok in _VALID:
            if not ok(getattr(self, name)):
                raise ConfigError(field_error(name, getattr(self, name)))
        if why := options_error(self.fp8, self.fp8_params, self.precision, self.expert_load, self.moe_capacity):
            raise ConfigError(why)
        if self.ep > 1 and self.tp > 1 and not self.sp:
            raise ConfigError("expert parallelism with tensor parallelism needs sequence parallelism (sp): each "
                              "tensor-parallel rank then dispatches its own share of the tokens (Megatron-Core)")
        if self.expert_ranks % self.ep:
            raise ConfigError(f"expert-parallel degree ep={self.ep} does not divide the {self.expert_ranks} ranks of a "
                              f"stage that hold different tokens (sp_degree*cp*dp)")
        if self.sp and self.tp == 1:
            raise ConfigError("sequence parallelism (sp) splits activations over the tensor-parallel group: it "
                             "needs tp > 1, got tp=1")
        if self.dp_replicate > 1 and (why := replicate_error(self.dp_replicate, self.zero, self.dp)):
            raise ConfigError(why)
        if self.dp_replicate > 1 and self.ep > 1 and (self.expert_ranks // self.dp_replicate) % self.ep:
            raise ConfigError(f"expert-parallel degree ep={self.ep} does not divide the "
                              f"{self.expert_ranks // self.dp_replicate} ranks of a stage's shard group that hold "
                              "different tokens (sp_degree*cp*dp/dp_replicate): "
                              "the experts are sharded within one replica (torchtitan's efsdp mesh)")
        if self.tp_comm_overlap and not self.sp:
            raise ConfigError("tensor-parallel communication overlap (tp_comm_overlap) splits the all-gathers and "
                              "reduce-scatters of sequence parallelism: it needs sp (and tp > 1)")
        if self.async_tp and (why := async_tp_error(self.sp, self.compile, self.tp_comm_overlap)):
            raise ConfigError(why)
        if self.recompute_layers and not RECOMPUTE[self.recompute].partial:
            raise ConfigError(f"recompute_layers={self.recompute_layers!r}: the blocks of each model chunk recomputed "
                              "under recompute \"block\" (0 with any other mode)")
        why = self.schedule_kind.check(self.pp, self.v, self.m)
        if why is not None:
            raise ConfigError(f"schedule {self.schedule} with pp={self.pp} v={self.v} m={self.m}: {why}")

    def fallback(self, *, recompute: str | None = None, zero: int | None = None) -> ParallelConfig:
        """This configuration recomputing `recompute` (no layer count) or sharding at ZeRO stage `zero`: checked for
        those two fields only, as nothing else changes (the search makes tens of thousands of these per plan, and
        dataclasses.replace checks every rule again)."""
        for name, value in (("recompute", recompute), ("zero", zero)):
            if value is not None and (why := field_error(name, value)):
                raise ConfigError(why)
        new = object.__new__(ParallelConfig)
        for name in FIELDS:
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
        return self.gpus_per_stage * self.pp

    @property
    def gpus_per_stage(self) -> int:
        """GPUs of one pipeline stage, t * cp * d (Megatron's rank order puts adjacent stages that far apart); each
        pipeline rank's bubbles are theirs."""
        return self.tp * self.cp * self.dp

    @property
    def global_batch(self) -> int:
        return self.dp * self.b * self.m

    @property
    def stages(self) -> int:
        """Virtual pipeline stages p * v."""
        return self.pp * self.v

    @property
    def shard_ranks(self) -> int:
        """The data-parallel ranks a parameter, its gradient and its optimizer state are sharded over (Megatron shards
        over dp x cp; hybrid sharding over the (dp / dp_replicate) x cp of one replica: torchtitan's "fsdp" mesh
        dimension, dp_shard x cp, torchtitan/distributed/parallel_dims.py)."""
        return self.dp * self.cp // self.dp_replicate

    @property
    def optimizer_shards(self) -> int:
        """Replicas the optimizer state is divided over (shard_ranks under a sharded optimizer)."""
        return self.shard_ranks if self.zero >= 1 else 1

    @property
    def expert_optimizer_shards(self) -> int:
        """Replicas the experts' optimizer state is divided over: the expert-data-parallel ranks (Megatron-Core's
        distributed optimizer over its expert-data-parallel group), of one replica under hybrid sharding
        (torchtitan's "efsdp" mesh dimension)."""
        return self.expert_dp // self.dp_replicate if self.zero >= 1 else 1

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
        return _schedules()[self.schedule]

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

    def gathered_bytes(self, fp8_unit: bool) -> float:
        """Bytes per parameter a sharded step all-gathers of a unit (and under ZeRO-3 holds whole while it runs): the
        training precision's, or one where the unit's weights are gathered in FP8: kept in FP8 only (fp8_params:
        Megatron's --fp8-param-gather, its distributed optimizer gathering the FP8 parameters), or cast to FP8 for
        FSDP's all-gather (Fp8Recipe.fsdp_gather, ZeRO-3)."""
        fp8 = self.fp8_recipe
        return 1.0 if fp8_unit and fp8 is not None and (self.fp8_params or fp8.fsdp_gather and self.zero >= 3) else \
            self.numerics.weight_bytes

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
                self.ep, self.expert_load, self.moe_capacity, self.moe_dispatcher, self.moe_a2a_overlap, self.compile,
                self.async_tp)

    def __str__(self) -> str:
        extra = "".join([f" cp={self.cp}" if self.cp > 1 else "", f" ep={self.ep}" if self.ep > 1 else "", " sp" if self.sp else "",
                         f" zero={self.zero}" if self.zero else "",
                         f" replicate={self.dp_replicate}" if self.dp_replicate > 1 else "",
                         " grad-fp32" if self.grad_fp32 else "",
                         " overlap" if self.overlap_grad_reduce else "",
                         " tp-overlap" if self.tp_comm_overlap else "", " async-tp" if self.async_tp else "",
                         f" fp8={self.fp8}" if self.fp8 else "",
                         " fp8-params" if self.fp8_params else "", " compile" if self.compile else "",
                         f" {self.moe_dispatcher}" if self.moe_dispatcher != "alltoall" and self.ep > 1 else "",
                         " a2a-overlap" if self.moe_a2a_overlap and self.ep > 1 else "",
                         f" capacity={self.moe_capacity:g}" if self.moe_capacity else
                         f" load={self.expert_load:g}" if self.expert_load != 1 else ""])
        layers = f"({self.recompute_layers} per chunk)" if self.recompute_mode.partial else ""
        return (f"t={self.tp} p={self.pp} d={self.dp}{extra} b={self.b} m={self.m} v={self.v} "
                f"{self.schedule} recompute={self.recompute}{layers}")


FIELDS = {f.name: f for f in fields(ParallelConfig)}
"""ParallelConfig's fields by name, each with its metadata (the module's docstring)."""


def _rule(f) -> tuple[Callable[[Any], bool], Callable[[bool], str]]:
    """Field f's own check: what it accepts, and what a message says it must be (spelt for the CLI or not)."""
    meta = f.metadata
    if (choices := meta["choices"]) is not None:
        listed = choices if callable(choices) else lambda: choices
        return (lambda x: x == f.default or x in listed()), lambda cli: f"one of {choices_text(f.name, cli)}"
    if meta["valid"] is not None:
        ok, phrase = meta["valid"]
        return ok, lambda cli: phrase
    if f.type == "bool":
        return (lambda x: type(x) is bool), lambda cli: "true or false"
    assert f.type == "int", f"{f.name}: a field of type {f.type} says what it accepts (choices or valid)"
    return (lambda x: type(x) is int and x >= 1), lambda cli: "a positive integer"


def choices_text(name: str, cli: bool = False) -> str | None:
    """Field `name`'s choices as a sentence lists them (with what the CLI takes beside them where `cli`), or None."""
    meta = FIELDS[name].metadata
    if (choices := meta["choices"]) is None:
        return None
    return ", ".join(map(str, choices() if callable(choices) else choices)) + (meta["more"] if cli else "")


_RULES = {name: _rule(f) for name, f in FIELDS.items()}
_VALID = tuple((name, ok) for name, (ok, _) in _RULES.items())


def field_error(name: str, value: Any, cli: bool = False) -> str | None:
    """Why `value` cannot be field `name`'s (a sentence naming it, or its CLI flag where `cli`), or None."""
    ok, phrase = _RULES[name]
    if ok(value):
        return None
    return f"{FIELDS[name].metadata['flag'].split('/')[0] if cli else name} must be {phrase(cli)}, got {value!r}"


def replicate_error(replicate: int, zero: int | None, dp: int | None, say: Callable[[str], str] = str) -> str | None:
    """Why `replicate` replicas of a hybrid-sharded group (dp_replicate) cannot go with this ZeRO stage (None: not
    stated) and data-parallel degree (None where the search chooses it), or None. `say` spells a field."""
    if replicate > 1 and zero != 3:
        return (f"{say('dp_replicate')} {replicate} replicates a group that shards the parameters (FSDP): it needs "
                f"{say('zero')} 3" + ("" if zero is None else f", got {zero}"))
    if replicate > 1 and dp is not None and dp % replicate:
        return (f"{say('dp_replicate')} {replicate} does not divide the data-parallel degree {say('dp')} {dp} into "
                "replicas of equal shard groups")
    return None


def async_tp_error(sp: bool | None, compile: bool, tp_comm_overlap: bool,
                   say: Callable[[str], str] = str) -> str | None:
    """Why async tensor parallelism cannot go with these fields (sp None: the search chooses it), or None."""
    flag = lambda name: say(name).split("/")[0]  # noqa: E731 (a flag, not its negation)
    if not compile:
        return (f"async tensor parallelism ({flag('async_tp')}) is a pass of torch.compile's Inductor over the "
                f"compiled blocks: it needs {flag('compile')}")
    if sp is False:
        return (f"async tensor parallelism ({flag('async_tp')}) splits the all-gathers and reduce-scatters of sequence "
                f"parallelism: it needs {flag('sp')}")
    if tp_comm_overlap:
        return (f"{flag('async_tp')} and {flag('tp_comm_overlap')} are two ways to overlap the same tensor-parallel "
                "traffic (torch's symmetric memory, Transformer Engine's userbuffers): give one")
    return None


def options_error(fp8: str, fp8_params: bool, precision: str, expert_load: float | None, moe_capacity: float,
                  say: Callable[[str], str] = str) -> str | None:
    """Why these fields, which the user sets and the search does not choose, cannot go together, or None: the rules
    the pins (planner.options.Pins) are held to before the search as well as every configuration. `say` spells a
    field (its name, or its CLI flag); fp8 may be "auto" (the engine's default recipe, not yet known), expert_load
    None (not pinned)."""
    if fp8 and precision == "fp32":
        return f"FP8 recipes run under bf16 or fp16 mixed precision; drop {say('precision')} fp32 or {say('fp8')}"
    if fp8_params and not (fp8 == "auto" or fp8 and FP8_RECIPES[fp8].weight_cache):
        return (f"{say('fp8_params')} keeps the weights in FP8 only, as Transformer Engine does: it needs one of its "
                f"FP8 recipes ({say('fp8')})")
    if moe_capacity and expert_load is not None and expert_load != moe_capacity:
        return (f"{say('expert_load')} {expert_load:g} is a dropless router's balance, but {say('moe_capacity')} "
                f"{moe_capacity:g} pads every expert to that share: give one of them")
    return None
