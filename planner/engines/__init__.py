"""What runs a plan: one `Engine` record per engine, registered by name in ``ENGINES``.

fxplanner's own runtime (`python -m planner.runtime`) runs the plan as the model file writes it; an exported engine
(Megatron-LM / Megatron-Core with Transformer Engine, torchtitan) runs the plan's export. A plan for an engine chooses
among what that engine runs, priced as its kernels run it. The CLI's --engine and `planner export --to`, the plan
file, the search's choices, the pricing and the launch read these records; adding an engine is adding its record here
(and its exporter in planner.export). Light: importable without torch or pydantic (the CLI's argument checks and the
runtime's top level read it).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter
from typing import Callable, Collection, Mapping

from costmodels.fp8 import Fp8Recipe, default_recipe
from costmodels.holding import DEFAULT_MEMORY, EngineMemory

__all__ = ["Engine", "ENGINES"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Engine:
    """One engine: what it is called, what it runs and how, how a plan for it is launched."""

    name: str
    """As --engine, `planner export --to` and the plan's source.engine spell it."""
    title: str
    """As sentences name it ("Megatron-Core")."""
    export: str = ""
    """The function of planner.export that writes a plan as this engine's job; the plan's launch runs that job's
    script on every node (planner.api.engine_launch). "": the fxplanner runtime, which runs the plan itself, launched
    with torchrun (planner.launch)."""
    schedules: tuple[str, ...] | None = None
    """The pipeline schedule kinds (planner.schedules) it runs; None: every registered kind."""
    schedule_names: Mapping[str, str] = field(default_factory=dict)
    """Its own names of the schedule kinds it has one for (torchtitan's schedule classes, read beside the plan's
    schedule CSV)."""
    kernels: str = "traced"
    """How its units are priced: a key of passes.kernels.KERNELS ("traced": op by op as the model file writes them;
    "titan": so, but for an attention core the file writes out, which torchtitan's own model runs as one fused kernel;
    "megatron": as Transformer Engine's fused kernels run them, with Megatron's own cross-entropy)."""
    attention: str = "sdpa"
    """The fused attention kernel it runs (targets.specs.ATTENTION_KERNELS), whose share of the peak on the GPU is the
    target's (GPUSpec.attention): "sdpa", torch's scaled_dot_product_attention as the model file calls it (the
    fxplanner runtime, torchtitan: its FlashAttention-2 backend on Ampere and Hopper); "te", Transformer Engine's
    fused attention (Megatron-Core: FlashAttention-3 or cuDNN's on Hopper)."""
    compile: str = ""
    """How it compiles a model's repeated blocks when told to (--compile, ParallelConfig.compile), as a key of
    passes.kernels.KERNELS its compiled units are priced as ("inductor": torch.compile's Inductor, each block one
    compiled region); "": it runs them as written (a plan with --compile is refused)."""
    async_tp: str = ""
    """How it runs async tensor parallelism (--async-tp, ParallelConfig.async_tp: the sequence-parallel collectives
    decomposed into per-rank chunks pipelined with the matrix products over symmetric memory), as sentences name it;
    "": it runs none (a plan with --async-tp is refused)."""
    fp8: str = ""
    """How it runs the linear layers' GEMMs in FP8, as sentences name it; "": it runs none."""
    fp8_recipe: Callable[[Fp8Recipe], str] | None = None
    """With fp8: its own name of an FP8 recipe (costmodels.fp8), "" for one it does not run."""
    fp8_default: Callable[[Collection[str]], str] | None = None
    """With fp8: the recipe --fp8 auto means on a GPU with these peak keys."""
    fsdp: str = ""
    """How it shards the parameters over the data-parallel ranks (ZeRO-3, FSDP), as sentences name it; "": it runs
    up to ZeRO-2."""
    optimizer_only: bool = True
    """It shards the optimizer state alone (ZeRO-1: Megatron's distributed optimizer, the fxplanner runtime's); False:
    a sharded step shards the gradients too (torchtitan shards with FSDP2 only: ZeRO-2 is fully_shard with
    reshard_after_forward False, the parameters whole through the step, ZeRO-3 with it True)."""
    hsdp: str = ""
    """How it runs hybrid-sharded data parallelism (--dp-replicate R with --zero 3: FSDP within each of R replicas,
    the gradient shards all-reduced across them), as sentences name it; "": it shards over every data-parallel rank
    or none (a plan with --dp-replicate above 1 is refused)."""
    expert_parallel: bool = False
    """It divides the experts of mixture-of-experts layers over expert-parallel ranks (--ep)."""
    moe_capacity: bool = False
    """It pads experts to a capacity factor (--moe-capacity); the others route every token to its experts."""
    moe_a2a_overlap: str = ""
    """How it hides a microbatch's expert all-to-alls behind another microbatch's compute (--moe-a2a-overlap), as
    sentences name it; "": its MoE layers wait for their dispatch and combine (torchtitan 0.3's token dispatchers,
    standard, DeepEP and HybridEP alike, read the combine's result at once and run the shared experts after it:
    torchtitan/models/common/token_dispatcher.py), and a plan with --moe-a2a-overlap is refused."""
    grouped_mm: bool = False
    """It runs a rank's local experts as torchtitan's GroupedExperts does (torchtitan/models/common/moe.py), priced so
    by costmodels.compute.unit_time: each of the experts' products is one torch._grouped_mm kernel over all the rank's
    experts and their tokens, which reaches the rate of one product of their total size
    (bench/results/README_cuda_2026-11-28.md), and the router's gate runs in fp32 (torch.autocast to float32 around
    it, TF32 off). False: a GEMM per expert, each at its own size (Transformer Engine's GroupedLinear issues one cuBLAS
    call per expert), the gate in the model's precision."""
    grad_fp32: bool = False
    """By default it accumulates and reduces bf16 training's gradients in fp32 (else in the weights' dtype)."""
    grad_reduce_bf16: bool = True
    """It can reduce bf16 training's gradients in bf16 (--grad-reduce-in-bf16); False: always in fp32 (torchtitan's
    training.mixed_precision_reduce takes "float32" only, FSDP2's MixedPrecisionPolicy reduce_dtype; under DDP its
    parameters and their gradients are fp32)."""
    selective: str = "core"
    """What its selective recomputation checkpoints (passes.units.Unit.checkpoint): "core", the attention core
    (Megatron-Core's --recompute-granularity selective --recompute-modules core_attn; the fxplanner runtime's); "op",
    per op as torch.utils.checkpoint's selective checkpointing runs a policy (torchtitan's SelectiveAC, its
    activation_checkpoint.mode "selective": the outputs of the matrix products but every second one and of the
    attention kernel are kept, the rest rerun in the backward)."""
    memory: EngineMemory = DEFAULT_MEMORY
    """How it holds parameters, gradients and the loss's temporaries where the engines differ (costmodels.holding)."""
    eager: bool = False
    """Run as written (not compiled), its memory-bound ops are eager PyTorch's kernels, one per op, each at its own
    measured speed (costmodels.eager; Efficiency.eager), with nothing fused (torchtitan without --compile.enable runs
    the model file's RMSNorm, rotary embedding and SwiGLU op by op). False: priced with Efficiency.fusion, the share of
    the elementwise traffic an engine's fused kernels avoid (the fxplanner runtime's figures were fitted so)."""
    @property
    def zero_stages(self) -> tuple[int, ...]:
        """The ZeRO stages it runs (--zero): none, the optimizer's alone where it can, the gradients' (ZeRO-2), and
        the parameters' where it shards them (fsdp)."""
        return (0, *((1,) if self.optimizer_only else ()), 2, *((3,) if self.fsdp else ()))

    recompute_block: bool = True
    """It recomputes the first N blocks of each model chunk (recompute "block"), which the search tries where
    recomputing nothing does not fit."""
    fill: str = ""
    """The module that runs fill jobs in its pipeline bubbles; "": it runs none (a plan with fill jobs is refused).
    Fill adapters for the exported engines are modules of this package."""


