"""What eager PyTorch's memory-bound kernels reach on this GPU, by kind and size, and what the host spends a launch:
the constants a fill job (eager PyTorch, op by op, in the fill runtime) is priced with.

    python bench/cuda_eager_kernels.py [--json out.json]

Each kernel runs on tensors of 4 to 256 MB in bf16 and fp32, timed by CUDA events (median of 20 after 5
warm-ups); its bandwidth is the bytes the planner counts for it (passes/costs.py: every input read once, the output
written once) over its time, against the GPU's HBM bandwidth (targets: `gpu.hbm_bw`). Kinds: a binary add, GELU,
ReLU, LayerNorm over rows of 768 / 4096, softmax over rows of 128 / 2048, training BatchNorm (NCHW and
channels-last), and the layout copies of attention heads (a permuted q of (b, s, 3, h, d) made contiguous, a
(b, h, s, d) context transposed and made contiguous). Host: microseconds a launch costs the host with nothing for the
GPU to do (1-element tensors), for an add under no_grad, a Linear module's forward under autocast with autograd, and
that forward plus its backward.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

MB = 1 << 20


def timed(fn, reps: int = 20) -> float:
    for _ in range(5):
        fn()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2 * reps)]
    for i in range(reps):
        ev[2 * i].record()
        fn()
        ev[2 * i + 1].record()
    torch.cuda.synchronize()
    return statistics.median(ev[2 * i].elapsed_time(ev[2 * i + 1]) for i in range(reps)) / 1e3


def kernels(dtype: torch.dtype) -> list[tuple[str, int, float]]:
    """(kind, bytes of its output, seconds) over sizes."""
    es = torch.tensor([], dtype=dtype).element_size()
    rows = []
    for mb in (4, 16, 64, 256):
        n = mb * MB // es
        a, b = torch.randn(n, device="cuda", dtype=dtype), torch.randn(n, device="cuda", dtype=dtype)
        rows += [("add", 3 * n * es, timed(lambda: a + b)), ("gelu", 2 * n * es, timed(lambda: F.gelu(a))),
                 ("relu", 2 * n * es, timed(lambda: F.relu(a)))]
        for width in (768, 4096):
            x = a[: n // width * width].view(-1, width)
            ln = torch.nn.LayerNorm(width, device="cuda", dtype=dtype)
            rows.append((f"layer_norm_{width}", 2 * x.numel() * es, timed(lambda: ln(x))))
        for width in (128, 2048):
            x = a[: n // width * width].view(-1, width)
            rows.append((f"softmax_{width}", 2 * x.numel() * es, timed(lambda: torch.softmax(x, -1))))
        c = 64
        hw = max(int((n // (64 * c)) ** 0.5), 1)
        img = a[: 64 * c * hw * hw].view(64, c, hw, hw)
        bn = torch.nn.BatchNorm2d(c, device="cuda", dtype=dtype).train()
        last = img.contiguous(memory_format=torch.channels_last)
        rows += [("batch_norm_train_nchw", 2 * img.numel() * es, timed(lambda: bn(img))),
                 ("batch_norm_train_channels_last", 2 * img.numel() * es, timed(lambda: bn(last)))]
        d, h = 64, 12
        s = max(n // (3 * h * d * 8), 1)
        qkv = a[: 8 * s * 3 * h * d].view(8, s, 3, h, d)
        q = qkv.permute(2, 0, 3, 1, 4)[0]
        rows.append(("copy_permuted_heads", 2 * q.numel() * es, timed(lambda: q.contiguous())))
        ctx = a[: 8 * h * s * d].view(8, h, s, d)
        rows.append(("copy_transposed_context", 2 * ctx.numel() * es,
                     timed(lambda: ctx.transpose(1, 2).contiguous())))
    return rows


def host_per_launch() -> dict:
    x = torch.ones(1, device="cuda")
    lin = torch.nn.Linear(1, 1, device="cuda")
    out = {}

    def loop(fn, n: int = 2000) -> float:
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        host = (time.perf_counter() - t) / n
        torch.cuda.synchronize()
        return host

    with torch.no_grad():
        out["add_no_grad_s"] = loop(lambda: x + x)
        out["linear_no_grad_s"] = loop(lambda: lin(x))
    y = torch.ones(1, 1, device="cuda", requires_grad=True)

    def fwd():
        with torch.autocast("cuda", torch.bfloat16):
            return lin(y)

    out["linear_autocast_forward_s"] = loop(fwd)
    out["linear_autocast_forward_backward_s"] = loop(lambda: fwd().float().sum().backward())
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    a = ap.parse_args()
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    name = torch.cuda.get_device_name(0)
    try:
        from targets.registry import get_target

        bw = get_target("h200" if "H200" in name else "h100-sxm").gpu.hbm_bw
    except Exception:  # noqa: BLE001 - the datasheet figure if the planner is not importable
        bw = 4.8e12 if "H200" in name else 3.35e12
    result = {"device": name, "torch": torch.__version__, "hbm_bw": bw, "kernels": {}, "host": host_per_launch()}
    print("host", {k: round(v * 1e6, 2) for k, v in result["host"].items()}, "us", flush=True)
    for dtype in (torch.bfloat16, torch.float32):
        for kind, nbytes, s in kernels(dtype):
            key = f"{kind}/{str(dtype).split('.')[-1]}"
            result["kernels"].setdefault(key, []).append({"bytes": nbytes, "s": s, "of_hbm": nbytes / s / bw})
    for key, rows in result["kernels"].items():
        print(f"{key:44s}", " ".join(f"{r['bytes'] / MB:7.0f}MB {r['of_hbm']:.2f}" for r in rows), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
