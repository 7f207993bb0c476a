"""Fill predictions against what the seed papers measured on their own setups.

    python bench/paper_fill.py [--json out.json] [--ipc]

PipeFill section 6.1 (../shared/seeds/001_…, l.197-231): a 5B LLM trained on 16 V100-16GB, one per machine
(25 Gb/s between them), 16 pipeline stages, no tensor parallelism, microbatch 2 of 2048 tokens, 8 microbatches
per replica, GPipe, Adam; its Executor fills 68% of each bubble. Measured: bubble ratio 65%, 4.5 GB free in
the bubbles, main job 60 TFLOP/s while executing, main-job overhead < 2% at 68% filled, and 7.39 TFLOP/s per GPU
recovered (averaged over all GPUs and the run's wall-clock time) with the paper's full fill-job trace.

What we assume because the paper does not say it: the 5B model's shape (GPT, 24 layers, hidden 4096, 32 heads,
vocabulary 50257: 4.8B in the blocks + 0.2B embedding), fp16 mixed precision, the fill job (BERT-base inference,
sequence 128, batch 8-64: the issue's choice; the paper's 7.39 is for its trace mix, of which BERT inference is
one of the more favourable jobs, 001 l.223, 243). Nothing here is fitted to the paper's results: the fill's
compute is priced by the same cost models as the main job, the bubble costs are planner/fill/physics.py's
constants with their sources, and the margin is PipeFill's 68%.

The ratio printed is predicted / measured. `--ipc` measures the per-unit request/reply round trip of the fill
executor's pipes on this machine (planner/fill/physics.py: STEP_IPC_S).
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
from planner.fill.spec import FillJobSpec, FillSpec, Work  # noqa: E402
from planner.search import Pins  # noqa: E402

GB = 1e9
PIPEFILL = {"recovered_tflops_per_gpu": 7.39, "main_tflops_executing": 60.0, "bubble_ratio": 0.652,
            "free_bytes": 4.5 * GB, "main_overhead_below": 0.02}
"""PipeFill 6.1 measured (001 l.229, 231, 243); the bubble ratio is (p-1)/(m+p-1) = 15/23."""


def pipefill() -> dict:
    job = FillJobSpec(name="bert-base-infer", model=str(ROOT / "examples" / "bert.py"),
                      model_args={"preset": "base", "seq": 128}, kind="infer", batch_sizes=[8, 16, 32, 64],
                      work=Work(samples=10_000_000))
    plan, _ = make_plan(str(ROOT / "examples" / "gpt.py"), gpus=16, global_batch=16, target="v100-16gb",
                        gpus_per_node=1, model_args={"layers": 24, "hidden": 4096, "heads": 32, "seq": 2048},
                        pins=Pins(tp=1, pp=16, dp=1, b=2, schedule="gpipe", precision="fp16"),
                        fill=FillSpec(jobs=[job]))
    pr, fp = plan.predictions, plan.fill.predictions
    executing = pr.hardware_tflops_per_gpu / (1 - pr.bubble_fraction)
    free = sorted(b.free_bytes for b in plan.bubbles if b.duration_s > 0.5)
    rows = [
        ("bubble ratio", pr.bubble_fraction, PIPEFILL["bubble_ratio"]),
        ("main job TFLOP/s while executing", executing, PIPEFILL["main_tflops_executing"]),
        ("free GB in the long bubbles (median)", free[len(free) // 2] / GB, PIPEFILL["free_bytes"] / GB),
        ("recovered TFLOP/s per GPU at 68% of each bubble", fp.fill_tflops_per_gpu,
         PIPEFILL["recovered_tflops_per_gpu"]),
    ]
    job = plan.fill.jobs[0]
    return {"setup": f"{plan.config.to_config()} on 16 x v100-16gb; fill {job.name} "
                     f"({'resident' if job.resident else 'loaded per bubble'}), margin {plan.fill.safety_margin:.2f}",
            "rows": [{"figure": n, "predicted": p, "paper": m, "ratio": p / m} for n, p, m in rows],
            "main_overhead": "predicted 0 (no chunk may pass 68% of its bubble; the runtime kills one past the "
                             "grace period) against the paper's < 2%"}


def measure_ipc(n: int = 2000) -> float:
    """Seconds per request/reply of a unit between two processes over multiprocessing pipes."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    task_rx, to_task = ctx.Pipe(duplex=False)
    from_task, task_tx = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_echo, args=(task_rx, task_tx))
    proc.start()
    for _ in range(100):
        to_task.send(("step", 0, 1))
        from_task.recv()
    start = time.perf_counter()
    for i in range(n):
        to_task.send(("step", i, 1 << 30))
        from_task.recv()
    per = (time.perf_counter() - start) / n
    to_task.send(("stop",))
    proc.join()
    return per


def _echo(rx, tx) -> None:
    while (msg := rx.recv())[0] != "stop":
        tx.send(("step", msg[1], time.time(), time.time(), time.monotonic(), time.monotonic(), False))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--ipc", action="store_true", help="also measure the fill executor's per-unit round trip")
    args = ap.parse_args()
    out = {"pipefill_6_1": pipefill()}
    pf = out["pipefill_6_1"]
    print(f"PipeFill 6.1: {pf['setup']}")
    print(f"  {'figure':52s} {'predicted':>10s} {'paper':>8s} {'ratio':>6s}")
    for r in pf["rows"]:
        print(f"  {r['figure']:52s} {r['predicted']:10.3f} {r['paper']:8.3f} {r['ratio']:6.2f}")
    print(f"  main-job overhead: {pf['main_overhead']}")
    if args.ipc:
        out["ipc_s"] = measure_ipc()
        print(f"fill executor request/reply per unit: {out['ipc_s'] * 1e6:.1f} us")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
