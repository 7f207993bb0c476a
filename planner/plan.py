"""The plan file: one versioned JSON document, validated on load, never executing code.

Pydantic models (extra="forbid") at this boundary; the exported JSON Schema lives in
schemas/plan.schema.json and a test fails when it drifts.
"""
from __future__ import annotations

from dataclasses import MISSING
from pathlib import Path
from typing import Literal, Optional, Union, get_type_hints

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from passes.errors import UserError, load_document, write_atomic

from .config import FIELDS, ParallelConfig
from .engines import ENGINES
from .fill.physics import FillPolicy, GpuSharing
from .simulate import Bubble

__all__ = ["SCHEMA", "Plan", "ConfigModel", "load_plan", "save_plan", "json_schema", "plan_hardware",
           "plan_schedule", "inconsistency"]

SCHEMA = "fxplanner.plan/v2"
ArgValue = Union[bool, int, float, str]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class Source(_Model):
    """What the plan was made from."""

    model_file: str = Field(description="path of the model file, as given")
    model_sha256: str = Field(description="sha256 of the model file; the runtime refuses a different file")
    model_args: dict[str, ArgValue] = Field(description="keyword arguments of build_model / example_inputs")
    leaves: list[str] = Field(default_factory=list, description="modules traced as leaves")
    engine: Literal[tuple(ENGINES)] = Field(
        "fxplanner", description="what runs the plan: fxplanner's runtime, or the engine it is exported to (its launch "
        "commands are the export's)")
    notes: list[str] = Field(default_factory=list, description="how the model was priced: unpriced ops, unused "
                             "parameters, layers priced without a parallelism they need")
    frontend: Literal["export", "fx"] = Field("export", description="how the model was captured: torch.export, or "
                                              "torch.fx.symbolic_trace where export could not take it (or leaves)")
    model_shape: dict[str, Optional[ArgValue]] = Field(default_factory=dict, description="layers, hidden, heads, "
                                                       "kv_heads, ffn, vocab, seq, gated, norm, position, tied, bias, "
                                                       "rope_theta, rope_scaling, attention_dropout, hidden_dropout, "
                                                       "norm_eps (passes.shape; null: not stated), for exports")
    target: str = Field(description="target name")
    gpu: dict[str, float | str | dict[str, float]] = Field(description="GPU figures used")
    cluster: dict[str, float | int] = Field(description="cluster figures used")
    efficiency: dict[str, float | list[tuple[str, float, float]]] = Field(
        default_factory=dict, description="cost-model efficiencies used (defaults, or a calibration's)")
    reserve_bytes: int = Field(3 << 30, description="device memory kept from the model (context, fragmentation, "
                               "buffers)")
    gpus: int
    gpus_per_node: int
    global_batch: int
    tool_version: str


class _ConfigFields(_Model):
    @model_validator(mode="after")
    def _consistent(self) -> "_ConfigFields":
        self.to_config()  # every rule of ParallelConfig, with its message
        return self

    @classmethod
    def of(cls, c: ParallelConfig) -> "ConfigModel":
        return cls(**{plan: getattr(c, name) for name, plan in _PLAN_NAMES.items()})

    def to_config(self) -> ParallelConfig:
        return ParallelConfig(**{name: getattr(self, plan) for name, plan in _PLAN_NAMES.items()})


_PLAN_NAMES = {name: f.metadata["plan"] or name for name, f in FIELDS.items()}
ConfigModel = create_model(
    "ConfigModel", __base__=_ConfigFields, __module__=__name__,
    __doc__="A `ParallelConfig` in the plan file: its fields, some under longer names for readers (planner.config: "
            "each field's `plan` and `help`); `of` and `to_config` convert.",
    **{_PLAN_NAMES[name]: (hint, Field(... if FIELDS[name].default is MISSING else FIELDS[name].default,
                                       description=FIELDS[name].metadata["help"]))
       for name, hint in get_type_hints(ParallelConfig).items()})


