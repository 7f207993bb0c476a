"""Fill-job specification: a YAML file of independent jobs to run inside the bubbles.

    jobs:
      - name: bert-infer
        model: ../examples/bert.py      # relative to this file
        model_args: {preset: base}
        kind: infer                     # train | infer
        batch_sizes: [8, 16, 32]
        work: {samples: 200000}         # or {iterations: N}
        arrival_s: 0
        deadline_s: 7200                # optional
        priority: 1                     # optional, higher first
        pair_with: other-train-job      # optional, training jobs: run beside that job on its rank, their
                                        # memory staggered as Waterwave pairs jobs (e.g. two trials of a sweep)
    safety_margin: 0.32                 # optional: share of every bubble left unused (default: PipeFill's
                                        # 68% filled, where it measured < 2% main-job overhead)
    policy: sjf                         # optional: which of a rank's jobs runs next (fifo | sjf | makespan | edf)
    gpu_sharing: timeslice              # optional: timeslice (the fill's own process beside the main job's,
                                        # the default), mps (nvidia-cuda-mps-control -d on every node first: the
                                        # launch commands do it), or none (the main job waits on the host: CPU runs)

A job's work is done once: an inference job's batches are divided among every GPU that runs it, a training
job runs data parallel over the GPUs of one pipeline stage (planner/fill/assign.py).
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from passes.errors import UserError, invalid_file

from .physics import DEFAULT_SAFETY_MARGIN, FillPolicy, GpuSharing

if TYPE_CHECKING:
    from planner.plan import Fill

__all__ = ["FillJobSpec", "FillSpec", "load_fill_spec"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Work(_Strict):
    samples: Optional[int] = Field(None, gt=0, description="samples to process")
    iterations: Optional[int] = Field(None, gt=0, description="training or inference steps")

    @model_validator(mode="after")
    def _one(self) -> "Work":
        if (self.samples is None) == (self.iterations is None):
            raise ValueError("give exactly one of samples or iterations")
        return self


class FillJobSpec(_Strict):
    """A fill job as the fill file asks for it: the batch sizes it may run at and its work. The plan records it as a
    FillJob (planner.plan) per batch size and configuration it was given, which is what the runtime runs."""

    name: str = Field(min_length=1)
    model: str = Field(description="model file (build_model, example_inputs), relative to the YAML file")
    model_args: dict[str, Union[bool, int, float, str]] = Field(default_factory=dict)
    kind: Literal["train", "infer"]
    batch_sizes: list[int] = Field(min_length=1)
    work: Work
    arrival_s: float = Field(0.0, ge=0)
    deadline_s: Optional[float] = Field(None, gt=0)
    priority: int = 0
    leaves: list[str] = Field(default_factory=list)
    pair_with: Optional[str] = Field(None, description="training: another training job of the file to run beside on "
                                     "one rank, paired as Waterwave pairs jobs (planner/fill/waterwave.py)")

    @field_validator("batch_sizes")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if any(b < 1 for b in v):
            raise ValueError(f"every batch size must be positive, got {v}")
        return sorted(set(v))

    def iterations(self, batch_size: int) -> int:
        if self.work.iterations is not None:
            return self.work.iterations
        return -(-self.work.samples // batch_size)


class FillSpec(_Strict):
    jobs: list[FillJobSpec] = Field(min_length=1)
    safety_margin: float = Field(DEFAULT_SAFETY_MARGIN, ge=0, lt=1,
                                 description="share of every bubble left unused (planner/fill/physics.py)")
    policy: FillPolicy = Field(
        "sjf", description="which of a rank's jobs runs next when one ends (planner/fill/job_scheduler.py)")
    gpu_sharing: GpuSharing = Field(
        "timeslice", description="how a fill process shares its GPU with the main job waiting in a bubble: time "
                                 "slices (separate processes, the default), MPS, or none (the main job waits on "
                                 "the host, as on CPU); planner/fill/physics.py")

    @classmethod
    def of_plan(cls, fill: "Fill") -> "FillSpec":
        """A plan's fill section as the fill file that asks for its jobs: each at the batch size the plan chose (its
        configurations are re-priced; the YAML the plan was made from, when at hand, lets every batch size compete
        again). A plan's FillJob is one of its job's batch sizes and configurations, named job@b<batch>-<config>."""
        paired = {b.split("@")[0]: a.split("@")[0] for a, b in (p.jobs for p in fill.pairs)}
        jobs: dict[str, FillJobSpec] = {}
        for j in fill.jobs:
            name = j.name.split("@")[0]
            jobs.setdefault(name, FillJobSpec(name=name, model=j.model_file, model_args=j.model_args, kind=j.kind,
                                              batch_sizes=[j.batch_size], leaves=list(j.leaves),
                                              work=Work(iterations=j.iterations or 1), arrival_s=j.arrival_s,
                                              deadline_s=j.deadline_s, priority=j.priority,
                                              pair_with=paired.get(name)))
        return cls(jobs=list(jobs.values()), safety_margin=fill.safety_margin, policy=fill.policy,
                   gpu_sharing=fill.gpu_sharing)

    @model_validator(mode="after")
    def _unique(self) -> "FillSpec":
        names = [j.name for j in self.jobs]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"job names must be unique, repeated: {', '.join(sorted(dup))}")
        kinds = {j.name: j.kind for j in self.jobs}
        for j in self.jobs:
            if j.pair_with is not None and (j.kind != "train" or kinds.get(j.pair_with) != "train"
                                            or j.pair_with == j.name):
                raise ValueError(f"job {j.name!r}: pair_with must name another training job of the file, and only a "
                                 f"training job can be paired (got {j.pair_with!r})")
        return self


def load_fill_spec(path: str | Path) -> FillSpec:
    """Parse and validate; model paths become absolute (relative to the YAML file)."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise UserError(f"fill file {path} does not exist") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" at line {mark.line + 1}" if mark else ""
        raise UserError(f"fill file {path} is not valid YAML{line}") from None
    if not isinstance(data, dict):
        raise UserError(f"fill file {path} must be a mapping with a 'jobs' list")
    try:
        spec = FillSpec.model_validate(data)
    except ValidationError as exc:
        raise invalid_file("fill file", path, exc) from None
    for job in spec.jobs:
        model = Path(job.model)
        job.model = str(model if model.is_absolute() else (path.parent / model).resolve())
        if not Path(job.model).is_file():  # named now, with its job, before the main model is traced
            what = "is a directory, not a .py model file" if Path(job.model).is_dir() else "does not exist"
            rel = "" if model.is_absolute() else f" (relative to the fill file's folder: {job.model})"
            raise UserError(f"fill file {path}: job {job.name!r}: model file {model}{rel} {what}")
    return spec
