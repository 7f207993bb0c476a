"""Fill-job profiles: each job traced and priced with the same passes as the main model, under
configurations batch size x {plain, checkpoint (activation recomputation), offload (optimizer
state on the host, training only)} (PipeFill 4.3), as the linearized unit sequence the packer cuts
into chunks, plus the memory the job keeps on the device between bubbles.
"""
from __future__ import annotations

from dataclasses import dataclass

from costmodels.compute import Efficiency, unit_time
from costmodels.memory import unit_activation_bytes
from passes.pipeline import ModelProfile, analyze
from targets.specs import Target

from .packing import FillUnit
from .pipeswitch import Layer
from .spec import FillJobSpec

__all__ = ["FillProfile", "profile_job", "linearize"]

CONFIGS = ("plain", "checkpoint", "offload")
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

    @property
    def iteration_s(self) -> float:
        return sum(u.time_s for u in self.units)

    @property
    def flops_per_iteration(self) -> float:
        return sum(u.flops for u in self.units)


def linearize(prof: ModelProfile, kind: str, config: str, b: int, target: Target,
              eff: Efficiency) -> tuple[list[FillUnit], int]:
    """(units of one iteration, resident bytes) for a job configuration."""
    rc = "full" if config == "checkpoint" else "none"
    times = [unit_time(u, b, 1, target, recompute=rc, eff=eff) for u in prof.units]
    params = sum(u.params for u in prof.units)
    if kind == "infer":
        units = [FillUnit(name=f"F:{u.name}", time_s=t.fwd_s, flops=u.fwd_flops(b),
                          mem_bytes=int(u.input_bytes(b) + u.output_bytes(b) + unit_activation_bytes(u, b, 1, "none")))
                 for u, t in zip(prof.units, times)]
        return units, int(params * 2)
    kept = [unit_activation_bytes(u, b, 1, "full" if config == "checkpoint" and u.kind == "block" else "none")
            for u in prof.units]
    working = [unit_activation_bytes(u, b, 1, "none") for u in prof.units]
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
    units.append(_optimizer_unit(params, config, target, eff))
    resident = params * (4 if config == "offload" else 16)  # bf16 weights+grads, + fp32 Adam on device
    return units, int(resident)


def _optimizer_unit(params: int, config: str, target: Target, eff: Efficiency) -> FillUnit:
    if config == "offload":  # gradients down, weights up over PCIe; Adam on the host
        t = 4 * params / target.gpu.pcie_bw + 16 * params / HOST_ADAM_BYTES_PER_S
    else:
        t = 2 * 16 * params / (target.gpu.hbm_bw * eff.hbm)
    return FillUnit(name="OPT", time_s=t, flops=0.0, mem_bytes=0)


def profile_job(job: FillJobSpec, target: Target, eff: Efficiency = Efficiency(),
                dtype: str = "bf16") -> list[FillProfile]:
    prof, _ = analyze(job.model, job.model_args, leaves=tuple(job.leaves), dtype=dtype)
    configs = CONFIGS if job.kind == "train" else ("plain",)
    out = []
    for b in job.batch_sizes:
        for config in configs:
            units, resident = linearize(prof, job.kind, config, b, target, eff)
            fwd = [unit_time(u, b, 1, target, eff=eff).fwd_s for u in prof.units]
            layers = tuple(Layer(name=u.name, param_bytes=int(u.params * 2), exec_time_s=f)
                           for u, f in zip(prof.units, fwd))
            out.append(FillProfile(job=job.name, kind=job.kind, batch_size=b, config=config, units=tuple(units),
                                   resident_bytes=resident, layers=layers, params=prof.total_params,
                                   sha256=prof.sha256))
    return out
