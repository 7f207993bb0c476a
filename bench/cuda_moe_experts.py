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
- grouped (bf16): the six products as torch._grouped_mm runs them for torchtitan's MoE (one call per product for the
  16 experts: (n x 16, h) by (16, h, 2f) with per-expert offsets, the input gradients likewise, the weight gradients
  grouped over the token dimension), captured in a CUDA graph;
- predicted: `Hardware.matmul_rate` of each product (planner's GEMM model, bf16 / fp8 on the GPU's target: h100-sxm,
  h200) summed, and the launches it charges (`Efficiency.launch_s` per product).

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


def _grouped_operands(n: int) -> list:
    """The six products of 16 experts with n tokens each as torch._grouped_mm takes them (offsets: each expert's
    end row; the weight gradients group the token dimension, their first operand transposed)."""
    offs = torch.arange(1, EXPERTS + 1, device="cuda", dtype=torch.int32) * n
    ops = []
    for i, (m, k, nn) in enumerate(shapes(n)):
        if i < 4:  # tokens (16 n, k) by each expert's (k, nn)
            a = torch.randn(EXPERTS * m, k, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(EXPERTS, nn, k, device="cuda", dtype=torch.bfloat16).transpose(-2, -1)
        else:  # dW: (m, 16 k) by (16 k, nn), k = n tokens of each expert
            a = torch.randn(EXPERTS * k, m, device="cuda", dtype=torch.bfloat16).t()
            b = torch.randn(EXPERTS * k, nn, device="cuda", dtype=torch.bfloat16)
        ops.append((a, b))
    return [(a, b, offs) for a, b in ops]


def _graph_time(fn) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm the libraries' workspaces outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return _time(graph.replay)


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
    replay = _graph_time(lambda: _layer(ops, fp8))
    grouped, error = None, None
    if not fp8:
        try:
            gops = _grouped_operands(n)
            grouped = _graph_time(lambda: [torch._grouped_mm(a, b, offs=o) for a, b, o in gops])
        except RuntimeError as e:  # (a layout this torch's grouped GEMM refuses: recorded, the rest still runs)
            error = str(e).splitlines()[0]
    prec = "fp8" if fp8 else "bf16"
    flops = [2.0 * m * k * nn for m, k, nn in shapes(n)]
    predicted = EXPERTS * sum(f / hw.matmul_rate(f, prec) for f in flops)
    one_kernel = sum(EXPERTS * f / hw.matmul_rate(EXPERTS * f, prec) for f in flops)  # (Efficiency.grouped_mm's)
    launches = EXPERTS * len(flops) * hw.eff.launch_s
    total = EXPERTS * sum(flops)
    return {"tokens_per_expert": n, "precision": prec, "eager_ms": eager * 1e3, "graph_ms": replay * 1e3,
            "predicted_gemm_ms": predicted * 1e3, "predicted_one_kernel_ms": one_kernel * 1e3, "predicted_launch_ms": launches * 1e3,
            "grouped_mm_ms": grouped and grouped * 1e3, "grouped_mm_tflops": grouped and total / grouped / 1e12,
            "grouped_mm_error": error,
            "graph_tflops": total / replay / 1e12, "predicted_tflops": total / predicted / 1e12,
            "measured_over_predicted": replay / (predicted + launches)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    name = torch.cuda.get_device_name(0)
    hw = Hardware(target=get_target("h200" if "H200" in name else "h100-sxm"))
    rows = []
    for n in (256, 2048, 8192):
        for fp8 in (False, True):
            rows.append(measure(n, fp8, hw))
            print(json.dumps(rows[-1]), flush=True)
    result = {"device": name, "target": hw.name, "torch": torch.__version__, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
