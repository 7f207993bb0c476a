"""What the cost models price on: a target's datasheet figures and how close kernels get to them.

`Hardware` pairs a `Target` (datasheet peaks, from targets/) with the `Efficiency` the cost models
apply to it (fitted defaults, or a calibration measured on the user's machine) and the memory the
framework keeps for itself. Every cost function takes one, so a calibration applies to everything
priced on it: the main model and the fill jobs alike.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from targets.specs import ClusterSpec, GPUSpec, Target

__all__ = ["Efficiency", "Hardware", "achieved_links", "GiB"]

GiB = 1 << 30


@dataclass(frozen=True, kw_only=True, slots=True)
class Efficiency:
    """How close kernels get to the datasheet.

    A matrix product runs at the GPU's measured ceiling (targets: `GPUSpec.matmul_ceiling` for GEMMs,
    `GPUSpec.attention(kernel)` for the engine's flash attention kernel, per GPU generation with their sources) times
    gemm_max, the share of that ceiling a whole training step's products reach (smaller, oddly shaped
    GEMMs, clocks under a full step's power draw), less for products too small to fill the device.
    gemm_max = 0.78 was fitted to all 13 rows of ../shared/references/reference_runs.json (the ten SC21
    weak-scaling rows on A100, the two NeMo GPT-3 175B rows and the NeMo Llama 3.1 8B row on H100):
    0.01 grid, minimizing the mean |error| of `python bench/reference_runs.py`. Re-derived on the same rows once
    they were priced as Megatron-Core runs them (passes.kernels), with the tensor-parallel overlap the GPT-3 rows
    state and its SMs, and Megatron's fp32 gradients: 0.77 again (mean 2.87%; 0.74/0.75/0.76 give 3.46/3.23/3.05%).
    Re-derived once more when the SC21 rows were priced with the dropouts Megatron-LM ran them with
    (bench/models/ref_gpt_megatron.py: the scale-mask-softmax and the attention dropout are separate kernels, each
    dropout writes its mask): 0.78 (mean 2.33%, median 1.16%, max 7.06%; 0.76/0.77/0.79 give 3.33/2.57/2.43%).
    The H100 rows are within 4-5% without it: the generations differ by their measured ceilings, not by a
    constant fitted per GPU. fusion was fitted (coarse grid, bench/thesis_tables.py) to the thesis' Tables 4.1
    and 4.2: Megatron's fused kernels (scale-mask-softmax, bias-GeLU, bias-dropout-add) avoid about a
    fifth of the elementwise HBM traffic an op-by-op execution moves; a model priced as an engine's kernels
    (passes.kernels) is already fused, and planner.api sets it to 0 there. The rest are priors: half of
    gemm_max at ~1 GFLOP per product on an A100 (a product needs a few microseconds of work to fill the
    device, so the half point scales with the peak), elementwise kernels at 80% of HBM bandwidth,
    collectives at 70% of link bandwidth. Calibrate on your own cluster (`calibration`)."""

    gemm_max: float = 0.78  # share of the GPU's matmul ceiling (targets: matmul_ceiling) a training step's GEMMs reach
    gemm_half_s: float = 3.2e-6  # a product this long at peak reaches half of gemm_max (1 GFLOP on A100)
    hbm: float = 0.80
    link: float = 0.70
    fusion: float = 0.2  # share of elementwise HBM traffic that fused kernels avoid
    launch_s: float = 4e-6
    calibration: float = 1.0  # measured / predicted compute time, from `planner calibrate`
    unit_factors: tuple[tuple[str, float, float], ...] = ()  # (unit kind, forward, backward) corrections
    action_overhead_s: float = 0.0  # per forward or backward action of a stage (runtime framework cost)
    eager: bool = False  # memory-bound work at eager PyTorch's kernel speeds (costmodels.eager), as a fill job runs
    moe_host_s: float = 0.0  # least seconds of a mixture-of-experts layer's forward: the engine's host time for it,
    # which the dropless dispatch's stream drain exposes (costmodels.compute.MEGATRON_MOE_HOST_S); 0: not modelled
    grouped_mm: bool = False  # a rank's local experts run as one torch._grouped_mm kernel over all of them, the
    # router's gate in fp32 (planner.engines Engine.grouped_mm); False: a GEMM per expert

    def __post_init__(self) -> None:
        if not 0 <= self.fusion < 1:
            raise ValueError(f"efficiency fusion must be in [0, 1), got {self.fusion}")
        for name in ("gemm_max", "hbm", "link"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"efficiency {name} must be in (0, 1], got {getattr(self, name)}")
        if self.calibration <= 0:
            raise ValueError(f"calibration factor must be positive, got {self.calibration}")

    def unit_factor(self, kind: str) -> tuple[float, float]:
        """(forward, backward) calibration factor of a unit kind; (1, 1) if not measured."""
        return next(((f, b) for k, f, b in self.unit_factors if k == kind), (1.0, 1.0))


@dataclass(frozen=True, kw_only=True, slots=True)
class Hardware:
    """A target as the cost models see it."""

    target: Target
    eff: Efficiency = Efficiency()
    reserve_bytes: int = 3 * GiB
    """Device memory the model cannot use: CUDA context, allocator fragmentation, communication buffers."""
    attention: str = "te"
    """The fused attention kernel the engine runs (targets.specs.ATTENTION_KERNELS; planner.engines Engine.attention):
    its share of the peak on this GPU is the target's (GPUSpec.attention)."""

    @property
    def name(self) -> str:
        return self.target.name

    @property
    def gpu(self) -> GPUSpec:
        return self.target.gpu

    @property
    def cluster(self) -> ClusterSpec:
        return self.target.cluster

    @property
    def capacity(self) -> float:
        return float(self.target.gpu.hbm_bytes)

    @property
    def links(self) -> ClusterSpec:
        """The cluster with its link bandwidths scaled to what collectives achieve."""
        return achieved_links(self.target.cluster, self.eff.link)

    def matmul_rate(self, flops: float, precision: str, attention: bool = False) -> float:
        """FLOP/s one matrix product of `flops` reaches in a training step: the GPU's measured ceiling (of a
        GEMM, or of the engine's flash attention kernel, `self.attention`) times the share a step's products reach
        (gemm_max), less for a product too small to fill the device."""
        peak = self.gpu.peak(precision)
        ceiling = self.gpu.attention(self.attention) if attention else self.gpu.ceiling(precision)
        return peak * ceiling * self.eff.gemm_max * flops / (flops + peak * self.eff.gemm_half_s)

    def with_eff(self, **changes: object) -> Hardware:
        return replace(self, eff=replace(self.eff, **changes))


@lru_cache(maxsize=64)
def achieved_links(cluster: ClusterSpec, link_eff: float) -> ClusterSpec:
    """The cluster with its link bandwidths scaled to what collectives achieve."""
    return ClusterSpec(gpus_per_node=cluster.gpus_per_node, nvlink_bw=cluster.nvlink_bw * link_eff,
                       nvlink_latency_s=cluster.nvlink_latency_s, internode_bw=cluster.internode_bw * link_eff,
                       internode_latency_s=cluster.internode_latency_s)
