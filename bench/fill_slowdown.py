"""Main-job slowdown with fill on this machine's CPU, for the end-to-end fill plan: a tiny GPT
(layers=4, p=2, GPipe, B=16, b=2) with an MLP training job that the planner packs into its bubbles.

    python bench/fill_slowdown.py [--steps 20] [--out DIR] [--json]

Makes the plan (for a CPU-core-like target, so that the tiny GPT's bubbles last milliseconds and
the planner places chunks in them), runs `planner launch PLAN --local --steps N --compare-no-fill
--json`, and prints the mean iteration time with and without fill (slowest rank, steps after the
first: step 0 never fills), the slowdown, the fill units done and the share of the bubble time that
fill steps used. On a small CPU machine the main ranks and their fill processes share the cores,
so the slowdown is a worst case: on a GPU the fill job uses the idle device, not the main job's CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.api import make_plan  # noqa: E402
from planner.fill.spec import load_fill_spec  # noqa: E402
from planner.metrics import MetricsDocument  # noqa: E402
from planner.plan import Plan, save_plan  # noqa: E402
from planner.runtime import child_env  # noqa: E402
from planner.search import Pins  # noqa: E402

GPT = {"preset": "tiny", "layers": 4, "dropout": 0.0}
PINS = Pins(tp=1, pp=2, dp=1, b=2, v=1, schedule="gpipe", recompute="none", precision="fp32")
GLOBAL_BATCH = 16
CPU_TARGET = ROOT / "examples" / "targets" / "cpu-core.yaml"
FILL = ROOT / "examples" / "fill" / "tiny-mlp.yaml"


def make(out: Path) -> tuple[Plan, Path]:
    plan, _ = make_plan(str(ROOT / "examples" / "gpt.py"), gpus=2, gpus_per_node=2, global_batch=GLOBAL_BATCH,
                        target=str(CPU_TARGET), model_args=GPT, pins=PINS,
                        fill=load_fill_spec(FILL))
    if plan.fill is None or not plan.fill.chunks:
        raise SystemExit(f"the planner placed no fill chunks: {plan.fill.predictions.unplaceable if plan.fill else ''}")
    path = out / "plan.json"
    save_plan(plan, path)
    return plan, path


def launch(path: Path, steps: int, metrics: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "planner", "launch", str(path), "--local", "--steps", str(steps),
           "--compare-no-fill", "--json", "--metrics", str(metrics)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), cwd=path.parent)
    if proc.returncode != 0:
        raise SystemExit(f"`{' '.join(cmd[2:])}` failed ({proc.returncode}):\n"
                         f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


def fill_figures(metrics: MetricsDocument) -> dict[str, Any]:
    """Fill work and the share of bubble time it used (steps after the first, every rank; a fill step
    counts only inside its bubble's main_begin..main_end)."""
    run = metrics.runs[0]
    bubble_s = sum(b.duration_s for r in run.ranks for s in r.steps[1:] for b in s.bubbles)
    used_s, units, iterations, kills, errors = 0.0, 0, 0, 0, 0
    for rank in run.ranks:
        rep = rank.fill_report
        if rep is None:
            continue
        for occ in rep.bubbles:
            end = occ.main_end if occ.main_end is not None else float("inf")
            used_s += sum(max(0.0, min(s.end, end) - max(s.start, occ.main_begin)) for s in occ.steps)
        units += sum(j.units_done for j in rep.jobs)
        iterations += sum(j.iterations_done for j in rep.jobs)
        kills += len(rep.kills)
        errors += len(rep.errors)
    return {"fill_units_done": units, "fill_iterations_done": iterations, "fill_kills": kills,
            "fill_errors": errors, "bubble_s": bubble_s, "fill_in_bubbles_s": used_s,
            "bubble_time_used": used_s / bubble_s if bubble_s > 0 else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20, help="main-job steps per run (default 20)")
    ap.add_argument("--out", help="keep the plan and metrics in this folder (default: a temporary one)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = ap.parse_args()
    if args.steps < 2:
        ap.error(f"--steps must be at least 2 (step 0 never fills), got {args.steps}")
    with tempfile.TemporaryDirectory(prefix="fxp-fill-slowdown-") as tmp:
        out = Path(args.out) if args.out else Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        plan, path = make(out)
        doc = launch(path, args.steps, out / "metrics.json")
    cmp = doc["comparison"]
    row = {"steps": args.steps, "cpus": os.cpu_count(), "config": plan.config.model_dump(),
           "with_fill_s": cmp["with_fill_s"], "without_fill_s": cmp["without_fill_s"], "slowdown": cmp["slowdown"],
           **fill_figures(MetricsDocument.model_validate(doc["metrics"])),
           "planned_bubble_time_used": plan.fill.predictions.bubble_time_used}
    if args.json:
        print(json.dumps(row, indent=1))
        return
    print(f"tiny GPT, p=2 GPipe, B={GLOBAL_BATCH}, b={PINS.b}, {args.steps} steps on {row['cpus']} CPU(s)")
    print(f"mean iteration (steps 1..{args.steps - 1}, slowest rank): {row['with_fill_s'] * 1e3:.1f} ms with fill, "
          f"{row['without_fill_s'] * 1e3:.1f} ms without: slowdown {row['slowdown']:+.1%}")
    print(f"fill: {row['fill_units_done']} units ({row['fill_iterations_done']} iterations) done, "
          f"{row['fill_kills']} kill(s), {row['fill_errors']} error(s); bubble time used "
          f"{row['bubble_time_used']:.1%} ({row['fill_in_bubbles_s'] * 1e3:.0f} of {row['bubble_s'] * 1e3:.0f} ms; "
          f"planned {row['planned_bubble_time_used']:.1%} on the plan's target)")


if __name__ == "__main__":
    main()
