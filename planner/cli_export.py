"""`planner export`: a plan as torchtitan's or Megatron-LM's configuration."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from passes.errors import UserError, write_atomic

from .cli import app, err, out, user_errors
from .engines import ENGINES

EXPORTED = [name for name, e in ENGINES.items() if e.export]


@app.command()
def export(
    plan_file: str = typer.Argument("plan.json", help="plan written by `planner plan`"),
    to: str = typer.Option(..., "--to", help=f"engine: {' or '.join(EXPORTED)}"),
    output: Optional[str] = typer.Option(None, "-o", "--output", help="where to write (default: beside the plan, "
                                         f"{' or '.join(f'{n}.sh' for n in EXPORTED)})"),
    titan_module: Optional[str] = typer.Option(None, "--titan-module", help="torchtitan model module (e.g. llama3), "
                                               "for a model torchtitan does not ship"),
    titan_config: Optional[str] = typer.Option(None, "--titan-config", help="its config_registry function "
                                               "(e.g. llama3_8b)"),
    toml: bool = typer.Option(False, "--toml", help="torchtitan 0.1-0.2: a TOML job file (--job.config_file); "
                              "--titan-config is then the model flavor"),
    check: bool = typer.Option(False, "--check", help="load the result with the engine's own config code "
                               "(needs `pip install -e .[engines]`) and compare its parallel degrees with the plan; "
                               "for torchtitan also load the schedule CSV in torch's pipeline runtime; for Megatron-LM "
                               "also run its validate_args checks on the arguments and the environment the script "
                               "sets"),
) -> None:
    """Write PLAN as a torchtitan job (its command line) or Megatron-LM pretrain_gpt.py arguments."""
    from . import export as exporters
    from .export import check_megatron, check_torchtitan
    from .plan import load_plan

    with user_errors():
        if to not in EXPORTED:
            raise UserError(f"--to takes {' or '.join(EXPORTED)}, got {to!r}")
        if to != "torchtitan" and (titan_module or titan_config):
            raise UserError("--titan-module/--titan-config apply to --to torchtitan only")
        plan = load_plan(plan_file)
        if toml and (to != "torchtitan" or check):
            raise UserError("--toml writes torchtitan 0.1-0.2 job files: use it with --to torchtitan and without --check "
                            "(the installed engines extra is torchtitan >= 0.3)")
        path = Path(output) if output else Path(plan_file).with_name(f"{to}.toml" if toml else f"{to}.sh")
        # beside the job: job.sh -> job.schedule.csv; beside the plan without -o: plan.json -> plan.schedule.csv
        schedule_csv = (path if output else Path(plan_file)).with_suffix(".schedule.csv")
        # the fill trainer reads the plan: this one, or with -o a copy beside the job
        fill_plan = path.with_suffix(".plan.json") if output else Path(plan_file)
        kwargs = dict(module=titan_module, config=titan_config, toml=toml, schedule_csv=str(schedule_csv))
        if to != "torchtitan":
            kwargs = {}
        if not toml:
            kwargs["fill_plan"] = str(fill_plan)
        ex = getattr(exporters, ENGINES[to].export)(plan, **kwargs)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, ex.text, "export")
        if not toml:
            path.chmod(0o755)
        out.print(f"{to} configuration written to {path}", highlight=False)
        for name, text in ex.files.items():
            if name == str(fill_plan):
                if output:
                    write_atomic(name, text, "plan")
                    out.print(f"the plan its fill trainer reads written to {name}", highlight=False)
                continue
            write_atomic(name, text, "schedule")
            out.print(f"the plan's pipeline order (torch's compute-only schedule CSV, one row per pipeline rank) "
                      f"written to {name}", highlight=False)
        for u in ex.unexpressed:
            err.print(f"[yellow]not expressed[/] {u}", highlight=False)
        if check:
            try:
                seen = (check_torchtitan(ex, plan.source.gpus, plan) if to == "torchtitan"
                        else check_megatron(ex, plan.source.gpus))
            except ImportError as e:
                raise UserError(f"--check needs the engines extra ({e.name} is not installed): "
                                "pip install -e '.[engines]'") from None
            except (AssertionError, ValueError, SystemExit) as e:
                raise UserError(f"{to} refused the configuration: {str(e).strip() or type(e).__name__}") from None
            out.print(f"{to} reads: " + ", ".join(f"{k}={v}" for k, v in seen.items() if k != "layout"),
                      highlight=False)
