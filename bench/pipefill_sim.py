"""PipeFill §6.1 reproduction: a 40B GPT main job on 1K-8K GPUs with its bubbles filled.

    python bench/pipefill_sim.py [--schedule 1f1b|gpipe] [--hours 4] [--policy fifo] [--json out.json]

Main job (PipeFill §5.2): 40B GPT, t = 8, p = 16, microbatch b = 2, global batch 1024, sequence 2048,
scaled by data parallelism: d = n / (t p), m = 1024 / (d b). One iteration is generated with
``planner.schedule_ir.generate`` and timed with ``planner.simulate.simulate``; the head and tail idle
gaps of a rank are one fill-drain bubble across iterations, so they are merged.

Assumptions (ours, stated because the paper does not give them):

- Hardware: A100 80GB (targets registry), dense bf16 peak 312 TFLOP/s at 40% efficiency for the
  main job. The paper ran V100s (main job 60 TFLOP/s, 001 l.243), so we compare ratios.
- 40B GPT shape: 48 layers, hidden 8192, 64 heads (12 l h^2 = 38.7B + 0.4B embeddings). Per stage
  3 layers; t_f = 3 (24 b s h^2 + 4 b s^2 h) / t / (0.4 peak), t_b = 2 t_f; p2p, all-reduce and
  optimizer step taken as 0 so the iteration is exactly (m + p - 1)(t_f + t_b).
- Bubbles have 4.5 GB free (PipeFill measured 4.5 GB and used it in its simulator, 001 l.229);
  Executors fill 68% of each bubble (safety margin 0.32: "in our simulator results, the Fill Job
  Executors fill the same percentage of the bubble duration by default", 001 l.231), 1 ms launch
  per chunk. Only the fill-drain and fwd-bwd bubbles are filled (PipeFill does not fill 1F1B's
  non-contiguous bubbles, 001 l.180, 257); ``--fill-all`` fills every bubble.
- Fill jobs (Table 1, transformer rows): BERT-base (109M) and BERT-large (334M), inference at
  sequence 512 or training at sequence 128 with equal probability (models < 700M, 001 l.211).
  Per-layer FLOPs 24 b s h^2 + 4 b s^2 h (backward 2x); efficiency 0.4 T / (T + 2048) for T
  tokens per GEMM (small batches run far below peak); training stashes s b h (34 + 5 a s / h)
  bytes per layer (Korthikanti et al.), resident 2N bytes for inference and 16N for mixed-precision
  Adam, or 4N with the optimizer offloaded to the CPU (ZeRO-Offload) when 16N does not fit.
  The Executor picks the batch (power of two) with the most samples per cycle on each rank;
  a dedicated GPU runs the largest batch that fits 80 GB.
- Trace: job sizes log-uniform in [1 min, 1 h] of dedicated GPU time (the paper samples the
  Alibaba trace filtered to < 1 GPU-hour, 001 l.211), all queued at t = 0 (a backlog, so the
  numbers are the bubbles' capacity over ``--hours``). One pipeline slice (16 GPUs, one per stage)
  is simulated; the other GPUs of a stage see the same bubbles, so C = n.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.fill.cluster_sim import Prices, SimReport, simulate  # noqa: E402
from planner.fill.packing import BubbleSlot, FillUnit, greedy_pack  # noqa: E402
from planner.fill.job_scheduler import TraceJob, PlanChunk, Rank, RankPlan  # noqa: E402
from planner.schedule_ir import generate  # noqa: E402
from planner.simulate import SimCosts, simulate as simulate_iteration  # noqa: E402
from targets.registry import get_target  # noqa: E402

GiB, GB = 1 << 30, 1e9
A100 = get_target("a100-80gb").gpu
PEAK = A100.peak_flops["bf16"]
EFFICIENCY = 0.40
HALF_TOKENS = 2048
FREE_BYTES = int(4.5 * GB)
SAFETY_MARGIN = 0.32
LAUNCH_S = 1e-3
PCIE_BW = 25 * GB  # achievable pinned copies on PCIe Gen4 (targets lists the 32 GB/s peak)
CPU_ADAM_BW = 50 * GB  # bytes/s of optimizer state a CPU Adam step streams
PLAN_CYCLES = 4
SCALES = (1024, 2048, 4096, 8192)
SEED = 20240601

# Paper numbers (001 = PipeFill seed file): GPUs saved, "200-300 GPUs worth of fill-job when the
# main job is using 2K GPUs, 600-900 ... 4K GPUs, and 1500-2600 GPUs when using 8K GPUs" (l.223,
# low = full trace, high = BERT inference only); "most ... around 30% of exclusive execution"
# (l.251); 7.39 TFLOPS/GPU recovered on V100s at a 65% bubble ratio, main job 60 TFLOPS (l.231,
# 243); +5-10% GPU utilization at 1-2K GPUs for the trace, +7.8-15.6% for BERT inference (l.221, 223).
PAPER_GPUS_SAVED = {2048: (200, 300), 4096: (600, 900), 8192: (1500, 2600)}
PAPER_RECOVERED_OF_MAIN = 7.39 / 60.0
# "At 4K GPUs, PipeFill is able to get 89% of the GPU utilization of traditional pipeline-
# parallelism at 2K GPUs; at 8K GPUs ... 92% ... at 4K GPUs" (trace, l.221); BERT inference only:
# 96.7% and "exceeds ... by 6.5%" (l.223).
PAPER_STRONG_SCALING = {(4096, "trace"): 0.89, (8192, "trace"): 0.92,
                        (4096, "bert-inf"): 0.967, (8192, "bert-inf"): 1.065}


# --- main job ----------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class MainJob:
    layers: int = 48
    hidden: int = 8192
    seq: int = 2048
    t: int = 8
    p: int = 16
    micro: int = 2
    global_batch: int = 1024

    def forward_s(self) -> float:
        """One microbatch's forward on one stage (per GPU of the tensor-parallel group)."""
        b, s, h = self.micro, self.seq, self.hidden
        flops = self.layers // self.p * (24 * b * s * h * h + 4 * b * s * s * h)
        return flops / self.t / (PEAK * EFFICIENCY)

    def microbatches(self, n_gpus: int) -> tuple[int, int]:
        if n_gpus % (self.t * self.p):
            raise ValueError(f"{n_gpus} GPUs is not a multiple of t*p = {self.t * self.p}")
        d = n_gpus // (self.t * self.p)
        if self.global_batch % (d * self.micro):
            raise ValueError(f"global batch {self.global_batch} is not divisible by d*b = {d * self.micro}")
        return d, self.global_batch // (d * self.micro)


