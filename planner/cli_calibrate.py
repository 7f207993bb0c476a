"""`planner calibrate`: measure this machine and write correction factors."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import List, Optional

import typer
from rich.table import Table

from passes.errors import UserError, output_path, write_atomic

from .cli import _ms, app, err, out, print_json, unit_progress, user_errors


def calibration_home() -> Path:
    """Where calibrate writes by default: this user's data folder ($XDG_DATA_HOME/fxplanner, else
    ~/.local/share/fxplanner), never the current directory, so that a run from a checkout leaves its tree alone and
    the second step finds the first's calibration from any directory."""
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "fxplanner"


def _default(path: Optional[str], name: str) -> str:
    """`path`, or `name` in calibration_home() (created now)."""
    if path:
        return path
    home = calibration_home()
    home.mkdir(parents=True, exist_ok=True)
    return str(home / name)


HOME_HELP = "$XDG_DATA_HOME/fxplanner, default ~/.local/share/fxplanner"


@app.command()
def calibrate(
    model: Optional[str] = typer.Argument(None, help="model file whose units are timed (first step; not with "
                                          "--from-run)"),
    measure: bool = typer.Option(False, "--measure", help="time the units here (required: calibration measures)"),
    target: Optional[str] = typer.Option(None, help="target the factors are for (default: describe this machine)"),
    batch: int = typer.Option(4, "--batch", "-b", help="microbatch size to time"),
    model_arg: List[str] = typer.Option([], "--model-arg", help="key=value passed to build_model"),
    repeats: int = typer.Option(5, help="timed repetitions per unit"),
    comm: bool = typer.Option(True, help="fit gloo latency/bandwidth with a two-process ping-pong"),
    target_out: Optional[str] = typer.Option(None, help="where to write this machine's target (no --target; "
                                             f"default: local-cpu.yaml in {HOME_HELP})"),
    from_run: Optional[str] = typer.Option(None, "--from-run", help="metrics of a run of --plan: fit the "
                                           "runtime's per-action overhead into the existing calibration (-o)"),
    plan_file: Optional[str] = typer.Option(None, "--plan", help="the plan that --from-run measured"),
    output: Optional[str] = typer.Option(None, "-o", "--output", help="calibration file to write (with --from-run: "
                                         f"to update; default: calibration.json in {HOME_HELP})"),
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
) -> None:
    """Profile MODEL's units on this device and store per-target correction factors (first step, --measure); then,
    after a short run of a plan made with them, fit the runtime's per-action overhead (second step, --from-run).
    Both write into this user's data folder unless -o/--target-out say otherwise, never the current directory."""
    from targets.registry import get_target

    from .api import parse_model_args
    from .calibrate import calibrate as run, fit_comm, machine_target

    if from_run:
        with user_errors():
            _fit_from_run(from_run, plan_file, output or str(calibration_home() / "calibration.json"))
        return
    with user_errors():
        if model is None:
            raise UserError("calibrate takes MODEL.py with --measure (first step), or --from-run METRICS.json "
                            "--plan PLAN.json (second step)")
        if not measure:
            raise UserError("calibration measures this machine: pass --measure")
        output = _default(output, "calibration.json")
        target_out = None if target else _default(target_out, "local-cpu.yaml")
        for path, what in ((output, "calibration"), *(() if target else ((target_out, "target"),))):
            output_path(path, what)  # a missing folder is refused before anything is measured or written
        kwargs = parse_model_args(model_arg)
        import torch

        from passes.load import load_model_file
        from passes.profile import check_fits

        # before anything is measured or written: a model that cannot fit here is refused now
        check_fits(load_model_file(model, kwargs), torch.device("cuda" if torch.cuda.is_available() else "cpu"), model)
        with err.status("measuring the interconnect and the device"):
            fit = fit_comm() if comm else None
            tg = get_target(target) if target else machine_target(target_out, fit)
        with err.status(f"timing the units of {model}") as st:
            cal, rows = run(model, kwargs, batch=batch, target=tg, repeats=repeats, comm=fit,
                            progress=unit_progress(st))
        write_atomic(output, cal.model_dump_json(by_alias=True, indent=1) + "\n", "calibration")
    if as_json:
        print_json(json.dumps({"calibration": json.loads(cal.model_dump_json(by_alias=True)), "units": rows}, indent=2))
        return
    table = Table(title=f"calibration of {cal.target} on {cal.device} ({cal.dtype}, b={batch})")
    for col in ("unit kind", "units", "forward: measured/predicted", "backward: measured/predicted"):
        table.add_column(col)
    for kind, f in cal.unit_factors.items():
        table.add_row(kind, str(f.units), f"{f.fwd:.3f}", f"{f.bwd:.3f}")
    out.print(table)
    if fit:
        out.print(f"gloo: latency {_ms(fit.latency_s)}, bandwidth {fit.bandwidth / 1e9:.2f} GB/s", highlight=False)
    where = "" if target else f"; target {target_out}"
    out.print(f"written {output}{where}", highlight=False)
    out.print("next, the second step (the runtime's per-action overhead; without it the unit factors alone can make "
              "the whole-iteration prediction worse): make a plan with this calibration, run it briefly, and fit "
              "from its metrics:", highlight=False)
    margs = "".join(f" --model-arg {a}" for a in model_arg)
    cpu = "" if target else " --dtype fp32"  # (what the runtime trains in on CPU)
    beside = Path(output).parent  # the run's plan and metrics beside the calibration, not in the current directory
    plan, metrics = beside / "calibration-plan.json", beside / "calibration-metrics.json"
    for cmd in (f"planner plan {model}{margs} --gpus 2 --gpus-per-node 2 --tp 1 --pp 2 --schedule 1f1b "
                f"--microbatch {batch} --global-batch {4 * batch}{cpu} --target {target or target_out} "
                f"--calibration {output} -o {plan}",
                f"planner launch {plan} --local --metrics {metrics}",
                f"planner calibrate --from-run {metrics} --plan {plan} -o {output}"):
        out.print(f"  {cmd}", highlight=False, soft_wrap=True)


def _fit_from_run(metrics: str, plan_file: Optional[str], output: str) -> None:
    from costmodels.calibration import load_calibration

    from .metrics import load_metrics
    from .plan import load_plan
    from .runtime import mean_iteration_s
    from .validate import fit_action_overhead, run_of

    if not plan_file:
        raise UserError("--from-run needs --plan, the plan that was run")
    if not Path(output).exists():
        raise UserError(f"--from-run updates the calibration {output}, which does not exist: run the first step "
                        "(planner calibrate MODEL.py --measure) first, or name its calibration with -o")
    cal = load_calibration(output)
    plan = load_plan(plan_file)
    measured = mean_iteration_s(run_of(load_metrics(metrics), plan, plan_file, metrics))
    extra = fit_action_overhead(plan, measured)
    cal = cal.model_copy(update={"action_overhead_s": cal.action_overhead_s + extra})
    write_atomic(output, cal.model_dump_json(by_alias=True, indent=1) + "\n", "calibration")
    out.print(f"measured iteration {_ms(measured)} against {_ms(plan.predictions.iteration_s)} predicted: "
              f"per-action overhead now {_ms(cal.action_overhead_s)}; written {output}", highlight=False)
