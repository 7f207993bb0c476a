"""Fill predictions against what the seed papers measured on their own setups.

    python bench/paper_fill.py [--json out.json] [--ipc]

Waterwave Table 1 and 5.3 (../shared/seeds/004_…): the largest batch size of two identical training jobs paired on
one V100 32 GB against one job alone (the memory-sharing efficiency pairing buys), and the throughput of two paired
ResNet152 against running them one after the other (see waterwave()).

PipeSwitch Table 3 (../shared/seeds/002_…): the switching overhead of a BERT-base inference job loaded from host
memory by pipelined transmission, on a V100, against the transmission fxplanner charges a fill job that is not
resident (see pipeswitch()).

The ratio printed is predicted / measured; a range is printed where the paper gives one. Nothing here is fitted to
the papers' results: the fill's compute is priced by the same cost models as the main job, its memory-bound kernels
at the speeds eager PyTorch's reach, measured on an H200 (costmodels.eager: a fill job runs op by op, unfused; the
papers' V100 and RTX 6000 Ada are assumed to reach the same shares of their bandwidth), the bubble costs are
planner/fill/physics.py's constants with their sources, and each paper's own rules (margin, admission) are used.

PipeFill section 6.1 (../shared/seeds/001_…, l.197-231): a 5B LLM trained on 16 V100-16GB, one per machine
(25 Gb/s between them), 16 pipeline stages, no tensor parallelism, microbatch 2 of 2048 tokens, 8 microbatches
per replica, GPipe, Adam; its Executor fills 68% of each bubble. Measured: bubble ratio 65%, 4.5 GB free in
the bubbles, main job 60 TFLOP/s while executing, main-job overhead < 2% at 68% filled, and 7.39 TFLOP/s per GPU
recovered (averaged over all GPUs and the run's wall-clock time, l.219) with the paper's full fill-job trace (l.229).

The trace's composition is not stated, so it is not planned here. The paper gives its ingredients only (l.183-187,
209-211): five models (EfficientNet 117M, BERT-base 109M, BERT-large 334M, Swin-large 779M, XLM-RoBERTa-XL 2.8B),
sampled "to match the distribution of model sizes and types from the HuggingFace Model Hub" (the probabilities are
not given; only that 10.4% of the Hub's models are CNNs), training or batch inference with equal probability below
700M parameters and inference above, job sizes from the Alibaba trace (under 9 GPU-minutes) converted to samples
at each job's isolated throughput. We keep the issue's fill, BERT-base inference (sequence 128, batch 8-64), one of
the more favourable jobs (l.223, 243), and compare it twice: against the trace mix's 7.39, and against what the
paper says inference alone gains over the mix, 1.4x (l.27: +45% -> +63% GPU utilization at 8K GPUs) to 1.5x (l.33:
"increases the gains by ~50%"), i.e. 10.3-11.1 TFLOP/s: a range derived from stated figures, not a measurement.
The fill's relative performance P (GPUs saved ~ C*B*P, l.253: fill work in dedicated-GPU time per bubble time) is
compared with "around 30% of exclusive execution" for most of the jobs (l.251). And against BERT inference alone as
the paper's figures give it (derived, not measured: its simulator's, within 5% of the cluster): 1.56x the mix's
recovered FLOP/s (l.221, 223), P from its 2600 GPUs saved at 8K GPUs (l.253), and from the two the FLOP/s BERT-base
inference ran at alone on their V100s, recovered / (B x P): where the prediction parts from the paper.

What we assume because PipeFill does not say it: the 5B model's shape (GPT, 24 layers, hidden 4096, 32 heads,
vocabulary 50257: 4.8B in the blocks + 0.2B embedding) and fp16 mixed precision. Its Executor is a process of its
own on each device (l.107) and MPS is not named, so the fill is time-sliced with the main job's waiting receive
(planner/fill/physics.py: TIMESLICE_S, measured on an H100 by bench/cuda_colocate.py; the V100's slice is assumed
the same). FreeRide's side tasks run under MPS (000 l.187).

FreeRide section 4 (../shared/seeds/000_…): a 3.6B LLM adapted from GPT2-XL trained by DeepSpeed 0.12.2 in a
4-stage pipeline, one stage per GPU of one server (l.96-97, 277) of four RTX 6000 Ada 48 GB (Server-I, l.269), 4
microbatches (l.151, the setup of Figure 1), the microbatch "maximized until just before OOM" (l.277), 128 epochs
(l.306). Side tasks
(l.279, 306): ResNet18, ResNet50 and VGG19 training (PyTorch's out-of-the-box models) at batch 64, "the same side
task in all workers if they have enough GPU memory"; PageRank, Graph SGD and image processing are not DNNs and
are not planned. A side task runs whole steps (read a batch, forward, loss, backward, optimizer: l.207), the next
one only if the bubble's remaining time exceeds the step's profiled duration (l.249), in the GPU memory its worker's
bubbles have free, which is the same for every bubble of a stage (l.132-137: the main job's consumption stays at its
peak). Metrics (l.294-300, A.3 l.505-526): time increase I = (T_with - T_no) / T_no and cost savings
S = (C_sideTasks - (C_with - C_no)) / C_no with C = P_Server-I x T and C_sideTasks = P_Server-II x W / Th_Server-II,
Th the side task's throughput alone on Server-II, one RTX 3080 10 GB; P_Server-I = $3.96/h, P_Server-II = $0.18/h
(l.269). With W a fixed amount of work per main iteration, S = (P_II / P_I) x W_iter / (Th_II x t_iter) - I.
Measured (l.82, 308): with the iterative interface, 1.1% average time increase and 7.8% average cost savings over
the six side tasks (the mixed workload: 10.1% and 1.1%); Table 1 (l.281-292) gives I and S per side task, and the
three DNN side tasks planned here are compared one by one (I 0.9% each; S 6.4%, 5.3%, 3.9%) and as their mean
(I 0.9%, S 5.2%). Earlier versions of this bench read Table 1 as missing and set the three tasks' mean against the
six tasks' 7.8%: the graph and image tasks saved more than the DNN ones.
Also stated: bubble rate 42.4% (1.2B) to 40.4% (6B) at 4 microbatches (l.147-151), bubbles of 0.22-1.04 s
(l.128), free memory from under 3 GB (stage 0) to over 20 GB (stage 3) (l.132-137), VGG19 too large for the
bubbles of stages 0 and 1 (l.314).

What FreeRide does not say and we take from the authors' artifact (github.com/jiashu-z/freeride: ae/side_task_
deepspeed/experiment_config.py "xxxlarge", config/simplegpt2_template.json, side_task/model_training/): the 3.6B
model is 72 blocks of hidden 2048, 16 heads, sequence 1024 (12 x 72 x 2048^2 = 3.62B), microbatch 3 (our memory
model agrees that it is the largest: at b = 3 the stage of the embedding and 18 blocks holds 45.1 of 48 GiB, 9 GiB
of it per microbatch of activations), fp32 Adam (no fp16 section), no activation checkpointing, flash attention,
dropout 0; side tasks train on 224x224 images with torchvision's 1000-class heads (examples/vision.py). We add
GPT-2's 50257-token tied embedding (examples/gpt.py needs one: +0.1B parameters, +2.6% FLOPs) and assume
DeepSpeed's schedule is 1F1B (its TrainSchedule). The artifact's measured side-task profiles
(iterative_summary_ada6000.json: step time on the RTX 6000 Ada at batch 64; ae/collect_experiment_data/
analyze_cost.ipynb: throughput on the RTX 3080) are printed as a cross-check of the inputs to S, not as targets.

Two predictions of S per side task. FreeRide's, the one its measurement answers to: its runtime as the authors'
artifact runs it: the bubbles its instrumented DeepSpeed reports (freeride_reported: all but the last stage's
end-of-batch drain), a side task starting half a manager poll (10 ms) and half a task-loop sleep (5 ms) into each,
a step only while the time left exceeds its checked duration (the step time rounded up to 10 ms, x1.2), a 5 ms
sleep after every step (freeride_steps_in), the step time being the planner's price of the side task on the RTX 6000
Ada, on the workers whose free memory at the main job's peak (l.134) holds it. And fxplanner's own packing of the
same jobs on the same plan (make_plan with one fill job per worker: layer-sized units, an iteration may span
bubbles, its admission slack and its memory ledger, margin 0 as FreeRide uses none), which is what fxplanner would
recover there, not a prediction of FreeRide's figure. I is the plan's: its iteration time with the side tasks
against without (0: no unit passes its bubble's end, and the main job is not charged the instrumentation's
synchronizes and RPCs, which we have no measurement of). FreeRide's I is 0.9% for every DNN side task whatever its
step (31-160 ms), which points at something the side tasks share rather than at their steps' overrun. One
candidate, not priced here for want of a constant: heat. Its harness waits for the GPUs to cool to 50 C before each
run with side tasks and to 33 C before each baseline run (ae/side_task_deepspeed/run_side_task.py,
ae/vanilla_deepspeed_baseline/run.py), and a GPU kept busy through its bubbles runs hotter and boosts lower.
`--ipc` measures the per-unit request/reply round trip of the fill executor's pipes on this machine
(planner/fill/physics.py: STEP_IPC_S).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from costmodels.hardware import Hardware  # noqa: E402
from planner.api import make_plan  # noqa: E402
from planner.fill.assign import load_grouping, plan_hold_free  # noqa: E402
from planner.fill.physics import FILL_CONTEXT_BYTES  # noqa: E402
from planner.fill.profiles import FillProfile, profile_job  # noqa: E402
from planner.fill.spec import FillJobSpec, FillSpec, Work  # noqa: E402
from planner.fill.waterwave import SPLIT_FRACTION, pair_units, schedule_pair, split_of  # noqa: E402
from passes.pipeline import analyze  # noqa: E402
from planner.fill.profiles import linearize  # noqa: E402
from planner.plan import Plan  # noqa: E402
from planner.search import Pins  # noqa: E402
from targets.registry import get_target  # noqa: E402

GB = 1e9
EXAMPLES = ROOT / "examples"
PIPEFILL = {"recovered_tflops_per_gpu": 7.39, "main_tflops_executing": 60.0, "bubble_ratio": 0.652,
            "free_bytes": 4.5 * GB, "main_overhead_below": 0.02, "inference_gain_over_mix": (1.4, 1.5),
            "relative_performance": 0.30, "bert_gain_over_mix": 7.8 / 5.0, "gpus_saved_8k": {"mix": 1500, "bert": 2600}}
"""PipeFill 6.1 measured (001 l.229, 231, 243); the bubble ratio is (p-1)/(m+p-1) = 15/23; inference alone gains
1.4x (l.27: 45% -> 63%) to 1.5x (l.33) over the trace mix; most fill jobs run at about 30% of exclusive (l.251).
Filling with BERT inference alone recovers 7.8-15.6% of GPU utilization where the trace mix recovers 5-10% at 1-2K GPUs
(l.221, 223: 1.56x at both ends), and saves over 2600 GPUs where the mix saves 1500 at 8K GPUs (l.253, C*B*P), the
scale whose bubble ratio the physical cluster's 65% stands for (l.229)."""