def iteration(job: MainJob, m: int, kind: str):  # noqa: ANN201 - planner.simulate.SimResult
    p, tf = job.p, job.forward_s()
    costs = SimCosts(forward_s=(tf,) * p, backward_s=(2 * tf,) * p, p2p_s=0.0,
                     allreduce_s=(0.0,) * p, optimizer_s=(0.0,) * p, static_bytes=(0,) * p,
                     activation_bytes=(0,) * p, capacity_bytes=FREE_BYTES)
    return simulate_iteration(generate(kind, p, m), costs)


def rank_cycle(r: int, bubbles: list, period: float, fill_all: bool) -> tuple[Rank, tuple[int, ...]]:
    """The rank's cycle starting at its fill-drain bubble (tail + next head), and the slots to fill."""
    eps = 1e-9 * period
    head = [b for b in bubbles if b.start_s <= eps]
    tail = [b for b in bubbles if b.start_s + b.duration_s >= period - eps and b not in head]
    middle = [b for b in bubbles if b not in head and b not in tail]
    origin = tail[0].start_s if tail else 0.0
    slots, starts, fill = [], [], []
    drain = sum(b.duration_s for b in head + tail)
    if drain > 0:
        slots.append(BubbleSlot(id=0, duration_s=drain, free_bytes=FREE_BYTES))
        starts.append(0.0)
        fill.append(0)
    for b in middle:
        if fill_all or (b.kind == "B" and not any(x.kind == "B" for x in middle[:middle.index(b)])):
            fill.append(len(slots))
        slots.append(BubbleSlot(id=len(slots), duration_s=b.duration_s, free_bytes=FREE_BYTES))
        starts.append((b.start_s - origin) % period)
    return Rank(id=r, slots=tuple(slots), period_s=period, starts_s=tuple(starts)), tuple(fill)