class Stage(_Model):
    stage: int = Field(description="virtual stage index (its rank follows the schedule's placement: loop or v)")
    rank: int = Field(description="pipeline rank that runs it")
    units: list[str]
    nodes: list[str] = Field(description="node names of the planning graph (source.frontend), in order; the "
                                         "runtime places nodes by their unit")
    forward_s: float
    backward_s: float
    weight_s: float = Field(0.0, description="of backward_s, what the W step (weight gradient) takes when the "
                                             "schedule splits the backward")
    activation_bytes: float = Field(description="per microbatch in flight")
    weight_bytes: float = Field(0.0, description="of activation_bytes, what a microbatch still holds between its "
                                                 "I and its W step (split backward)")
    tensor_parallel: dict[str, Literal["colwise", "rowwise", "vocab", "vocab_colwise"]] = Field(
        default_factory=dict, description="module path -> how its weight is split over the tensor-parallel ranks: a "
        "linear colwise or rowwise (torch.distributed.tensor.parallel styles), an embedding by vocabulary rows (vocab: "
        "every use of its weight, a head tied to it included), an LM head by its vocabulary outputs (vocab_colwise, "
        "its logits gathered)")


class RankMemory(_Model):
    rank: int
    weights: float
    grads: float
    optimizer: float
    activations: float
    reserve: float
    total: float
    capacity: float


class Predictions(_Model):
    iteration_s: float
    samples_per_s: float
    tokens_per_s: float = Field(description="0 for a model whose input is not token ids")
    tflops_per_gpu: float = Field(description="thesis eq. 4.2 convention (recomputation counted)")
    mfu: float = Field(description="model FLOPs utilization as PaLM and Megatron define it: 3x the forward's matrix "
                                   "products (attention in full, no recomputation) per second per GPU over the "
                                   "dtype's dense peak")
    hfu: float = Field(description="hardware FLOPs utilization: FLOPs executed (recomputation as planned, causal "
                                   "attention as run) over the dense peak")
    hardware_tflops_per_gpu: float = Field(description="FLOPs actually executed (recomputation only as planned)")
    bubble_fraction: float
    p2p_s: float
    tp_comm_s: float = Field(description="per microbatch, forward + backward, all units")
    allreduce_s: list[float]
    optimizer_s: list[float]
    memory: list[RankMemory]
    action_overhead_s: float = Field(0.0, description="calibrated runtime cost per F/B action, inside forward_s/backward_s")


class Alternative(_Model):
    config: ConfigModel
    iteration_s: float
    tflops_per_gpu: float
    mfu: float = Field(description="as Predictions.mfu")
    peak_memory: float
    simulated: bool


class Launch(_Model):
    nnodes: int
    nproc_per_node: int
    commands: list[str] = Field(description="one torchrun command per node")
    script: str = Field(description="a bash launch script taking the node rank")


class SearchInfo(_Model):
    evaluated: int
    rejected: dict[str, int]
    seconds: float
    pinned: list[str]


class FillShard(_Model):
    """One pipeline rank's share of a fill job. Its d x cp x t GPUs divide it: replica k of R takes batches
    first_batch + k, first_batch + k + R, ... below first_batch + batches (a training job's R replicas are data
    parallel: each step every replica trains on its own batch and the gradients are averaged)."""

    rank: int = Field(description="pipeline rank")
    first_batch: int
    batches: int
    start_s: float = Field(description="predicted start of the job's turn on this rank (s after the main job starts)")
    end_s: float = Field(description="predicted end of that turn")


