"""`planner simulate-fill plan.json trace.yaml`: run a fill-job trace through a plan's bubbles
with the event-driven cluster simulator (PipeFill 5.1).

The jobs are placed, configured and packed as the planner places them (planner/fill/assign.py: assign_fill, the
function `planner plan --fill` and `planner refit` use), which is what the runtime then runs: an inference job's
batches divided among the pipeline ranks whose bubbles fit it, a training job data parallel over one rank's GPUs,
two training jobs asked to pair (pair_with) run as one Waterwave pair on their rank, every job's bytes held between
bubbles beside the others of its rank, and the main job's optimizer state offloaded where the plan offloads it.
Each (job, rank) share becomes one simulated job on that rank, a pair one job for both. The simulator adds what the
plan's steady rates leave out: each job starting at the first bubble after its arrival or its predecessor's end,
its last chunk cut to the work left, the ranks' order from the policy at each event, and the figures over the whole
run (PipeFill 6.1) beside those while each rank has fill work (the plan's).
"""
from __future__ import annotations

from dataclasses import replace

from planner.plan import Plan, plan_hardware

from .assign import FillAssignment, assign_fill, plan_cycles, plan_hold_free
from .cluster_sim import Prices, SimReport, simulate
from .profiles import profile_job, shared_profile
from .job_scheduler import Rank, RankPlan, TraceJob, Unplaceable
from .spec import FillSpec

__all__ = ["plan_assignment", "simulate_trace", "trace_jobs"]


def _ranks(plan: Plan) -> list[Rank]:
    return [Rank(id=r, slots=tuple(cycle), period_s=plan.predictions.iteration_s,
                 starts_s=tuple(b.start_s for b in plan.bubbles if b.rank == r))
            for r, cycle in enumerate(plan_cycles(plan))]


def plan_assignment(plan: Plan, spec: FillSpec) -> FillAssignment:
    """The spec's jobs placed and packed into the plan's bubbles as `planner plan --fill` places them."""
    hw = plan_hardware(plan)
    jobs = {}
    for js in spec.jobs:
        alone = profile_job(js, hw, plan.config.precision, host=spec.gpu_sharing != "none")
        jobs[js.name] = [shared_profile(p, spec.gpu_sharing) for p in alone]
    return assign_fill(plan_cycles(plan), plan.predictions.iteration_s, jobs, hw, safety_margin=spec.safety_margin,
                       hold_free=plan_hold_free(plan), replicas=plan.config.to_config().gpus_per_stage,
                       policy=spec.policy)


def trace_jobs(fa: FillAssignment, ranks: int) -> tuple[list[TraceJob], list[Unplaceable]]:
    """One simulated job per (job, rank) share of the assignment (named `job/rank` where a job has several), a pair's
    two jobs as one (`a+b`), each allowed on its rank only; its work is what one GPU of the rank does: its share of
    the batches over the rank's GPUs, in units of its packing's stream."""
    shards: dict[str, int] = {}
    for t in fa.turns:
        shards[t.job] = shards.get(t.job, 0) + 1
    out: list[TraceJob] = []
    done: set[tuple[int, str]] = set()
    for t in fa.turns:
        rf = t.fill
        key = (rf.rank, rf.packed_as)
        if key in done:
            continue
        done.add(key)
        plans = tuple(RankPlan.from_packing(rf.packing) if r == rf.rank else None for r in range(ranks))
        mem = max((ch.mem_bytes for ch in rf.packing.chunks), default=0)
        if rf.pair is None:
            steps = -(-t.batches // fa.replicas)
            n = len(rf.units)
            out.append(TraceJob(name=t.job if shards[t.job] == 1 else f"{t.job}/{rf.rank}", work=float(steps * n),
                                plans=plans, mem_bytes=mem, arrival_s=rf.profile.arrival_s,
                                deadline_s=rf.profile.deadline_s, priority=rf.profile.priority, kind=rf.profile.kind,
                                dedicated_s_per_work=rf.profile.dedicated_s / n))
            continue
        both = [u for u in fa.turns if u.rank == rf.rank and u.job in rf.pair.jobs]
        profs = [u.fill.profile for u in both]
        per = rf.pair.schedule.iterations  # iterations of each job per period of the pair's units
        n = len(rf.units)
        steps = max(-(-u.batches // fa.replicas) for u in both)
        out.append(TraceJob(name=rf.packed_as, work=steps / per * n, plans=plans, mem_bytes=mem,
                            arrival_s=max(p.arrival_s for p in profs),
                            deadline_s=min((p.deadline_s for p in profs if p.deadline_s is not None), default=None),
                            priority=max(p.priority for p in profs), kind="train",
                            dedicated_s_per_work=sum(p.dedicated_s for p in profs) * per / n))
    unplaceable = [Unplaceable(job=name, reason="unplaceable", detail=why) for name, why in fa.unplaceable.items()]
    unplaceable += [Unplaceable(job=name, reason="not chosen", detail=why) for name, why in fa.not_chosen.items()]
    return out, unplaceable


def simulate_trace(plan: Plan, spec: FillSpec, *, policy=None, horizon_s: float | None = None,
                   prices: Prices | None = None) -> SimReport:
    """One simulated rank per pipeline rank; each stands for the t*cp*d GPUs that share its bubbles (and divide its
    jobs). `policy`: which of a rank's jobs runs next (a POLICIES name or a score function; default the spec's)."""
    ranks = _ranks(plan)
    fa = plan_assignment(plan, spec)
    jobs, unplaceable = trace_jobs(fa, len(ranks))
    rep = simulate(jobs, ranks, spec.policy if policy is None else policy, horizon_s=horizon_s,
                   gpus_per_rank=fa.replicas, prices=prices)
    return replace(rep, unplaceable=rep.unplaceable + tuple(unplaceable))
