"""What running a fill job inside a bubble costs beyond its own compute, and how much of a bubble it may take.

Named constants with their sources (seed files in ../shared/seeds/: 000 FreeRide, 001 PipeFill, 002 PipeSwitch).
Nothing here is fitted to the papers' result figures; `bench/paper_fill.py` compares against those.

The fill job's own compute is priced by the same cost models as the main job, at the fill job's own sizes
(batch, hidden size: small products run below the GEMM ceiling, `Hardware.matmul_rate`) and on the main job's
hardware and calibration. What the bubble adds is priced here, as the runtime (planner/runtime/fill_executor.py,
iterative interface) runs it:

- **The share of a bubble filled.** PipeFill measured a main-job overhead under 2% while its executor filled up
  to 68% of each bubble, and a substantial one above (001 l.231); its simulator fills 68% by default. The
  default safety margin is the rest, 32%. FreeRide runs a step whenever the time left exceeds the step's
  profiled duration (000 l.249), with no margin; its measured time increase was 0.9-1.4% (Table 1).
- **Admission of a step.** The runtime starts a unit only if the usable time left covers its profiled time x
  `STEP_SAFETY` + `STEP_ALLOWANCE_S` (FreeRide's program-directed limit with our margin for a step that runs
  slower than profiled): the last unit of a chunk needs that slack, so a chunk is charged it once.
- **Every unit a round trip.** Each unit is one request from the executor to the task process and one reply
  (a pipe each way), and on CUDA the task synchronizes at the unit's end, so the next unit's first kernel
  launch is exposed: `STEP_IPC_S` + the target's kernel launch per unit (charged to a batched unit too, though
  its batch makes one round trip).
- **Interruption.** No step is cut by the bubble's end (admission above), so the interruption PipeFill names
  (001 l.245) is the tail of the bubble the next unit does not fit into: the packing's granularity, priced by
  the packer, not a constant.
- **The host.** The runtime runs a fill job as eager PyTorch, each op dispatched by the host (under autograd and
  autocast in training): a unit takes no less than `host_unit_s` of its kernels (HOST_UNIT_S, measured), whatever
  little GPU work it holds; small fill jobs are bound by it (the plan says which).
- **Sharing the GPU with the waiting main job.** In a bubble the main job waits in a receive, and NCCL's receive
  is a kernel spinning on the GPU until the data arrives. Without MPS the GPU time-slices between the two
  processes' contexts: each time the fill job synchronizes (every unit ends with one) the spinning receive takes
  a slice, and while both have work they alternate (`TIMESLICE_S`, measured; `shared_unit_s`). So the runtime
  runs units back to back in batches of up to `BATCH_WORK_S` of their own work, ending each batch with one
  synchronize, where that is cheaper than a synchronize each (`batched`: every unit under 0.8 of a slice), as
  PipeFill's Executor synchronizes per graph partition (001 l.107), not per layer: such a unit takes twice its
  compute and its share of the batch's slice (`runtime_unit_s`). PipeFill's
  Executor is such a process (001 l.107); FreeRide runs its side tasks under MPS (000 l.187), where the fill job's
  kernels share the SMs with the receive's and it is priced at its own speed (measured: GEMM loops at 0.92-1.03
  of alone; the runtime's own BERT-base units at 1.38x their MPS-alone time, about their time alone without
  MPS: optimistic by up to that for units of many small kernels). A fill
  spec says which (`gpu_sharing`: timeslice, the default, mps, or none where the main job waits on the host, as
  the CPU runtime's gloo receive does).
- **Process switch.** The fill job runs in its own process, created and initialized before the first bubble
  and kept (FreeRide's PAUSED state holds its GPU context, 000 l.205): the seconds of process launch and CUDA
  context creation PipeSwitch measured for stop-and-start (Table 1: 7.3 s on a V100, 002 l.102-110) are paid
  once, not per bubble. Per bubble, the signal crosses two pipes (main job -> executor -> task), within
  `STEP_ALLOWANCE_S`.
- **Memory.** The task process's CUDA context stays on the device between bubbles: `FILL_CONTEXT_BYTES`
  (PipeSwitch: "every standby worker needs to maintain its own CUDA context, which consumes a few hundred MB
  GPU memory", 002 l.282). What a fill job holds between bubbles (context, weights, optimizer state, the
  activations of an iteration it is in the middle of) must fit beside the main job at the main job's peak on
  that rank; what it uses only while it runs must fit beside the main job's memory during that bubble (the
  pipeline program's memory ledger). PipeFill empties the main job's allocator cache at every bubble so its
  cached free blocks count as free (001 l.115, 117); the runtime does the same on CUDA.
"""
from __future__ import annotations

import math
from typing import Literal, Sequence

