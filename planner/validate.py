"""Predicted against measured: what `planner validate` prints and writes.

From a plan and the metrics of a run of it (`planner launch --metrics`), per pipeline rank:
forward and backward time of each stage over one iteration, each bubble's start and duration,
the iteration time, peak memory (CUDA) and fill work per bubble — each with its error
(measured / predicted - 1). Step 0 is left out (it warms up and measures bubbles without fill).
The report is a planner.metrics.ValidationReport (schema fxplanner.validation/v1).
`refit` writes measured bubble durations back into a plan so fill packing uses them.
"""
from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Any

from .metrics import (Comparison, MetricsDocument, RankComparison, RankValidation, RunEntry, StepRecord,
                      ValidationReport)
from .plan import Plan

__all__ = ["compare", "refit", "repack_fill", "error", "fit_action_overhead"]


def error(measured: float | None, predicted: float | None) -> float | None:
    if measured is None or not predicted:
        return None
    return measured / predicted - 1


def _row(what: str, predicted: float | None, measured: float | None, rank: int, **extra: Any) -> RankComparison:
    return RankComparison(what=what, predicted=predicted, measured=measured, error=error(measured, predicted),
                          rank=rank, **extra)


def _steps(run: RunEntry, pp_rank: int, skip: int) -> list[StepRecord]:
    """Steps of every instance (dp x tp) of a pipeline rank, warm-up steps left out."""
    out = [s for r in run.ranks if r.pp == pp_rank for s in r.steps[skip:]]
    return out or [s for r in run.ranks if r.pp == pp_rank for s in r.steps]


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def _bubble_rows(plan: Plan, steps: list[StepRecord], rank: int) -> list[RankComparison]:
    rows = []
    for b in (b for b in plan.bubbles if b.rank == rank):
        seen = [x for s in steps for x in s.bubbles if x.id == b.id]
        rows.append(_row(f"bubble {b.id} start", b.start_s, _mean([x.start_s for x in seen]), rank=rank))
        rows.append(_row(f"bubble {b.id} duration", b.duration_s, _mean([x.duration_s for x in seen]), rank=rank,
                         kind=b.kind))
    return rows


def _fill_rows(plan: Plan, run: RunEntry, rank: int) -> list[RankComparison]:
    if plan.fill is None:
        return []
    planned: dict[int, float] = {}
    for ch in plan.fill.chunks:
        if ch.rank == rank:
            planned[ch.bubble_id] = planned.get(ch.bubble_id, 0.0) + ch.units
    done: dict[int, list[float]] = {}
    for r in run.ranks:
        if r.pp != rank or r.fill_report is None:
            continue
        for occ in r.fill_report.bubbles:
            done.setdefault(occ.bubble_id, []).append(len(occ.steps))  # each step is one unit
    return [_row(f"fill units in bubble {bid}", planned.get(bid), _mean(done.get(bid, [])), rank=rank)
            for bid in sorted(set(planned) | set(done)) if bid >= 0]


TOLERANCE = 0.05
"""What a rank holds may differ from the plan by this much before `planner validate` flags it."""
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _held(plan: Plan, rank: int) -> dict[str, float]:
    """What the plan says pipeline rank `rank` holds: parameters, optimizer-state bytes, and per stage the
    bytes one microbatch saves for the backward."""
    mem = plan.predictions.memory[rank]
    out = {"parameters": mem.weights / plan.config.to_config().numerics.weight_bytes,
           "optimizer state bytes": mem.optimizer}
    out.update({f"stage {st.stage} saved activation bytes": st.activation_bytes
                for st in plan.partition if st.rank == rank})
    return out


def _measured(h: Any) -> dict[str, float]:
    out = {"parameters": h.parameters, "optimizer state bytes": h.optimizer_state_bytes}
    out.update({f"stage {k} saved activation bytes": v for k, v in h.saved_activation_bytes.items()})
    return out


def _holding_rows(plan: Plan, run: RunEntry, rank: int) -> list[RankComparison]:
    seen = [_measured(r.holds) for r in run.ranks if r.pp == rank and r.holds is not None]
    if not seen:
        return []
    return [_row(what, planned, _mean([m[what] for m in seen if what in m]), rank=rank)
            for what, planned in _held(plan, rank).items()]


