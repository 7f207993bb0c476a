"""Two processes on one GPU, as a fill job shares a pipeline stage's GPU: what the fill job gets while the main
job waits in a bubble, and what the main job waits when its bubble ends with the fill job on the GPU.

    python bench/cuda_colocate.py [--json out.json] [--seconds 1.5] [--mps] [--runner-only]

In a bubble the main job's process waits in a receive: NCCL's receive kernel spins on the GPU until the previous
stage's activations arrive. Here that is `torch.cuda._sleep`, one block spinning for the whole measurement
("recv"); "idle" is a main process that holds its CUDA context and launches nothing (a receive that waits on the
host). Without MPS two processes' contexts time-slice the GPU; `--mps` starts MPS's control daemon (as FreeRide
runs its side tasks) and measures again, the kernels of both then sharing the SMs.

Measured, each for `--seconds`, with the fill job a GEMM loop that synchronizes every k products (a fill unit
ends with a synchronize in planner/runtime/fill_task.py), at a BERT-base-inference size (batch 8 x 128 tokens,
768 -> 3072: ~22 us a product on an H100) and a large one (8192^3, ~1.6 ms):
- fill: its TFLOP/s alone, beside "recv" and beside "idle", and the share (beside / alone);
- slice_ms: the GPU time each synchronize of the fill hands the waiting receive, if the share is
  w / (w + slice) for w the fill's work between synchronizes (k products' time alone);
- runner: the fill runtime's own task (planner/runtime/fill_task.py UnitRunner: BERT-base inference, batch 8,
  sequence 128, PipeFill's fill job, or with `--runner-job resnet18` ResNet18 training at batch 64, FreeRide's side task; in bf16 as a bf16 plan runs it; fp32 before 2026-11-27) stepping its units, each ending with its synchronize: the median seconds of
  each unit alone and beside "recv", against planner/fill/physics.py's shared_unit_s of the alone times; and again
  as the runtime runs them time-sliced, short units (physics.batched) in batches with one synchronize each
  (`runner_time_sliced_batched`), against runtime_unit_s;
- main_end: the main job's bubble end: it spins 5 ms (its receive) then runs a 2048^3 product and synchronizes;
  the extra time of that cycle beside the fill loop over alone (how long the main job waits for the fill).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SIZES = {"bert_b8": (8 * 128, 768, 3072), "large": (8192, 8192, 8192)}  # (m, k, n) of one product


def _cycles_per_ms() -> float:
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    torch.cuda._sleep(1_000_000)
    ev[0].record()
    torch.cuda._sleep(20_000_000)
    ev[1].record()
    torch.cuda.synchronize()
    return 20_000_000 / ev[0].elapsed_time(ev[1])


def fill(size: str, k: int, seconds: float, start, out) -> None:
    m, kk, n = SIZES[size]
    a = torch.randn(m, kk, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(kk, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(20):
        a @ b
    torch.cuda.synchronize()
    start.wait()
    t0 = time.perf_counter()
    done = 0
    while time.perf_counter() - t0 < seconds:
        for _ in range(k):
            a @ b
        torch.cuda.synchronize()
        done += k
    out.put(("fill", 2.0 * m * kk * n * done / (time.perf_counter() - t0) / 1e12))


def recv(seconds: float, start, out) -> None:
    """A receive waiting the whole time: one spinning kernel."""
    cycles = int(_cycles_per_ms() * (seconds + 1.0) * 1e3)
    start.wait()
    torch.cuda._sleep(cycles)
    torch.cuda.synchronize()
    out.put(("recv", None))


def idle(seconds: float, start, out) -> None:
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    start.wait()
    time.sleep(seconds)
    out.put(("idle", None))


def main_end(seconds: float, start, out) -> None:
    """Bubble ends: a 5 ms receive, then the main job's next product, synchronized; seconds per cycle."""
    cycles = int(_cycles_per_ms() * 5)
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    for _ in range(20):
        a @ a
    torch.cuda.synchronize()
    start.wait()
    per = []
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        t = time.perf_counter()
        torch.cuda._sleep(cycles)
        a @ a
        torch.cuda.synchronize()
        per.append(time.perf_counter() - t)
    out.put(("main_end", statistics.median(per)))


RUNNER_JOBS = {"bert": ("bert.py", {"preset": "base", "seq": 128}, "infer", 8),
               "resnet18": ("vision.py", {"arch": "resnet18"}, "train", 64)}
"""The runner's fill job: BERT-base inference at batch 8 (PipeFill's), or ResNet18 training at batch 64 (FreeRide's),
in bf16."""


