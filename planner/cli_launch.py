"""`planner launch`: run a plan's torchrun command on this machine and print its metrics."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional

import typer
from rich.table import Table

from passes.errors import UserError

from .cli import _fail, _ms, app, out, print_json, user_errors
from .engines import ENGINES

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
            engine = plan.source.engine
            if ENGINES[engine].export:  # the engine's own job, as `planner export` writes it: the same on every node
                from .api import engine_launch

                cmds = engine_launch(plan, plan_file).commands
                out.print(f"this plan runs in {engine}: on each of its {len(cmds)} node(s) write its {engine} "
                          "configuration and run it (RDZV_ENDPOINT=host:port of node 0; torchrun's rendezvous numbers "
                          "the nodes); nothing was written now:", highlight=False)
                for cmd in cmds:
                    out.print(f"  {cmd}", highlight=False, soft_wrap=True)
                return
            script = Path(plan_file).with_name("launch.sh")
            if script.exists() and script.read_text() != plan.launch.script:  # never overwrite another file silently
                how = f"({script} exists and is not this plan's script: left as it is)"
            else:
                script.write_text(plan.launch.script)
                script.chmod(0o755)
                how = f"or `{script} NODE_RANK` (written now)"
            out.print(f"multi-node runs start on each node with the plan's commands {how}; RDZV_ENDPOINT=host:port "
                      "of node 0; add --local to run every rank here:", highlight=False)
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


@app.command()
def rehearse(
    plan_file: str = typer.Argument("plan.json", help="plan written by `planner plan`"),
    rank: int = typer.Option(..., "--rank", help="the pipeline rank to run for real (its peers are replayed)"),
    steps: int = typer.Option(5, "--steps", help="training iterations; step 0 runs without fill and measures"),
    compare_no_fill: bool = typer.Option(False, "--compare-no-fill",
                                         help="run without fill first, then with it, and print the slowdown"),
    fill_fraction: Optional[List[float]] = typer.Option(
        None, "--fill-fraction", help="offer the fill jobs this fraction of each bubble (0 < F <= 1; default: the "
        "bubble less the plan's safety margin); repeat it for one run with fill per fraction"),
    no_fill: bool = typer.Option(False, "--no-fill", help="never hand bubbles to fill jobs"),
    device: str = typer.Option("auto", "--device", help="auto (cuda if available, else cpu), cpu, cuda, cuda:N"),
    report_file: str = typer.Option("rehearsal.json", "-o", "--output", help="where to write the report JSON"),
    metrics: str = typer.Option("rehearsal-metrics.json", "--metrics",
                                help="where to write the metrics (`planner validate PLAN --metrics` reads them)"),
    boundary: Optional[str] = typer.Option(None, "--boundary", hidden=True,
                                           help="replay a launch's recorded boundary tensors (rank file)"),
    seed: int = typer.Option(0, "--seed", help="seed of build_model"),
    as_json: bool = typer.Option(False, "--json", help="print the report JSON instead of the tables"),
) -> None:
    """Run one pipeline rank of PLAN on this machine's device: its real stages in the plan's order, every receive
    arriving when the plan's simulation says, its bubbles handed to its fill jobs; predicted against measured."""
    from passes.errors import write_atomic

    from .metrics import save_metrics
    from .runtime.rehearse import RehearseOptions, rehearse as run_rehearsal

    with user_errors():
        if device == "auto":
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda":
            device = "cuda:0"
        opts = RehearseOptions(rank=rank, steps=steps, fill=not no_fill, compare_no_fill=compare_no_fill,
                               fill_fractions=tuple(fill_fraction or (None,)), device=device, seed=seed,
                               boundary=Path(boundary) if boundary else None)
        echo = (lambda line: None) if as_json else (lambda line: out.print(line, highlight=False, markup=False))
        report = run_rehearsal(plan_file, opts, log=echo)
        save_metrics(report.pop("metrics"), metrics)
        write_atomic(report_file, json.dumps(report, indent=1) + "\n", "rehearsal report")
    if as_json:
        print_json(json.dumps(report, indent=1))
        return
    _print_rehearsal(report, report_file, metrics)


def _err(measured: float | None, predicted: float | None) -> str:
    return "-" if measured is None or not predicted else f"{measured / predicted - 1:+.1%}"


def _print_rehearsal(r: dict, report_file: str, metrics: str) -> None:
    table = Table(title=f"pipeline rank {r['rank']} on {r['device']}: compute per microbatch (median over steps)")
    for col in ("stage", "action", "count", "predicted", "measured", "error"):
        table.add_column(col, justify="right")
    for k in r["action_kinds"]:
        table.add_row(str(k["stage"]), k["kind"], str(k["count"]), _ms(k["predicted_s"]), _ms(k["measured_s"]),
                      _err(k["measured_s"], k["predicted_s"]))
    out.print(table)
    bubbles = r["bubbles"]
    if bubbles:
        table = Table(title="bubbles (median over the steps after the first)")
        for col in ("bubble", "kind", "predicted start", "predicted", "measured", "error"):
            table.add_column(col, justify="right")
        for b in bubbles:
            table.add_row(str(b["id"]), b["kind"], _ms(b["predicted_start_s"]), _ms(b["predicted_s"]),
                          "-" if b["measured_s"] is None else _ms(b["measured_s"]), _err(b["measured_s"], b["predicted_s"]))
        out.print(table)
    mem = r["memory"]
    gib = lambda x: "-" if x is None else f"{x / 2**30:.2f} GiB"  # noqa: E731
    out.print(f"memory: planned {gib(mem['predicted_bytes'])} (reserve excluded) of {gib(mem['capacity_bytes'])}; "
              f"peak allocated {gib(mem['allocated_peak_bytes'])}, reserved {gib(mem['reserved_peak_bytes'])}"
              f"{'' if mem['allocated_peak_bytes'] is not None else ' (measured on CUDA only)'}", highlight=False)
    out.print(f"iteration: predicted {_ms(r['iteration']['predicted_s'])}; the replayed pipeline ends its steps at "
              f"{_ms(r['iteration']['replayed_s'])}", highlight=False)
    for run in r["runs"]:
        st = run["step_s"]
        line = f"{run['label']}: step {_ms(st['median'])} median [{_ms(st['min'])}, {_ms(st['max'])}]" \
            if st["median"] is not None else f"{run['label']}: no steps after the first"
        if run["slowdown"] is not None:
            line += f", main-job slowdown {run['slowdown']:+.2%}"
        fill = run["fill_work"]
        if fill:
            tflops = "-" if fill["tflops"] is None else f"{fill['tflops']:.3g}"
            line += (f"; fill {fill['units_per_step']:.1f} units/step (planned {fill['planned_units_per_step']}), "
                     f"{fill['work_s_per_step'] * 1e3:.2f} ms of planned work/step "
                     f"(planned {fill['planned_work_s_per_step'] * 1e3:.2f} ms), {tflops} TFLOP/s recovered "
                     f"(plan: {fill['planned_tflops']:.3g} TFLOP/s/GPU), {fill['overruns']} overrun(s), "
                     f"{fill['kills']} kill(s), {fill['errors']} error(s)")
        out.print(line, highlight=False)
    out.print(f"written {report_file} and {metrics} (`planner validate PLAN --metrics {metrics}`)", highlight=False)