def main_job_ranks(n_gpus: int, kind: str = "1f1b", fill_all: bool = False,
                   job: MainJob = MainJob()) -> dict:
    d, m = job.microbatches(n_gpus)
    sim = iteration(job, m, kind)
    ranks, fillable = [], []
    for r in range(job.p):
        rank, fill = rank_cycle(r, [b for b in sim.bubbles if b.rank == r], sim.iteration_s, fill_all)
        ranks.append(rank)
        fillable.append(fill)
    return {"d": d, "m": m, "iteration_s": sim.iteration_s, "bubble_fraction": sim.bubble_fraction,
            "formula": Fraction(job.p - 1, m + job.p - 1), "ranks": ranks, "fillable": fillable}


# --- fill jobs ---------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class FillModel:
    name: str
    params: float
    layers: int
    hidden: int
    heads: int
    seq: int
    train: bool


BERT_BASE = dict(params=109e6, layers=12, hidden=768, heads=12)
BERT_LARGE = dict(params=334e6, layers=24, hidden=1024, heads=16)
KINDS = {
    "bert-base-inf": FillModel(name="bert-base-inf", seq=512, train=False, **BERT_BASE),
    "bert-large-inf": FillModel(name="bert-large-inf", seq=512, train=False, **BERT_LARGE),
    "bert-base-train": FillModel(name="bert-base-train", seq=128, train=True, **BERT_BASE),
    "bert-large-train": FillModel(name="bert-large-train", seq=128, train=True, **BERT_LARGE),
}
WORKLOADS = {"trace": tuple(KINDS), "bert-inf": ("bert-base-inf", "bert-large-inf")}


def efficiency(tokens: float) -> float:
    return EFFICIENCY * tokens / (tokens + HALF_TOKENS)


def _layer(model: FillModel, batch: int) -> tuple[float, float, int, int]:
    """Forward (seconds, FLOPs, working bytes, bytes stashed for backward) of one layer."""
    b, s, h, a = batch, model.seq, model.hidden, model.heads
    flops = 24 * b * s * h * h + 4 * b * s * s * h
    work = 2 * b * s * 6 * h + 2 * b * a * s * s
    stash = int(s * b * h * (34 + 5 * a * s / h))
    return flops / (PEAK * efficiency(b * s)), flops, work, stash


def resident_and_opt(model: FillModel, capacity: int) -> tuple[int, float]:
    """Resident bytes and optimizer-step seconds (GPU Adam, or CPU Adam when 16N does not fit)."""
    n = model.params
    if not model.train:
        return int(2 * n), 0.0
    if 16 * n < capacity / 2:
        return int(16 * n), 32 * n / A100.hbm_bw
    return int(4 * n), 4 * n / PCIE_BW + 16 * n / CPU_ADAM_BW


def units(model: FillModel, batch: int, capacity: int) -> tuple[list[FillUnit], int]:
    sec, flops, work, stash = _layer(model, batch)
    resident, opt_s = resident_and_opt(model, capacity)
    if not model.train:
        return [FillUnit(name=f"L{i}", time_s=sec, mem_bytes=work, flops=flops)
                for i in range(model.layers)], resident
    fwd = [FillUnit(name=f"F{i}", time_s=sec, mem_bytes=(i + 1) * stash + work, flops=flops)
           for i in range(model.layers)]
    bwd = [FillUnit(name=f"B{i}", time_s=2 * sec, mem_bytes=(i + 1) * stash + 2 * work, flops=2 * flops)
           for i in reversed(range(model.layers))]
    return fwd + bwd + [FillUnit(name="opt", time_s=opt_s, mem_bytes=0, flops=0.0)], resident


def _fits(model: FillModel, batch: int, capacity: int) -> bool:
    us, resident = units(model, batch, capacity)
    return resident + max(u.mem_bytes for u in us) <= capacity