def runner(batched: bool, job: str, seconds: float, start, out) -> None:
    """`batched`: as the runtime runs units on a time-sliced GPU, runs of short units (physics.batched, by their
    times alone, taken before the start) back to back within BATCH_WORK_S, one synchronize a batch
    (fill_task._timed_steps), each unit timed by CUDA events."""
    from planner.fill.physics import BATCH_WORK_S, batched as is_batched
    from planner.plan import FillJob
    from planner.runtime.fill_executor import TaskOptions
    from planner.runtime.fill_task import UnitRunner, _timed_steps

    model, margs, kind, batch = RUNNER_JOBS[job]
    fill_job = FillJob(name=job, model_file=str(ROOT / "examples" / model), model_sha256="", model_args=margs,
                       kind=kind, batch_size=batch, config="plain", units=[], unit_time_s=[], resident=True)
    r = UnitRunner(fill_job, TaskOptions(device="cuda:0", interface="iterative", iterations=None, precision="bf16"))
    r.to_device()
    n = len(r.linearized)
    for _ in range(3 * n):
        r.step()
    alone = r.profile(3)
    start.wait()
    times: dict[int, list[float]] = {}
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        k, t = r.pos % n, time.perf_counter()
        m = work = 0
        while batched and m < n and is_batched(alone[(k + m) % n], "timeslice") and \
                work + alone[(k + m) % n] <= BATCH_WORK_S:
            work, m = work + alone[(k + m) % n], m + 1
        if m > 1:
            for rec in _timed_steps(r, m)[1]:
                times.setdefault(rec[1] % n, []).append(rec[5] - rec[4])
        else:
            r.step()
            times.setdefault(k, []).append(time.perf_counter() - t)
    out.put(("unit_s", [statistics.median(times.get(k, [float("nan")])) for k in range(n)]))


def runner_rows(seconds: float, sharing: str, batched: bool = False, job: str = "bert") -> dict:
    from planner.fill.physics import runtime_unit_s, shared_unit_s

    alone = _run([(runner, (batched, job))], seconds)["unit_s"]
    beside = _run([(runner, (batched, job)), (recv, ())], seconds)["unit_s"]
    predicted = [(runtime_unit_s if batched else shared_unit_s)(a, sharing) for a in alone]
    res = {"job": job, "units": len(alone), "batched": batched, "alone_ms": [a * 1e3 for a in alone],
           "beside_recv_ms": [b * 1e3 for b in beside],
           "iteration_alone_ms": sum(alone) * 1e3, "iteration_beside_recv_ms": sum(beside) * 1e3,
           "iteration_predicted_ms": sum(predicted) * 1e3, "sharing": sharing,
           "measured_over_predicted": sum(beside) / sum(predicted)}
    print("runner", {k: v if isinstance(v, str) else round(v, 3) for k, v in res.items() if not isinstance(v, list)},
          flush=True)
    return res


def _run(targets: list, seconds: float) -> dict:
    ctx = mp.get_context("spawn")
    start, out = ctx.Barrier(len(targets)), ctx.Queue()
    procs = [ctx.Process(target=f, args=(*args, seconds, start, out)) for f, args in targets]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=seconds + 120) for _ in procs)
    for p in procs:
        p.join()
    return got


def measure(seconds: float, cases: list[tuple[str, int]], beside: tuple) -> dict:
    res = {}
    for size, k in cases:
        m, kk, n = SIZES[size]
        row = {"alone_tflops": _run([(fill, (size, k))], seconds)["fill"]}
        work_ms = k * 2.0 * m * kk * n / (row["alone_tflops"] * 1e12) * 1e3
        for other in beside:
            got = _run([(fill, (size, k)), (other, ())], seconds)["fill"]
            share, name = got / row["alone_tflops"], other.__name__
            row[f"beside_{name}_tflops"], row[f"share_beside_{name}"] = got, share
            row[f"slice_ms_beside_{name}"] = work_ms * (1 / share - 1)
        res[f"{size}_k{k}"] = row
        print(size, k, {key: round(v, 3) for key, v in row.items()}, flush=True)
    alone = _run([(main_end, ())], seconds)["main_end"]
    res["main_end_alone_ms"] = alone * 1e3
    for size in SIZES:
        res[f"main_end_extra_ms_beside_{size}"] = (_run([(main_end, ()), (fill, (size, 10))], seconds)["main_end"]
                                                   - alone) * 1e3
    print({key: round(v, 3) for key, v in res.items() if key.startswith("main_end")}, flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--seconds", type=float, default=1.5)
    ap.add_argument("--mps", action="store_true", help="also measure under MPS (starts nvidia-cuda-mps-control)")
    ap.add_argument("--runner-only", action="store_true", help="only the fill task's own units (no GEMM loops)")
    ap.add_argument("--runner-job", choices=sorted(RUNNER_JOBS), default="bert")
    args = ap.parse_args()
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "seconds": args.seconds}
    cases = [("bert_b8", 1), ("bert_b8", 10), ("bert_b8", 100), ("large", 1), ("large", 10)]
    result["runner_time_sliced"] = runner_rows(args.seconds, "timeslice", job=args.runner_job)
    result["runner_time_sliced_batched"] = runner_rows(args.seconds, "timeslice", batched=True, job=args.runner_job)
    if not args.runner_only:
        result["time_sliced"] = measure(args.seconds, cases, (recv, idle))
    if args.mps:
        started = subprocess.run(["nvidia-cuda-mps-control", "-d"], capture_output=True, text=True)
        if started.returncode:
            result["mps"] = f"nvidia-cuda-mps-control -d failed: {started.stderr.strip() or started.stdout.strip()}"
        else:
            try:
                print("under MPS", flush=True)
                result["runner_mps"] = runner_rows(args.seconds, "mps", job=args.runner_job)
                if not args.runner_only:
                    result["mps"] = measure(args.seconds, cases[:2] + cases[3:4], (recv,))
            except Exception as exc:  # noqa: BLE001 - record what MPS did here
                result["mps"] = f"failed under MPS: {exc!r}"
            finally:
                subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", text=True)
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
