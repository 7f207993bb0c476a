"""What the runtime writes back: the metrics document (``--metrics``) and ``planner validate``'s report.

Pydantic models (extra="forbid") describing exactly what ``python -m planner.runtime`` records per
run, rank, step and bubble, and what each rank's fill executor reports. Rank 0 validates the
gathered records with them before writing, so a file that does not conform is never written; every
reader loads it with ``load_metrics``. The exported JSON Schemas live in schemas/metrics.schema.json
and schemas/validation.schema.json, and a test fails when they drift.

Times named ``*_s`` are seconds. Fill-report timestamps (``main_begin``, ``start``, ``killed_at``,
...) are wall-clock ``time.time()`` seconds since the epoch on the rank's host.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator

from passes.errors import load_document, write_atomic

from .plan import ConfigModel
from .runtime import METRICS_SCHEMA

__all__ = ["METRICS_SCHEMA", "VALIDATION_SCHEMA", "MetricsDocument", "RunEntry", "RankRecord", "StepRecord",
           "StageTimes", "BubbleRecord", "Characterization", "FillReport", "FillJobReport", "FillOccurrence",
           "FillStep", "FillOverrun", "FillKill", "FillError", "FillTransition", "Comparison", "RankComparison",
           "RankValidation", "ValidationReport", "load_metrics", "save_metrics", "metrics_json_schema",
           "validation_json_schema"]

VALIDATION_SCHEMA = "fxplanner.validation/v1"

Interface = Literal["iterative", "imperative"]
TaskState = Literal["SUBMITTED", "CREATED", "PAUSED", "RUNNING", "STOPPED"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


# ---------------------------------------------------------------------------------------------
# Fill report: planner/runtime/fill_executor.py (FillExecutor.report) through FillClient.report()


class FillStep(_Model):
    """One linearized unit a fill job ran inside a bubble."""

    job: str = Field(description="fill job name")
    unit: str = Field(description="name of the linearized unit")
    pos: int = Field(description="position in the job's stream of units, counted over iterations")
    iteration: int = Field(description="the job's iteration this unit belongs to")
    start: float = Field(description="wall clock when the unit started (s since the epoch)")
    end: float = Field(description="wall clock when the unit ended (s since the epoch)")
    interface: Interface = Field(description="side-task interface that ran it")
    batch: Optional[int] = Field(None, description="the job's batch the iteration this unit completed ran on "
                                 "(its index among the job's batches); absent for the other units")
    checksum: Optional[float] = Field(None, description="sum of the weights after it (data-parallel jobs)")
    live_bytes: Optional[int] = Field(None, description="training: activations its iteration keeps for the backward "
                                      "after it (the saved bytes measured per forward unit)")
    pair_live_bytes: Optional[int] = Field(None, description="a paired job (Waterwave): its live bytes plus its "
                                           "partner's, after it")
    pair_budget_bytes: Optional[int] = Field(None, description="a paired job: the pair's budget (FillPair.budget_bytes)")
    allocated_bytes: Optional[int] = Field(None, description="CUDA: the task's allocated device bytes after it")


class FillOverrun(_Model):
    """A task still busy when its bubble's pause point came (it got the grace period)."""

    job: str = Field(description="fill job name")
    unit: str = Field(description="unit name, or 'init' for InitSideTask")
    pos: Optional[int] = Field(description="position of the unit in the job's stream; null for init")
    started: float = Field(description="wall clock when the unit was sent (s since the epoch)")
    pause_at: float = Field(description="wall clock of the pause point (s since the epoch)")
    cause: Literal["deadline", "bubble end"] = Field(description="what set the pause point")
    finished_at: Optional[float] = Field(description="wall clock when it finished within the grace period; null if not")
    killed: bool = Field(description="killed after the grace period")


class FillKill(_Model):
    """A task SIGKILLed because it was not paused by its pause point plus the grace period."""

    job: str = Field(description="fill job name")
    what: Literal["init", "step", "run"] = Field(description="what it was doing: InitSideTask, an iterative step, "
                                                 "or its own loop (imperative interface)")
    unit: Optional[str] = Field(description="the unit it was running; null for an imperative loop")
    started: Optional[float] = Field(description="wall clock when that work was sent (s since the epoch)")
    limit: float = Field(description="wall clock of pause point + grace (s since the epoch)")
    killed_at: float = Field(description="wall clock of the SIGKILL (s since the epoch)")
    grace_s: float = Field(description="grace period, seconds")


