"""A fill job's own speed on this GPU, run by the fill runtime (planner/runtime/fill_task.py UnitRunner), against the
planner's price of the same job on the same GPU (planner/fill/profiles.py profile_job): the check of "the fill
job's own efficiency at its own sizes" that the papers' V100 and RTX 6000 Ada figures cannot give us directly.

    python bench/cuda_fill_speed.py [--json out.json] [--target h200]

Jobs: BERT-base inference at sequence 128 (PipeFill's and PipeSwitch's fill job) at batch 8 and 32, and FreeRide's
side tasks (ResNet18, ResNet50, VGG19 training at batch 64), each in fp32 and in bf16 (the runtime runs a job in
the plan's precision: inference in the dtype, training under autocast). Measured per job: each linearized unit's
time with its own synchronize (UnitRunner.profile, the runtime's admission profile), and an iteration's units
queued back to back with one synchronize (the GPU's time, as a batch runs). torch's defaults otherwise: fp32
matrix products in full fp32, cuDNN's convolutions allowed TF32.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

JOBS = [("bert-base-infer-b8", "bert.py", {"preset": "base", "seq": 128}, "infer", 8),
        ("bert-base-infer-b32", "bert.py", {"preset": "base", "seq": 128}, "infer", 32),
        ("bert-base-infer-b128", "bert.py", {"preset": "base", "seq": 128}, "infer", 128),
        ("resnet18-train-b64", "vision.py", {"arch": "resnet18"}, "train", 64),
        ("resnet50-train-b64", "vision.py", {"arch": "resnet50"}, "train", 64),
        ("vgg19-train-b64", "vision.py", {"arch": "vgg19"}, "train", 64)]
TARGETS = {"H200": "h200", "H100": "h100-sxm", "B200": "b200"}


def measured(model: str, args: dict, kind: str, batch: int, precision: str, reps: int = 5) -> dict:
    from planner.plan import FillJob
    from planner.runtime.fill_executor import TaskOptions
    from planner.runtime.fill_task import UnitRunner

    job = FillJob(name="j", model_file=str(ROOT / "examples" / model), model_sha256="", model_args=args, kind=kind,
                  batch_size=batch, config="plain", units=[], unit_time_s=[], resident=True)
    r = UnitRunner(job, TaskOptions(device="cuda:0", interface="iterative", iterations=None, precision=precision))
    r.to_device()
    n = len(r.linearized)
    for _ in range(2 * n):
        r.step()
    units = r.profile(reps)
    whole = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            r.step(sync=False)
        torch.cuda.synchronize()
        whole.append(time.perf_counter() - t)
    whole.sort()
    host: list[list[float]] = [[] for _ in range(n)]  # the host's seconds to queue each unit, the GPU idle at its start
    for _ in range(reps):
        for _ in range(n):
            k = r.pos % n
            torch.cuda.synchronize()
            t = time.perf_counter()
            r.step(sync=False)
            host[k].append(time.perf_counter() - t)
    torch.cuda.synchronize()
    data = []
    for i in range(3):  # the host's work for a batch (the model file's sample_batch), inside the first unit
        t = time.perf_counter()
        r.mf.call("sample_batch", batch, i)
        data.append(time.perf_counter() - t)
    out = {"data_s": statistics.median(data), "units": n, "unit_s": units, "iteration_synced_s": sum(units), "iteration_one_sync_s": whole[len(whole) // 2],
           "unit_host_s": [statistics.median(h) for h in host], "unit_ops": _unit_ops(r),
           "peak_allocated_gb": torch.cuda.max_memory_allocated() / 1e9}
    del r
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return out


def _unit_ops(r) -> list[dict[str, int]]:
    """Per linearized unit, the forward's graph nodes that the generated code calls, by target (a leaf module by its
    class): what the host dispatches for the unit (a backward unit: its forward's nodes)."""
    from collections import Counter

    per_call = []
    for call in r.calls:
        sub = r.module.get_submodule(call.target)
        c: Counter = Counter()
        for node in sub.graph.nodes:
            if node.op == "call_module":
                c[type(sub.get_submodule(node.target)).__name__] += 1
            elif node.op in ("call_function", "call_method"):
                c[getattr(node.target, "__name__", str(node.target))] += 1
        per_call.append(dict(c))
    n = len(per_call)
    return [per_call[k] if k < n else per_call[2 * n - 1 - k] if k < 2 * n else {"optimizer": 1}
            for k in range(len(r.linearized))]


def predicted(model: str, args: dict, kind: str, batch: int, precision: str, target: str) -> dict:
    from planner.fill.profiles import profile_job
    from planner.fill.spec import FillJobSpec, Work
    from targets.registry import get_target
    from costmodels.hardware import Hardware

    job = FillJobSpec(name="j", model=str(ROOT / "examples" / model), model_args=args, kind=kind,
                      batch_sizes=[batch], work=Work(iterations=1))
    prof = next(p for p in profile_job(job, Hardware(target=get_target(target)), precision) if p.config == "plain")
    from passes.pipeline import analyze

    units, _ = analyze(str(ROOT / "examples" / model), args, dtype=precision)
    nodes = [len(u.nodes) for u in units.units]
    return {"iteration_s": prof.dedicated_s, "flops_per_iteration": prof.flops_per_iteration,
            "unit_s": [u.time_s for u in prof.units], "unit_nodes": nodes}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--target", help="the planner's target to price on (default: from the device's name)")
    args = ap.parse_args()
    name = torch.cuda.get_device_name(0)
    target = args.target or next((t for k, t in TARGETS.items() if k in name), "h100-sxm")
    result = {"device": name, "torch": torch.__version__, "target": target, "jobs": {}}
    for job, model, margs, kind, batch in JOBS:
        for precision in ("fp32", "bf16"):
            key = f"{job}-{precision}"
            row: dict = {}
            try:
                row["measured"] = measured(model, margs, kind, batch, precision)
            except Exception as exc:  # noqa: BLE001 - record and go on to the next job
                row["measured_error"] = repr(exc)
            try:
                row["predicted"] = predicted(model, margs, kind, batch, precision, target)
            except Exception as exc:  # noqa: BLE001
                row["predicted_error"] = repr(exc)
            if "measured" in row and "predicted" in row:
                m, p = row["measured"], row["predicted"]
                row["measured_tflops_one_sync"] = p["flops_per_iteration"] / m["iteration_one_sync_s"] / 1e12
                row["predicted_tflops"] = p["flops_per_iteration"] / p["iteration_s"] / 1e12
                row["measured_over_predicted_one_sync"] = m["iteration_one_sync_s"] / p["iteration_s"]
                row["measured_over_predicted_synced"] = m["iteration_synced_s"] / p["iteration_s"]
            result["jobs"][key] = row
            print(key, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
                        if not isinstance(v, dict)},
                  {k: round(v, 5) for k, v in row.get("measured", {}).items() if isinstance(v, float)},
                  round(row.get("predicted", {}).get("iteration_s", float("nan")), 5), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