__all__ = ["SAFE_FILL_FRACTION", "DEFAULT_SAFETY_MARGIN", "STEP_SAFETY", "STEP_ALLOWANCE_S", "STEP_IPC_S",
           "FILL_CONTEXT_BYTES", "TIMESLICE_S", "HOST_UNIT_S", "HOST_KERNEL_S", "HOST_OPTIMIZER_TENSOR_S",
           "host_unit_s", "GpuSharing", "FillPolicy", "chunk_overhead_s", "unit_overhead_s",
           "shortest_bubble_s", "shared_unit_s", "BATCH_WORK_S", "batched", "runtime_unit_s"]

GpuSharing = Literal["timeslice", "mps", "none"]
"""timeslice: the fill's process beside the main job's, whose receive spins on the GPU (NCCL); mps: the same under
MPS; none: the main job waits on the host (the CPU runtime's gloo receive), the fill has the device to itself."""
FillPolicy = Literal["fifo", "sjf", "makespan", "edf"]
"""Which of a rank's fill jobs runs next when one ends: the names of planner/fill/job_scheduler.py POLICIES."""

SAFE_FILL_FRACTION = 0.68
"""PipeFill 6.1 (001 l.231): the main job's overhead stays under 2% up to 68% of each bubble filled."""
DEFAULT_SAFETY_MARGIN = round(1.0 - SAFE_FILL_FRACTION, 2)
STEP_SAFETY = 1.25
"""The runtime starts a unit only if the usable time left >= its profiled (or recently observed) time x this."""
STEP_ALLOWANCE_S = 1e-3
"""... + this: the bubble signal's two pipe hops, the task's wake-up and a unit's jitter."""
STEP_IPC_S = 40e-6
"""One executor -> task -> executor round trip of a unit's request and reply over multiprocessing pipes: 38 us
measured on the 2-core CI machine (`python bench/paper_fill.py --ipc` measures it where you run it)."""
FILL_CONTEXT_BYTES = 300 << 20
"""A fill task process's CUDA context on the device: "a few hundred MB" (PipeSwitch, 002 l.282)."""


HOST_UNIT_S = {"infer": 120e-6, "forward": 150e-6, "backward": 380e-6}
"""The host's seconds to run one unit beyond its kernels (the fill task's step: the unit's arguments, autocast and
grad mode, its call; for a backward the autograd engine's call), and HOST_KERNEL_S per kernel the unit launches
(passes.units Part.kernels), each op dispatched eagerly (under autograd and autocast in training). A unit takes no
less than these on the host however little GPU work it holds: BERT-base inference at batch 8 in bf16 runs 0.5 ms a
layer where its kernels take 0.1 ms. Measured on the H100 machine (2026-11-27: `python bench/cuda_fill_speed.py`,
bench/results/cuda_fill_speed_h100_2026-11-27.json, each unit queued with the GPU idle at its start and no
synchronize: unit_host_s) over BERT-base inference (b 8/32/128) and ResNet18/50 and VGG19 training (b 64), fp32 and
bf16: least squares of each mode's units on the planner's kernel count (training's first unit, which waits for its
batch, left out); inference's per-unit part from its one-kernel head units (77-176 us), its per-kernel part from its
layers. Per iteration these give 0.86-1.18x the measured host time of ten of the twelve jobs; BERT at batch 32
0.65-0.76x (its host ran 8.5-9.9 ms an iteration where batch 8 and 128 ran 5.8-6.7: the host's noise, or its
allocator; tests/fill/test_physics.py holds the other ten to 0.7-1.3x); on the H200 machine's host (same day,
cuda_fill_speed_h200_2026-11-27b.json) 0.79-1.37x of eleven, BERT b32 fp32 0.61x. Host speed is the machine's,
not the GPU's: taken for every target (the papers' V100 and RTX 6000 Ada hosts are not measured)."""
HOST_KERNEL_S = {"infer": 24e-6, "forward": 58e-6, "backward": 39e-6}
HOST_OPTIMIZER_TENSOR_S = 34e-6
"""The optimizer step's host seconds per parameter tensor (torch.optim.Adam, foreach): 2.1, 5.1, 1.9 ms for ResNet18,
ResNet50, VGG19's 62, 161, 38 tensors on the H100 machine (same file)."""


TIMESLICE_S = 2.2e-3
"""The GPU time a spinning context takes from a time-sliced fill process each time the fill synchronizes, and
the slice the two alternate by while both have work. Measured on an H100 (driver 580.159.04, torch 2.11; `python
bench/cuda_colocate.py`, bench/results/cuda_colocate_h100_2026-11-26.json): a GEMM loop synchronizing every k
products beside a process spinning one kernel (`torch.cuda._sleep`, as NCCL's receive spins) gives it 2.36, 2.34,
2.23 ms per synchronize (k = 1, 10, 100 products of 8x128 tokens, 768 -> 3072) and 2.13 ms (k = 1, 8192^3); with
16 ms of work between synchronizes the fill gets 0.52 of the GPU. Beside a process that launches nothing it runs
at its own speed (0.97-1.04), and nearly so under MPS beside the spinning kernel (0.92-1.03). The runtime's own
task (planner/runtime/fill_task.py, BERT-base inference at batch 8, 14 units an iteration) took 44.7 ms an
iteration beside the receive against 41.2 ms from `shared_unit_s` of its 10.4 ms alone (`--runner-only`,
bench/results/cuda_colocate_runner_h100_2026-11-26.json). The slice is the driver's scheduling policy
(`nvidia-smi compute-policy`), taken here for every GPU: not measured on others."""