class FillJob(_Model):
    name: str
    model_file: str
    model_sha256: str
    model_args: dict[str, ArgValue]
    kind: Literal["train", "infer"]
    batch_size: int
    config: Literal["plain", "checkpoint", "offload"] = Field(description="fill-job configuration (PipeFill 4.3)")
    units: list[str] = Field(description="the job's linearized units: forward units, then backward, then optimizer")
    unit_time_s: list[float] = Field(description="predicted time of each linearized unit on the target")
    resident: bool = Field(description="kept on the device between bubbles, else loaded per bubble")
    load_groups: list[list[int]] = Field(default_factory=list, description="not resident: PipeSwitch's transfer "
                                         "groups, [start, stop) ranges of its forward units, loaded in order in each "
                                         "bubble (the next group's transfer overlapping the current group's compute)")
    leaves: list[str] = Field(default_factory=list, description="modules traced as leaves")
    engine: Literal[tuple(ENGINES)] = Field(
        "fxplanner", description="what runs the plan: fxplanner's runtime, or the engine it is exported to (its launch "
        "commands are the export's)")
    notes: list[str] = Field(default_factory=list, description="how the model was priced: unpriced ops, unused "
                             "parameters, layers priced without a parallelism they need")
    iterations: Optional[int] = Field(None, description="work: the job's batches (iterations of batch_size on one "
                                      "GPU), done once over all the GPUs that run it")
    arrival_s: float = Field(0.0, description="seconds after the main job starts when the job may first run")
    deadline_s: Optional[float] = Field(None, description="seconds after the main job starts by which it should end")
    priority: int = Field(0, description="free for user score functions")
    shards: list[FillShard] = Field(default_factory=list, description="per pipeline rank that runs the job, its "
                                      "share of the batches and its predicted turn there")


class FillChunk(_Model):
    job: str
    rank: int = Field(description="pipeline rank whose bubble runs it (each of that rank's GPUs runs its own share "
                      "of the job: FillJob.shards)")
    bubble_id: int
    first_unit: int = Field(description="index into the job's linearized units, counted over repeated iterations")
    units: int
    expected_s: float
    memory_bytes: int


class FillPredictions(_Model):
    fill_tflops_per_gpu: float
    bubble_time_used: float = Field(description="fraction of all bubble time that fill chunks occupy")
    total_useful_tflops_per_gpu: float
    offload_optimizer: bool
    offload_bytes: list[int] = Field(default_factory=list, description="per pipeline rank, the main job's optimizer "
                                     "bytes held in host memory from the step's start to its gradient reduction "
                                     "(PipeFill 4.2), freeing them for the bubbles")
    unplaceable: dict[str, str] = Field(default_factory=dict, description="job -> why it fits no bubble")
    not_chosen: dict[str, str] = Field(default_factory=dict, description="job -> why it fits but runs nowhere "
                                       "(every job of the spec is placed, unplaceable, or here)")
    notes: dict[str, str] = Field(default_factory=dict, description="job -> a pairing it asked for (pair_with) and "
                                  "why it was not made")
    solver: str = Field("greedy", description="how the packing was solved: greedy (and, when CP-SAT was asked for, "
                        "that greedy is proven optimal where chunk boundaries cost nothing), or CP-SAT's solves, time "
                        "and gap to its proven bound")
    under_mps_tflops_per_gpu: float | None = Field(None, description="a time-sliced plan's fill re-packed with its "
                                                   "units at their own speed: what running it under MPS would recover")
    choice: str = Field("", description="which won, shrinking the bubbles (a zero-bubble schedule) or keeping and "
                        "filling them, and why, with both configurations' figures; or why they were not compared (a pinned schedule)")


class FillPair(_Model):
    """Two training jobs of one pipeline rank paired as Waterwave pairs them (planner/fill/waterwave.py): they run
    together, their node groups taking turns, a unit admitted only while the pair stays within budget_bytes. The
    runtime decides with these numbers (waterwave.PairLedger), as the planner simulated."""

    rank: int = Field(description="pipeline rank")
    jobs: list[str] = Field(description="the two FillJob names (job 0 and job 1 of the lists below)")
    budget_bytes: int = Field(description="device bytes the pair's activations and working memory may use together")
    split_bytes: int = Field(description="Waterwave's split size: a node group closes once it (de)allocates this")
    stops: list[list[int]] = Field(description="per job, the unit indices where its node groups end (exclusive)")
    mem_bytes: list[list[int]] = Field(description="per job and unit: bytes while it runs, its live activations included")
    state_bytes: list[list[int]] = Field(description="per job and unit: bytes live after it")
    iterations: int = Field(description="iterations of each job per period of the pair's schedule")
    peak_bytes: int = Field(description="the most the pair uses at once (predicted)")
    held_bytes: int = Field(description="the most the pair's activations hold between units, so between bubbles")
    side_by_side_bytes: int = Field(description="what the two need unstaggered: the sum of their peaks")


