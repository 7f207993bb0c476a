"""A rank's experts of an MoE layer on the GPU at hand, against what the planner prices for the same products.

    python bench/cuda_moe_experts.py [--json out.json]

Qwen3-30B-A3B (hidden 2048, expert FFN 768, SwiGLU, 128 experts, top 8) at EP 8: 16 experts on a rank, each
receiving tokens x 8 x 8 / 128 assignments when the router is balanced (2048 at 4096 tokens a microbatch, the H100
row of bench/reference_runs_2026.json; 8192 at 16384, the B200 row). One expert's forward and backward is six
products: fc1 (n, h, 2f), fc2 (n, f, h), their input gradients (n, h, f), (n, 2f, h) and weight gradients
(f, n, h), (h, n, 2f). Timed for the 16 experts in a loop, as Transformer Engine's GroupedLinear issues them one
cuBLAS call per expert:

- eager: wall time of the loop, the host issuing every call (a host-bound layer shows here);
- graph: the same loop captured in a CUDA graph and replayed (the GPU's time alone);
- predicted: `Hardware.matmul_rate` of each product (planner's GEMM model, bf16 / fp8 on h100-sxm) summed,
  and the launches it charges (`Efficiency.launch_s` per product).

bf16 through torch.mm; fp8 through torch._scaled_mm with per-tensor scales (the products alone: the casts
Transformer Engine adds are not in it).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from costmodels.hardware import Hardware  # noqa: E402
from targets.registry import get_target  # noqa: E402

H, F, EXPERTS = 2048, 768, 16


def shapes(n: int) -> list[tuple[int, int, int]]:
    return [(n, H, 2 * F), (n, F, H), (n, H, F), (n, 2 * F, H), (F, n, H), (H, n, 2 * F)]


def _operands(n: int, fp8: bool) -> list:
    ops = []
    for m, k, nn in shapes(n):
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(nn, k, device="cuda", dtype=torch.bfloat16)
        if fp8:  # _scaled_mm takes a row-major and b column-major
            a, b = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
        ops.append((a, b.t(), torch.empty(m, nn, device="cuda", dtype=torch.bfloat16)))
    return [ops for _ in range(EXPERTS)]


def _layer(ops: list, fp8: bool) -> None:
    one = torch.ones((), device="cuda")
    for expert in ops:
        for a, b, out in expert:
            if fp8:
                torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
            else:
                torch.mm(a, b, out=out)


def _time(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def measure(n: int, fp8: bool, hw: Hardware) -> dict:
    ops = _operands(n, fp8)
    eager = _time(lambda: _layer(ops, fp8))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _layer(ops, fp8)  # warm cuBLAS's workspace outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _layer(ops, fp8)
    replay = _time(graph.replay)
    prec = "fp8" if fp8 else "bf16"
    flops = [2.0 * m * k * nn for m, k, nn in shapes(n)]
    predicted = EXPERTS * sum(f / hw.matmul_rate(f, prec) for f in flops)
    launches = EXPERTS * len(flops) * hw.eff.launch_s
    total = EXPERTS * sum(flops)
    return {"tokens_per_expert": n, "precision": prec, "eager_ms": eager * 1e3, "graph_ms": replay * 1e3,
            "predicted_gemm_ms": predicted * 1e3, "predicted_launch_ms": launches * 1e3,
            "graph_tflops": total / replay / 1e12, "predicted_tflops": total / predicted / 1e12,
            "measured_over_predicted": replay / (predicted + launches)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    hw = Hardware(target=get_target("h100-sxm"))
    rows = []
    for n in (256, 2048, 8192):
        for fp8 in (False, True):
            rows.append(measure(n, fp8, hw))
            print(json.dumps(rows[-1]), flush=True)
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
