"""Where a fill job's GPU time goes, by kernel, against the planner's price of its parts: torch.profiler over one
iteration of the fill runtime's task (planner/runtime/fill_task.py UnitRunner, its units queued back to back, one
synchronize), the kernels' GPU time summed by kind (matrix products, attention, convolutions, normalization,
elementwise, reductions, copies) and the 25 longest kernels.

    python bench/cuda_fill_profile.py [--json out.json]

Jobs: BERT-base inference at batch 128 in bf16 (the PipeFill fill job at a batch where the GPU, not the host, bounds
it) and ResNet50 training at batch 64 in bf16 (autocast, channels-last): bench/cuda_fill_speed.py measured both
slower than priced (1.36x and 3.3x on an H200).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

JOBS = [("bert-base-infer-b128-bf16", "bert.py", {"preset": "base", "seq": 128}, "infer", 128),
        ("resnet50-train-b64-bf16", "vision.py", {"arch": "resnet50"}, "train", 64)]
KINDS = [("attention", r"flash|fmha|attention|sdpa"), ("gemm", r"gemm|cutlass|xmma|cublas|sm90_|sm80_|s16816|matmul"),
         ("conv", r"conv|implicit|winograd|dgrad|wgrad|fprop|cudnn"), ("norm", r"norm|batch_norm|bn_"),
         ("copy", r"copy|cat|transpose|permute|contiguous|memcpy|memset"),
         ("reduce", r"reduce|sum|mean|softmax|max"), ("elementwise", r"elementwise|vectorized|unrolled|pointwise")]


def kind_of(name: str) -> str:
    low = name.lower()
    return next((k for k, pat in KINDS if re.search(pat, low)), "other")


def profile(model: str, args: dict, kind: str, batch: int) -> dict:
    from planner.plan import FillJob
    from planner.runtime.fill_executor import TaskOptions
    from planner.runtime.fill_task import UnitRunner

    job = FillJob(name="j", model_file=str(ROOT / "examples" / model), model_sha256="", model_args=args, kind=kind,
                  batch_size=batch, config="plain", units=[], unit_time_s=[], resident=True)
    r = UnitRunner(job, TaskOptions(device="cuda:0", interface="iterative", iterations=None, precision="bf16"))
    r.to_device()
    n = len(r.linearized)
    for _ in range(3 * n):
        r.step()
    r._batch(r.iterations)  # the batch made, so the profile holds the units' own work
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile as prof

    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        t = time.perf_counter()
        for _ in range(n):
            r.step(sync=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    by_kind: dict[str, float] = defaultdict(float)
    kernels: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for e in p.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            us = e.device_time if hasattr(e, "device_time") else e.cuda_time
            by_kind[kind_of(e.name)] += us
            kernels[e.name][0] += us
            kernels[e.name][1] += 1
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:25]
    return {"wall_ms": wall * 1e3, "gpu_ms": sum(by_kind.values()) / 1e3, "launches": sum(c for _, c in kernels.values()),
            "by_kind_ms": {k: v / 1e3 for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            "top": [{"kernel": k[:120], "ms": v[0] / 1e3, "count": v[1], "kind": kind_of(k)} for k, v in top]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    a = ap.parse_args()
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "jobs": {}}
    for name, model, args, kind, batch in JOBS:
        try:
            got = profile(model, args, kind, batch)
        except Exception as exc:  # noqa: BLE001 - record and go on
            got = {"error": repr(exc)}
        result["jobs"][name] = got
        print(name, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in got.items() if k != "top"}, flush=True)
        for row in got.get("top", [])[:12]:
            print("   ", round(row["ms"], 3), row["count"], row["kind"], row["kernel"][:90], flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