class Fill(_Model):
    safety_margin: float
    policy: FillPolicy = Field("sjf", description="which of a rank's fill jobs runs next when one ends (planner/fill/"
                               "job_scheduler.py POLICIES: fifo, sjf, makespan, edf)")
    gpu_sharing: GpuSharing = Field(
        "timeslice", description="how the fill processes share a GPU with the main job: time slices, MPS (start "
                                 "nvidia-cuda-mps-control -d on every node before torchrun), or none (the main job "
                                 "waits on the host: the CPU runtime); planner/fill/physics.py")
    jobs: list[FillJob]
    chunks: list[FillChunk]
    pairs: list[FillPair] = Field(default_factory=list, description="training jobs paired on a rank (Waterwave)")
    predictions: FillPredictions


class Plan(_Model):
    schema_version: Literal["fxplanner.plan/v2"] = Field(default=SCHEMA, alias="schema")
    source: Source
    config: ConfigModel
    alternatives: list[Alternative]
    partition: list[Stage]
    actions: list[list[str]] = Field(description="per pipeline rank, the action strings (1F0, 0B3, BUBBLE2, ...)")
    bubbles: list[Bubble]
    predictions: Predictions
    launch: Launch
    search: SearchInfo
    fill: Fill | None = None


def inconsistency(plan: Plan) -> str | None:
    """Where the parts of a plan disagree with each other (an edited field), or None. `load_plan` refuses
    such a plan, so every command that reads one checks it."""
    c, src, pred = plan.config, plan.source, plan.predictions
    world = c.tp * c.pp * c.dp * c.cp
    placement = c.to_config().placement
    rank_of = placement.rank_of if len(placement.rank_of) == len(plan.partition) else ()
    checks = [
        (world == src.gpus, f"config.tp*pp*dp*cp = {world} GPUs but source.gpus = {src.gpus}"),
        (c.dp * c.microbatch * c.microbatches == src.global_batch,
         f"config.dp*microbatch*microbatches = {c.dp * c.microbatch * c.microbatches} samples but "
         f"source.global_batch = {src.global_batch}"),
        (len(plan.partition) == c.pp * c.vp, f"partition has {len(plan.partition)} stages but config.pp*vp = "
                                             f"{c.pp * c.vp}"),
        (sorted(s.stage for s in plan.partition) == list(range(len(plan.partition))) and all(
            0 <= s.stage < len(rank_of) and s.rank == rank_of[s.stage] for s in plan.partition),
         f"partition stages must be numbered 0..pp*vp-1, each on the rank of the {c.schedule} schedule's "
         f"'{placement.style}' placement"),
        (len(pred.memory) == c.pp == len(pred.allreduce_s) == len(pred.optimizer_s),
         f"predictions hold {len(pred.memory)} ranks' memory but config.pp = {c.pp}"),
        (plan.launch.nnodes * plan.launch.nproc_per_node == src.gpus,
         f"launch runs {plan.launch.nnodes} x {plan.launch.nproc_per_node} processes but source.gpus = {src.gpus}"),
        (pred.iteration_s > 0 and abs(pred.samples_per_s * pred.iteration_s / src.global_batch - 1) < 1e-6,
         f"predictions.samples_per_s {pred.samples_per_s:g} is not global_batch / iteration_s "
         f"({src.global_batch} / {pred.iteration_s:g})"),
        (0 <= pred.bubble_fraction < 1 and 0 <= pred.mfu <= 1 and 0 <= pred.hfu <= 1,
         "predictions: bubble_fraction must lie in [0, 1), mfu and hfu in [0, 1]"),
    ]
    for ok, why in checks:
        if not ok:
            return why
    busiest = max((sum(s.forward_s + s.backward_s for s in plan.partition if s.rank == r) * c.microbatches
                   for r in range(c.pp)), default=0.0)
    if pred.iteration_s < busiest * (1 - 1e-6):
        return (f"predictions.iteration_s {pred.iteration_s:g} s is shorter than the busiest rank's "
                f"compute ({busiest:g} s)")
    from .schedule_ir import validate

    try:
        validate(plan_schedule(plan))  # complete, dependencies kept, sends paired, no deadlock
    except ValueError as exc:
        return f"actions: {exc}"
    if plan.fill is not None:
        bad = [ch.job for ch in plan.fill.chunks if ch.rank >= c.pp]
        if bad:
            return f"fill chunk of {bad[0]} runs on rank >= config.pp = {c.pp}"
        jobs = {j.name: j for j in plan.fill.jobs}
        for pair in plan.fill.pairs:
            named = [jobs.get(n) for n in pair.jobs]
            if len(named) != 2 or None in named or any(j.kind != "train" for j in named):
                return f"fill pair {pair.jobs} does not name two training jobs of the plan"
            units = [len(j.units) for j in named]
            if [len(x) for x in pair.mem_bytes] != units or [len(x) for x in pair.state_bytes] != units \
                    or len(pair.stops) != 2 or pair.rank >= c.pp:
                return (f"fill pair {pair.jobs}: mem_bytes, state_bytes and stops must cover each job's units, on a rank "
                        f"below config.pp = {c.pp}")
    return None


