"""Time of a unit on a target GPU at microbatch b and tensor-parallel degree t.

Roofline per bucket: matrix products run at an achievable fraction of the dtype's dense peak that
grows with the size of the product (small GEMMs cannot fill the GPU), or are bound by HBM traffic;
everything else is memory-bound elementwise work. Each kernel costs a launch overhead. A
per-target calibration factor, set from a measured profile, scales the result. Tensor
parallelism divides the sharded part by t and adds the all-reduces of Megatron's split.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from passes.units import Part, Unit
from targets.specs import ClusterSpec, Target

from .comm import allreduce_time

__all__ = ["Efficiency", "UnitTime", "unit_time", "gemm_efficiency", "RECOMPUTE", "achieved_links",
           "tp_allreduce_s"]

RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True, kw_only=True, slots=True)
class Efficiency:
    """How close kernels get to the datasheet.

    gemm_max and fusion were fitted (coarse grid, bench/thesis_tables.py) to the 16 measured rows of
    the thesis' Tables 4.1 and 4.2 — max error 7.8%, mean 3.5% — and are physically plausible:
    Megatron's GEMMs inside a full training step reach ~70% of A100 dense peak, and its fused
    kernels (scale-mask-softmax, bias-GeLU, bias-dropout-add) avoid about a fifth of the elementwise
    HBM traffic an op-by-op execution moves. The rest are priors: half of gemm_max at ~1 GFLOP per
    product on an A100 (a product needs a few microseconds of work to fill the device, so the
    half point scales with the peak), elementwise kernels at 80% of HBM bandwidth, collectives at 70% of link bandwidth.
    Calibrate on your own cluster (`calibration`) rather than trusting these off A100."""

    gemm_max: float = 0.70
    gemm_half_s: float = 3.2e-6  # a product this long at peak reaches half of gemm_max (1 GFLOP on A100)
    hbm: float = 0.80
    link: float = 0.70
    fusion: float = 0.2  # share of elementwise HBM traffic that fused kernels avoid
    launch_s: float = 4e-6
    calibration: float = 1.0  # measured / predicted compute time, from `planner calibrate`
    unit_factors: tuple[tuple[str, float, float], ...] = ()  # (unit kind, forward, backward) corrections
    action_overhead_s: float = 0.0  # per forward or backward action of a stage (runtime framework cost)

    def __post_init__(self) -> None:
        if not 0 <= self.fusion < 1:
            raise ValueError(f"efficiency fusion must be in [0, 1), got {self.fusion}")
        for name in ("gemm_max", "hbm", "link"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"efficiency {name} must be in (0, 1], got {getattr(self, name)}")
        if self.calibration <= 0:
            raise ValueError(f"calibration factor must be positive, got {self.calibration}")


@dataclass(frozen=True, kw_only=True, slots=True)
class UnitTime:
    fwd_s: float  # forward compute + forward TP all-reduces
    bwd_s: float  # backward (+ recomputation) + backward TP all-reduces
    tp_comm_s: float  # of which TP communication, forward + backward


def gemm_efficiency(flops_per_gemm: float, eff: Efficiency, peak: float) -> float:
    half = peak * eff.gemm_half_s
    return eff.gemm_max * flops_per_gemm / (flops_per_gemm + half)


def _part_time(part: Part, b: float, t: int, target: Target, eff: Efficiency, gemms: int,
               dtype: str) -> tuple[float, float]:
    """(forward, backward) seconds of one part, already divided over t GPUs."""
    gpu = target.gpu
    mm = part.mm_flops(b) / t
    ew_flops = max(part.fwd_flops(b) / t - mm, 0.0)
    mm_bytes = part.mm_bytes(b) / t
    ew_bytes = max(part.fwd_bytes(b) / t - mm_bytes, 0.0) * (1 - eff.fusion)
    peak, bw, vec = gpu.peak(dtype), gpu.hbm_bw * eff.hbm, gpu.peak("fp32")
    rate = peak * gemm_efficiency(mm / max(gemms, 1), eff, peak) if mm else peak
    fwd = max(mm / rate, mm_bytes / bw) + max(ew_flops / vec, ew_bytes / bw)
    bwd_ew_flops = max(part.bwd_flops(b) / t - 2 * mm, 0.0)
    bwd_ew_bytes = max(part.bwd_bytes(b) / t - 2 * mm_bytes, 0.0) * (1 - eff.fusion)
    bwd = max(2 * mm / rate, 2 * mm_bytes / bw) + max(bwd_ew_flops / vec, bwd_ew_bytes / bw)
    launches = part.kernels * eff.launch_s
    return (fwd + launches) * eff.calibration, (bwd + 2 * launches) * eff.calibration


def tp_allreduce_s(nbytes: float, t: int, target: Target, eff: Efficiency) -> float:
    """One all-reduce of `nbytes` over t tensor-parallel GPUs (within a node when t fits in one)."""
    if t == 1 or nbytes == 0:
        return 0.0
    per_node = min(t, target.cluster.gpus_per_node)
    return allreduce_time(nbytes, per_node, t // per_node, achieved_links(target.cluster, eff.link))


@lru_cache(maxsize=64)
def achieved_links(cluster: ClusterSpec, link_eff: float) -> ClusterSpec:
    """The cluster with its link bandwidths scaled to what collectives achieve."""
    return ClusterSpec(gpus_per_node=cluster.gpus_per_node, nvlink_bw=cluster.nvlink_bw * link_eff,
                       nvlink_latency_s=cluster.nvlink_latency_s, internode_bw=cluster.internode_bw * link_eff,
                       internode_latency_s=cluster.internode_latency_s)


def unit_time(unit: Unit, b: float, t: int, target: Target, *, recompute: str = "none",
              eff: Efficiency = Efficiency(), dtype: str = "bf16") -> UnitTime:
    """Forward and backward seconds of `unit` for one microbatch of b samples with TP degree t.

    recompute: 'none'; 'selective' redoes the oversized cheap tensors (attention scores) in the
    backward pass; 'full' (block units only) redoes the whole forward, its all-reduces included."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    sf, sb = _part_time(unit.sharded, b, t, target, eff, unit.matmuls, dtype)
    rf, rb = _part_time(unit.replicated, b, 1, target, eff, unit.matmuls, dtype)
    n = max(unit.tp_allreduces, 1)
    ar_f = n * tp_allreduce_s(unit.tp_fwd_allreduce_bytes(b) / n, t, target, eff) if unit.tp_allreduces else 0.0
    ar_b = tp_allreduce_s(unit.tp_bwd_allreduce_bytes(b) / n, t, target, eff) * n if t > 1 else 0.0
    kf, kb = next(((f, b_) for kind, f, b_ in eff.unit_factors if kind == unit.kind), (1.0, 1.0))
    fwd = (sf + rf) * kf + ar_f
    bwd = (sb + rb) * kb + ar_b
    if recompute == "full" and unit.kind == "block":
        bwd += fwd
    elif recompute == "selective":
        part = unit.sharded
        peak = target.gpu.peak(dtype)
        sel_rate = peak * gemm_efficiency(part.selective_flops(b) / t, eff, peak)
        if part.selective_flops(b):
            bwd += (part.selective_flops(b) / t / sel_rate + 2 * part.selective_bytes(b) / t /
                    (target.gpu.hbm_bw * eff.hbm)) * eff.calibration
    return UnitTime(fwd_s=fwd, bwd_s=bwd, tp_comm_s=ar_f + ar_b)
