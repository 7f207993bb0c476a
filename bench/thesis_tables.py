"""Predicted TFLOP/s per GPU for the thesis' Table 4.1 and Table 4.2 (PTD-P rows) against published.

    python bench/thesis_tables.py [--json out.json]

For each row the published configuration (t, p, d, full recomputation, interleaved schedule when
p > 1; microbatch 1 for Table 4.2) is priced, and the free search's choice is shown beside it.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from passes.pipeline import analyze  # noqa: E402
from planner.evaluate import Evaluator  # noqa: E402
from planner.search import Pins, search  # noqa: E402
from costmodels.hardware import Hardware  # noqa: E402
from targets.registry import get_target  # noqa: E402

# (preset, n GPUs, global batch, t, p, microbatch or None, published TFLOP/s per GPU)
TABLE_4_1 = [
    ("1.7b", 32, 512, 1, 1, None, 137), ("3.6b", 64, 512, 2, 1, None, 138),
    ("7.5b", 128, 512, 4, 1, None, 142), ("18b", 256, 1024, 8, 1, None, 135),
    ("39b", 512, 1536, 8, 2, None, 138), ("76b", 1024, 1792, 8, 4, None, 140),
    ("145b", 1536, 2304, 8, 8, None, 148), ("310b", 1920, 2160, 8, 16, None, 155),
    ("530b", 2520, 2520, 8, 35, None, 163), ("1t", 3072, 3072, 8, 64, None, 163),
]
TABLE_4_2 = [
    ("175b", 384, 1536, 8, 12, 1, 153), ("175b", 768, 1536, 8, 12, 1, 149), ("175b", 1536, 1536, 8, 12, 1, 141),
    ("530b", 560, 2240, 8, 35, 1, 171), ("530b", 1120, 2240, 8, 35, 1, 167), ("530b", 2240, 2240, 8, 35, 1, 159),
]


def published_pins(t: int, p: int, n: int, b: int | None) -> Pins:
    return Pins(tp=t, pp=p, dp=n // (t * p), b=b, recompute="full", sp=False, cp=1, schedule="interleaved" if p > 1 else None)


def run_row(row, profiles: dict) -> dict:
    preset, n, B, t, p, b, published = row
    if preset not in profiles:
        profiles[preset] = analyze(ROOT / "examples" / "gpt.py", {"preset": preset})[0]
    ev = Evaluator(units=profiles[preset].units, hw=Hardware(target=get_target("a100-80gb")), global_batch=B, n_gpus=n)
    pinned = search(ev, published_pins(t, p, n, b), simulate_top=1).best
    chosen = search(ev, simulate_top=1).best
    return {"model": preset, "gpus": n, "batch": B, "published_tflops": published,
            "predicted_tflops": pinned.tflops_per_gpu, "error": pinned.tflops_per_gpu / published - 1,
            "published_config": str(pinned.config), "chosen_config": str(chosen.config),
            "chosen_tflops": chosen.tflops_per_gpu}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", help="write the rows as JSON here")
    args = ap.parse_args()
    profiles: dict = {}
    rows = []
    start = time.perf_counter()
    print(f"{'model':>6} {'GPUs':>5} {'B':>5} {'published':>9} {'predicted':>9} {'error':>7}  "
          f"{'chosen':>7}  configuration priced / chosen")
    for table, data in (("4.1", TABLE_4_1), ("4.2", TABLE_4_2)):
        for row in data:
            r = run_row(row, profiles) | {"table": table}
            rows.append(r)
            print(f"{r['model']:>6} {r['gpus']:>5} {r['batch']:>5} {r['published_tflops']:>9.0f} "
                  f"{r['predicted_tflops']:>9.1f} {r['error']:>+7.1%}  {r['chosen_tflops']:>7.1f}  "
                  f"{r['published_config']}  /  {r['chosen_config']}", flush=True)
    worst = max(abs(r["error"]) for r in rows)
    print(f"worst error {worst:.1%}; mean |error| {sum(abs(r['error']) for r in rows) / len(rows):.1%}; "
          f"{time.perf_counter() - start:.0f}s")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
