"""`planner launch`: run a plan's torchrun command on this machine and print its metrics."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer
from rich.table import Table

from passes.errors import UserError

from .cli import _fail, _ms, app, out, print_json, user_errors

if TYPE_CHECKING:
    from .metrics import MetricsDocument, RunEntry


@app.command()
def launch(
    plan_file: str = typer.Argument("plan.json", help="plan written by `planner plan`"),
    local: bool = typer.Option(False, "--local", help="run every rank on this machine (one process each, gloo on CPU)"),
    steps: int = typer.Option(3, "--steps", help="training iterations; step 0 runs without fill and measures bubbles"),
    no_fill: bool = typer.Option(False, "--no-fill", help="never hand bubbles to fill jobs"),
    compare_no_fill: bool = typer.Option(False, "--compare-no-fill",
                                         help="also run with --no-fill and print the main job's slowdown"),
    metrics: Optional[str] = typer.Option(None, "--metrics", help="write the metrics JSON here"),
    optimizer: str = typer.Option("adam", "--optimizer", help="adam or sgd"),
    lr: float = typer.Option(1e-3, "--lr", help="learning rate"),
    seed: int = typer.Option(0, "--seed", help="seed of build_model on every rank"),
    as_json: bool = typer.Option(False, "--json", help="print the metrics JSON instead of the summary"),
    oversubscribe: bool = typer.Option(False, "--oversubscribe",
                                       help="start a local launch larger than this machine's cores and memory hold"),
) -> None:
    """Run PLAN with torchrun on this machine (--local), streaming each rank's log."""
    from .plan import load_plan
    from .runtime import launch_local

    with user_errors():
        plan = load_plan(plan_file)
        if not local:
            script = Path(plan_file).with_name("launch.sh")
            script.write_text(plan.launch.script)
            script.chmod(0o755)
            out.print(f"multi-node runs start on each node with the plan's commands, or `{script} NODE_RANK` "
                      f"(written now; RDZV_ENDPOINT=host:port of node 0); add --local to run every rank here:",
                      highlight=False)
            for cmd in plan.launch.commands:
                out.print(f"  {cmd}", highlight=False, soft_wrap=True)
            return
        if compare_no_fill and no_fill:
            raise UserError("--compare-no-fill runs once with fill and once without; drop --no-fill")
        if steps < 1:
            raise UserError(f"--steps must be at least 1, got {steps}")
        extra = ["--optimizer", optimizer, "--lr", repr(lr), "--seed", str(seed)]
        echo = (lambda line: None) if as_json else typer.echo
        first = launch_local(plan_file, steps=steps, fill=not no_fill, metrics=metrics, extra=extra, on_line=echo,
                             oversubscribe=oversubscribe)
        _check(first.returncode)
        baseline = None
        if compare_no_fill:
            base_out = str(Path(metrics).with_suffix(".nofill.json")) if metrics else None
            second = launch_local(plan_file, steps=steps, fill=False, metrics=base_out, extra=extra, on_line=echo,
                                  oversubscribe=oversubscribe)
            _check(second.returncode)
            baseline = second.metrics
    if first.metrics is None:
        _fail("the run exited 0 but wrote no metrics", 1)
    _report(first.metrics, baseline, as_json)


def _check(returncode: int) -> None:
    if returncode != 0:
        _fail(f"the run failed (torchrun exit code {returncode}); the rank logs above say why", returncode)


def _report(metrics: MetricsDocument, baseline: MetricsDocument | None, as_json: bool) -> None:
    from .runtime import mean_iteration_s, summarize

    slowdown = None
    if baseline is not None:
        with_fill, without = mean_iteration_s(metrics), mean_iteration_s(baseline)
        slowdown = {"with_fill_s": with_fill, "without_fill_s": without,
                    "slowdown": with_fill / without - 1 if without > 0 else None}
    if as_json:
        dump = lambda doc: None if doc is None else doc.model_dump(mode="json", by_alias=True)  # noqa: E731
        print_json(json.dumps({"metrics": dump(metrics), "no_fill": dump(baseline), "comparison": slowdown}, indent=2))
        return
    rows = summarize(metrics)
    table = Table(title="main job per step (slowest rank)")
    for col in ("step", "loss", "iteration", "bubble time / rank", "bubbles", "fill"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["step"]), "-" if r["loss"] is None else f"{r['loss']:.5f}", _ms(r["iteration_s"]),
                      _ms(r["bubble_s"]), str(r["bubbles"]), "yes" if r["fill"] else "no")
    out.print(table)
    for run in metrics.runs:
        c = run.config
        out.print(f"predicted iteration on {c.pp}x{c.dp}x{c.cp}x{c.tp} (pp x dp x cp x tp) target GPUs: "
                  f"{_ms(run.predicted_iteration_s)}; measured here: "
                  f"{_ms(mean_iteration_s(metrics.model_copy(update={'runs': [run]})))}", highlight=False)
        _print_fill(run)
    if slowdown is not None:
        pct = "n/a" if slowdown["slowdown"] is None else f"{slowdown['slowdown']:+.1%}"
        out.print(f"main-job slowdown with fill: {pct} (mean iteration {_ms(slowdown['with_fill_s'])} with fill, "
                  f"{_ms(slowdown['without_fill_s'])} without; steps after the first)", highlight=False)


def _print_fill(run: RunEntry) -> None:
    for rank in run.ranks:
        rep = rank.fill_report
        if rep is None:
            continue
        units = sum(b.units_done for b in rep.bubbles)
        errors = len(rep.errors) + sum(1 for j in rep.jobs if j.error)
        out.print(f"rank {rank.rank}: fill {len(rep.bubbles)} bubble(s) used, {units} unit(s) done, "
                  f"{len(rep.overruns)} overrun(s), {len(rep.kills)} kill(s), {errors} error(s)", highlight=False)
        for job in rep.jobs:
            if job.error:
                out.print(f"  fill job {job.name}: {job.error}", highlight=False, soft_wrap=True)