def batches(model: FillModel, capacity: int, cap: int = 1024) -> list[int]:
    out, b = [], 1
    while b <= cap and _fits(model, b, capacity):
        out.append(b)
        b *= 2
    return out


def dedicated_s_per_sample(model: FillModel) -> float:
    capacity = int(0.9 * A100.hbm_bytes)
    b = batches(model, capacity)[-1]
    us, _ = units(model, b, capacity)
    return sum(u.time_s for u in us) / b


def best_plan(model: FillModel, rank: Rank, fill: tuple[int, ...]) -> RankPlan | None:
    """The batch whose greedy packing (PipeFill Alg. 1) does the most samples per cycle."""
    cycle = [rank.slots[i] for i in fill]
    best, best_rate = None, 0.0
    for b in batches(model, FREE_BYTES) if cycle else []:
        us, resident = units(model, b, FREE_BYTES)
        pk = greedy_pack(us, cycle, safety_margin=SAFETY_MARGIN, launch_overhead_s=LAUNCH_S,
                         resident_bytes=resident, cycles=PLAN_CYCLES)
        rate = pk.units_completed * b / len(us)
        if rate > best_rate:
            per_unit = b / len(us)
            best_rate, best = rate, RankPlan(cycles=PLAN_CYCLES, chunks=tuple(
                PlanChunk(cycle=c.cycle, slot=fill[c.slot], work=c.num_units * per_unit,
                          busy_s=c.time_s + c.overhead_s, overhead_s=c.overhead_s, flops=c.flops)
                for c in pk.chunks))
    return best


def min_mem(model: FillModel) -> int:
    us, resident = units(model, 1, FREE_BYTES)
    return resident + max(u.mem_bytes for u in us)


# --- trace and runs ----------------------------------------------------------------------------


def trace(kinds: tuple[str, ...], plans: dict, total_dedicated_s: float, seed: int) -> list[TraceJob]:
    rng, jobs, total = random.Random(seed), [], 0.0
    while total < total_dedicated_s:
        model = KINDS[rng.choice(kinds)]
        size_s = math.exp(rng.uniform(math.log(60), math.log(3600)))
        per = dedicated_s_per_sample(model)
        jobs.append(TraceJob(name=f"{model.name}-{len(jobs)}", kind=model.name, work=size_s / per,
                            plans=plans[model.name], mem_bytes=min_mem(model),
                            arrival_s=0.0, dedicated_s_per_work=per))
        total += size_s
    return jobs


def run_scale(n: int, workload: str, args: argparse.Namespace) -> tuple[dict, SimReport]:
    main = main_job_ranks(n, args.schedule, args.fill_all)
    ranks, horizon = main["ranks"], args.hours * 3600
    plans = {k: tuple(best_plan(KINDS[k], r, f) for r, f in zip(ranks, main["fillable"]))
             for k in WORKLOADS[workload]}
    bubble_s = sum(r.bubble_s for r in ranks) * horizon / ranks[0].period_s
    jobs = trace(WORKLOADS[workload], plans, 1.2 * bubble_s, SEED + n)
    rep = simulate(jobs, ranks, args.policy, horizon_s=horizon, gpus_per_rank=n // len(ranks),
                   prices=Prices(main_per_gpu_hour=args.main_price, side_per_gpu_hour=args.side_price))
    main_tflops = PEAK * EFFICIENCY / 1e12
    row = {
        "gpus": n, "workload": workload, "d": main["d"], "m": main["m"],
        "iteration_s": main["iteration_s"], "bubble_ratio": main["bubble_fraction"],
        "formula": float(main["formula"]), "sim_bubble_ratio": rep.bubble_ratio,
        "fill_tflops_per_gpu": rep.fill_tflops_per_gpu,
        "util_gain": rep.fill_tflops_per_gpu / ((1 - rep.bubble_ratio) * main_tflops),
        "recovered_of_main": rep.fill_tflops_per_gpu / main_tflops,
        "relative_perf": rep.relative_perf, "gpus_saved": rep.gpus_saved, "gpus_worth": rep.gpus_worth,
        "bubble_used": rep.bubble_s_used / rep.bubble_s_total,
        "jobs_done": len(rep.finished), "jobs": len(jobs),
        "cost_savings": rep.cost.savings if rep.cost else math.nan,
        "mean_slowdown": _mean([j.slowdown for j in rep.finished if j.slowdown is not None]),
        "mean_jct_s": rep.mean_jct_s,
        "paper_gpus_saved": PAPER_GPUS_SAVED.get(n),
    }
    return row, rep


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