class FillError(_Model):
    """A fill job that raised, whose process died, or that could not start."""

    job: str = Field(description="fill job name")
    at: float = Field(description="wall clock when recorded (s since the epoch)")
    message: str = Field(description="the exception with its traceback, or why the process ended")
    unit: Optional[str] = Field(description="the unit it was running, if any")


class FillTransition(_Model):
    """One side-task state-machine transition (FreeRide Figure 3(a))."""

    t: float = Field(description="wall clock of the transition (s since the epoch)")
    job: str = Field(description="fill job name")
    transition: Literal["CreateSideTask", "InitSideTask", "StartSideTask", "RunNextStep", "PauseSideTask",
                        "StopSideTask"]
    from_: TaskState = Field(alias="from", description="state before")
    to: TaskState = Field(description="state after")
    reason: str = Field(description="why, in words (the unit run, the bubble, the stop cause)")


class FillTurn(_Model):
    """A fill job picked to run on the rank (it keeps the bubbles until it stops)."""

    job: str = Field(description="fill job name")
    at: float = Field(description="wall clock of the pick (s since the epoch)")
    elapsed_s: float = Field(description="seconds since the main job started (arrivals count from there)")


class FillOccurrence(_Model):
    """One occurrence of a bubble on the rank and what the fill jobs did in it."""

    bubble_id: int = Field(description="the plan's bubble id on this pipeline rank")
    seq: int = Field(description="occurrence number on this rank, from 1")
    main_begin: float = Field(description="wall clock when the main job reached the BUBBLE action (s since the epoch)")
    gpu_idle: float = Field(description="wall clock when the bubble started: the call, or the GPU going idle on CUDA")
    main_end: Optional[float] = Field(description="wall clock when the main job resumed; null if never signalled")
    deadline: float = Field(description="gpu_idle + duration_s (s since the epoch)")
    usable_until: float = Field(description="gpu_idle + duration_s x (1 - safety margin) (s since the epoch)")
    duration_s: float = Field(description="bubble duration the executor used: the main job's, capped by step 0's")
    free_bytes: int = Field(description="device memory free for fill jobs in this bubble, bytes")
    jobs: list[str] = Field(description="fill jobs the plan assigns to this bubble, in order")
    planned_units: dict[str, float] = Field(description="job -> units the plan packs into this bubble "
                                            "(mean over its chunks)")
    units_done: int = Field(description="units run in this occurrence")
    samples_done: int = Field(description="samples of iterations completed in this occurrence")
    steps: list[FillStep] = Field(description="units run in this occurrence, in order (one unit each)")
    overruns: list[FillOverrun]
    kills: list[FillKill]
    errors: list[FillError]


class FillLoad(_Model):
    """One transfer group of a streamed (not resident) fill job's weights loaded onto the device (PipeSwitch)."""

    group: int = Field(description="index of the plan's transfer group")
    units: list[int] = Field(description="[start, stop) of the forward units whose weights it carries")
    bytes: int = Field(description="weight bytes moved")
    prefetched: bool = Field(description="started while the previous group computed (else exposed: the first "
                             "group of a bubble)")
    start: float = Field(description="wall clock when the transfer started (s since the epoch)")
    end: float = Field(description="wall clock when it ended")
    overlap_s: float = Field(description="seconds of the transfer during which the job computed")


