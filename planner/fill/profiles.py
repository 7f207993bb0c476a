"""Fill-job profiles: each job traced and priced with the same passes as the main model, under
configurations batch size x {plain, checkpoint (activation recomputation), offload (optimizer
state on the host, training only)} (PipeFill 4.3), as the linearized unit sequence the packer cuts
into chunks, plus the memory the job keeps on the device between bubbles.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from costmodels.compute import unit_time
from costmodels.hardware import Hardware
from costmodels.precision import ADAM_HOST_BYTES, PRECISIONS
from costmodels.recompute import RECOMPUTE
from passes.pipeline import ModelProfile, analyze
from passes.units import Unit
from planner.config import ParallelConfig

from .packing import FillUnit
from .physics import HOST_OPTIMIZER_TENSOR_S, GpuSharing, host_unit_s, runtime_unit_s
from .pipeswitch import Layer
from .spec import FillJobSpec

__all__ = ["FillProfile", "profile_job", "shared_profile", "linearize"]

CONFIGS = {"plain": "none", "checkpoint": "full", "offload": "none"}
"""Fill-job configuration -> the recomputation mode it trains with."""
HOST_ADAM_BYTES_PER_S = 20e9  # host-memory bandwidth an offloaded Adam step streams at (assumption)


@dataclass(frozen=True, kw_only=True, slots=True)
class FillProfile:
    job: str
    kind: str
    batch_size: int
    config: str
    units: tuple[FillUnit, ...]  # one iteration, linearized
    resident_bytes: int  # kept on the device between bubbles
    layers: tuple[Layer, ...]  # for pipelined loading when not resident (PipeSwitch)
    params: int
    sha256: str
    batches: int = 1
    """The job's amount of work: batches of batch_size (iterations on one GPU), done once over all its GPUs."""
    arrival_s: float = 0.0
    deadline_s: float | None = None
    priority: int = 0
    pair_with: str | None = None
    """Another training job to run beside, paired (FillJobSpec.pair_with)."""
    host_wait_s: float = 0.0
    """Of one iteration alone, the seconds the GPU waits for the host issuing its units (planner/fill/physics.py
    HOST_UNIT_S)."""
    alone_s: float | None = None
    """One iteration's seconds on a GPU of its own, where the units' times are inside bubbles beside the main job
    (planner/fill/physics.py: runtime_unit_s); None where they are the same."""

    @property
    def iteration_s(self) -> float:
        return sum(u.time_s for u in self.units)

    @property
    def dedicated_s(self) -> float:
        """One iteration's seconds on a GPU of its own."""
        return self.iteration_s if self.alone_s is None else self.alone_s

    @property
    def flops_per_iteration(self) -> float:
        return sum(u.flops for u in self.units)


def job_config(b: int, config: str, precision: str) -> ParallelConfig:
    """A fill job runs on one GPU: no parallelism, one microbatch of b samples."""
    return ParallelConfig(tp=1, pp=1, dp=1, b=b, m=1, recompute=CONFIGS[config], precision=precision)


def linearize(prof: ModelProfile, kind: str, config: str, b: int, hw: Hardware,
              precision: str, host: bool = True) -> tuple[list[FillUnit], int]:
    """(units of one iteration, resident bytes) for a job configuration; `host`: each unit no faster than the host
    issues it (a CUDA device, planner/fill/physics.py HOST_UNIT_S), not on the CPU runtime, where an op's dispatch
    is part of its run."""
    cfg = job_config(b, config, precision)
    num = cfg.numerics
    times = [unit_time(u, hw, cfg) for u in prof.units]
    params = sum(u.params for u in prof.units)
    plain = RECOMPUTE["none"].kept_bytes
    if kind == "infer":
        units = [FillUnit(name=f"F:{u.name}", time_s=t.fwd_s, flops=u.fwd_flops(b),
                          mem_bytes=int(u.input_bytes(b) + u.output_bytes(b) + plain(u, b, 1)))
                 for u, t in zip(prof.units, times)]
        if host:
            units = _issued(units, [host_unit_s("infer", _kernels(u)) for u in prof.units])
        return units, int(params * num.weight_bytes)
    kept = [cfg.recompute_mode.kept_bytes(u, b, 1) if u.kind == "block" else plain(u, b, 1) for u in prof.units]
    working = [plain(u, b, 1) for u in prof.units]
    units, live = [], 0.0
    for u, t, k in zip(prof.units, times, kept):
        live += k
        units.append(FillUnit(name=f"F:{u.name}", time_s=t.fwd_s, flops=u.fwd_flops(b), mem_bytes=int(live),
                              state_bytes=int(live)))
    for i in reversed(range(len(prof.units))):
        u, t = prof.units[i], times[i]
        units.append(FillUnit(name=f"B:{u.name}", time_s=t.bwd_s, flops=u.bwd_flops(b),
                              mem_bytes=int(live + working[i]), state_bytes=int(live - kept[i])))
        live -= kept[i]
    units.append(_optimizer_unit(params, config, hw, cfg))
    offloaded = config == "offload"  # weights + grads on the device; Adam state on the host
    resident = params * (num.weight_bytes + num.grad_bytes if offloaded else num.bytes_per_param())
    if not host:
        return units, int(resident)
    fwd = [host_unit_s("forward", _kernels(u)) for u in prof.units]
    redo = [f if config == "checkpoint" and u.kind == "block" else 0.0 for u, f in zip(prof.units, fwd)]
    bwd = [host_unit_s("backward", _kernels(u)) + r for u, r in zip(prof.units, redo)]
    tensors = sum(1 for u in prof.units for part in (u.sharded, u.replicated) for _, n in part.weights if n)
    return _issued(units, [*fwd, *reversed(bwd), HOST_OPTIMIZER_TENSOR_S * tensors]), int(resident)