HEADER = (f"{'GPUs':>5} {'workload':<9}{'d':>3}{'m':>4}{'iter s':>7}{'B':>7}{'(p-1)/(m+p-1)':>14}"
          f"{'used':>6}{'TFLOP/s':>8}{'gain':>7}{'P':>6}{'C*B*P':>7}{'worth':>7}{'paper':>11}"
          f"{'S':>7}{'done':>10}")


def fmt(r: dict) -> str:
    paper = "-" if r["paper_gpus_saved"] is None else "{}-{}".format(*r["paper_gpus_saved"])
    return (f"{r['gpus']:>5} {r['workload']:<9}{r['d']:>3}{r['m']:>4}{r['iteration_s']:>7.2f}"
            f"{r['bubble_ratio']:>7.3f}{r['formula']:>14.3f}{r['bubble_used']:>6.2f}"
            f"{r['fill_tflops_per_gpu']:>8.2f}{r['util_gain']:>7.1%}{r['relative_perf']:>6.2f}"
            f"{r['gpus_saved']:>7.0f}{r['gpus_worth']:>7.0f}{paper:>11}{r['cost_savings']:>7.1%}"
            f"{r['jobs_done']:>5}/{r['jobs']:<4}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b",
                    help="main-job schedule (the paper's default is gpipe, 001 l.205)")
    ap.add_argument("--fill-all", action="store_true", help="also fill 1F1B's non-contiguous bubbles")
    ap.add_argument("--policy", default="fifo", help="fill-job policy: fifo, sjf, makespan, edf")
    ap.add_argument("--hours", type=float, default=4.0, help="simulated main-job hours per scale")
    ap.add_argument("--main-price", type=float, default=4.10, help="$/GPU-hour of the main job's GPUs")
    ap.add_argument("--side-price", type=float, default=4.10, help="$/GPU-hour of a dedicated fill GPU")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args()
    rows = []
    print(HEADER, flush=True)
    for n in SCALES:
        for workload in WORKLOADS:
            row, _ = run_scale(n, workload, args)
            rows.append(row)
            print(fmt(row), flush=True)
    print_comparison(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def print_comparison(rows: list[dict]) -> None:
    print("\nB: bubble ratio from planner.simulate; used: bubble time used / bubble time; gain: "
          "recovered TFLOP/s over the main job's (1-B) utilization; P: relative performance; "
          "worth: dedicated GPU-hours done per hour; paper: PipeFill's GPUs saved (trace-BERT); "
          "S: FreeRide cost savings.")
    top = max(rows, key=lambda r: (r["gpus"], r["workload"] == "trace"))
    print(f"Paper: recovered/main-job FLOPS = 7.39/60 = {PAPER_RECOVERED_OF_MAIN:.1%} at B = 0.65 "
          f"(V100); here at {top['gpus']} GPUs ({top['workload']}): {top['recovered_of_main']:.1%}. "
          "Paper P is about 0.3 for most fill jobs (001 l.251).")
    main = PEAK * EFFICIENCY / 1e12
    plain = {r["gpus"]: (1 - r["bubble_ratio"]) * main for r in rows}
    for r in rows:
        paper = PAPER_STRONG_SCALING.get((r["gpus"], r["workload"]))
        if paper is None or r["gpus"] // 2 not in plain:
            continue
        ours = (plain[r["gpus"]] + r["fill_tflops_per_gpu"]) / plain[r["gpus"] // 2]
        print(f"{r['gpus']} GPUs {r['workload']}: utilization with filling / plain at "
              f"{r['gpus'] // 2} GPUs = {ours:.1%} (paper {paper:.1%})")


if __name__ == "__main__":
    main()