def shared_unit_s(compute_s: float, sharing: GpuSharing) -> float:
    """A fill unit's seconds inside a bubble beside the main job's waiting receive. Time-sliced, the receive gets
    one slice for each slice the unit uses, and at least one, at the synchronize that ends it: the unit's compute
    plus TIMESLICE_S x ceil(compute / TIMESLICE_S). Under MPS, or beside a main job waiting on the host, its
    compute."""
    if sharing != "timeslice" or compute_s <= 0:
        return compute_s
    return compute_s + TIMESLICE_S * math.ceil(compute_s / TIMESLICE_S)


BATCH_WORK_S = 4 * TIMESLICE_S
"""The most of a job's own GPU work a batch of short units holds before its synchronize. Longer batches hand the
receive fewer slices (one per batch: TIMESLICE_S / BATCH_WORK_S, a quarter of the work here); shorter ones bound
what a bubble that ends earlier than measured leaves running beside the main job's next kernels (about twice this,
time-sliced)."""


def _in_batch_s(compute_s: float) -> float:
    """A time-sliced unit's seconds inside a full batch: its compute twice over (the GPU alternates between the batch
    and the spinning receive by slices) plus its share of the slice the batch's synchronize hands the receive."""
    return 2 * compute_s + TIMESLICE_S * compute_s / BATCH_WORK_S


def batched(compute_s: float, sharing: GpuSharing) -> bool:
    """Whether the runtime runs a unit of this compute in batches: time-sliced, no longer than a batch holds, and
    cheaper so than with a synchronize of its own (always below 0.8 of a slice; between multiples of a slice above)."""
    return sharing == "timeslice" and 0 < compute_s <= BATCH_WORK_S and \
        _in_batch_s(compute_s) < shared_unit_s(compute_s, sharing)


def runtime_unit_s(compute_s: float, sharing: GpuSharing, host_s: float = 0.0) -> float:
    """A unit's seconds inside a bubble as the runtime runs it: in a batch where that is cheaper (`batched`, by its
    time alone, as the runtime decides from its profile), else between its own synchronizes (`shared_unit_s` of its
    time alone). `host_s`: the host's seconds to issue it (HOST_UNIT_S), where longer than its GPU time its time
    alone: in a batch the GPU alternating with the receive (twice its GPU time) cannot make it faster than the host
    issues it, and it hands the receive its share of the batch's slice by its time alone (a host-bound batch's queue
    runs dry and the receive takes the GPU: BERT-base inference at batch 8 in bf16, 14 units of 0.27 ms alone on
    an H200, ran 6.0 ms an iteration in one batch beside the receive, 3.9 ms alone, which this prices at 4.7 ms from
    those alone times; on an H100 3.7 ms of GPU timeline beside it, 4.2 ms alone: no slice seen there)."""
    alone = max(compute_s, host_s)
    if batched(alone, sharing):
        return max(host_s, 2 * compute_s) + TIMESLICE_S * alone / BATCH_WORK_S
    return shared_unit_s(alone, sharing)


def host_unit_s(mode: str, kernels: int) -> float:
    """The host's seconds to run a fill unit of `kernels` kernels eagerly: mode "infer", "forward" or "backward"."""
    return HOST_UNIT_S[mode] + HOST_KERNEL_S[mode] * kernels


def unit_overhead_s(launch_s: float) -> float:
    """Seconds each unit adds to its chunk beyond its compute: the request/reply round trip, and the first
    kernel launch after the previous unit's synchronize."""
    return STEP_IPC_S + launch_s


def chunk_overhead_s(unit_times: Sequence[float]) -> float:
    """Seconds each non-empty chunk is charged once: the admission slack of its last unit (bounded by the job's
    longest unit, so a chunk's fit does not depend on where it ends) and the runtime's per-step allowance."""
    return (STEP_SAFETY - 1.0) * max(unit_times, default=0.0) + STEP_ALLOWANCE_S


def shortest_bubble_s(unit_times: Sequence[float], launch_s: float, safety_margin: float) -> float:
    """The shortest bubble in which this job can run one unit: anything shorter is left empty."""
    return (chunk_overhead_s(unit_times) + min(unit_times, default=0.0) + unit_overhead_s(launch_s)) / \
        (1.0 - safety_margin)
