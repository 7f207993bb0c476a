"""`planner calibrate`: measure this machine and write correction factors."""
from __future__ import annotations

import json
from typing import List, Optional

import typer
from rich.table import Table

from passes.errors import UserError, output_path, write_atomic

from .cli import _ms, app, err, out, print_json, unit_progress, user_errors


@app.command()
def calibrate(
    model: str = typer.Argument(..., help="model file whose units are timed"),
    measure: bool = typer.Option(False, "--measure", help="time the units here (required: calibration measures)"),
    target: Optional[str] = typer.Option(None, help="target the factors are for (default: describe this machine)"),
    batch: int = typer.Option(4, "--batch", "-b", help="microbatch size to time"),
    model_arg: List[str] = typer.Option([], "--model-arg", help="key=value passed to build_model"),
    repeats: int = typer.Option(5, help="timed repetitions per unit"),
    comm: bool = typer.Option(True, help="fit gloo latency/bandwidth with a two-process ping-pong"),
    target_out: str = typer.Option("local-cpu.yaml", help="where to write this machine's target (no --target)"),
    from_run: Optional[str] = typer.Option(None, "--from-run", help="metrics of a run of --plan: fit the "
                                           "runtime's per-action overhead into the existing calibration (-o)"),
    plan_file: Optional[str] = typer.Option(None, "--plan", help="the plan that --from-run measured"),
    output: str = typer.Option("calibration.json", "-o", "--output", help="calibration file to write"),
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
) -> None:
    """Profile MODEL's units on this device and store per-target correction factors."""
    from targets.registry import get_target

    from .api import parse_model_args
    from .calibrate import calibrate as run, fit_comm, machine_target

    if from_run:
        _fit_from_run(from_run, plan_file, output)
        return
    with user_errors():
        if not measure:
            raise UserError("calibration measures this machine: pass --measure")
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
    out.print(f"written {output}{where}; use: planner plan MODEL.py --target {target or target_out} "
              f"--calibration {output}", highlight=False)


def _fit_from_run(metrics: str, plan_file: Optional[str], output: str) -> None:
    from costmodels.calibration import load_calibration

    from .metrics import load_metrics
    from .plan import load_plan
    from .runtime import mean_iteration_s
    from .validate import fit_action_overhead, run_of

    with user_errors():
        if not plan_file:
            raise UserError("--from-run needs --plan, the plan that was run")
        cal = load_calibration(output)
        plan = load_plan(plan_file)
        measured = mean_iteration_s(run_of(load_metrics(metrics), plan, plan_file, metrics))
        extra = fit_action_overhead(plan, measured)
        cal = cal.model_copy(update={"action_overhead_s": cal.action_overhead_s + extra})
        write_atomic(output, cal.model_dump_json(by_alias=True, indent=1) + "\n", "calibration")
    out.print(f"measured iteration {_ms(measured)} against {_ms(plan.predictions.iteration_s)} predicted: "
              f"per-action overhead now {_ms(cal.action_overhead_s)}; written {output}", highlight=False)
