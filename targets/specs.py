"""GPU, cluster and target specs: plain frozen data that cost models read.

Units are SI throughout: FLOP/s, bytes, bytes/s, seconds. Bandwidths are per direction.
Figures are datasheet peaks; efficiency (achieved vs. peak) is the cost models' business,
so that one efficiency knob applies uniformly instead of being baked into some figures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from collections.abc import Mapping

__all__ = ["ATTENTION_KERNELS", "DTYPES", "DTYPE_ALIASES", "TargetError", "GPUSpec", "ClusterSpec", "Target",
           "canonical_dtype"]

#: Dtype names accepted as keys of ``GPUSpec.peak_flops`` (dense, no structured sparsity).
DTYPES: tuple[str, ...] = ("fp64", "fp32", "tf32", "fp16", "bf16", "fp8", "mxfp8", "fp4")
"""mxfp8: FP8 with one shared power-of-two scale per 32 elements, run natively by Blackwell's tensor cores (OCP
Microscaling); a GPU without the key cannot run an MXFP8 recipe. fp4: NVFP4/MXFP4 tensor rate."""

ATTENTION_KERNELS: dict[str, str] = {
    "te": "Transformer Engine's fused attention (FlashAttention-3 or cuDNN's on Hopper): GPUSpec.attention_ceiling",
    "sdpa": "torch's scaled_dot_product_attention (its FlashAttention-2 backend): GPUSpec.sdpa_attention_ceiling",
}
"""The fused attention kernels an engine runs (planner.engines Engine.attention), each with the GPUSpec share it
reaches."""

#: Other spellings of the dtypes above (torch names, with or without ``torch.``).
DTYPE_ALIASES: dict[str, str] = {
    "float64": "fp64", "double": "fp64",
    "float32": "fp32", "float": "fp32",
    "float16": "fp16", "half": "fp16",
    "bfloat16": "bf16",
    "float8_e4m3fn": "fp8", "float8_e5m2": "fp8", "float8": "fp8", "nvfp4": "fp4", "mxfp4": "fp4",
}


class TargetError(ValueError):
    """A target, GPU or cluster spec is unknown or invalid; the message says which and why."""


def canonical_dtype(dtype: object) -> str:
    """Map 'bf16', 'bfloat16', 'torch.bfloat16' or a torch dtype to a name in DTYPES."""
    name = str(dtype).strip().lower().removeprefix("torch.")
    name = DTYPE_ALIASES.get(name, name)
    if name not in DTYPES:
        raise TargetError(f"unknown dtype {dtype!r} — known dtypes: {', '.join(DTYPES)}")
    return name


def _check_positive(owner: str, field_name: str, value: object, *, allow_zero: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value >= 0 if allow_zero else value > 0)
    if not ok:
        what = "a non-negative" if allow_zero else "a positive"
        raise TargetError(f"{owner}: {field_name} must be {what} finite number, got {value!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class GPUSpec:
    """One GPU model's datasheet figures."""

    name: str
    """Human name, e.g. 'A100 80GB SXM'."""
    peak_flops: Mapping[str, float] = field(hash=False)
    """Dense peak FLOP/s per dtype (keys from DTYPES); a dtype the GPU lacks is absent."""
    hbm_bytes: int
    """Device memory capacity in bytes."""
    hbm_bw: float
    """Device memory bandwidth, bytes/s."""
    pcie_bw: float
    """Host<->device bandwidth, bytes/s per direction."""
    matmul_ceiling: float = 0.859
    """Share of the dense peak that the best-shaped large bf16 GEMM reaches on this GPU (a measured maximum
    achievable matmul FLOP/s, not a datasheet figure); where a GPU has no measurement, the A100 SXM's."""
    attention_ceiling: float = 0.73
    """Share of the dense peak that the best fused (flash) attention kernel reaches on this GPU (Transformer
    Engine's: FlashAttention-3 or cuDNN's on Hopper, FlashAttention-2 on Ampere); where a GPU has no measurement,
    FlashAttention-2's on the A100."""
    sdpa_attention_ceiling: float = 0.0
    """Share of the dense peak that torch's scaled_dot_product_attention reaches on this GPU in bf16/fp16: the kernel
    its dispatch takes there (its FlashAttention-2 backend on Ampere and Hopper); 0: attention_ceiling's (where that
    is FlashAttention-2 already, or nothing is measured)."""
    fp8_matmul_ceiling: float = 0.0
    """Share of the FP8 peak the best large FP8 GEMM reaches (0: the bf16 matmul_ceiling, an assumption)."""
    sms: int = 0
    """Streaming multiprocessors (0: not stated): what communication kernels that run beside a GEMM take from it."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise TargetError(f"GPUSpec: name must be a non-empty string, got {self.name!r}")
        for share in ("matmul_ceiling", "attention_ceiling") + tuple(
                name for name in ("fp8_matmul_ceiling", "sdpa_attention_ceiling") if getattr(self, name)):
            if not 0 < getattr(self, share) <= 1:
                raise TargetError(f"GPU {self.name!r}: {share} is a share of the peak in (0, 1], "
                                  f"got {getattr(self, share)!r}")
        owner = f"GPU {self.name!r}"
        if not isinstance(self.peak_flops, Mapping) or not self.peak_flops:
            raise TargetError(f"{owner}: peak_flops must be a non-empty mapping dtype -> FLOP/s, "
                              f"got {self.peak_flops!r}")
        flops: dict[str, float] = {}
        for key, value in self.peak_flops.items():
            if key not in DTYPES:
                raise TargetError(f"{owner}: peak_flops has unknown dtype {key!r} — "
                                  f"known dtypes: {', '.join(DTYPES)}")
            _check_positive(owner, f"peak_flops[{key!r}]", value)
            flops[key] = float(value)
        # A private copy, so the caller's dict cannot change a frozen spec behind its back.
        object.__setattr__(self, "peak_flops", flops)
        if isinstance(self.hbm_bytes, float) and self.hbm_bytes.is_integer():
            object.__setattr__(self, "hbm_bytes", int(self.hbm_bytes))
        if not isinstance(self.hbm_bytes, int):
            raise TargetError(f"{owner}: hbm_bytes must be a whole number of bytes, got {self.hbm_bytes!r}")
        for name in ("hbm_bytes", "hbm_bw", "pcie_bw"):
            _check_positive(owner, name, getattr(self, name))

    def peak(self, dtype: object) -> float:
        """Dense peak FLOP/s for ``dtype`` ('bf16', 'bfloat16', torch.bfloat16, ...)."""
        name = canonical_dtype(dtype)
        try:
            return self.peak_flops[name]
        except KeyError:
            usable = [d for d in ("bf16", "fp16", "fp32") if d in self.peak_flops]
            raise TargetError(f"GPU {self.name!r} has no {name} peak — it supports "
                              f"{', '.join(sorted(self.peak_flops))}; plan with --dtype {usable[0] if usable else 'fp32'}"
                              ) from None

    def ceiling(self, dtype: str) -> float:
        """Share of `dtype`'s peak the best large GEMM reaches: the FP8 measurement for the 8-bit rates (MXFP8 and
        FP4 take it too where nothing else is measured), the bf16 one otherwise."""
        low = dtype in ("fp8", "mxfp8", "fp4") and self.fp8_matmul_ceiling
        return self.fp8_matmul_ceiling if low else self.matmul_ceiling

    def attention(self, kernel: str) -> float:
        """Share of the peak the fused attention kernel `kernel` (ATTENTION_KERNELS: an engine's, planner.engines
        Engine.attention) reaches on this GPU."""
        if kernel not in ATTENTION_KERNELS:
            raise TargetError(f"unknown attention kernel {kernel!r}; known: {', '.join(ATTENTION_KERNELS)}")
        return (self.sdpa_attention_ceiling or self.attention_ceiling) if kernel == "sdpa" else self.attention_ceiling

    @property
    def dtypes(self) -> tuple[str, ...]:
        """The dtypes this GPU has a peak for, in DTYPES order."""
        return tuple(d for d in DTYPES if d in self.peak_flops)


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterSpec:
    """How GPUs are wired: within a node (NVLink, or PCIe on PCIe parts) and across nodes."""

    gpus_per_node: int
    """GPUs in one NVLink domain (a node of 8 on DGX/HGX; the part of an NVL72 rack a job uses): the cost models'
    'node', inside which collectives run over NVLink."""
    nvlink_bw: float
    """Per-GPU unidirectional intra-node bandwidth usable by collectives, bytes/s
    (NVLink, or the PCIe link on PCIe-only parts)."""
    nvlink_latency_s: float
    """Per-step latency of an intra-node collective, seconds."""
    internode_bw: float
    """Per-GPU unidirectional inter-node bandwidth, bytes/s (node NIC bandwidth / GPUs per node)."""
    internode_latency_s: float
    """Per-step latency of an inter-node collective, seconds."""
    gpus_per_host: int = 0
    """GPUs one host (one torchrun agent) drives, where fewer than the NVLink domain (GB200: 4 per compute tray);
    0: the same as gpus_per_node."""

    @property
    def host_gpus(self) -> int:
        """GPUs per host: what torchrun's --nproc-per-node is."""
        return self.gpus_per_host or self.gpus_per_node

    def __post_init__(self) -> None:
        owner = "cluster"
        if isinstance(self.gpus_per_node, bool) or not isinstance(self.gpus_per_node, int) \
                or self.gpus_per_node < 1:
            raise TargetError(f"{owner}: gpus_per_node must be a positive integer, got {self.gpus_per_node!r}")
        if isinstance(self.gpus_per_host, bool) or not isinstance(self.gpus_per_host, int) or self.gpus_per_host < 0 \
                or (self.gpus_per_host and self.gpus_per_node % self.gpus_per_host):
            raise TargetError(f"{owner}: gpus_per_host must be 0 (the node) or divide the {self.gpus_per_node} GPUs "
                              f"per node, got {self.gpus_per_host!r}")
        _check_positive(owner, "nvlink_bw", self.nvlink_bw)
        _check_positive(owner, "internode_bw", self.internode_bw)
        _check_positive(owner, "nvlink_latency_s", self.nvlink_latency_s, allow_zero=True)
        _check_positive(owner, "internode_latency_s", self.internode_latency_s, allow_zero=True)


@dataclass(frozen=True, kw_only=True, slots=True)
class Target:
    """A GPU in a cluster: what the planner plans for."""

    name: str
    """Registry name, e.g. 'a100-80gb', or the name a user YAML file gives."""
    gpu: GPUSpec
    cluster: ClusterSpec
    description: str = ""
    """One line on what this is and where its figures come from."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise TargetError(f"Target: name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.gpu, GPUSpec):
            raise TargetError(f"target {self.name!r}: gpu must be a GPUSpec, got {type(self.gpu).__name__}")
        if not isinstance(self.cluster, ClusterSpec):
            raise TargetError(f"target {self.name!r}: cluster must be a ClusterSpec, "
                              f"got {type(self.cluster).__name__}")

    def with_gpus_per_node(self, gpus_per_node: int) -> Target:
        """This target with the cluster's GPUs per node replaced (e.g. a 4-GPU partition of a node)."""
        host = self.cluster.gpus_per_host
        return replace(self, cluster=replace(self.cluster, gpus_per_node=gpus_per_node,
                                             gpus_per_host=host if host and gpus_per_node % host == 0 else 0))