ENGINES: dict[str, Engine] = {e.name: e for e in (
    Engine(name="fxplanner", title="the fxplanner runtime", fill="planner.runtime.fill_client",
           memory=EngineMemory(loss_backward=True)),
    Engine(name="megatron", title="Megatron-Core", export="to_megatron", schedules=("1f1b", "interleaved"),
           fill="planner.engines.megatron_fill",
           kernels="megatron", attention="te", fp8="Transformer Engine's recipes",
           fp8_recipe=attrgetter("megatron_recipe"),
           fp8_default=default_recipe, fsdp="Megatron-FSDP", hsdp="Megatron-FSDP's hybrid FSDP", expert_parallel=True,
           moe_capacity=True, moe_a2a_overlap="its 1F1B all-to-all overlap, --overlap-moe-expert-parallel-comm",
           grad_fp32=True),
    Engine(name="torchtitan", title="torchtitan", export="to_torchtitan", fill="planner.engines.titan",
           schedule_names={"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved1F1B"},
           fp8="torchao's float8", fp8_recipe=attrgetter("titan_recipe"), fp8_default=lambda peaks: "torchao-rowwise",
           fsdp="FSDP2", hsdp="FSDP2's HSDP", optimizer_only=False, expert_parallel=True, grouped_mm=True,
           recompute_block=False,
           selective="op", grad_fp32=True, grad_reduce_bf16=False, kernels="titan",
           compile="inductor", eager=True,
           async_tp="torch's micro-pipelined TP (Inductor's micro_pipeline_tp pass)",
           memory=EngineMemory(master_shard=True, step_frees_grads=True, grad_pool=True, loss_parallel=True,
                               loss_backward=True)),
)}
"""Megatron-Core runs forward_backward_pipelining_without_interleaving / with_interleaving; torchtitan runs any of the
plan's schedules from the CSV of its actions the export writes. Megatron accumulates and reduces bf16 training's
gradients in fp32 unless told --grad-reduce-in-bf16 (megatron/training/arguments.py). torchtitan's activation
checkpointing checkpoints every block or every k-th one, not the first N. torchtitan compiles each TransformerBlock
on its own (--compile.enable; torchtitan/models/llama3/infra/parallelize.py apply_compile, after activation
checkpointing and before FSDP), the rest of the model (embedding, final norm, output projection) eager; the fxplanner
runtime runs the model file eagerly. Hybrid sharding: torchtitan applies fully_shard over the 2-D mesh
(dp_replicate, fsdp = dp_shard x cp) of --parallelism.data_parallel_replicate_degree and data_parallel_shard_degree
(torchtitan/distributed/parallel_dims.py, ranks ordered pp, dp_replicate, dp_shard, cp, tp), and FSDP2 all-reduces
each reduce-scattered gradient shard over the replicate group (torch/distributed/fsdp/_fully_shard/
_fsdp_collectives.py foreach_reduce, all_reduce_group); Megatron-FSDP does the same with
--num-distributed-optimizer-instances R (megatron/core/distributed/fsdp/mcore_fsdp_adapter.py: enable_hsdp, its
shard group the contiguous dp x cp / R ranks of parallel_state's intra-partial data-parallel group, the outer
replicas its inter-distributed-optimizer-instance group)."""
