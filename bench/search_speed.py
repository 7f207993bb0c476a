"""Planning speed: 1T GPT on 3072 A100s (B = 3072) and 175B on 1024 (B = 1536).

    python bench/search_speed.py [--json out.json]

Prints the search time (tracing excluded, reported apart), configurations considered, and the choice.
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
from planner.search import search  # noqa: E402
from costmodels.hardware import Hardware  # noqa: E402
from targets.registry import get_target  # noqa: E402

CASES = [("1t", 3072, 3072), ("175b", 1024, 1536)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    for preset, n, B in CASES:
        t0 = time.perf_counter()
        prof, _ = analyze(ROOT / "examples" / "gpt.py", {"preset": preset})
        t1 = time.perf_counter()
        ev = Evaluator(units=prof.units, hw=Hardware(target=get_target("a100-80gb")), global_batch=B, n_gpus=n,
                       tokens_per_sample=prof.tokens_per_sample)
        r = search(ev)
        t2 = time.perf_counter()
        rows.append({"model": preset, "gpus": n, "batch": B, "trace_s": t1 - t0, "search_s": t2 - t1,
                     "considered": r.evaluated, "priced": r.evaluated - sum(r.rejected.values()),
                     "rejected": r.rejected, "chosen": str(r.best.config), "tflops_per_gpu": r.best.tflops_per_gpu})
        print(f"{preset} on {n} GPUs, B={B}: search {t2 - t1:.2f}s (trace {t1 - t0:.1f}s apart), "
              f"{r.evaluated} configurations considered, {rows[-1]['priced']} priced; chosen {r.best.config} "
              f"-> {r.best.tflops_per_gpu:.1f} TFLOP/s/GPU", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