class FillJobReport(_Model):
    """One fill job's state and progress at shutdown."""

    name: str = Field(description="fill job name")
    kind: Literal["train", "infer"]
    interface: Interface = Field(description="side-task interface (FreeRide A.1)")
    batch_size: int = Field(description="samples per iteration")
    state: TaskState = Field(description="state-machine state at shutdown")
    stop_reason: Optional[Literal["done", "failed", "killed", "shutdown"]] = Field(
        description="why it reached STOPPED; null if it never did")
    error: Optional[str] = Field(description="why it failed, if it did")
    units_done: int = Field(description="units run in all")
    iterations_done: int = Field(description="iterations completed")
    samples_done: int = Field(description="samples of the iterations completed")
    batch_first: int = Field(0, description="its share: iteration i runs on the job's batch batch_first + i x "
                             "batch_stride")
    batch_stride: int = Field(1, description="see batch_first (the GPUs of its pipeline rank)")
    planned_iterations: Optional[int] = Field(None, description="iterations of its share (null: until shutdown)")
    dp_size: int = Field(1, description="data-parallel replicas of a training job (this rank's stage GPUs)")
    dp_rank: int = Field(0, description="this replica's index among them")
    checksum: Optional[float] = Field(None, description="sum of its weights after its last iteration (data-parallel "
                                      "jobs: equal on every replica)")
    config: str = Field("plain", description="fill-job configuration it ran (plain, checkpoint, offload)")
    resident: bool = Field(True, description="weights kept on the device between bubbles (else streamed per bubble)")
    loads: list[FillLoad] = Field(default_factory=list, description="a streamed job's weight loads (the first 200)")
    loads_total: int = Field(0, description="weight loads in all")
    saved_bytes: dict[str, int] = Field(default_factory=dict, description="training: forward unit -> bytes it left "
                                        "for the backward, measured with saved-tensor hooks (checkpointed units: "
                                        "the inputs they recompute from)")
    optimizer_on: Optional[str] = Field(None, description="training: where the optimizer's state lives (host "
                                        "under offload, else the job's device)")
    optimizer_state_bytes: Optional[int] = Field(None, description="training: bytes of the optimizer's state")
    optimizer_steps_module_weights: Optional[bool] = Field(None, description="training: whether the optimizer "
                                                           "steps the device weights themselves (false under "
                                                           "offload: it steps host copies)")
    units: list[str] = Field(description="the job's linearized units, as the task traced them")
    profile_s: Optional[dict[str, float]] = Field(description="unit -> seconds timed by InitSideTask; null if never")
    observed_s: dict[str, float] = Field(description="unit -> recently observed seconds (moving average)")
    predicted_s: dict[str, float] = Field(description="unit -> seconds the plan predicted on its target")


class FillReport(_Model):
    """What a rank's fill executor did. When it did not answer (crashed, hung) only the lists, empty,
    and ``error`` are present."""

    pipeline_rank: Optional[int] = Field(None, description="pipeline rank the executor serves")
    global_rank: Optional[int] = Field(None, description="global rank of the main-job process")
    device: Optional[str] = Field(None, description="torch device of the fill jobs")
    executor_pid: Optional[int] = Field(None, description="process id of the fill executor")
    grace_s: Optional[float] = Field(None, description="how long past a pause point a task may run, seconds")
    safety_margin: Optional[float] = Field(None, description="fraction of each bubble kept free")
    started_at: Optional[float] = Field(None, description="wall clock when the executor started (s since the epoch)")
    jobs: list[FillJobReport] = Field(description="the rank's fill jobs")
    bubbles: list[FillOccurrence] = Field(description="every bubble occurrence signalled after fill started")
    overruns: list[FillOverrun] = Field(description="all occurrences' overruns")
    kills: list[FillKill] = Field(description="every SIGKILL, also those outside a bubble")
    errors: list[FillError] = Field(description="every fill-job failure, also those outside a bubble")
    transitions: list[FillTransition] = Field(description="the state-machine log, in order")
    policy: Optional[str] = Field(None, description="how the next job is picked when one ends")
    replica: Optional[int] = Field(None, description="this GPU's index among its pipeline rank's GPUs")
    replicas: Optional[int] = Field(None, description="GPUs of its pipeline rank (they divide each job)")
    turns: list[FillTurn] = Field(default_factory=list, description="each job's turn start, in order")
    error: Optional[str] = Field(None, description="why the executor gave no report")


# ---------------------------------------------------------------------------------------------
# Metrics: planner/runtime/executor.py (Executor.run, run_step) and __main__.py (_run_entry)


class BubbleRecord(_Model):
    """One bubble as the main job measured it: from its BUBBLE action to the next compute action."""

    id: int = Field(description="the plan's bubble id on this pipeline rank")
    start_s: float = Field(description="start, seconds after the step began")
    duration_s: float = Field(description="measured idle time, seconds")
    predicted_start_s: Optional[float] = Field(description="the plan's start, seconds; null if the plan lacks it")
    predicted_s: Optional[float] = Field(description="the plan's duration, seconds; null if the plan lacks it")


