"""How an engine holds parameters, gradients and the loss's temporaries where the engines differ: one record per
engine, on its `planner.engines.Engine` (`memory`), read by costmodels.memory. Light: no torch (the engine registry
imports it)."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_MEMORY", "EngineMemory"]


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineMemory:
    """How an engine holds parameters and gradients where the engines differ (the default: Megatron-Core's and the
    fxplanner runtime's, persistent gradient buffers and a training-precision weight copy beside the optimizer's
    fp32 master)."""

    master_shard: bool = False
    """Under ZeRO-3 the sharded parameter is the fp32 master weight the optimizer steps, and the training-precision
    copy exists only unsharded, while a unit runs (torch FSDP2 with a MixedPrecisionPolicy: fully_shard keeps the
    module's fp32 parameter as its sharded DTensor, torch/distributed/fsdp/_fully_shard/_fsdp_param.py FSDPParam.
    _init_sharded_param, and casts to param_dtype in its all-gather input, foreach_all_gather_copy_in); the
    optimizer keeps Adam's two moments only."""
    step_frees_grads: bool = False
    """Each step starts with its gradients freed (torchtitan's train_step calls optimizers.zero_grad(), torch.optim.
    Optimizer.zero_grad's set_to_none=True; FSDP2 assigns each sharded gradient anew after its reduce-scatter,
    _fsdp_collectives.py foreach_reduce): with one microbatch per step none exists before the backward, and each
    unit's appears as its backward ends, when its activations are freed (stage_memory's backward sweep)."""
    grad_pool: bool = False
    """The sharded gradients live in a pool of their own, reserved all step: FSDP2 allocates each unit's
    reduce-scatter output, whose views are its sharded gradients, on the reduce-scatter stream (torch/distributed/fsdp/
    _fully_shard/_fsdp_collectives.py foreach_reduce: "the GPU sharded gradient is allocated in the RS stream"; on
    the all-reduce stream under HSDP), and torch's caching allocator reuses a freed block only on the stream that
    allocated it (c10/cuda/CUDACachingAllocator.cpp, one pool per stream). What zero_grad frees stays reserved for the
    next step's gradients, out of reach of the compute stream's activations: the device holds the compute stream's
    peak and every sharded gradient beside it (torch.cuda.max_memory_reserved, what torchtitan logs as its memory),
    even where no gradient is allocated at that peak."""
    loss_parallel: bool = False
    """Under tensor parallelism the loss runs on each rank's vocabulary shard of the logits, never gathered whole:
    torchtitan's loss parallelism (its output projection ColwiseParallel with output_layouts Shard(-1); torch.
    distributed.tensor.parallel.loss_parallel through torchtitan 0.2, on by default (--parallelism.
    disable_loss_parallel false), and torchtitan/components/loss.py _LossParallelCrossEntropy since, always on): the
    loss's kept log-softmax and its backward's gradients are 1/t of the logits' (Unit.loss_kept, Unit.loss_held)."""
    loss_backward: bool = False
    """The backward of the model file's loss is priced: Unit.loss_work, the gradients torch.nn.functional.
    cross_entropy's backward holds (aten.nll_loss_backward's and aten._log_softmax_backward_data's, fp32 and of the
    logits' size each) beside the saved log-softmax and every kept activation, a working set of the last unit's
    backward. torchtitan computes that loss (torchtitan/components/loss.py cross_entropy_loss: the logits cast to
    fp32, over the whole vocabulary), and so does the fxplanner runtime, which runs the model file's loss_fn: its last
    stage held both gradients at its peak (a CPU tracker of every live storage over a rehearsed HF Llama rank,
    bench/results/README_cuda_2026-11-28.md). Megatron-Core runs its own fused vocabulary-parallel cross-entropy (no
    loss_work is measured for kernels "megatron")."""


DEFAULT_MEMORY = EngineMemory()
