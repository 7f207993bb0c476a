"""Planning the mixture-of-experts models of 2026 for Megatron-Core: DeepSeek-V3 on 1024 H100 in FP8, Qwen3-235B-A22B
on 256 H100, Mixtral 8x7B on 64 H100 -- what `planner plan ... --engine megatron` takes, end to end (tracing, search,
simulation, the export of the launch), and what it chooses.

    python bench/moe_plans.py [--json out.json]

Global batches: DeepSeek-V3's pre-training batch reached 15360 sequences of 4096 tokens (its report, 4.2); 8192 here,
a multiple of every data-parallel degree the 1024 GPUs allow. The others: 2048 and 256 sequences.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.api import make_plan  # noqa: E402
from planner.search import Pins  # noqa: E402

CASES = [("hf_deepseek_v3.py", {}, 1024, 8192, "fp8"), ("hf_qwen3_moe.py", {"preset": "qwen3-235b-a22b"}, 256, 2048, ""),
         ("hf_mixtral.py", {}, 64, 256, "")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    for model, margs, n, batch, fp8 in CASES:
        t0 = time.perf_counter()
        plan, r = make_plan(str(ROOT / "examples" / model), gpus=n, global_batch=batch, target="h100-sxm",
                            model_args=margs, pins=Pins(engine="megatron", fp8="auto" if fp8 else ""),
                            plan_path="/tmp/moe-plan.json")
        wall = time.perf_counter() - t0
        p = plan.predictions
        rows.append({"model": model, **margs, "gpus": n, "batch": batch, "plan_s": wall, "search_s": plan.search.seconds,
                     "chosen": str(r.best.config), "ep": plan.config.ep, "iteration_s": p.iteration_s,
                     "tflops_per_gpu": p.tflops_per_gpu, "mfu": p.mfu})
        print(f"{model} {margs or ''} on {n} H100, B={batch}{' fp8' if fp8 else ''}: planned in {wall:.1f}s "
              f"(search {plan.search.seconds:.1f}s); chosen {r.best.config} -> {p.iteration_s:.2f} s/iteration, "
              f"{p.tflops_per_gpu:.0f} TFLOP/s/GPU, MFU {p.mfu:.1%}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