class StageTimes(_Model):
    """One virtual stage's compute in a step."""

    forward_s: float = Field(description="forward time summed over the step's microbatches, seconds")
    backward_s: float = Field(description="backward time summed over the step's microbatches, seconds")


class StepRecord(_Model):
    """One training step on one rank."""

    step: int = Field(description="step index, from 0 (step 0 runs without fill and measures the bubbles)")
    iteration_s: float = Field(description="wall time of the step, ending with a barrier over all ranks, seconds")
    loss: Optional[float] = Field(description="sum over microbatches of loss/m, averaged over dp and cp; last "
                                  "pipeline rank only, else null")
    bubbles: list[BubbleRecord] = Field(description="this rank's bubbles in the step, in order")
    stages: dict[str, StageTimes] = Field(description="virtual stage index (as a string) -> compute times")
    peak_memory_bytes: Optional[int] = Field(description="peak allocated device memory, bytes; CUDA only, else null")
    fill: bool = Field(description="bubbles were handed to a fill client in this step")
    loss_scale: Optional[float] = Field(None, description="fp16: the loss scale the step's gradients carry, else null")
    skipped: bool = Field(False, description="fp16: the gradients overflowed, the optimizer step was skipped and the "
                                             "scale halved")
    optimizer_offloaded_bytes: int = Field(0, description="optimizer state bytes held in host memory from the step's "
                                           "start to its gradient reduction (the plan's main-job offload)")


class Characterization(_Model):
    """A bubble measured by doubling waits inside it until the step slows (PipeFill 4.2)."""

    rank: int = Field(description="pipeline rank of the bubble")
    bubble: int = Field(description="bubble id")
    duration_s: float = Field(description="largest wait that did not slow the step, seconds")
    baseline_s: float = Field(description="slowest rank's step time with no wait, seconds")
    probes: list[tuple[float, float]] = Field(description="(wait, slowest step time) in seconds, in the order tried")


class Holdings(_Model):
    """What one rank actually holds and runs, to check against the plan (`planner validate`)."""

    parameters: int = Field(description="parameter elements the rank holds (its tensor-parallel shards; a weight "
                            "shared by two of its stages once)")
    parameter_dtype: str = Field(description="dtype of the parameters the model runs in (torch name)")
    optimizer_state_bytes: int = Field(description="optimizer state held after a step: moments, and the fp32 master "
                                       "copy where the parameters are lower precision")
    tensor_parallel: list[str] = Field(description="modules whose weights are sharded over the tensor-parallel group")
    recompute: Literal["none", "selective", "full", "block"] = Field(
        description="what the rank's blocks recompute: the attention core (selective), whole blocks (full), the "
        "first blocks of each stage whole (block)")
    saved_activation_bytes: dict[str, int] = Field(description="virtual stage -> bytes one microbatch leaves for the "
                                                   "backward: tensors autograd saves (weights excluded) and the inputs "
                                                   "a checkpoint keeps; measured with saved-tensor hooks in step 0")
    overlapped_buckets: int = Field(description="gradient buckets whose data-parallel reduction was launched during "
                                    "the backward in the last step")


class RankRecord(_Model):
    """One process's record (gathered to rank 0)."""

    rank: int = Field(description="global rank")
    pp: int = Field(description="pipeline rank")
    dp: int = Field(description="data-parallel rank")
    tp: int = Field(description="tensor-parallel rank")
    cp: int = Field(0, description="context-parallel rank")
    stages: list[int] = Field(description="virtual stages this rank runs")
    steps: list[StepRecord] = Field(description="the training steps, in order")
    fill_report: Optional[FillReport] = Field(description="the fill executor's report; null when no fill client ran")
    fill_client: str = Field(description="class of the fill hooks at the end (FillClient, NullFill)")
    characterization: Optional[Characterization] = Field(description="with --characterize, else null")
    holds: Optional[Holdings] = Field(None, description="what the rank holds and runs (null in older metrics)")

    @field_validator("fill_report", mode="before")
    @classmethod
    def _no_report(cls, value: object) -> object:
        return None if value == {} else value  # the executor's NullFill reports {}


