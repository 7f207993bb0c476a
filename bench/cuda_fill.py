"""The fill mechanisms' CUDA paths, timed on the GPU at hand (prints figures; `--json` writes them).

    python bench/cuda_fill.py [--json out.json]

- Main-job optimizer offload (planner/runtime/optim.py GradSync.offload / restore, PipeFill 4.2): Adam state of a
  ~1 GB model to pinned host memory on a side stream and back; GB/s each way on the first call (which pins the
  host buffers), on a later one, and on one beside a matmul loop on the default stream; and the machine's own
  copy rates for the same bytes (one tensor, pinned and pageable) to read them against.
- PipeSwitch streaming (planner/runtime/fill_task.py Streamer): a fill job's weights loaded in two groups, the
  second's transfer overlapping the first group's compute; per-load seconds and overlap.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.plan import FillJob  # noqa: E402
from planner.runtime.fill_executor import TaskOptions  # noqa: E402
from planner.runtime.fill_task import UnitRunner  # noqa: E402
from planner.runtime.optim import GradSync  # noqa: E402


def offload() -> dict:
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(4)]).cuda()  # 67M params: Adam state 537 MB
    sync = GradSync(dict(net.named_parameters()), shared=(), dp_group=None, dp_size=1, dp_rank=0, zero=False,
                    overlap=False, optimizer="adam", lr=1e-3)
    net(torch.randn(8, 4096, device="cuda")).sum().backward()
    sync.step()  # Adam's state exists
    torch.cuda.synchronize()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    a @ a  # cuBLAS's handle and workspace before any timing (a cold first product took ~75 ms here)
    out = {}
    for name, busy in (("first", False), ("alone", False), ("with_matmuls", True)):  # the first call pins
        torch.cuda.synchronize()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        ev[0].record()
        t0 = time.perf_counter()
        moved = sync.offload(1 << 40)
        ev[1].record(sync._stream)  # the copies' end, on their side stream
        t_issued = time.perf_counter()
        if busy:  # the main job's forward passes on the default stream meanwhile
            for _ in range(20):
                a @ a
        ev[2].record()
        sync._stream.synchronize()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        sync.restore()
        sync._stream.synchronize()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        out[name] = {"bytes": moved, "d2h_s": t1 - t0, "h2d_s": t2 - t1, "d2h_GBps": moved / (t1 - t0) / 1e9,
                     "h2d_GBps": moved / (t2 - t1) / 1e9, "d2h_issue_s": t_issued - t0,
                     "d2h_copies_done_gpu_s": ev[0].elapsed_time(ev[1]) / 1e3,
                     "default_stream_done_gpu_s": ev[0].elapsed_time(ev[2]) / 1e3}
    out["raw_copies"] = raw_copies(537_001_984)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        a @ a
    torch.cuda.synchronize()
    out["matmuls_alone_s"] = time.perf_counter() - t0
    return out


def raw_copies(nbytes: int) -> dict:
    """This machine's own copy rates for the same bytes, one tensor, timed by events: the reference for the
    offload's (pinned and pageable host memory, each direction)."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {}
    for pinned in (True, False):
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        for name, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
            dst.copy_(src, non_blocking=pinned)
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            ev[0].record()
            dst.copy_(src, non_blocking=pinned)
            ev[1].record()
            torch.cuda.synchronize()
            out[f"{name}_{'pinned' if pinned else 'pageable'}_GBps"] = nbytes / ev[0].elapsed_time(ev[1]) / 1e6
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    torch.cuda.synchronize()
    ev[0].record()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        host.copy_(dev, non_blocking=True)
    ev[1].record(side)
    for _ in range(20):
        a @ a
    ev[2].record()
    torch.cuda.synchronize()
    out["d2h_pinned_beside_matmuls_GBps"] = nbytes / ev[0].elapsed_time(ev[1]) / 1e6
    out["matmuls_beside_d2h_s"] = ev[0].elapsed_time(ev[2]) / 1e3
    return out


def streaming() -> dict:
    job = FillJob(name="mlp", model_file=str(ROOT / "examples" / "mlp.py"), model_sha256="",
                  model_args={"features": 4096, "width": 4096, "depth": 8}, kind="infer", batch_size=4096,
                  config="plain", units=[], unit_time_s=[], resident=False, load_groups=[[0, 5], [5, 10]])
    runner = UnitRunner(job, TaskOptions(device="cuda:0", interface="iterative", iterations=None))
    runner.to_device()
    rounds = []
    for _ in range(3):  # one bubble each: load by groups, compute, leave
        while not runner.step():
            pass
        torch.cuda.synchronize()
        rounds.append(runner.progress()["loads"])
        runner.unload()
    return {"loads": rounds[-1], "rounds": len(rounds)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/cuda_fill.py needs a CUDA GPU")
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "offload": offload(),
           "streaming": streaming()}
    print("raw copies:", ", ".join(f"{k} {v:.1f}" for k, v in out["offload"]["raw_copies"].items()))
    for name, r in out["offload"].items():
        if isinstance(r, dict) and "bytes" in r:
            print(f"offload ({name}): {r['bytes'] / 1e6:.0f} MB, D2H {r['d2h_GBps']:.1f} GB/s, H2D {r['h2d_GBps']:.1f} GB/s")
    print(f"20 bf16 8192^3 matmuls alone: {out['offload']['matmuls_alone_s'] * 1e3:.1f} ms")
    for ld in out["streaming"]["loads"]:
        print(f"streamed group {ld['group']}: {ld['bytes'] / 1e6:.0f} MB, prefetched {ld['prefetched']}, "
              f"transfer {(ld['end'] - ld['start']) * 1e3:.2f} ms, overlap with compute {ld['overlap_s'] * 1e3:.2f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