def _kernels(u: Unit) -> int:
    return u.sharded.kernels + u.replicated.kernels


def _issued(units: list[FillUnit], host: list[float]) -> list[FillUnit]:
    """Each unit no faster than the host issues it (planner/fill/physics.py HOST_UNIT_S): the fill runtime runs the
    job as eager PyTorch, one op at a time."""
    return [replace(u, time_s=h, gpu_s=u.time_s) if h > u.time_s else u for u, h in zip(units, host)]


def _optimizer_unit(params: int, config: str, hw: Hardware, cfg: ParallelConfig) -> FillUnit:
    num = cfg.numerics
    if config == "offload":  # gradients down, weights up over PCIe; Adam on the host
        t = (num.grad_bytes + num.weight_bytes) * params / hw.gpu.pcie_bw + ADAM_HOST_BYTES * params / HOST_ADAM_BYTES_PER_S
    else:
        t = 2 * num.bytes_per_param() * params / (hw.gpu.hbm_bw * hw.eff.hbm)
    return FillUnit(name="OPT", time_s=t, flops=0.0, mem_bytes=0)


def profile_job(job: FillJobSpec, hw: Hardware, precision: str,
                sharing: GpuSharing | None = None, host: bool | None = None) -> list[FillProfile]:
    """The job traced in the main job's precision and priced on the main job's hardware (its calibration
    included), under every batch size x configuration; with `sharing`, each unit's time is the time it takes
    inside a bubble beside the main job (planner/fill/physics.py: runtime_unit_s). The fill runtime runs the job
    as eager PyTorch, op by op: its memory-bound kernels at their own measured speeds (costmodels.eager), none
    fused; on a CUDA device each unit no faster than the host issues it (`host`: by default unless `sharing` is
    "none", the CPU runtime's)."""
    # (its attention at the fused kernel's share, whatever the main job's engine runs: the fill runtime's measurements
    # ran torch 2.11, whose SDPA takes cuDNN on Hopper; targets/builtin.py)
    hw = replace(hw.with_eff(eager=True, fusion=0.0), attention="te")
    host = sharing != "none" if host is None else host
    prof, _ = analyze(job.model, job.model_args, leaves=tuple(job.leaves), dtype=precision)
    configs = tuple(CONFIGS) if job.kind == "train" else ("plain",)
    out = []
    for b in job.batch_sizes:
        fwd = [unit_time(u, hw, job_config(b, "plain", precision)).fwd_s for u in prof.units]
        for config in configs:
            units, resident = linearize(prof, job.kind, config, b, hw, precision, host)
            layers = tuple(Layer(name=u.name, param_bytes=int(u.params * PRECISIONS[precision].weight_bytes),
                                 exec_time_s=f) for u, f in zip(prof.units, fwd))
            out.append(FillProfile(job=job.name, kind=job.kind, batch_size=b, config=config, units=tuple(units),
                                   resident_bytes=resident, layers=layers, params=prof.total_params,
                                   sha256=prof.sha256, batches=job.iterations(b), arrival_s=job.arrival_s,
                                   deadline_s=job.deadline_s, priority=job.priority,
                                   pair_with=job.pair_with,
                                   host_wait_s=sum(u.time_s - u.gpu_s for u in units if u.gpu_s is not None)))
    return out if sharing is None else [shared_profile(p, sharing) for p in out]


def shared_profile(prof: FillProfile, sharing: GpuSharing) -> FillProfile:
    """A profile priced alone, its units' times as they run inside bubbles beside the main job (physics)."""
    def inside(u: FillUnit) -> FillUnit:
        if u.gpu_s is None:
            return replace(u, time_s=runtime_unit_s(u.time_s, sharing))
        return replace(u, time_s=runtime_unit_s(u.gpu_s, sharing, host_s=u.time_s))

    return replace(prof, units=tuple(inside(u) for u in prof.units), alone_s=prof.dedicated_s)