def run_key(plan: Plan) -> str:
    """What a run of the plan's main job depends on, hashed: the model (file hash and arguments), the configuration,
    the partition and the action lists. Metrics carry it (RunEntry.plan_key); refitting bubbles or re-packing the fill
    leaves it unchanged, another plan does not."""
    import hashlib
    import json

    what = {"model": plan.source.model_sha256, "args": plan.source.model_args,
            "config": plan.config.model_dump(mode="json"),
            "partition": [[s.stage, s.rank, s.units, s.tensor_parallel] for s in plan.partition], "actions": plan.actions}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()


def plan_hardware(plan: Plan):
    """What the plan was priced on, rebuilt from the figures stored in it (no registry lookup)."""
    from costmodels.hardware import Efficiency, Hardware
    from targets.specs import ClusterSpec, GPUSpec, Target

    src = plan.source
    target = Target(name=src.target, gpu=GPUSpec(**src.gpu), cluster=ClusterSpec(**src.cluster))
    eff = dict(src.efficiency)
    eff["unit_factors"] = tuple(tuple(f) for f in eff.get("unit_factors", ()))
    return Hardware(target=target, eff=Efficiency(**eff), reserve_bytes=src.reserve_bytes,
                    attention=ENGINES[src.engine].attention)  # (the engine's attention kernel)


def plan_schedule(plan: Plan):
    """The plan's action lists as a Schedule (BUBBLE actions included): what the runtime executes."""
    from .schedule_ir import Action, Schedule

    c = plan.config
    return Schedule(kind=c.schedule, p=c.pp, v=c.vp, m=c.microbatches,
                    ranks=tuple(tuple(Action.parse(a) for a in acts) for acts in plan.actions))


def json_schema() -> dict:
    return Plan.model_json_schema(by_alias=True)


def save_plan(plan: Plan, path: str | Path) -> None:
    write_atomic(path, plan.model_dump_json(by_alias=True, indent=1) + "\n", "plan")


def load_plan(path: str | Path) -> Plan:
    """Read and validate a plan. JSON only: nothing in it is ever executed or unpickled."""
    plan = load_document(path, "plan file", SCHEMA, Plan, missing=f"create one with `planner plan MODEL.py -o {path}`",
                         other_schema=f"this planner reads {SCHEMA!r}; re-run `planner plan` to regenerate it")
    why = inconsistency(plan)
    if why is not None:
        raise UserError(f"plan file {path} is inconsistent: {why}; re-run `planner plan` rather than editing it")
    return plan
