"""`planner simulate-fill plan.json trace.yaml`: run a fill-job trace through a plan's bubbles
with the event-driven cluster simulator (PipeFill 5.1)."""
from __future__ import annotations

from planner.plan import Plan, plan_hardware

from .assign import best_fill, plan_cycles, plan_hold_free
from .cluster_sim import Prices, SimReport, simulate
from .profiles import profile_job
from .scheduler import TraceJob, Rank, RankPlan
from .spec import FillSpec

__all__ = ["simulate_trace"]


def _ranks(plan: Plan) -> list[Rank]:
    return [Rank(id=r, slots=tuple(cycle), period_s=plan.predictions.iteration_s,
                 starts_s=tuple(b.start_s for b in plan.bubbles if b.rank == r))
            for r, cycle in enumerate(plan_cycles(plan))]


def simulate_trace(plan: Plan, spec: FillSpec, *, policy: str = "fifo", horizon_s: float | None = None,
                   prices: Prices | None = None) -> SimReport:
    """One simulated rank per pipeline rank; each stands for the t*d GPUs that share its bubbles."""
    hw = plan_hardware(plan)
    ranks = _ranks(plan)
    hold = plan_hold_free(plan)
    jobs = []
    for js in spec.jobs:
        profiles = profile_job(js, hw, plan.config.precision, spec.gpu_sharing)
        plans, best_any = [], None
        for rank in ranks:
            rf = best_fill(rank.id, list(rank.slots), profiles, hw, safety_margin=spec.safety_margin,
                           hold_free=hold[rank.id]) if rank.slots else None
            plans.append(RankPlan.from_packing(rf.packing) if rf else None)
            best_any = best_any or rf
        prof = best_any.profile if best_any else profiles[0]
        per_iter = len(prof.units)
        jobs.append(TraceJob(name=js.name, work=float(js.iterations(prof.batch_size) * per_iter), plans=tuple(plans),
                            mem_bytes=prof.resident_bytes, arrival_s=js.arrival_s, deadline_s=js.deadline_s,
                            priority=js.priority, kind=js.kind, dedicated_s_per_work=prof.dedicated_s / per_iter))
    gpus_per_rank = plan.config.tp * plan.config.cp * plan.config.dp
    return simulate(jobs, ranks, policy, horizon_s=horizon_s, gpus_per_rank=gpus_per_rank, prices=prices)
