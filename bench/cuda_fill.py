"""The fill mechanisms' CUDA paths, timed on the GPU at hand (prints figures; `--json` writes them).

    python bench/cuda_fill.py [--json out.json]

- Main-job optimizer offload (planner/runtime/optim.py GradSync.offload / restore, PipeFill 4.2): Adam state of a
  ~1 GB model to pinned host memory on a side stream and back; GB/s each way, and how much of the copy a
  concurrent matmul loop on the default stream hid.
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

from planner.runtime.fill_executor import TaskSpec  # noqa: E402
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
    out = {}
    for busy in (False, True):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        moved = sync.offload(1 << 40)
        if busy:  # the main job's forward passes on the default stream meanwhile
            for _ in range(20):
                a @ a
        sync._stream.synchronize()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        sync.restore()
        sync._stream.synchronize()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        out["with_matmuls" if busy else "alone"] = {"bytes": moved, "d2h_s": t1 - t0, "h2d_s": t2 - t1,
                                                    "d2h_GBps": moved / (t1 - t0) / 1e9,
                                                    "h2d_GBps": moved / (t2 - t1) / 1e9}
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        a @ a
    torch.cuda.synchronize()
    out["matmuls_alone_s"] = time.perf_counter() - t0
    return out


def streaming() -> dict:
    runner = UnitRunner(TaskSpec(job="mlp", model_file=str(ROOT / "examples" / "mlp.py"), model_sha256="",
                                 model_args={"features": 4096, "width": 4096, "depth": 8}, kind="infer",
                                 batch_size=4096, units=(), device="cuda:0", interface="iterative", iterations=None,
                                 resident=False, load_groups=((0, 5), (5, 10))))
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
    for name, r in out["offload"].items():
        if isinstance(r, dict):
            print(f"offload ({name}): {r['bytes'] / 1e6:.0f} MB, D2H {r['d2h_GBps']:.1f} GB/s, H2D {r['h2d_GBps']:.1f} GB/s")
    print(f"20 bf16 8192^3 matmuls alone: {out['offload']['matmuls_alone_s'] * 1e3:.1f} ms")
    for ld in out["streaming"]["loads"]:
        print(f"streamed group {ld['group']}: {ld['bytes'] / 1e6:.0f} MB, prefetched {ld['prefetched']}, "
              f"transfer {(ld['end'] - ld['start']) * 1e3:.2f} ms, overlap with compute {ld['overlap_s'] * 1e3:.2f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