FREERIDE = {"bubble_rate": (0.404, 0.424),
            "longest_bubble_s": 1.04, "price_server_i": 3.96, "price_server_ii": 0.18,
            "per_task": {"resnet18": (0.009, 0.064), "resnet50": (0.009, 0.053), "vgg19": (0.009, 0.039)}}
"""FreeRide measured (Table 1, l.281-292: I and S per side task, iterative interface; l.147-151: bubble rate of the 6B
and 1.2B models at 4 microbatches, the 3.6B's is between; l.128) and its prices (l.269, $ per hour)."""
FR_TASKS = ("resnet18", "resnet50", "vgg19")
FR_BATCH = 64  # 000 l.306
FR_WORKERS = 4  # one per GPU of Server-I, the same side task in each (l.306)
FR_GPT = {"layers": 72, "hidden": 2048, "heads": 16, "seq": 1024, "vocab": 50257, "dropout": 0.0, "flash": True}
FR_PINS = Pins(tp=1, pp=4, dp=1, b=3, schedule="1f1b", precision="fp32", recompute="none")
FR_MICROBATCHES = 4  # 000 l.151
ARTIFACT = {"ada_step_s": {"resnet18": 0.031112, "resnet50": 0.086666, "vgg19": 0.160252},
            "ada_max_allocated_gb": {"resnet18": 3.897, "resnet50": 8.064, "vgg19": 12.361},
            "rtx3080_samples_per_s": {"resnet18": 998.7, "resnet50": 393.4, "vgg19": 161.8},
            "free_gb_per_stage": (3, 9, 16, 24)}