def mismatches(plan: Plan, run: RunEntry) -> list[str]:
    """One sentence per way a rank holds or runs something other than the plan says."""
    c, out = plan.config, []
    for r in run.ranks:
        h = r.holds
        if h is None:
            continue
        who = f"rank {r.rank} (pipeline {r.pp}, data {r.dp}, {f'context {r.cp}, ' if c.cp > 1 else ''}tensor {r.tp})"
        got = _measured(h)
        for what, planned in _held(plan, r.pp).items():
            e = error(got.get(what), planned)
            if e is not None and abs(e) > TOLERANCE:
                out.append(f"{who}: {what} {got[what]:,.0f} held, {planned:,.0f} planned ({e:+.1%})")
        if h.parameter_dtype != DTYPES[c.precision]:
            out.append(f"{who}: trains in {h.parameter_dtype}, the plan in {c.precision}")
        if h.recompute != c.recompute:
            out.append(f"{who}: recomputes {h.recompute}, the plan {c.recompute}")
        planned_tp = sorted({m for st in plan.partition if st.rank == r.pp for m in st.tensor_parallel})
        if h.tensor_parallel != planned_tp:
            extra, missing = set(h.tensor_parallel) - set(planned_tp), set(planned_tp) - set(h.tensor_parallel)
            out.append(f"{who}: tensor-parallel layout differs from the plan (sharded but not planned: "
                       f"{sorted(extra) or 'none'}; planned but not sharded: {sorted(missing) or 'none'})")
    return out


def compare(plan: Plan, metrics: MetricsDocument, skip: int = 1) -> ValidationReport:
    """Predicted against measured for the document's first run (a run of `plan`)."""
    run = metrics.runs[0]
    c = plan.config
    ranks = []
    for r in sorted({x.pp for x in run.ranks}):  # every rank of a launch; a rehearsal's one
        steps = _steps(run, r, skip)
        rows = []
        extra = plan.predictions.action_overhead_s  # framework time: not inside the measured compute
        for st in (s for s in plan.partition if s.rank == r):
            key = str(st.stage)
            fwd = _mean([s.stages[key].forward_s for s in steps if key in s.stages])
            bwd = _mean([s.stages[key].backward_s for s in steps if key in s.stages])
            rows.append(_row(f"stage {st.stage} forward", (st.forward_s - extra) * c.microbatches, fwd, rank=r))
            rows.append(_row(f"stage {st.stage} backward", (st.backward_s - extra) * c.microbatches, bwd, rank=r))
        rows.extend(_bubble_rows(plan, steps, r))
        rows.append(_row("iteration", plan.predictions.iteration_s, _mean([s.iteration_s for s in steps]), rank=r))
        peaks = [s.peak_memory_bytes for s in steps if s.peak_memory_bytes is not None]
        rows.append(_row("peak memory", plan.predictions.memory[r].total, max(peaks) if peaks else None, rank=r))
        rows.extend(_fill_rows(plan, run, r))
        rows.extend(_holding_rows(plan, run, r))
        ranks.append(RankValidation(rank=r, rows=rows))
    slowest = [max(s.iteration_s for s in step_set) for step_set in zip(*[r.steps[skip:] for r in run.ranks])]
    measured = _mean(slowest)
    it = Comparison(what="iteration (slowest rank)", predicted=plan.predictions.iteration_s, measured=measured,
                    error=error(measured, plan.predictions.iteration_s))
    return ValidationReport(plan=run.plan, device=run.device, steps=run.steps, iteration=it, ranks=ranks,
                            mismatches=mismatches(plan, run))


