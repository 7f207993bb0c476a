"""The `planner` command: thin wiring of library calls; rich output lives only here."""
from __future__ import annotations

import atexit
import json
import os
import re
import sys
from contextlib import contextmanager
from typing import Any, Iterator, List

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from costmodels.precision import PRECISIONS
from passes.errors import UserError
from targets.builtin import DEFAULT_TARGET
from targets.specs import TargetError

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="Plan pipeline/tensor/data-parallel training and fill its bubbles.")
out = Console(width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True)


def print_json(text: str) -> None:
    """JSON on stdout as it is: rich's highlighting took 9 s over a 4 MB plan (256 GPUs), and a pipe needs none."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


GiB = 2**30
TARGET_HELP = "built-in target name (see `planner targets`) or a target YAML file"


def _fail(message: str, code: int = 2) -> None:
    """One line on stderr (text from models and torch escaped: rich would eat its brackets) and the exit code."""
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


@contextmanager
def user_errors() -> Iterator[None]:
    """The one place that maps known exceptions to a message and an exit code (no traceback)."""
    try:
        yield
    except (UserError, TargetError) as exc:
        _fail(str(exc))
    except KeyboardInterrupt:
        _fail("interrupted", 130)


@contextmanager
def status(enabled: bool, text: str) -> Iterator[Any]:
    if not enabled:
        yield None
        return
    with err.status(text) as st:
        yield st


def unit_progress(st: Any):
    """A measure_units progress callback that updates a status line (None: no status shown)."""
    if st is None:
        return None
    return lambda done, total, eta: st.update(f"timed {done}/{total} distinct units, about {eta:.0f} s left")


def _si(x: float, unit: str = "") -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def _ms(s: float) -> str:
    return f"{s * 1e3:.3f} ms" if s < 1 else f"{s:.3f} s"


@app.command()
def targets(as_json: bool = typer.Option(False, "--json", help="machine-readable output")) -> None:
    """List the built-in targets."""
    from targets.registry import list_targets

    rows = [{"name": t.name, "gpu": t.gpu.name, "bf16_tflops": t.gpu.peak_flops.get("bf16", 0) / 1e12,
             "fp8_tflops": t.gpu.peak_flops.get("fp8", 0) / 1e12,
             "hbm_gib": t.gpu.hbm_bytes / GiB, "hbm_tb_s": t.gpu.hbm_bw / 1e12, "gpus_per_node": t.cluster.gpus_per_node,
             "nvlink_gb_s": t.cluster.nvlink_bw / 1e9, "internode_gb_s": t.cluster.internode_bw / 1e9,
             "default": t.name == DEFAULT_TARGET} for t in list_targets()]
    if as_json:
        print_json(json.dumps(rows, indent=2))
        return
    table = Table(title="built-in targets")
    for col in ("name", "GPU", "bf16 TFLOP/s", "FP8 TFLOP/s", "HBM GiB", "HBM TB/s", "GPUs/node", "NVLink GB/s", "inter-node GB/s"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["name"] + (" (default)" if r["default"] else ""), r["gpu"],
                      f"{r['bf16_tflops']:.0f}" if r["bf16_tflops"] else "none (use --dtype fp16)",
                      f"{r['fp8_tflops']:.0f}" if r["fp8_tflops"] else "none",
                      f"{r['hbm_gib']:.0f}", f"{r['hbm_tb_s']:.2f}", str(r["gpus_per_node"]),
                      f"{r['nvlink_gb_s']:.0f}", f"{r['internode_gb_s']:.1f}")
    out.print(table)


@app.command()
def profile(
    model: str = typer.Argument(..., help="model file defining build_model() and example_inputs()"),
    target: str = typer.Option(DEFAULT_TARGET, help=TARGET_HELP),
    batch: int = typer.Option(1, "--batch", "-b", help="microbatch size to price"),
    tp: int = typer.Option(1, "--tp", help="tensor-parallel degree to price"),
    model_arg: List[str] = typer.Option([], "--model-arg", help="key=value passed to build_model"),
    leaf: List[str] = typer.Option([], "--leaf", help="module class or name to trace as one node"),
    dtype: str = typer.Option("bf16", "--dtype", help=f"precision to price: {', '.join(PRECISIONS)} (FP8 GEMMs "
                              "depend on the engine's recipe: `planner plan --dtype fp8` prices them)"),
    measure: bool = typer.Option(False, "--measure", help="also time each unit on this machine"),
    repeats: int = typer.Option(5, help="timed repetitions per unit with --measure"),
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
    all_rows: bool = typer.Option(False, "--all", help="print every unit (by default 40 rows at most)"),
) -> None:
    """Trace MODEL on meta tensors and price every unit on the target."""
    from targets.registry import get_target

    from .config import ParallelConfig
    from .options import parse_model_args

    with user_errors():  # the arguments are checked before torch is imported (seconds)
        if batch < 1:
            raise UserError(f"--batch must be positive, got {batch}")
        if dtype not in PRECISIONS:
            raise UserError(f"--dtype must be one of {', '.join(PRECISIONS)}, got {dtype!r}" + (
                "; FP8 GEMMs depend on the engine's recipe: `planner plan --dtype fp8` prices them"
                if dtype == "fp8" else ""))
        kwargs = parse_model_args(model_arg)
        tg = get_target(target)
        cfg = ParallelConfig(tp=tp, pp=1, dp=1, b=batch, m=1, precision=dtype)
        with status(not as_json, "loading torch and the cost models") as st:
            from passes.pipeline import analyze

            from costmodels.hardware import Hardware

            from .api import profile_rows
            from .search import tp_reason

            prof, _ = analyze(model, kwargs, leaves=tuple(leaf), dtype=dtype,
                              progress=(lambda name: st.update(f"pass: {name}")) if st else None)
        why = tp_reason(tp, {(u.heads, u.kv_heads) for u in prof.units})
        if why is not None:
            raise UserError(f"--tp {tp}: {why}; choose a t that divides them")
        from .engines import ENGINES

        rows = profile_rows(prof, Hardware(target=tg, attention=ENGINES["fxplanner"].attention), cfg)  # (op by op, as
        # the fxplanner runtime runs the file)
        if measure:
            from passes.profile import measure_units

            with status(not as_json, "measuring units on this machine") as mst:
                measured = measure_units(model, kwargs, batch, leaves=tuple(leaf), repeats=repeats,
                                         progress=unit_progress(mst))
            for row, m in zip(rows, measured):
                row.update(measured_fwd_s=m.fwd_median_s, measured_bwd_s=m.bwd_median_s,
                           measured_fwd_spread=m.fwd_spread, measured_bwd_spread=m.bwd_spread,
                           measured_device=m.device, measured_peak_bytes=m.peak_bytes)
    totals = {"params": prof.total_params, "fwd_flops": sum(r["fwd_flops"] for r in rows),
              "bwd_flops": sum(r["bwd_flops"] for r in rows), "fwd_s": sum(r["fwd_s"] for r in rows),
              "bwd_s": sum(r["bwd_s"] for r in rows), "activation_bytes": sum(r["activation_bytes"] for r in rows)}
    if as_json:
        print_json(json.dumps({"model": prof.path, "target": tg.name, "batch": batch, "tp": tp, "units": rows,
                               "totals": totals, "frontend": prof.frontend, "notes": list(prof.notes),
                               "unpriced": [{"op": op, "share_of_bytes": share} for op, share in prof.unpriced],
                               "passes": [{"name": n, "seconds": s} for n, s in prof.pass_times]}, indent=2))
        return
    _print_profile(prof, tg.name, batch, tp, rows, totals, measure, all_rows)


def _print_profile(prof, target: str, batch: int, tp: int, rows: list[dict], totals: dict, measured: bool,
                   all_rows: bool = False) -> None:
    table = Table(title=f"{prof.name}: {len(rows)} units, b={batch}, t={tp}, on {target}")
    cols = ["#", "unit", "kind", "params", "fwd FLOPs", "bwd FLOPs", "activations", "fwd (pred)", "bwd (pred)"]
    if measured:
        cols += ["fwd (here)", "bwd (here)"]
    for col in cols:
        table.add_column(col, justify="right" if col not in ("unit", "kind") else "left")
    shown = rows if len(rows) <= 40 or all_rows else rows[:20] + [None] + rows[-19:]
    for i, r in enumerate(shown):
        if r is None:
            table.add_row("…", f"{len(rows) - 39} more units (--all)", *[""] * (len(cols) - 2))
            continue
        idx = rows.index(r)
        cells = [str(idx), r["unit"], r["kind"], _si(r["params"]), _si(r["fwd_flops"]), _si(r["bwd_flops"]),
                 _si(r["activation_bytes"], "B"), _ms(r["fwd_s"]), _ms(r["bwd_s"])]
        if measured:
            cells += [f"{_ms(r['measured_fwd_s'])} ±{r['measured_fwd_spread']:.0%}",
                      f"{_ms(r['measured_bwd_s'])} ±{r['measured_bwd_spread']:.0%}"]
        table.add_row(*cells)
    table.add_row("", "total", "", _si(totals["params"]), _si(totals["fwd_flops"]), _si(totals["bwd_flops"]),
                  _si(totals["activation_bytes"], "B"), _ms(totals["fwd_s"]), _ms(totals["bwd_s"]),
                  *([""] * (2 if measured else 0)), style="bold")
    out.print(table)
    tied = sum(r["params"] for r in rows) - totals["params"]
    if tied > 0:  # a weight two units use (a head tied to the embedding) is in both rows, once in the total
        out.print(f"the unit rows add up to {_si(sum(r['params'] for r in rows))} parameters: {_si(tied)} of them are "
                  "shared between units (a head tied to the embedding shows the embedding's weight again); the total "
                  "counts each parameter once", highlight=False)
    print_model_notes(prof)
    out.print(f"captured with {'torch.export' if prof.frontend == 'export' else 'torch.fx'}; passes: "
              + ", ".join(f"{n} {s:.2f}s" for n, s in prof.pass_times), highlight=False)


def print_model_notes(prof) -> None:
    """What the user should know about how the model was priced: unpriced ops and notes."""
    for op, share in prof.unpriced:
        out.print(f"unpriced: op {op} ({share:.1%} of the forward's memory traffic) is not in the cost tables; it is "
                  "priced as memory-bound with 2 FLOPs per parameter per row", highlight=False)
    for note in prof.notes:
        out.print(f"note: {note}", highlight=False)


_KEY_VALUE = re.compile(r"^[A-Za-z_][\w.-]*=")


def spread_model_args(argv: list[str]) -> list[str]:
    """`--model-arg a=1 b=2` as the README writes it: the key=value words after one --model-arg's value become
    --model-arg options of their own (an option takes one value on the command line)."""
    out: list[str] = []
    after = False  # the previous word was a --model-arg value
    for i, word in enumerate(argv):
        if after and _KEY_VALUE.match(word):
            out += ["--model-arg", word]
            continue
        out.append(word)
        after = word.startswith("--model-arg=") or (i > 0 and argv[i - 1] == "--model-arg")
    return out


def run(argv: list[str]) -> int:
    """The planner command on `argv` (the words after `planner`); its exit status."""
    try:
        app(args=spread_model_args(argv), prog_name="planner")
        return 0
    except SystemExit as done:
        if isinstance(done.code, str):
            print(done.code, file=sys.stderr)
        return done.code if isinstance(done.code, int) else int(done.code is not None)


def main() -> None:
    code = run(sys.argv[1:])
    # exit as the interpreter would (its exit handlers: logging's flush, torch's), less its teardown of every object
    # left (the traced graphs, the search's caches): 1.5-2 s after planning a large model
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


from . import cli_plan  # noqa: E402,F401  (registers plan/show/chart)
from . import cli_launch  # noqa: E402,F401  (registers launch)
from . import cli_calibrate  # noqa: E402,F401
from . import cli_fill  # noqa: E402,F401
from . import cli_validate  # noqa: E402,F401
from . import cli_export  # noqa: E402,F401