class RunEntry(_Model):
    """One plan's run."""

    plan: str = Field(description="path of the plan file, as given")
    plan_key: Optional[str] = Field(None, description="planner.plan.run_key of the plan run: validate and refit match "
                                    "metrics to their plan by it")
    config: ConfigModel = Field(description="the plan's configuration")
    world: int = Field(description="processes")
    device: str = Field(description="torch device of rank 0 (cpu, cuda:0)")
    steps: int = Field(description="training steps run (--steps)")
    fill: bool = Field(description="fill jobs were allowed (no --no-fill)")
    optimizer: Literal["adam", "sgd"]
    lr: float = Field(description="learning rate")
    seed: int = Field(description="torch.manual_seed before build_model on every rank")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(description="dtype of the parameters and activations "
                                                             "the runtime trains in (the plan's precision)")
    loss: list[float] = Field(description="per step, from the last pipeline rank (dp 0, tp 0)")
    predicted_iteration_s: float = Field(description="the plan's predicted iteration on its target, seconds")
    rehearsed_rank: Optional[int] = Field(None, description="a rehearsal (planner rehearse): the one pipeline rank "
                                          "that ran, its peers replayed from the plan; null for a launch")
    ranks: list[RankRecord] = Field(min_length=1, description="per global rank, in order")


class MetricsDocument(_Model):
    """``--metrics``: one entry per plan run in the launch."""

    schema_version: Literal[METRICS_SCHEMA] = Field(default=METRICS_SCHEMA, alias="schema")
    runs: list[RunEntry] = Field(min_length=1, description="one per plan, in the order given")


# ---------------------------------------------------------------------------------------------
# `planner validate`: predicted against measured (planner/validate.py compare)


class Comparison(_Model):
    """One figure, predicted (the plan, on its target) against measured (the run, here)."""

    what: str = Field(description="the figure compared")
    predicted: Optional[float] = Field(description="seconds; bytes for peak memory; units for fill rows")
    measured: Optional[float] = Field(description="same unit as predicted, over the steps after the warm-up "
                                      "(mean; max for peak memory)")
    error: Optional[float] = Field(description="measured / predicted - 1; null if either is missing or predicted is 0")


class RankComparison(Comparison):
    """A figure of one pipeline rank (its dp x tp instances pooled)."""

    rank: int = Field(description="pipeline rank")
    kind: Optional[Literal["A", "B", "C"]] = Field(None, description="bubble kind (bubble duration rows only)")


class RankValidation(_Model):
    rank: int = Field(description="pipeline rank")
    rows: list[RankComparison] = Field(description="stage compute, bubbles, iteration, peak memory, fill units")


class ValidationReport(_Model):
    """``planner validate``'s output (validation.json)."""

    schema_version: Literal[VALIDATION_SCHEMA] = Field(default=VALIDATION_SCHEMA, alias="schema")
    plan: str = Field(description="plan file of the run, as given to the runtime")
    device: str = Field(description="torch device of rank 0")
    steps: int = Field(description="steps run, the warm-up included")
    iteration: Comparison = Field(description="the slowest rank's iteration")
    ranks: list[RankValidation]
    mismatches: list[str] = Field(default_factory=list, description="what a rank holds or runs unlike the plan: "
                                  "parameters, optimizer state or saved activations more than 5% off, another dtype, "
                                  "recomputation or tensor-parallel layout; one sentence each")


# ---------------------------------------------------------------------------------------------
# Files


def load_metrics(path: str | Path) -> MetricsDocument:
    """Read and validate a metrics file, or raise UserError with one sentence saying what is wrong."""
    return load_document(path, "metrics file", METRICS_SCHEMA, MetricsDocument,
                         missing=f"write one with `planner launch PLAN --local --metrics {path}`",
                         other_schema=f"not {METRICS_SCHEMA!r}: it is not a metrics file from `planner launch --metrics`")


def save_metrics(doc: MetricsDocument, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, doc.model_dump_json(by_alias=True, indent=1) + "\n", "metrics")


def metrics_json_schema() -> dict:
    return MetricsDocument.model_json_schema(by_alias=True)


def validation_json_schema() -> dict:
    return ValidationReport.model_json_schema(by_alias=True)