"""The authors' artifact, not the paper: avg_step_time and max_allocated_memory at batch 64 on the RTX 6000 Ada
(iterative_summary_ada6000.json), side_task_throughputs_3080 (analyze_cost.ipynb), the per-stage GPU memory limits
of the 3.6B run (experiment_config.py stage_id_gpu_memory_map, GB)."""


def _row(name: str, predicted: float, paper: float | tuple[float, float] | None) -> dict[str, Any]:
    """A figure against the paper's: ratio predicted / paper, a (low, high) pair against a range, None without."""
    if paper is None:
        ratio: float | list[float] | None = None
    elif isinstance(paper, tuple):
        ratio = [predicted / paper[1], predicted / paper[0]]
    else:
        ratio = predicted / paper if paper else None
    return {"figure": name, "predicted": predicted, "paper": list(paper) if isinstance(paper, tuple) else paper,
            "ratio": ratio}


# --- PipeFill ------------------------------------------------------------------------------------------------------


def pipefill() -> dict:
    job = FillJobSpec(name="bert-base-infer", model=str(EXAMPLES / "bert.py"),
                      model_args={"preset": "base", "seq": 128}, kind="infer", batch_sizes=[8, 16, 32, 64],
                      work=Work(samples=10_000_000))
    pins = Pins(tp=1, pp=16, dp=1, b=2, schedule="gpipe", precision="fp16")
    kw = dict(gpus=16, global_batch=16, target="v100-16gb", gpus_per_node=1, pins=pins,
              model_args={"layers": 24, "hidden": 4096, "heads": 32, "seq": 2048})
    # its Executor is a process of its own on each device (l.107), MPS is not named: time-sliced
    plan, _ = make_plan(str(EXAMPLES / "gpt.py"), fill=FillSpec(jobs=[job], gpu_sharing="timeslice"), **kw)
    alone, _ = make_plan(str(EXAMPLES / "gpt.py"), **kw)
    overhead = time_increase(plan.predictions.iteration_s, alone.predictions.iteration_s)
    pr, fp = plan.predictions, plan.fill.predictions
    executing = pr.hardware_tflops_per_gpu / (1 - pr.bubble_fraction)
    free = sorted(b.free_bytes for b in plan.bubbles if b.duration_s > 0.5)
    chosen = plan.fill.jobs[0]
    prof = _profile(job, "v100-16gb", pins.precision, chosen.batch_size, chosen.config)
    isolated = prof.flops_per_iteration / prof.iteration_s  # FLOP/s of the job alone on one GPU
    relative = fp.fill_tflops_per_gpu * 1e12 / isolated / pr.bubble_fraction
    lo, hi = PIPEFILL["inference_gain_over_mix"]
    # BERT inference alone, derived from the paper's figures (its simulator, within 5% of the cluster: l.231): the
    # recovered FLOP/s 1.56x the mix's, P from 2600 GPUs saved of 8192 at B = 0.652, and so the FLOP/s BERT runs at
    # alone on their V100s (recovered = B x P x alone): where the prediction parts from them
    bert_recovered = PIPEFILL["bert_gain_over_mix"] * PIPEFILL["recovered_tflops_per_gpu"]
    bert_p = PIPEFILL["gpus_saved_8k"]["bert"] / (8192 * PIPEFILL["bubble_ratio"])
    rows = [
        _row("bubble ratio", pr.bubble_fraction, PIPEFILL["bubble_ratio"]),
        _row("main job TFLOP/s while executing", executing, PIPEFILL["main_tflops_executing"]),
        _row("free GB in the long bubbles (median)", free[len(free) // 2] / GB, PIPEFILL["free_bytes"] / GB),
        _row("recovered TFLOP/s/GPU at 68%: BERT vs the trace mix", fp.fill_tflops_per_gpu,
             PIPEFILL["recovered_tflops_per_gpu"]),
        _row("recovered TFLOP/s/GPU at 68%: BERT vs inference (derived)", fp.fill_tflops_per_gpu,
             (lo * PIPEFILL["recovered_tflops_per_gpu"], hi * PIPEFILL["recovered_tflops_per_gpu"])),
        _row("fill relative performance P (C*B*P)", relative, PIPEFILL["relative_performance"]),
        _row("recovered TFLOP/s/GPU: BERT vs BERT alone (derived)", fp.fill_tflops_per_gpu, bert_recovered),
        _row("P: BERT vs BERT alone (derived)", relative, bert_p),
        _row("BERT-base inference alone, TFLOP/s (derived)", isolated / 1e12,
             bert_recovered / (PIPEFILL["bubble_ratio"] * bert_p)),
    ]
    where = "resident" if chosen.resident else "loaded per bubble"
    return {"setup": f"{plan.config.to_config()} on 16 x v100-16gb; fill {chosen.name} ({where}), "
                     f"margin {plan.fill.safety_margin:.2f}, time-sliced (under MPS it would recover "
                     f"{fp.under_mps_tflops_per_gpu:.1f} TFLOP/s/GPU)",
            "rows": rows,
            "main_overhead": overhead,
            "main_overhead_text": f"predicted {overhead:.4f} (the plan's iteration with the fill against without: no "
                                  f"chunk may pass 68% of its bubble, the runtime kills one past the grace period) "
                                  f"against the paper's < {PIPEFILL['main_overhead_below']:.0%}"}


def _profile(job: FillJobSpec, target: str, precision: str, batch: int, config: str = "plain") -> FillProfile:
    """The job's profile at one batch size and configuration, priced on `target` by the planner's cost models."""
    hw = Hardware(target=get_target(target))
    return next(p for p in profile_job(job.model_copy(update={"batch_sizes": [batch]}), hw, precision)
                if p.config == config)


# --- PipeSwitch ----------------------------------------------------------------------------------------------------

PIPESWITCH_BERT_V100_S = 10.27e-3
"""PipeSwitch Table 3 (002 l.326-328): total overhead over the ready model, Bert_base inference on p3.2xlarge (one
V100, PCIe 3.0 x16), batch 8 (l.306), model in host memory: pipelined transmission by its optimal grouping."""


PIPESWITCH_RESNET152_V100_S = 32e-3
"""PipeSwitch Table 1 (002 l.102-108, the measurement study of 4.1, l.124): ResNet152's inference time on p3.2xlarge
(one V100), PyTorch from PyPI (l.304); batch 8 assumed (the paper's inference default, l.306), fp32 (PyTorch's)."""


def pipeswitch() -> dict:
    """The overhead fxplanner charges a BERT-base inference fill job that is not resident: the transmission its
    grouping (planner/fill/assign.py load_grouping, PipeSwitch's Algorithm 1 over our units) cannot hide behind the
    forward. Assumed: fp32 (PipeSwitch's PyTorch default), sequence 128 (not stated). Our units are 14 (embedding,
    12 blocks, head) where PipeSwitch groups 139 layers; coarser units hide less. And a fill job's own speed at an
    inference batch, against a measured one: ResNet152's forward at batch 8 (Table 1)."""
    job = FillJobSpec(name="bert-base", model=str(ROOT / "examples" / "bert.py"),
                      model_args={"preset": "base", "seq": 128}, kind="infer", batch_sizes=[8], work=Work(samples=8))
    hw = Hardware(target=get_target("v100-16gb"))
    prof = _profile(job, "v100-16gb", "fp32", 8)
    resnet = _profile(FillJobSpec(name="resnet152", model=str(EXAMPLES / "vision.py"), model_args={"arch": "resnet152"},
                                  kind="infer", batch_sizes=[8], work=Work(samples=8)), "v100-16gb", "fp32", 8)
    g = load_grouping(prof, hw)
    forward = sum(layer.exec_time_s for layer in prof.layers)
    overhead = max(g.latency_s - forward, 0.0)
    return {"setup": f"BERT-base inference, batch 8, fp32, on one v100-16gb; {len(prof.layers)} units in "
                     f"{len(g.groups)} transfer groups, {sum(layer.param_bytes for layer in prof.layers) / 1e6:.0f} MB",
            "rows": [_row("switching overhead ms (pipelined transmission)", overhead * 1e3,
                          PIPESWITCH_BERT_V100_S * 1e3),
                     _row("ResNet152 inference ms, batch 8, fp32 (Table 1)", resnet.iteration_s * 1e3,
                          PIPESWITCH_RESNET152_V100_S * 1e3)]}


# --- Waterwave -----------------------------------------------------------------------------------------------------

WATERWAVE_V100 = {"resnet50": (406, 370), "resnet152": (186, 160), "bert-base": (138, 124)}
"""Waterwave Table 1 (004 l.232-247), V100-S (32 GB): the largest batch size of one job alone (Sole) and of each of
two identical jobs trained together (Waterwave)."""
WATERWAVE_RESNET152_B32_GAIN = 1.1427
"""Waterwave 5.3 (004 l.268): its highest throughput gain over temporal sharing among the CNNs and BERT, ResNet152 at
batch 32 (two identical jobs)."""


def _waterwave_model(name: str):
    if name == "bert-base":
        return ROOT / "examples" / "bert.py", {"preset": "base", "seq": 128}
    return ROOT / "examples" / "vision.py", {"arch": name}


def _largest(fits, hi: int = 1024) -> int:
    """The largest batch size in [1, hi] for which fits(b) holds (fits is monotone in b), 0 if none."""
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def waterwave() -> dict:
    """Table 1's memory-sharing efficiency as fxplanner predicts it: the largest batch size of a training job alone on
    a V100 32 GB (its process's context, weights, gradients and optimizer state, and its iteration's peak activations
    must fit), and of each of two identical jobs paired by planner/fill/waterwave.py (two processes, so two contexts;
    their activations staggered by the pair rule within what the two leave). fp32 (TensorFlow 1.15's default),
    Adam's state for every model (Waterwave trains the CNNs with SGD: 4 bytes per parameter less, 0.1-0.2 GB here),
    BERT at sequence 128 (not stated). And 5.3's throughput: two ResNet152 at batch 32 paired, against the two run one
    after the other (temporal sharing): our pair runs one unit at a time, so no gain is predicted beyond the cache
    releases it costs; Waterwave's two CUDA streams in one process overlap the two jobs' kernels. The absolute batch
    sizes set PyTorch's saved bytes (fused attention, no dropout in examples/bert.py) against TensorFlow 1.15's
    allocations: context for the ratio, which is what pairing changes."""
    hw = Hardware(target=get_target("v100-32gb"))
    cap = hw.gpu.hbm_bytes
    rows, setup = [], []
    for name, (sole_paper, paired_paper) in WATERWAVE_V100.items():
        model, args = _waterwave_model(name)
        prof, _ = analyze(str(model), args, dtype="fp32")
        cache: dict[int, tuple] = {}

        def job(b: int):
            if b not in cache:
                cache[b] = linearize(prof, "train", "plain", b, hw, "fp32")
            return cache[b]

        def sole(b: int) -> bool:
            units, resident = job(b)
            return FILL_CONTEXT_BYTES + resident + max(u.mem_bytes for u in units) <= cap

        def paired(b: int) -> bool:
            units, resident = job(b)
            budget = cap - 2 * (FILL_CONTEXT_BYTES + resident)
            return budget > 0 and schedule_pair(units, units, budget, split_of(budget)) is not None

        s, p = _largest(sole), _largest(paired)
        rows.append(_row(f"{name}: largest batch alone", s, sole_paper))
        rows.append(_row(f"{name}: largest batch, each of two paired", p, paired_paper))
        rows.append(_row(f"{name}: paired / alone (memory-sharing efficiency)", p / s, paired_paper / sole_paper))
        setup.append(f"{name} {len(prof.units)} units")
    units, resident = linearize(analyze(str(ROOT / "examples" / "vision.py"), {"arch": "resnet152"}, dtype="fp32")[0],
                                "train", "plain", 32, hw, "fp32")
    budget = cap - 2 * (FILL_CONTEXT_BYTES + resident)
    sched = schedule_pair(units, units, budget, split_of(budget))
    period = sum(u.time_s for u in pair_units(sched, units, units))
    sequential = 2 * sched.iterations * sum(u.time_s for u in units)
    rows.append(_row("resnet152 b32: paired throughput / one after the other", sequential / period,
                     WATERWAVE_RESNET152_B32_GAIN))
    return {"setup": f"one v100-32gb, fp32; {', '.join(setup)}; split size {SPLIT_FRACTION:.3f} of the pair's budget",
            "rows": rows}


# --- FreeRide ------------------------------------------------------------------------------------------------------


def time_increase(t_with: float, t_no: float) -> float:
    """FreeRide A.3: I = (T_withSideTasks - T_noSideTask) / T_noSideTask."""
    return (t_with - t_no) / t_no


def cost_savings(samples_per_iteration: float, iteration_s: float, dedicated_samples_per_s: float,
                 increase: float, price_ratio: float) -> float:
    """FreeRide A.3's S for side tasks that do `samples_per_iteration` (all workers) per main iteration of
    `iteration_s` without side tasks: C_sideTasks = P_II x W / Th_II, C_with - C_no = P_I x T_no x I and
    C_no = P_I x T_no, so with W = N x samples_per_iteration and T_no = N x iteration_s,
    S = (P_II / P_I) x samples_per_iteration / (Th_II x iteration_s) - I. `price_ratio` is P_II / P_I."""
    return price_ratio * samples_per_iteration / (dedicated_samples_per_s * iteration_s) - increase


FR_STATED_OOM_STAGES = {"vgg19": (0, 1)}
"""Stages whose bubbles FreeRide says a side task did not fit into (l.314: VGG19's memory exceeds the bubbles of
stages 0 and 1), set beside our own memory model's placement."""
FR_DURATION_ROUND_S = 0.01
FR_DURATION_FACTOR = 1.2
"""A side task's step duration as FreeRide's runtime checks it: its profiled median step time rounded up to 10 ms,
x1.2 (artifact ae/side_task_deepspeed/run_side_task.py, passed to the task as --duration). A step starts only while
the bubble's time left exceeds it (000 l.249; task_v2.py IterativeTask.do_i_have_enough_time)."""
FR_TASK_LOOP_S = 0.005
"""The side task's loop sleeps 5 ms after every pass, a step included (artifact src/freeride/task_v2.py,
IterativeTask.run); paused, it notices a start within one such sleep."""
FR_SCHEDULER_POLL_S = 0.01
"""The side-task manager looks for a bubble that has begun every 10 ms (artifact src/freeride/scheduler_v1.py,
schedule())."""


def freeride_steps_in(bubble_s: float, step_s: float) -> int:
    """Whole side-task steps FreeRide's iterative interface runs in one bubble, as its artifact runs them: the task
    starts on average half a manager poll and half a task-loop sleep after the bubble begins, a step starts only if
    the time left exceeds its checked duration (rounded up to 10 ms, x1.2), and each step is followed by one loop
    sleep."""
    duration = FR_DURATION_FACTOR * FR_DURATION_ROUND_S * math.ceil(step_s / FR_DURATION_ROUND_S - 1e-9)
    window = bubble_s - (FR_SCHEDULER_POLL_S + FR_TASK_LOOP_S) / 2
    if window <= duration:
        return 0
    return int((window - duration) // (step_s + FR_TASK_LOOP_S)) + 1


def freeride_reported(plan: Plan) -> list[list[float]]:
    """Per pipeline rank, the bubbles FreeRide's instrumented DeepSpeed reports to its side-task manager (the
    authors' DeepSpeed fork jiashu-z/DeepSpeed, deepspeed/runtime/pipe/engine.py as stored at 1b89ae7, not the commit
    the artifact pins: the start-of-batch bubble on every stage but the first, the waits for backward on all but the
    last, the end-of-batch bubble on stages 1 and 2; the last stage's is commented out), as durations in seconds (the
    fork reports each with the shortest profiled duration of its type; ours of one type are within 2% of each
    other)."""
    last = plan.config.pp - 1
    out: list[list[float]] = []
    for r in range(plan.config.pp):
        mine = sorted((b for b in plan.bubbles if b.rank == r), key=lambda b: b.start_s)
        if r == last and mine and mine[-1].kind == "A" and mine[-1].start_s > 0:
            mine = mine[:-1]  # the last stage's drain
        out.append([b.duration_s for b in mine])
    return out


def step_packing(prof: FillProfile, bubbles: Sequence[Sequence[float]], hold_free: Sequence[int]) -> list[float]:
    """Side-task steps per main iteration on each pipeline rank, as FreeRide runs them: a step is one whole
    iteration of `prof` (l.207), in the bubbles its DeepSpeed reports (freeride_reported) by the artifact's loop
    (freeride_steps_in), on a worker whose memory, the same in every bubble of the rank (l.134: the main job stays
    at its peak), holds the task's context, weights, optimizer state and the step's activations (Algorithm 1 l.4:
    a worker without enough is not given the task)."""
    held = prof.resident_bytes + FILL_CONTEXT_BYTES + max(u.mem_bytes for u in prof.units)
    return [0.0 if held > free else float(sum(freeride_steps_in(b, prof.iteration_s) for b in rank))
            for rank, free in zip(bubbles, hold_free)]


def side_task(arch: str, worker: int = 0) -> FillJobSpec:
    return FillJobSpec(name=f"{arch}-w{worker}", model=str(EXAMPLES / "vision.py"), model_args={"arch": arch},
                       kind="train", batch_sizes=[FR_BATCH], work=Work(iterations=10_000_000))


def freeride_plan(fill: FillSpec | None = None) -> Plan:
    plan, _ = make_plan(str(EXAMPLES / "gpt.py"), gpus=FR_WORKERS, global_batch=FR_MICROBATCHES * FR_PINS.b,
                        target="rtx6000-ada", gpus_per_node=FR_WORKERS, model_args=FR_GPT, pins=FR_PINS, fill=fill)
    return plan


def freeride_task(arch: str, main: Plan, price_ratio: float) -> dict[str, Any]:
    """I and S of one side task run in every worker: from the plan with the side tasks, and with FreeRide's steps."""
    plan = freeride_plan(FillSpec(jobs=[side_task(arch, w) for w in range(FR_WORKERS)], safety_margin=0.0,
                                  gpu_sharing="mps"))  # its side tasks run under MPS (l.187)
    t_no = main.predictions.iteration_s
    increase = time_increase(plan.predictions.iteration_s, t_no)
    ada = _profile(side_task(arch), "rtx6000-ada", FR_PINS.precision, FR_BATCH)
    ded = _profile(side_task(arch), "rtx3080", FR_PINS.precision, FR_BATCH)
    th_ii = FR_BATCH / ded.iteration_s
    # the plan's fill FLOP/s per GPU x GPUs x iteration = FLOPs of side-task work per main iteration
    plan_samples = (plan.fill.predictions.fill_tflops_per_gpu * 1e12 * plan.config.pp * plan.predictions.iteration_s
                    / ada.flops_per_iteration * FR_BATCH)
    steps = step_packing(ada, freeride_reported(main), plan_hold_free(main))
    step_samples = sum(steps) * FR_BATCH
    stated = sum(s for r, s in enumerate(steps) if r not in FR_STATED_OOM_STAGES.get(arch, ())) * FR_BATCH
    dedicated_mem = ded.resident_bytes + FILL_CONTEXT_BYTES + max(u.mem_bytes for u in ded.units)
    return {
        "side_task": arch, "time_increase": increase,
        "cost_savings_plan": cost_savings(plan_samples, t_no, th_ii, increase, price_ratio),
        "cost_savings_steps": cost_savings(step_samples, t_no, th_ii, increase, price_ratio),
        "cost_savings_steps_stated": cost_savings(stated, t_no, th_ii, increase, price_ratio),
        "samples_per_s_plan": plan_samples / t_no, "samples_per_s_steps": step_samples / t_no,
        "workers_plan": sorted({c.rank for c in plan.fill.chunks}),
        "workers_steps": [r for r, s in enumerate(steps) if s > 0],
        "step_s_ada": ada.iteration_s, "samples_per_s_rtx3080": th_ii,
        "steps_per_rank": steps,
        "allocated_gb_ada": (ada.resident_bytes + max(u.mem_bytes for u in ada.units)) / GB,  # no CUDA context
        "fits_rtx3080": dedicated_mem + Hardware(target=get_target("rtx3080")).reserve_bytes
                        <= get_target("rtx3080").gpu.hbm_bytes,
    }


def freeride() -> dict:
    price_ratio = FREERIDE["price_server_ii"] / FREERIDE["price_server_i"]
    main = freeride_plan()
    tasks = [freeride_task(arch, main, price_ratio) for arch in FR_TASKS]
    free = plan_hold_free(main)
    rows = [
        _row("bubble rate (paper: 6B .. 1.2B)", main.predictions.bubble_fraction, FREERIDE["bubble_rate"]),
        _row("longest bubble s", max(b.duration_s for b in main.bubbles), FREERIDE["longest_bubble_s"]),
    ]
    per_task = FREERIDE["per_task"]
    for t in tasks:
        i_paper, s_paper = per_task[t["side_task"]]
        rows += [_row(f"I {t['side_task']}", t["time_increase"], i_paper),
                 _row(f"S {t['side_task']} (FreeRide's steps)", t["cost_savings_steps"], s_paper),
                 *([_row(f"S {t['side_task']} (its steps where l.314 says it fit)", t["cost_savings_steps_stated"],
                         s_paper)] if t["side_task"] in FR_STATED_OOM_STAGES else []),
                 _row(f"S {t['side_task']} (fxplanner's packing)", t["cost_savings_plan"], s_paper)]
    avg = lambda key: sum(t[key] for t in tasks) / len(tasks)  # noqa: E731
    paper_avg = lambda k: sum(per_task[t][k] for t in FR_TASKS) / len(FR_TASKS)  # noqa: E731
    rows += [_row("I, mean of the 3 DNN side tasks", avg("time_increase"), paper_avg(0)),
             _row("S, mean of the 3, FreeRide's steps", avg("cost_savings_steps"), paper_avg(1)),
             _row("S, mean of the 3, fxplanner's packing", avg("cost_savings_plan"), paper_avg(1))]
    check = [_row(f"{t['side_task']} step s on RTX 6000 Ada", t["step_s_ada"], ARTIFACT["ada_step_s"][t["side_task"]])
             for t in tasks]
    check += [_row(f"{t['side_task']} samples/s on RTX 3080", t["samples_per_s_rtx3080"],
                   ARTIFACT["rtx3080_samples_per_s"][t["side_task"]]) for t in tasks]
    check += [_row(f"{t['side_task']} GB allocated at its peak (no context)", t["allocated_gb_ada"],
                   ARTIFACT["ada_max_allocated_gb"][t["side_task"]]) for t in tasks]
    check += [_row(f"free GB beside the peak, stage {r}", f / GB, float(g))
              for r, (f, g) in enumerate(zip(free, ARTIFACT["free_gb_per_stage"]))]
    return {"setup": f"{main.config.to_config()} on 4 x rtx6000-ada, 3.6B GPT (72 x 2048), iteration "
                     f"{main.predictions.iteration_s:.3f} s; side tasks at batch {FR_BATCH}, price ratio "
                     f"{price_ratio:.4f}",
            "rows": rows, "tasks": tasks, "artifact_check": check}


# --- IPC, printing -------------------------------------------------------------------------------------------------


def measure_ipc(n: int = 2000) -> float:
    """Seconds per request/reply of a unit between two processes over multiprocessing pipes."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    task_rx, to_task = ctx.Pipe(duplex=False)
    from_task, task_tx = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_echo, args=(task_rx, task_tx))
    proc.start()
    for _ in range(100):
        to_task.send(("step", 0, 1))
        from_task.recv()
    start = time.perf_counter()
    for i in range(n):
        to_task.send(("step", i, 1 << 30))
        from_task.recv()
    per = (time.perf_counter() - start) / n
    to_task.send(("stop",))
    proc.join()
    return per


def _echo(rx, tx) -> None:
    while (msg := rx.recv())[0] != "stop":
        tx.send(("step", msg[1], time.time(), time.time(), time.monotonic(), time.monotonic(), False))


def _fmt(value: Any, width: int) -> str:
    if value is None:
        return f"{'-':>{width}s}"
    if isinstance(value, list):
        return f"{f'{value[0]:.3g}-{value[1]:.3g}':>{width}s}"
    return f"{value:{width}.3f}"


def print_rows(rows: list[dict[str, Any]], against: str = "paper") -> None:
    print(f"  {'figure':58s} {'predicted':>10s} {against:>11s} {'ratio':>10s}")
    for r in rows:
        print(f"  {r['figure']:58s} {_fmt(r['predicted'], 10)} {_fmt(r['paper'], 11)} {_fmt(r['ratio'], 10)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--ipc", action="store_true", help="also measure the fill executor's per-unit round trip")
    args = ap.parse_args()
    out = {"pipefill_6_1": pipefill(), "freeride_4_2": freeride(), "pipeswitch_table_3": pipeswitch(),
           "waterwave_table_1": waterwave()}
    pf, fr = out["pipefill_6_1"], out["freeride_4_2"]
    print(f"PipeFill 6.1: {pf['setup']}")
    print_rows(pf["rows"])
    print(f"  main-job overhead: {pf['main_overhead_text']}")
    print(f"FreeRide 4.2: {fr['setup']}")
    print_rows(fr["rows"])
    for t in fr["tasks"]:
        print(f"  {t['side_task']}: workers (pipeline ranks) {t['workers_plan']} in the plan, {t['workers_steps']} "
              f"with FreeRide's steps; {t['samples_per_s_plan']:.0f} / {t['samples_per_s_steps']:.0f} samples/s; "
              f"steps per main iteration by rank {[round(s, 2) for s in t['steps_per_rank']]}"
              f"{'' if t['fits_rtx3080'] else '; over the RTX 3080 beside its 3 GiB reserve (priced anyway)'}")
    print("  cross-check of S's inputs against the authors' artifact (measured, not the paper's text):")
    print_rows(fr["artifact_check"], against="artifact")
    ps = out["pipeswitch_table_3"]
    print(f"PipeSwitch Table 3: {ps['setup']}")
    print_rows(ps["rows"])
    ww = out["waterwave_table_1"]
    print(f"Waterwave Table 1 and 5.3: {ww['setup']}")
    print_rows(ww["rows"])
    if args.ipc:
        out["ipc_s"] = measure_ipc()
        print(f"fill executor request/reply per unit: {out['ipc_s'] * 1e6:.1f} us")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
