"""Predicted against measured on this machine's CPU: the end-to-end plans (GPipe, 1F1B,
interleaved 1F1B; with and without fill), before and after calibration.

    python bench/prediction_error.py [--steps 6] [--json out.json]

1. `planner calibrate --measure` times the tiny GPT's units and fits gloo (local-cpu target).
2. Each schedule is planned with that calibration and run (`planner launch --local`): "before".
3. The runtime's per-action overhead is fitted from the 1F1B run (`calibrate --from-run`), every
   schedule is planned again and run again: "after" (GPipe and interleaved are out-of-sample).
4. The 1F1B plan is also run with a fill job (MLP training) packed into its bubbles.
Prints iteration error, mean |error| of per-stage compute, and bubble time predicted/measured with
the summed absolute error of bubble durations over the measured bubble time.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.api import make_plan  # noqa: E402
from planner.fill.spec import load_fill_spec  # noqa: E402
from planner.metrics import save_metrics  # noqa: E402
from planner.plan import load_plan, save_plan  # noqa: E402
from planner.runtime import launch_local  # noqa: E402
from planner.search import Pins  # noqa: E402
from planner.validate import compare  # noqa: E402
from costmodels.calibration import load_calibration  # noqa: E402

GPT = {"preset": "tiny", "layers": 4, "dropout": 0.0}
CASES = {"gpipe": Pins(tp=1, pp=2, dp=1, b=1, schedule="gpipe", recompute="none", precision="fp32"),
         "1f1b": Pins(tp=1, pp=2, dp=1, b=1, schedule="1f1b", recompute="none", precision="fp32"),
         "interleaved": Pins(tp=1, pp=2, dp=1, b=1, v=2, schedule="interleaved", recompute="none", precision="fp32")}
FILL = ROOT / "examples" / "fill" / "tiny-mlp.yaml"


def planner(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "planner", *args], check=True, stdout=subprocess.DEVNULL)


def plan(case: str, tmp: Path, cal: Path, fill: bool = False) -> Path:
    p, _ = make_plan(str(ROOT / "examples" / "gpt.py"), gpus=2, gpus_per_node=2, global_batch=8,
                     target=str(tmp / "local-cpu.yaml"), model_args=GPT, pins=CASES[case],
                     calibration=load_calibration(cal), fill=load_fill_spec(FILL) if fill else None)
    out = tmp / f"{case}{'-fill' if fill else ''}.json"
    save_plan(p, out)
    return out


def measure(path: Path, steps: int, fill: bool) -> dict:
    run = launch_local(path, steps=steps, fill=fill, on_line=lambda line: None)
    if run.returncode != 0 or run.metrics is None:
        raise SystemExit(f"run of {path} failed with exit code {run.returncode}")
    v = compare(load_plan(path), run.metrics)
    rows = [r for rank in v.ranks for r in rank.rows if r.error is not None]
    stage = [abs(r.error) for r in rows if r.what.startswith("stage")]
    bubbles = [r for r in rows if r.what.endswith("duration")]
    return {"iteration_predicted_s": v.iteration.predicted, "iteration_measured_s": v.iteration.measured,
            "iteration_error": v.iteration.error, "stage_mean_abs_error": statistics.fmean(stage),
            # bubbles: summed |measured - predicted| over summed measured (tiny predicted bubbles would
            # dominate a mean of relative errors)
            "bubble_abs_error": (sum(abs(r.measured - r.predicted) for r in bubbles) /
                                 sum(r.measured for r in bubbles)) if bubbles else None,
            "bubble_measured_s": sum(r.measured for r in bubbles), "bubble_predicted_s":
                sum(r.predicted for r in bubbles), "metrics": run.metrics}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="fxp-bench-") as tmpdir:
        tmp = Path(tmpdir)
        cal = tmp / "cal.json"
        planner("calibrate", str(ROOT / "examples" / "gpt.py"), *[f"--model-arg={k}={v}" for k, v in GPT.items()],
                "--batch", "1", "--measure", "-o", str(cal), "--target-out", str(tmp / "local-cpu.yaml"))
        for phase in ("before", "after"):
            if phase == "after":
                planner("calibrate", "--from-run", str(tmp / "1f1b-metrics.json"), "--plan",
                        str(tmp / "1f1b.json"), "-o", str(cal))
            for case in CASES:
                r = measure(plan(case, tmp, cal), args.steps, fill=False)
                if case == "1f1b" and phase == "before":
                    save_metrics(r["metrics"], tmp / "1f1b-metrics.json")
                rows.append({"phase": phase, "case": case, "fill": False, **r})
        rows.append({"phase": "after", "case": "1f1b", "fill": True,
                     **measure(plan("1f1b", tmp, cal, fill=True), args.steps, fill=True)})
        overhead = load_calibration(cal).action_overhead_s
    print(f"{'phase':<7} {'case':<12} {'fill':<5} {'predicted':>10} {'measured':>10} {'iter err':>9} "
          f"{'stage |err|':>11} {'bubbles pred/meas':>18} {'bubble err':>10}")
    for r in rows:
        b = "-" if r["bubble_abs_error"] is None else f"{r['bubble_abs_error']:.1%}"
        bb = f"{r['bubble_predicted_s'] * 1e3:.1f}/{r['bubble_measured_s'] * 1e3:.1f}ms"
        print(f"{r['phase']:<7} {r['case']:<12} {'yes' if r['fill'] else 'no':<5} "
              f"{r['iteration_predicted_s'] * 1e3:>8.2f}ms {r['iteration_measured_s'] * 1e3:>8.2f}ms "
              f"{r['iteration_error']:>+9.1%} {r['stage_mean_abs_error']:>11.1%} {bb:>18} {b:>10}")
    print(f"fitted per-action overhead: {overhead * 1e3:.3f} ms (from the 1F1B run; GPipe and interleaved out-of-sample)")
    if args.json:
        Path(args.json).write_text(json.dumps([{k: v for k, v in r.items() if k != "metrics"} for r in rows], indent=1))


if __name__ == "__main__":
    main()
