"""FreeRide's I on one GPU: how much slower a pipeline stage's compute runs when a side task trains in its bubbles
as FreeRide's artifact runs one, with and without MPS.

    python bench/cuda_freeride_i.py [--json out.json] [--iterations 10] [--side resnet18]

FreeRide (../shared/seeds/000_..., Table 1) measured the main job 0.9% slower with each DNN side task (I), the same
for steps of 31 to 160 ms; fxplanner predicts 0 (no unit passes its bubble). This isolates what one GPU contributes:
a "stage" process alternates a compute phase (bf16 products with a GELU between, ~`--compute-ms`, synchronized) and
a bubble (the receive: one kernel spinning for `--bubble-ms`, as NCCL's receive does); at each bubble it tells the
side process the bubble's length. The side process runs FreeRide's loop (bench/paper_fill.py's constants, from
the artifact): it looks for a begun bubble every 10 ms, starts a training step only while the bubble's time left
exceeds its profiled step rounded up to 10 ms x 1.2, synchronizes each step, and sleeps 5 ms after it. Its model is
examples/vision.py (torchvision's layers) at batch 64 in fp32, FreeRide's side tasks. Four runs: the stage alone
and with the side task, time-sliced (no MPS) and under MPS (FreeRide's setting). Reported: the stage's compute
phase and iteration (median), their increase over alone, the side task's steps per bubble, and the GPU's SM clock
and temperature (NVML) at the end of each run.
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from cuda_colocate import _cycles_per_ms  # noqa: E402

POLL_S, LOOP_SLEEP_S, ROUND_S, FACTOR = 0.01, 0.005, 0.01, 1.2  # bench/paper_fill.py FR_* (FreeRide's artifact)


def stage(iterations: int, compute_ms: float, bubble_ms: float, conn, start, out) -> None:
    x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) * 0.01

    def layer(y):
        return torch.nn.functional.gelu(y @ w)

    for _ in range(50):
        y = layer(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(100):
        y = layer(x)
    torch.cuda.synchronize()
    k = max(1, round(compute_ms / ((time.perf_counter() - t) / 100 * 1e3)))
    spin = int(_cycles_per_ms() * bubble_ms)
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    clocks = _Sampler()
    start.wait()
    compute, whole, gpu, phases = [], [], [], []
    length = bubble_ms / 1e3  # what the side task is told: the spin's measured length after the warm-up (FreeRide
    warm: list[float] = []    # knows its bubbles' lengths from profiling the main job)
    for i in range(iterations + 2):
        t0 = time.perf_counter()
        ev[0].record()
        y = x
        for _ in range(k):
            y = layer(x)
        ev[1].record()
        torch.cuda.synchronize()
        t1, w1 = time.perf_counter(), time.time()
        if conn is not None and i >= 2:
            conn.send(("begin", length, w1))
        torch.cuda._sleep(spin)
        ev[2].record()
        torch.cuda.synchronize()
        t2, w2 = time.perf_counter(), time.time()
        if conn is not None and i >= 2:
            conn.send(("end",))
        if i < 2:
            warm.append(t2 - t1)
            length = min(warm)
        else:
            compute.append(t1 - t0)
            whole.append(time.perf_counter() - t0)
            gpu.append((ev[0].elapsed_time(ev[1]) / 1e3, ev[1].elapsed_time(ev[2]) / 1e3))
            phases.append((w1 - (t1 - t0), w1, w2))
    if conn is not None:
        conn.send(("stop",))
    out.put(("stage", {"products_per_phase": k, "bubble_told_s": length, "compute_s": statistics.median(compute),
                       "iteration_s": statistics.median(whole), "compute_all_s": compute,
                       "gpu_compute_s": statistics.median(g[0] for g in gpu),
                       "gpu_bubble_s": statistics.median(g[1] for g in gpu),
                       "bubble_all_s": [w2 - w1 for _, w1, w2 in phases], "phases_wall": phases,
                       "sm_mhz_compute": clocks.median(phases, 0), "sm_mhz_bubble": clocks.median(phases, 1),
                       "power_w_compute": clocks.median(phases, 0, "power"),
                       "power_w_bubble": clocks.median(phases, 1, "power")}))


class _Sampler:
    """The GPU's SM clock and power every 10 ms (NVML), on a thread; medians over the compute phases or bubbles."""

    def __init__(self) -> None:
        import threading

        self.rows: list[tuple[float, int, float]] = []
        try:
            import pynvml

            pynvml.nvmlInit()
            self.h, self.nv = pynvml.nvmlDeviceGetHandleByIndex(0), pynvml
        except Exception:  # noqa: BLE001 - no NVML: no clock figures
            return
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            self.rows.append((time.time(), self.nv.nvmlDeviceGetClockInfo(self.h, self.nv.NVML_CLOCK_SM),
                              self.nv.nvmlDeviceGetPowerUsage(self.h) / 1e3))
            time.sleep(0.01)

    def median(self, phases: list, which: int, what: str = "sm") -> float | None:
        col = 1 if what == "sm" else 2
        got = [r[col] for r in list(self.rows) for p in phases if p[which] <= r[0] < p[which + 1]]
        return statistics.median(got) if got else None


