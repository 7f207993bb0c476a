"""`planner validate` (predicted against measured) and `planner refit` (measured bubbles into a plan)."""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from passes.errors import UserError, write_atomic

from .cli import _ms, app, err, out, status, user_errors

GiB = 2**30


def _echo(line: str) -> None:
    """A rank's log line as it came: its "[rank 0]" prefix is text, not rich markup."""
    err.print(line, highlight=False, markup=False)


def _fmt(what: str, x: float | None) -> str:
    if x is None:
        return "-"
    if what == "peak memory" or what.endswith("bytes"):
        return f"{x / GiB:.2f} GiB" if x >= 2**24 else f"{x / 2**10:,.1f} KiB"
    return f"{x:,.0f}" if what == "parameters" else f"{x:.1f}" if what.startswith("fill") else _ms(x)


@app.command()
def validate(
    plan_file: str = typer.Argument("plan.json", help="plan written by `planner plan`"),
    steps: int = typer.Option(5, "--steps", help="iterations to run (the first is left out: warm-up)"),
    no_fill: bool = typer.Option(False, "--no-fill", help="run without fill jobs"),
    metrics: Optional[str] = typer.Option(None, "--metrics", help="use these metrics instead of launching"),
    output: str = typer.Option("validation.json", "-o", "--output", help="where to write the comparison JSON"),
    show_bubbles: int = typer.Option(8, help="bubbles shown per rank in the table (all are in the JSON)"),
) -> None:
    """Launch PLAN locally (as `planner launch --local`), then print predicted against measured."""
    from .metrics import load_metrics
    from .plan import load_plan
    from .runtime import launch_local
    from .validate import compare, run_of

    with user_errors():
        plan = load_plan(plan_file)
        if metrics:
            doc = run_of(load_metrics(metrics), plan, plan_file, metrics)
        else:
            if steps < 2:
                raise UserError(f"--steps must be at least 2 (step 0 is warm-up), got {steps}")
            run = launch_local(plan_file, steps=steps, fill=not no_fill, on_line=_echo)
            if run.returncode != 0 or run.metrics is None:
                raise UserError(f"the run failed (exit code {run.returncode}); see the rank logs above")
            doc = run.metrics
        result = compare(plan, doc)
        write_atomic(output, result.model_dump_json(by_alias=True, indent=1) + "\n", "comparison")
    for rank in result.ranks:
        table = Table(title=f"pipeline rank {rank.rank}: predicted vs measured")
        for col in ("what", "predicted", "measured", "error"):
            table.add_column(col, justify="left" if col == "what" else "right")
        shown = 0
        for row in rank.rows:
            if row.what.startswith("bubble"):
                shown += 1
                if shown > 2 * show_bubbles:
                    continue
            e = row.error
            table.add_row(row.what, _fmt(row.what, row.predicted), _fmt(row.what, row.measured),
                          "-" if e is None else f"{e:+.1%}")
        out.print(table)
    for line in result.mismatches:
        out.print(f"[red]mismatch:[/] {escape(line)}", highlight=False)
    it = result.iteration
    out.print(f"iteration (slowest rank): predicted {_ms(it.predicted)}, measured {_ms(it.measured)}, "
              f"error {it.error:+.1%}; written {output}", highlight=False)


@app.command()
def refit(
    plan_file: str = typer.Argument(..., help="plan to update"),
    measured: str = typer.Option(..., "--measured", help="metrics JSON of a run of this plan"),
    output: Optional[str] = typer.Option(None, "-o", "--output", help="new plan (default: overwrite)"),
    fill: Optional[str] = typer.Option(None, "--fill", help="the fill YAML the plan was made with: every batch size "
                                       "competes again (default: the plan's own jobs at their chosen batch size)"),
) -> None:
    """Write the measured bubble durations back into the plan and re-pack its fill jobs into them."""
    from .fill.spec import load_fill_spec
    from .metrics import load_metrics
    from .plan import load_plan, save_plan
    from .validate import refit as do_refit, repack_fill, run_of

    with user_errors():
        plan = load_plan(plan_file)
        new = do_refit(plan, run_of(load_metrics(measured), plan, plan_file, measured))
        if new.fill is not None:
            with status(True, "re-packing the fill into the measured bubbles"):
                new = repack_fill(new, load_fill_spec(fill) if fill else None)
        elif fill:
            raise UserError(f"plan {plan_file} has no fill to re-pack; plan it with --fill {fill}")
        save_plan(new, output or plan_file)
    changed = sum(1 for a, b in zip(plan.bubbles, new.bubbles) if a.duration_s != b.duration_s)
    out.print(f"{changed} of {len(plan.bubbles)} bubbles now carry measured durations; written {output or plan_file}")
    if new.fill is not None:
        was, now = plan.fill.predictions, new.fill.predictions
        out.print(f"fill re-packed: {was.fill_tflops_per_gpu:.2f} -> {now.fill_tflops_per_gpu:.2f} TFLOP/s/GPU recovered, "
                  f"bubble time used {was.bubble_time_used:.0%} -> {now.bubble_time_used:.0%}, "
                  f"{len(plan.fill.chunks)} -> {len(new.fill.chunks)} chunks", highlight=False)


@app.command()
def characterize(
    plan_file: str = typer.Argument("plan.json", help="plan written by `planner plan`"),
    rank: int = typer.Option(..., "--rank", help="pipeline rank of the bubble"),
    bubble: int = typer.Option(..., "--bubble", help="bubble id on that rank (see `planner show`)"),
    write: bool = typer.Option(False, "--write", help="store the measured duration in the plan"),
) -> None:
    """Measure one bubble as PipeFill does: wait inside it, doubling, until the step slows down."""
    from .plan import load_plan, save_plan
    from .runtime import launch_local

    with user_errors():
        plan = load_plan(plan_file)
        match = [b for b in plan.bubbles if b.rank == rank and b.id == bubble]
        if not match:
            raise UserError(f"the plan has no bubble {bubble} on pipeline rank {rank}; `planner show {plan_file}` lists them")
        run = launch_local(plan_file, steps=2, fill=False, extra=["--characterize", f"{rank}:{bubble}"],
                           on_line=_echo)
        if run.returncode != 0 or run.metrics is None:
            raise UserError(f"the run failed (exit code {run.returncode}); see the rank logs above")
        entry = run.metrics.runs[0]
        found = entry.ranks[0].characterization
        if found is None:
            raise UserError("the run recorded no characterization; see the rank logs above")
        observed = [b.duration_s for r in entry.ranks if r.pp == rank
                    for s in r.steps[1:] for b in s.bubbles if b.id == bubble]
        if write:
            bubbles = [replace(b, duration_s=found.duration_s) if b in match else b
                       for b in plan.bubbles]
            save_plan(plan.model_copy(update={"bubbles": bubbles}), plan_file)
    out.print(f"bubble {bubble} on rank {rank}: largest harmless wait {_ms(found.duration_s)} "
              f"({len(found.probes)} probe steps, baseline step {_ms(found.baseline_s)}); observed idle "
              f"{_ms(sum(observed) / max(len(observed), 1))}; predicted {_ms(match[0].duration_s)}"
              + ("; written to the plan" if write else ""), highlight=False)
