"""Time of a unit on a target GPU under a training configuration.

Roofline per bucket: matrix products run at an achievable fraction of the precision's dense peak
that grows with the size of the product (small GEMMs cannot fill the GPU), or are bound by HBM
traffic; everything else is memory-bound elementwise work. Each kernel costs a launch overhead. A
per-target calibration factor, set from a measured profile, scales the result. Tensor
parallelism divides the sharded part by t and adds the all-reduces of Megatron's split; the
recomputation mode (costmodels.recompute) adds what the backward redoes. The backward splits into
the weight gradients (W: each weight product's dW) and the input gradient (I: everything else),
which zero-bubble pipeline schedules run apart (Qi et al. 2024).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from passes.units import Part, Unit

from .comm import allreduce_time, alltoall_time, p2p_time
from .eager import eager_share
from .fp8 import Fp8Recipe, runs_fp8
from .hardware import Hardware
from .memory import param_count

if TYPE_CHECKING:
    from planner.config import ParallelConfig

__all__ = ["MEGATRON_MOE_HOST_S", "UnitTime", "moe_host_wait_s", "part_forward_s", "unit_time", "tp_allreduce_s",
           "async_tp_s", "cp_ring_s", "expert_alltoall_s"]


@dataclass(frozen=True, kw_only=True, slots=True)
class UnitTime:
    fwd_s: float  # forward compute + forward TP all-reduces + exposed context-parallel ring
    bwd_s: float  # backward (+ recomputation) + backward TP all-reduces + exposed ring
    tp_comm_s: float  # of which TP communication, forward + backward
    cp_comm_s: float = 0.0  # of which the context-parallel ring's exposed part, forward + backward
    bwd_weight_s: float = 0.0  # of bwd_s, the weight gradients (W): each weight product's dW and its launch
    ep_comm_s: float = 0.0  # of fwd_s + bwd_s, the expert-parallel all-to-alls (dispatch, combine, their gradients)
    weight_cast_s: float = 0.0  # cached FP8 weights' casts, once per iteration: fwd_s holds 1/m of it
    host_wait_s: float = 0.0  # of fwd_s, what a MoE layer waits for the engine's host beyond its kernels

    @property
    def bwd_input_s(self) -> float:
        """Of bwd_s, the input gradient (I): the dX products, the elementwise backward, recomputation, the
        backward's TP all-reduces, context-parallel ring and expert all-to-alls (all on the path of the gradient
        sent upstream)."""
        return self.bwd_s - self.bwd_weight_s


def _part_time(part: Part, b: float, t: int, hw: Hardware, precision: str, fp8: Fp8Recipe | None = None,
               groups: float = 1.0, weights: float = 1.0, compiled: bool = False) -> tuple[float, float, float]:
    """(forward, backward, of the backward the weight gradients) seconds of one part, already divided over t
    GPUs. Each matrix product is its own kernel on the roofline: compute-bound at the GEMM efficiency its size
    reaches, or bound by the bytes it moves (attention's score products Q K^T and P V with a small head dimension
    are, on A100 and more so on H100); its backward FLOPs (two products per product, five for a fused attention's
    two) run at its rate, the dW product's share of them being the weight gradient (with one launch of its own).
    Under an FP8 recipe (costmodels.fp8) a weight product's three GEMMs run at the FP8 rate, and the casts of its
    input X (forward) and output gradient dY (backward; torchao casts X again there) move their bytes
    (Fp8Recipe.activation_casts; `compiled`: as Inductor fuses them), each cast a kernel of its own; the dW's share
    of the dY cast is the weight gradient's. `groups`: each weight product is a
    grouped GEMM of that many equal GEMMs (a rank's local experts), which reads `weights` of the product's weights (the
    bytes it moves whatever the batch: 1/ep of the experts'). Its efficiency is that of one of them where each is its
    own kernel (Transformer Engine's GroupedLinear), that of the whole where one kernel runs them all
    (torch._grouped_mm: Efficiency.grouped_mm)."""
    gpu, eff = hw.gpu, hw.eff
    bw, vec = gpu.hbm_bw * eff.hbm, gpu.peak("fp32")
    mm = mm_bwd = mm_bytes = fwd = bwd = wgrad = 0.0
    wgrad_kernels = casts = 0
    cast_x, cast_y, recast_x = fp8.activation_casts(compiled) if fp8 is not None else (0.0, 0.0, 0.0)
    for flops_of, bytes_of, bwd_flops_of, fused, wgrad_flops_of, x_of, y_of in part.products:
        f, by, fb, wf = flops_of(b) / t, bytes_of(b) / t, bwd_flops_of(b) / t, wgrad_flops_of(b) / t
        mm, mm_bwd, mm_bytes = mm + f, mm_bwd + fb, mm_bytes + by  # (what the rest of the part's bytes are net of)
        if weights != 1.0 and wf > 0:
            by -= (1 - weights) * bytes_of(0) / t
        low = fp8 is not None and wf > 0 and not fused
        dtype = fp8.gemm_dtype if low else precision
        size = f / groups if wf > 0 and not eff.grouped_mm else f
        rate = hw.matmul_rate(size, dtype, attention=fused) if f > 0 else gpu.peak(dtype)
        fwd += max(f / rate, by / bw)
        product_bwd = max(fb / rate, 2 * by / bw)
        bwd += product_bwd
        if low:
            x, y = x_of(b) / t, y_of(b) / t
            fwd += cast_x * x / bw
            cast_bwd = (cast_y * y + recast_x * x) / bw
            bwd += cast_bwd
            wgrad += cast_bwd * wf / fb
            casts += 1
        if wf > 0:  # dW and dX each move the forward's bytes: compute- or memory-bound, W is its FLOPs' share
            wgrad += product_bwd * wf / fb
            wgrad_kernels += 1
    ew_flops = max(part.fwd_flops(b) / t - mm, 0.0)
    bwd_ew_flops = max(part.bwd_flops(b) / t - mm_bwd, 0.0)
    if eff.eager:  # each kind of kernel at its own measured speed; nothing fused
        ew_s = sum(f(b) / t / (gpu.hbm_bw * eager_share(k, eff.hbm)) for k, f, _ in part.memory_bound)
        bwd_ew_s = sum(bb(b) / t / (gpu.hbm_bw * eager_share(k, eff.hbm)) for k, _, bb in part.memory_bound)
    else:
        ew_s = max(part.fwd_bytes(b) / t - mm_bytes, 0.0) * (1 - eff.fusion) / bw
        bwd_ew_s = max(part.bwd_bytes(b) / t - 2 * mm_bytes, 0.0) * (1 - eff.fusion) / bw
    fwd += max(ew_flops / vec, ew_s)
    bwd += max(bwd_ew_flops / vec, bwd_ew_s)
    launches = (part.kernels + casts) * eff.launch_s
    return ((fwd + launches) * eff.calibration, (bwd + 2 * launches) * eff.calibration,
            (wgrad + wgrad_kernels * eff.launch_s) * eff.calibration)


def part_forward_s(part: Part, b: float, t: int, hw: Hardware, precision: str, fp8: Fp8Recipe | None = None,
                   compiled: bool = False) -> float:
    """Forward seconds of one part divided over t GPUs, as unit_time prices a forward (what a recomputation reruns:
    its weight products under the FP8 recipe they ran under)."""
    return _part_time(part, b, t, hw, precision, fp8, compiled=compiled)[0]


def _gemm_s(part: Part, b: float, t: int, hw: Hardware, precision: str, fp8: Fp8Recipe | None = None,
            rows: bool | None = None) -> float:
    """Forward seconds of the part's products that are not a fused attention kernel, divided over t (`rows`: only
    the row-parallel ones, or only the others)."""
    bw = hw.gpu.hbm_bw * hw.eff.hbm
    return sum(max(f(b) / t / hw.matmul_rate(f(b) / t, fp8.gemm_dtype if fp8 and wf(b) > 0 else precision),
                   by(b) / t / bw)
               for i, (f, by, _, fused, wf, _, _) in enumerate(part.products)
               if not fused and f(b) > 0 and (rows is None or (i in part.row_products) == rows)) * hw.eff.calibration


DISPATCHER_SMS = {"deepep": 20, "hybridep": 16}
"""SMs the flex dispatchers' dispatch and combine kernels occupy: Megatron-Core's TransformerConfig defaults
moe_deepep_num_sms = 20 and moe_hybridep_num_sms = 16 (Megatron-Bridge's recipes keep them). Overlapped with another
microbatch's compute (--overlap-moe-expert-parallel-comm), that compute runs on the other SMs while they do: a hidden
all-to-all of A seconds costs A x sms / SMs (the work those SMs would have done meanwhile). Megatron's NCCL
all-to-all dispatcher is not charged: its channel count is NCCL's choice, not a stated configuration."""

MEGATRON_MOE_HOST_S = 5.3e-3
"""Least seconds of one mixture-of-experts layer's forward in Megatron-Core run eagerly (no full-iteration CUDA graph):
the host time of its Python (Transformer Engine's modules, the router, the dispatcher's bookkeeping, the grouped
experts). A dropless dispatch needs each expert's token count on the host, so it drains the stream every MoE layer
(megatron/core/transformer/moe/token_dispatcher.py `_maybe_dtoh_and_synchronize`; fused_a2a.py: HybridEP's dispatch
blocks unless told num_permuted_tokens): the host cannot run ahead of the GPU past a MoE layer, and a layer whose
kernels take less than its host time waits for the host. Megatron's host time per layer hardly depends on tensor
sizes: one constant. Fitted to one row, mbridge-26041-qwen3-30b-a3b-fp8cs-16 of bench/reference_runs_2026.json
(Qwen3-30B-A3B, FP8, HybridEP, 16 H100, 0.1 ms grid: that row's layers price 2.6 ms of GPU work a forward). Checked
without refitting: the same model's B200 and GB200 rows (their layers' forwards, 4.1 / 4.0 ms, also wait for the host),
and Megatron-Bridge's eager BF16 run of the H100 row with the all-to-all dispatcher (docs/training/cuda-graphs.md:
41.36 s an iteration, 40.2 s priced: its forward's 5.6 ms of kernels, mostly the cross-node all-to-all, hide the host,
and CUDA graphs of attention and the router did not speed it up there). The larger MoE rows' layers (Qwen3-235B,
DeepSeek-V3) take about as long on the GPU, and so barely feel it. Not applied to torchtitan (its host time is not
measured here) nor to the backward (no drain: the host runs ahead), nor where the experts' input is padded to a capacity
(ParallelConfig.moe_capacity: the token counts are known, no drain; Megatron-Core token_dispatcher.py drop_and_pad)."""

UB_SMS = 16
"""SMs a Transformer Engine userbuffers overlap takes from the GEMM it runs beside, for its "pipeline" (a row-parallel
linear's forward reduce-scatter) and "bulk" (a column-parallel linear's backward all-gather / reduce-scatter) methods:
TE's default configuration (transformer_engine/pytorch/module/base.py, initialize_ub: num_sm 16 and set_sm_margin for
every method but ring_exchange, whose point-to-point copies take one SM), which Megatron's --tp-comm-overlap runs without
--tp-comm-overlap-cfg. The GEMM runs on the remaining SMs for its whole length."""


def ub_sm_s(unit: Unit, b: float, t: int, hw: Hardware, precision: str, fp8: Fp8Recipe | None) -> tuple[float, float]:
    """(forward, backward) seconds tensor-parallel communication overlap adds to a unit's GEMMs by taking SMs from
    them (UB_SMS): the forward row-parallel products, and the column-parallel products' input and weight gradients."""
    sms = hw.gpu.sms
    if not sms or t == 1:
        return 0.0, 0.0
    slow = UB_SMS / (sms - UB_SMS)
    return (_gemm_s(unit.sharded, b, t, hw, precision, fp8, rows=True) * slow,
            2 * _gemm_s(unit.sharded, b, t, hw, precision, fp8, rows=False) * slow)


def async_tp_s(unit: Unit, b: float, t: int, hw: Hardware, precision: str, fp8: Fp8Recipe | None, ar_f: float,
               ar_b: float) -> tuple[float, float]:
    """(forward, backward) seconds the unit's sequence-parallel all-gathers and reduce-scatters (`ar_f`, `ar_b` as
    unpipelined collectives take them) add under async tensor parallelism, as torch's micro-pipeline runs them
    (torch/distributed/_symmetric_memory/__init__.py; Inductor's micro_pipeline_tp pass, torch/_inductor/fx_passes/
    micro_pipeline_tp.py, rewrites all_gather -> mm and mm -> reduce_scatter into fused_all_gather_matmul and
    fused_matmul_reduce_scatter):

    - each collective is split into t per-rank chunks over symmetric memory: the all-gather's matrix product runs as t
      products of 1/t of the tokens, the local shard's first, each remote shard pulled (a copy_ of a peer's buffer)
      while the previous shard's product runs, on two streams (_pipelined_all_gather_and_consume); the reduce-scatter's
      product runs as t products, each chunk pulled by its rank while the next one is produced
      (_pipelined_produce_and_all2all). Two serial resources, t - 1 transfers of C / (t - 1) and t products of G / t:
      the step takes max(G, G / t + C) (a flow shop), so what stays exposed is what the products' (t - 1) / t cannot
      cover, C - G (t - 1) / t, as for Transformer Engine's userbuffers; the transfers are copies of contiguous
      tensors (cudaMemcpyAsync on the copy engines), which take no SMs from the products (unlike UB_SMS);
    - the t smaller products reach less of the peak than one (Hardware.matmul_rate's size term): the decomposition's
      own cost, forward and again in the backward's input-gradient products, which the pass decomposes the same way;
    - what the pipeline cannot hide: the all-gather's copy of the local shard into its symmetric buffer before the
      barrier (its 1/t of the gathered bytes read and written), the reduce-scatter's sum of the t pulled partial
      products after it (the whole output read, its 1/t written), both memory-bound; and the two barriers that open
      and close each collective, an NVLink latency each.

    Only the input-gradient products are decomposed in the backward (their all-gather / reduce-scatter of the output
    gradients); the weight-gradient products contract over the gathered tokens, which the pass does not split, so
    they cover nothing (Transformer Engine's bulk overlap runs its collectives beside them: 2 x the cover there).
    Published: up to ~29% faster forwards and ~8% end to end for Llama 3 8B, ~20% / ~8% for 70B, TP 8 on H100
    (PyTorch dev-discuss, "[Distributed w/ TorchTitan] Introducing Async Tensor Parallelism in PyTorch", 2024)."""
    if t == 1 or not (ar_f or ar_b):
        return ar_f, ar_b
    whole = _gemm_s(unit.sharded, b, t, hw, precision, fp8)
    split = t * _gemm_s(unit.sharded, b / t, t, hw, precision, fp8)  # t products of 1/t of the tokens each
    cover, extra = split * (t - 1) / t, max(0.0, split - whole)
    hbm = hw.gpu.hbm_bw * hw.eff.hbm
    pairs = max(unit.tp_allreduces, 1)  # an all-gather and a reduce-scatter for each all-reduce unpipelined TP runs

    def fixed(nbytes: float) -> float:  # the all-gathers' local copies (2/t) and the reduce-scatters' sums (1 + 1/t)
        return nbytes * (1 + 3 / t) / hbm + 2 * 2 * pairs * hw.cluster.nvlink_latency_s

    return (max(0.0, ar_f - cover) + extra + fixed(unit.tp_fwd_allreduce_bytes(b)),
            max(0.0, ar_b - cover) + extra + fixed(unit.tp_bwd_allreduce_bytes(b)))


def tp_allreduce_s(nbytes: float, t: int, hw: Hardware) -> float:
    """One all-reduce of `nbytes` over t tensor-parallel GPUs (within a node when t fits in one)."""
    if t == 1 or nbytes == 0:
        return 0.0
    per_node = min(t, hw.cluster.gpus_per_node)
    return allreduce_time(nbytes, per_node, t // per_node, hw.links)


def cp_ring_s(unit: Unit, hw: Hardware, cfg: ParallelConfig) -> tuple[float, float]:
    """Exposed seconds (forward, backward) of ring attention over cfg.cp ranks, as Megatron-Core and
    Transformer Engine run it: each rank holds 1/cp of the sequence (two load-balanced chunks under a
    causal mask) and passes its keys and values around the ring in cp - 1 steps, each sent while the
    previous block of attention computes; the backward passes keys, values and their gradients. What a
    step's transfer takes beyond its share of the attention stays exposed."""
    if cfg.cp == 1 or not unit.attn_kv_bytes:
        return 0.0, 0.0
    b, t, cp = cfg.local_b, cfg.tp, cfg.cp
    kv_split = min(t, unit.kv_heads) if unit.kv_heads else t  # kv heads past t are replicated
    cl, eff = hw.cluster, hw.eff
    near = t * cp <= cl.gpus_per_node  # ranks ordered tp, cp: the ring stays inside a node
    bw = (cl.nvlink_bw if near else cl.internode_bw) * eff.link
    send = p2p_time(unit.attn_kv_bytes(b) / kv_split, bw, cl.nvlink_latency_s if near else cl.internode_latency_s)
    flops = unit.sharded.selective_flops(b) / t  # the attention core this rank computes
    step = flops / hw.matmul_rate(flops, cfg.precision, attention=unit.sharded.fused_attention) * eff.calibration / cp \
        if flops else 0.0
    return (cp - 1) * max(0.0, send - step), (cp - 1) * max(0.0, 2 * send - 2.5 * step)


def unit_time(unit: Unit, hw: Hardware, cfg: ParallelConfig) -> UnitTime:
    """Forward and backward seconds of `unit` for one microbatch of cfg.b samples at cfg.tp and cfg.cp,
    with cfg.recompute's recomputation inside the backward."""
    b, t = cfg.local_b, cfg.tp
    fp8 = cfg.fp8_recipe if runs_fp8(unit.kind) else None
    compiled = cfg.compile and unit.kind == "block"  # (the blocks are what the engine compiles: passes.kernels)
    sf, sb, sw = _part_time(unit.sharded, b, t, hw, cfg.precision, fp8, compiled=compiled)
    if 0 < unit.kv_heads < t:  # grouped-query attention: each kv head is replicated on t / kv_heads ranks
        rf_, rb_, rw_ = _part_time(unit.kv, b, unit.kv_heads, hw, cfg.precision, fp8, compiled=compiled)
        df, db, dw = _part_time(unit.kv, b, t, hw, cfg.precision, fp8, compiled=compiled)
        sf, sb, sw = sf + rf_ - df, sb + rb_ - db, sw + rw_ - dw
    # sequence parallelism: the norms, dropouts and residual adds run on 1/t of the sequence; the
    # all-reduces become a reduce-scatter and an all-gather of the same volume (the same ring time)
    rf, rb, rw = _part_time(unit.replicated, b, cfg.sp_degree, hw, cfg.precision, fp8, compiled=compiled)
    ep_f = ep_b = 0.0
    if unit.experts:  # each rank runs its experts/ep local experts as grouped GEMMs over their tokens (balanced
        # routing: a rank's share of the routed work is what it dispatches, 1/r of the stage's tokens times top-k)
        r, load = cfg.sp_degree, cfg.expert_load  # the busiest rank's tokens: load x its balanced share
        one = _part_time(unit.moe, b, r, hw, cfg.precision, fp8, compiled=compiled)  # as `replicated` priced it
        grouped = _part_time(unit.moe, b * load, r, hw, cfg.precision, fp8, groups=unit.experts / cfg.ep,
                             weights=1 / cfg.ep, compiled=compiled)
        rf, rb, rw = (x + g - o for x, g, o in zip((rf, rb, rw), grouped, one))
        if hw.eff.grouped_mm and unit.router.kernels:  # torchtitan's router gate: under torch.autocast to float32,
            # TF32 off (torchtitan/models/common/moe.py TokenChoiceTopKRouter), forward and backward at the fp32 rate
            gate = _part_time(unit.router, b, r, hw, "fp32", compiled=compiled)
            traced = _part_time(unit.router, b, r, hw, cfg.precision, fp8, compiled=compiled)
            rf, rb, rw = (x + g - o for x, g, o in zip((rf, rb, rw), gate, traced))
        ep_f = 2 * expert_alltoall_s(unit.moe_dispatch_bytes(b) * load / r, unit.top_k, cfg, hw)  # dispatch, combine
        ep_b = ep_f  # their gradients, the other way
    cast = 0.0  # the weights' FP8 casts: once per iteration (cached FP8 weights), or every microbatch both ways
    if fp8 is not None:
        weight = param_count(unit, cfg) * cfg.numerics.weight_bytes / (hw.gpu.hbm_bw * hw.eff.hbm)
        if fp8.weight_cache:
            cast = fp8.cast_passes() * weight
        else:
            gathered = fp8.fsdp_gather and cfg.zero >= 3 and not cfg.fp8_params
            wf, wb = fp8.weight_casts(compiled, cfg.shard_ranks if gathered else 1)
            sf, sb = sf + wf * weight, sb + wb * weight
    n = max(unit.tp_allreduces, 1)
    ar_f = n * tp_allreduce_s(unit.tp_fwd_allreduce_bytes(b) / n, t, hw) if unit.tp_allreduces else 0.0
    ar_b = tp_allreduce_s(unit.tp_bwd_allreduce_bytes(b) / n, t, hw) * n if t > 1 else 0.0
    if fp8 is not None and fp8.engine == "transformer_engine" and cfg.sp:  # Transformer Engine casts a linear's input
        # before its sequence-parallel all-gather: that half of the forward's traffic moves 1-byte elements
        ar_f *= 0.75
    if cfg.tp_comm_overlap and (ar_f or ar_b):
        # Transformer Engine's userbuffers (Megatron --tp-comm-overlap): each all-gather / reduce-scatter of the
        # sequence-parallel regions is split into t chunks exchanged around the ring while the linear's GEMM runs
        # on the chunk already there: only what the GEMMs' (t-1)/t cannot cover stays exposed
        cover = _gemm_s(unit.sharded, b, t, hw, cfg.precision, fp8) * (t - 1) / t
        sm_f, sm_b = ub_sm_s(unit, b, t, hw, cfg.precision, fp8)  # the SMs the overlap takes from those GEMMs
        ar_f, ar_b = max(0.0, ar_f - cover) + sm_f, max(0.0, ar_b - 2 * cover) + sm_b
    if cfg.async_tp and (ar_f or ar_b):  # torch's micro-pipelined TP (torchtitan's async TP)
        ar_f, ar_b = async_tp_s(unit, b, t, hw, cfg.precision, fp8, ar_f, ar_b)
    cp_f, cp_b = cp_ring_s(unit, hw, cfg)
    kf, kb = hw.eff.unit_factor(unit.kind)
    ep_all = ep_f  # (the forward's all-to-alls whole, as a recomputation reruns them)
    if cfg.moe_a2a_overlap and ep_f:  # Megatron's 1F1B all-to-all overlap: a microbatch's forward all-to-alls run
        # while another's backward computes, and its backward's while the other's forward computes; the flex
        # dispatchers' kernels take their SMs from that compute while they run (DISPATCHER_SMS)
        hid_f, hid_b = min(ep_f, (sb + rb) * kb), min(ep_b, (sf + rf) * kf)
        taken = DISPATCHER_SMS.get(cfg.moe_dispatcher, 0) / hw.gpu.sms if hw.gpu.sms else 0.0
        ep_f, ep_b = ep_f - hid_f * (1 - taken), ep_b - hid_b * (1 - taken)
    fwd = (sf + rf) * kf + ar_f + cp_f + ep_f + cast / cfg.m
    bwd = (sb + rb) * kb + ar_b + cp_b + ep_b
    # a dropless dispatch drains the stream: the layer's forward waits for the host's time for it
    # (MEGATRON_MOE_HOST_S); padded to a capacity it does not. Under the 1F1B all-to-all overlap the host runs it
    # beside another microbatch's backward of the layer: the pair waits
    wait = max(0.0, hw.eff.moe_host_s - fwd - (bwd if cfg.moe_a2a_overlap else 0.0)) \
        if unit.experts and not cfg.moe_capacity else 0.0
    fwd += wait
    bwd += cfg.recompute_mode.extra_backward_s(unit, b, t, hw, cfg.precision, fwd, fp8=fp8, compiled=compiled,
                                               collectives_s=ep_all)
    return UnitTime(fwd_s=fwd, bwd_s=bwd, tp_comm_s=ar_f + ar_b, cp_comm_s=cp_f + cp_b, bwd_weight_s=(sw + rw) * kb,
                    ep_comm_s=ep_f + ep_b, weight_cast_s=cast, host_wait_s=wait)


def moe_host_wait_s(unit: Unit, hw: Hardware, cfg: ParallelConfig) -> float:
    """Seconds a MoE unit's forward waits for the engine's host beyond its GPU work (UnitTime.host_wait_s; 0 where its
    kernels are longer, it is padded to a capacity, it is no MoE layer, or the floor is not modelled)."""
    return unit_time(unit, hw, cfg).host_wait_s


def expert_alltoall_s(nbytes: float, top_k: int, cfg: ParallelConfig, hw: Hardware) -> float:
    """One all-to-all of a rank's `nbytes` routed tokens (top_k copies of each) over its cfg.ep expert-parallel ranks:
    consecutive ranks of the stage (ranks ordered tp, cp, dp; the tensor-parallel ones among them only under sequence
    parallelism), inside a node while the group fits in one. Megatron's alltoall dispatcher sends every copy to its
    expert's rank; the flex dispatchers (DeepEP, HybridEP) send a token once to each other node holding one of its
    experts and fan it out there over NVLink: with balanced routing over N nodes a token reaches each other node with
    probability 1 - (1 - 1/N)^k."""
    if cfg.ep == 1:
        return 0.0
    stride = cfg.tp // cfg.sp_degree  # without sp the group skips over the tensor-parallel ranks (ep>1 needs sp there)
    per_node = max(1, min(cfg.ep, hw.cluster.gpus_per_node // stride))
    if cfg.moe_dispatcher == "alltoall" or per_node >= cfg.ep:
        return alltoall_time(nbytes, cfg.ep, per_node, hw.links)
    links, nodes, k = hw.links, cfg.ep // per_node, max(top_k, 1)
    far = nbytes / k * (nodes - 1) * (1 - (1 - 1 / nodes) ** k)  # one copy per other node reached
    near = nbytes * (per_node - 1) / cfg.ep + far  # copies to this node's other ranks, and the fan-out of what arrives
    return max(near / links.nvlink_bw + (per_node - 1) * links.nvlink_latency_s,
               far / links.internode_bw + (nodes - 1) * links.internode_latency_s)
