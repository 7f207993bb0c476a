"""`planner simulate-fill`: a fill-job trace through a plan's bubbles (cluster simulator)."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from passes.errors import UserError

from .cli import app, out, print_json, user_errors


@app.command("simulate-fill")
def simulate_fill(
    plan_file: str = typer.Argument(..., help="plan.json from `planner plan`"),
    trace: str = typer.Argument(..., help="fill-job YAML with arrivals (the --fill format)"),
    policy: Optional[str] = typer.Option(None, help="which of a rank's jobs runs next: fifo, sjf, makespan, edf, or a .py "
                                         "file defining score(job, state, rank); default the fill file's (as planned)"),
    horizon_s: Optional[float] = typer.Option(None, "--horizon", help="stop after this many seconds"),
    price_main: float = typer.Option(4.10, help="$ per GPU-hour of the main job's GPUs (FreeRide S)"),
    price_side: float = typer.Option(4.10, help="$ per GPU-hour a dedicated side-task GPU would cost"),
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
) -> None:
    """Run the trace's jobs inside the plan's bubble cycles, placed and packed as `planner plan --fill` places them,
    and print JCT, makespan, recovered work, and the plan's own figures beside the simulation's."""
    from .fill.cluster_sim import Prices
    from .fill.job_scheduler import load_score_function
    from .fill.spec import load_fill_spec
    from .fill.trace_sim import simulate_trace
    from .plan import load_plan

    with user_errors():
        plan = load_plan(plan_file)
        spec = load_fill_spec(trace)
        if policy is None:
            chosen = spec.policy
        elif policy.endswith(".py"):
            try:
                chosen = load_score_function(policy)
            except ValueError as exc:
                raise UserError(str(exc)) from None
        elif policy in ("fifo", "sjf", "makespan", "edf"):
            chosen = policy
        else:
            raise UserError(f"--policy must be fifo, sjf, makespan, edf or a .py file, got {policy!r}")
        report = simulate_trace(plan, spec, policy=chosen, horizon_s=horizon_s,
                                prices=Prices(main_per_gpu_hour=price_main, side_per_gpu_hour=price_side))
    summary = {"policy": report.policy, "gpus": report.gpus, "bubble_ratio": report.bubble_ratio,
               "bubble_time_used": report.bubble_s_used / report.bubble_s_total if report.bubble_s_total else 0.0,
               "fill_tflops_per_gpu": report.fill_tflops_per_gpu, "gpus_saved": report.gpus_saved,
               "while_busy": {"fill_tflops_per_gpu": report.busy_tflops_per_gpu,
                              "bubble_time_used": report.busy_bubble_time_used},
               "plan": _planned(plan, spec),
               "mean_jct_s": _number(report.mean_jct_s), "makespan_s": _number(report.makespan_s),
               "jobs_finished": len(report.finished),
               "cost_savings": report.cost.savings if report.cost else None,
               "time_increase": report.cost.time_increase if report.cost else None,
               "jobs": [{"name": j.name, "rank": j.rank, "arrival_s": j.arrival_s, "completion_s": j.completion_s,
                         "work_done": j.work_done, "work": j.work, "dedicated_s": j.dedicated_s} for j in report.jobs],
               "unplaceable": {u.job: f"{u.reason}: {u.detail}" for u in report.unplaceable}}
    if as_json:
        print_json(json.dumps(summary, indent=2))
        return
    table = Table(title=f"{Path(trace).name} through {Path(plan_file).name} ({report.policy})")
    for col in ("job", "rank", "arrival", "completion", "JCT", "done", "dedicated"):
        table.add_column(col)
    for j in report.jobs:
        fin = j.completion_s is not None
        table.add_row(j.name, "-" if j.rank is None else str(j.rank), f"{j.arrival_s:.0f}s",
                      f"{j.completion_s:.0f}s" if fin else "-", f"{j.completion_s - j.arrival_s:.0f}s" if fin else "-",
                      f"{j.work_done / j.work:.0%}", f"{j.dedicated_s:.0f}s")
    out.print(table)
    s = summary
    timing = (f"mean JCT {s['mean_jct_s']:.0f}s, makespan {s['makespan_s']:.0f}s" if s["jobs_finished"] else
              "no job finished within the horizon (raise --horizon), so no JCT or makespan")
    out.print(f"over the run (PipeFill 6.1: every GPU from 0 to the last completion or --horizon, a rank's time without "
              f"fill work and the chunks' overheads counted): fill {s['fill_tflops_per_gpu']:.2f} TFLOP/s/GPU, bubble "
              f"time used {s['bubble_time_used']:.1%} of bubble ratio {s['bubble_ratio']:.1%}, GPUs saved "
              f"{s['gpus_saved']:.1f} (PipeFill's C*B*P: {s['gpus']} GPUs x bubble ratio x the fill's speed in bubbles "
              f"relative to a dedicated GPU), {timing}"
              + (f", cost savings S {s['cost_savings']:.1%}" if s["cost_savings"] is not None else ""), highlight=False)
    busy, p = s["while_busy"], s["plan"]
    out.print(f"while each rank has fill work (as the plan counts): fill {busy['fill_tflops_per_gpu']:.2f} TFLOP/s/GPU, "
              f"{busy['bubble_time_used']:.1%} of bubble time worked"
              + (f"; the plan: {p['fill_tflops_per_gpu']:.2f} and {p['bubble_time_used']:.1%} (its steady rates; here "
                 "each job starts at the first bubble after it may, and its last chunk is cut to the work left)"
                 if p is not None else ""), highlight=False)
    for name, why in s["unplaceable"].items():
        out.print(f"[yellow]unplaceable[/] {name}: {why}", highlight=False)


def _planned(plan, spec) -> dict | None:
    """The plan's fill figures when its fill is these jobs under the same rules (margin, sharing), else None."""
    fill = plan.fill
    if fill is None or (fill.safety_margin, fill.gpu_sharing) != (spec.safety_margin, spec.gpu_sharing):
        return None
    fp = fill.predictions
    planned = {j.name.split("@")[0] for j in fill.jobs} | set(fp.unplaceable) | set(fp.not_chosen)
    if planned != {j.name for j in spec.jobs}:
        return None
    return {"fill_tflops_per_gpu": fp.fill_tflops_per_gpu, "bubble_time_used": fp.bubble_time_used}


def _number(x: float) -> float | None:
    """JSON has no NaN: an undefined figure (no job finished) is null."""
    return None if math.isnan(x) else x
