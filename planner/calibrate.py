"""Measure this machine and correct the cost models: `planner calibrate MODEL.py --measure`.

1. Micro-benchmarks of the local device (dense matmul FLOP/s, copy bandwidth) describe it as a
   target (on CPU: `local-cpu`, written as a target YAML any command accepts).
2. A short gloo (NCCL on CUDA) ping-pong between two local processes fits latency and bandwidth.
3. Every unit of the model is timed on the device; measured / predicted per unit kind, forward
   and backward apart, becomes the calibration's compute correction.
"""
from __future__ import annotations

import os
import socket
import statistics
import tempfile
import time
from pathlib import Path
from passes.errors import write_atomic
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml

from costmodels.calibration import Calibration, CommFit, UnitFactor
from costmodels.compute import unit_time
from costmodels.hardware import Hardware
from passes.pipeline import analyze
from planner.config import ParallelConfig
from passes.profile import measure_units
from targets.registry import load_target_yaml
from targets.specs import Target

__all__ = ["machine_target", "fit_comm", "calibrate"]

LOCAL_TARGET = "local-cpu"
PINGPONG_SIZES = (1 << 10, 1 << 16, 1 << 20, 1 << 23)


def _best_of(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def machine_target(path: str | Path, comm: CommFit | None = None, threads: int = 1) -> Target:
    """Describe this CPU as a target YAML (figures measured with `threads` threads, as each
    runtime rank uses) and load it back through the validated path."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
        flops = 2 * 1024**3 / _best_of(lambda: a @ b)
        x, y = torch.empty(1 << 25), torch.randn(1 << 25)  # 128 MiB each
        bw = 2 * x.numel() * 4 / _best_of(lambda: x.copy_(y))
    finally:
        torch.set_num_threads(old)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    link_bw, link_lat = (comm.bandwidth, comm.latency_s) if comm else (bw / 4, 20e-6)
    doc = {"schema_version": 1, "name": LOCAL_TARGET, "description": f"this machine's CPU ({threads} thread per rank)",
           "gpu": {"name": "local CPU", "peak_flops": {k: float(flops) for k in ("fp32", "bf16", "fp16")},
                   "hbm_bytes": int(ram), "hbm_bw": float(bw), "pcie_bw": float(bw)},
           "cluster": {"gpus_per_node": os.cpu_count() or 1, "nvlink_bw": float(link_bw),
                       "nvlink_latency_s": float(link_lat), "internode_bw": float(link_bw),
                       "internode_latency_s": float(link_lat)}}
    write_atomic(path, "# written by `planner calibrate`: measured, not datasheet, figures\n" + yaml.safe_dump(doc),
                 "target")
    return load_target_yaml(path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pingpong(rank: int, port: int, out: str, repeats: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    rows = []
    for size in PINGPONG_SIZES:
        buf = torch.zeros(size // 4)
        times = []
        for _ in range(repeats + 1):
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            times.append((time.perf_counter() - start) / 2)
        rows.append((size, statistics.median(times[1:])))
    if rank == 0:
        Path(out).write_text(repr(rows))
    dist.destroy_process_group()


def fit_comm(repeats: int = 10) -> CommFit:
    """Alpha-beta fit (least squares) of one-way gloo send time between two local processes."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "pingpong.txt")
        mp.start_processes(_pingpong, args=(_free_port(), out, repeats), nprocs=2, start_method="spawn")
        rows: list[tuple[int, float]] = eval(Path(out).read_text(), {})  # noqa: S307 - our own repr of numbers
    n = len(rows)
    mx = sum(s for s, _ in rows) / n
    my = sum(t for _, t in rows) / n
    slope = sum((s - mx) * (t - my) for s, t in rows) / sum((s - mx) ** 2 for s, _ in rows)
    return CommFit(backend="gloo", latency_s=max(my - slope * mx, 0.0), bandwidth=1 / max(slope, 1e-15))


def calibrate(model: str, kwargs: dict[str, Any], *, batch: int, target: Target, repeats: int = 5,
              comm: CommFit | None = None, progress=None) -> tuple[Calibration, list[dict[str, Any]]]:
    """Time every unit here and compare with `target`'s prediction (fp32 on CPU, bf16 on CUDA)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = "bf16" if device == "cuda" else "fp32"
    prof, _ = analyze(model, kwargs, dtype=dtype)
    old = torch.get_num_threads()
    torch.set_num_threads(1)  # as each runtime rank runs on CPU
    try:
        measured = measure_units(model, kwargs, batch, repeats=repeats, device=device, progress=progress)
    finally:
        torch.set_num_threads(old)
    rows, sums = [], {}
    from .engines import ENGINES

    hw = Hardware(target=target, attention=ENGINES["fxplanner"].attention)  # (as a plan for the runtime prices it)
    cfg = ParallelConfig(tp=1, pp=1, dp=1, b=batch, m=1, precision=dtype)
    for u, m in zip(prof.units, measured):
        pred = unit_time(u, hw, cfg)
        rows.append({"unit": u.name, "kind": u.kind, "pred_fwd_s": pred.fwd_s, "pred_bwd_s": pred.bwd_s,
                     "fwd_s": m.fwd_median_s, "bwd_s": m.bwd_median_s})
        acc = sums.setdefault(u.kind, [0.0, 0.0, 0.0, 0.0, 0])
        acc[0] += m.fwd_median_s
        acc[1] += pred.fwd_s
        acc[2] += m.bwd_median_s
        acc[3] += pred.bwd_s
        acc[4] += 1
    factors = {k: UnitFactor(fwd=a[0] / a[1], bwd=a[2] / a[3], units=a[4]) for k, a in sums.items()}
    cal = Calibration(target=target.name, device=device, dtype=dtype, model_file=str(model), batch=batch,
                      unit_factors=factors, comm=comm)
    return cal, rows