def side(arch: str, conn, start, out) -> None:
    from passes.load import load_model_file

    mf = load_model_file(ROOT / "examples" / "vision.py", {"arch": arch})
    model = mf.build("cuda")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    (x,), y = mf.call("sample_batch", 64, 0)
    x, y = x.cuda(), y.cuda()

    def step():
        opt.zero_grad(set_to_none=True)
        mf.module.loss_fn(model(x), y).backward()
        opt.step()
        torch.cuda.synchronize()

    for _ in range(5):
        step()
    times = []
    for _ in range(10):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    step_s = statistics.median(times)
    check_s = math.ceil(step_s / ROUND_S) * ROUND_S * FACTOR
    start.wait()
    steps, in_bubble, overrun, stamps = [], [], [], []
    while True:
        if not conn.poll(POLL_S):
            continue
        msg = conn.recv()
        if msg[0] == "stop":
            break
        if msg[0] != "begin":
            continue
        _, length, began = msg
        n = 0
        while length - (time.time() - began) > check_s and not conn.poll(0):
            t, w = time.perf_counter(), time.time()
            step()
            in_bubble.append(time.perf_counter() - t)
            stamps.append((w, time.time()))
            n += 1
            time.sleep(LOOP_SLEEP_S)
        overrun.append(time.time() - began - length)
        steps.append(n)
    out.put(("side", {"arch": arch, "step_alone_s": step_s, "check_s": check_s, "steps_per_bubble": steps,
                      "step_in_bubble_s": statistics.median(in_bubble) if in_bubble else None,
                      "last_step_end_past_bubble_s_max": max(overrun) if overrun else None, "step_stamps": stamps}))


def _nvml() -> dict:
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        return {"sm_clock_mhz": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
                "temperature_c": pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU),
                "power_w": pynvml.nvmlDeviceGetPowerUsage(h) / 1e3}
    except Exception as exc:  # noqa: BLE001 - a figure beside the measurement, not the measurement
        return {"nvml": repr(exc)}


def run(with_side: bool, args) -> dict:
    ctx = mp.get_context("spawn")
    start, out = ctx.Barrier(2 if with_side else 1), ctx.Queue()
    a, b = ctx.Pipe() if with_side else (None, None)
    procs = [ctx.Process(target=stage, args=(args.iterations, args.compute_ms, args.bubble_ms, a, start, out))]
    if with_side:
        procs.append(ctx.Process(target=side, args=(args.side, b, start, out)))
    for p in procs:
        p.start()
    got = dict(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    got["gpu_after"] = _nvml()
    s = got["stage"]
    if with_side:  # each step's end past the end of the bubble it ran in, measured (the stage's wall clock)
        ends = [p[2] for p in s["phases_wall"]]
        past = [e - min((b for b in ends if b >= a - 1e-3), default=e) for a, e in got["side"]["step_stamps"]]
        got["side"]["steps_past_bubble_end"] = sum(1 for x in past if x > 0)
        got["side"]["max_past_bubble_end_s"] = max(past) if past else None
    print({"side": args.side if with_side else None, **{k: round(v * (1e3 if k.endswith("_s") else 1), 2)
           for k, v in s.items() if isinstance(v, float)},
           **({k: v for k, v in got["side"].items() if k not in ("steps_per_bubble", "step_stamps")} if with_side
              else {})}, flush=True)
    return got


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--compute-ms", type=float, default=400.0)
    ap.add_argument("--bubble-ms", type=float, default=300.0)
    ap.add_argument("--side", default="resnet18")
    ap.add_argument("--mps-sides", default="resnet18,vgg19", help="side tasks to run under MPS, each against its "
                    "own run of the stage alone")
    args = ap.parse_args()
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "args": vars(args)}
    for mode in ("timeslice", "mps"):
        if mode == "mps":
            started = subprocess.run(["nvidia-cuda-mps-control", "-d"], capture_output=True, text=True)
            if started.returncode:
                result["mps"] = f"nvidia-cuda-mps-control -d failed: {started.stderr.strip()}"
                break
            time.sleep(1)
        try:
            for arch in (args.mps_sides.split(",") if mode == "mps" else [args.side]):
                args.side = arch
                alone, beside = run(False, args), run(True, args)
                sa, sb = alone["stage"], beside["stage"]
                key = f"{mode}_{arch}"
                result[key] = {"alone": alone, "with_side": beside,
                               "compute_increase": sb["compute_s"] / sa["compute_s"] - 1,
                               "gpu_compute_increase": sb["gpu_compute_s"] / sa["gpu_compute_s"] - 1,
                               "iteration_increase": sb["iteration_s"] / sa["iteration_s"] - 1}
                print(key, {k: round(v, 4) for k, v in result[key].items() if isinstance(v, float)}, flush=True)
        finally:
            if mode == "mps":
                subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", text=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