def run_of(doc, plan, plan_file: str, metrics: str):
    """The document with only the run of `plan_file` (a launch of several plans records one run each); metrics of
    another plan are refused (RunEntry.plan_key: the main job's model, configuration, partition and actions)."""
    from pathlib import Path

    from passes.errors import UserError

    from .plan import run_key

    key = run_key(plan)
    keyed = [r for r in doc.runs if r.plan_key is not None]
    if keyed:
        runs = [r for r in keyed if r.plan_key == key]
        if not runs:
            raise UserError(f"{metrics} holds runs of other plans than {plan_file} (their model, configuration or "
                            f"schedule differ): pass the plan that was launched, or launch this one")
        return doc.model_copy(update={"runs": runs[:1]})
    if len(doc.runs) <= 1:
        return doc
    want = Path(plan_file).resolve()
    runs = [r for r in doc.runs if Path(r.plan).resolve() == want] or [r for r in doc.runs
                                                                      if Path(r.plan).name == want.name]
    if len(runs) != 1:
        raise UserError(f"{metrics} holds runs of {', '.join(Path(r.plan).name for r in doc.runs)}; "
                        f"{'none' if not runs else 'several'} of them is {plan_file}: pass the plan that was launched")
    return doc.model_copy(update={"runs": runs})


def refit(plan: Plan, metrics: MetricsDocument, skip: int = 1) -> Plan:
    """The plan with each bubble's duration (and start) replaced by the measured mean."""
    run = metrics.runs[0]
    bubbles = []
    for b in plan.bubbles:
        seen = [x for s in _steps(run, b.rank, skip) for x in s.bubbles if x.id == b.id]
        if seen:
            b = replace(b, duration_s=statistics.fmean(x.duration_s for x in seen),
                        start_s=statistics.fmean(x.start_s for x in seen))
        bubbles.append(b)
    return plan.model_copy(update={"bubbles": bubbles})


def repack_fill(plan: Plan, spec=None, *, solver: str = "greedy", alone=None) -> Plan:
    """Pack the fill jobs again into the plan's bubbles (measured ones after `refit`), and update the fill
    predictions. `spec` is the fill YAML's spec, or None for the plan's own jobs (FillSpec.of_plan); `alone`, the
    jobs' profiles priced alone if at hand (profile_job without sharing), saves tracing them again."""
    from .fill.assign import assign_fill, plan_cycles, plan_hold_free
    from .fill.profiles import profile_job, shared_profile
    from .fill.section import fill_section
    from .fill.spec import FillSpec
    from .plan import plan_hardware

    if plan.fill is None:
        return plan
    spec = spec or FillSpec.of_plan(plan.fill)
    hw = plan_hardware(plan)
    alone = alone or {j.name: profile_job(j, hw, plan.config.precision, host=spec.gpu_sharing != "none")
                      for j in spec.jobs}
    jobs = {name: [shared_profile(p, spec.gpu_sharing) for p in profs] for name, profs in alone.items()}
    fa = assign_fill(plan_cycles(plan), plan.predictions.iteration_s, jobs, hw, safety_margin=spec.safety_margin, solver=solver,
                     hold_free=plan_hold_free(plan), replicas=plan.config.to_config().gpus_per_stage,
                     policy=spec.policy)
    old = plan.fill.predictions
    fill = fill_section(fa, spec, offload=old.offload_optimizer, offload_bytes=old.offload_bytes,
                        main_useful_per_gpu=(old.total_useful_tflops_per_gpu - old.fill_tflops_per_gpu) * 1e12)
    if old.choice:  # the main configuration is the plan's: its shrink-or-fill reasoning still stands
        fill.predictions.choice = f"{old.choice} (as planned; the fill was re-packed since)"
    return plan.model_copy(update={"fill": fill})


def fit_action_overhead(plan: Plan, measured_iteration_s: float, *, hi: float = 1.0, rounds: int = 40) -> float:
    """The per-action overhead that, added to every stage's forward and backward, makes the plan's
    simulated iteration equal the measured one (bisection on the simulator; 0 if already slower)."""
    from .chart import plan_simulation

    def simulated(extra: float) -> float:
        parts = [s.model_copy(update={"forward_s": s.forward_s + extra, "backward_s": s.backward_s + extra})
                 for s in plan.partition]
        return plan_simulation(plan.model_copy(update={"partition": parts})).iteration_s

    if simulated(0.0) >= measured_iteration_s:
        return 0.0
    lo = 0.0
    while simulated(hi) < measured_iteration_s:
        hi *= 2
    for _ in range(rounds):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if simulated(mid) < measured_iteration_s else (lo, mid)
    return (lo + hi) / 2
