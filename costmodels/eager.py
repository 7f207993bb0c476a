"""The memory-bound kernels eager PyTorch runs, op by op, as a fill job runs in the fill runtime: their speed as a
share of the GPU's HBM bandwidth, for the bytes the planner counts for them (passes/costs.py: each input read once,
the output written once).

Measured on one H200 (torch 2.11.0+cu130) by `bench/cuda_eager_kernels.py`
(`bench/results/cuda_eager_kernels_h200_2026-11-27.json`): each kernel on a 512 MB output (768 MB for the add),
timed by CUDA events; at the tensor sizes of a BERT-base layer at batch 128 (25-100 MB) torch.profiler's kernel times
in that model agree within 0.03-0.06 (`cuda_fill_profile_h200_2026-11-27.json`: LayerNorm 0.29, softmax 0.44, GELU
0.62, head copies 0.24, add 0.88). Kernels not listed run at `Efficiency.hbm` (0.80; an add measured 0.90, a ReLU
0.87). fp16 is taken as bf16 (the same kernels, templated on the type): not measured. A batch norm is the
channels-last kernel, the layout the fill runtime gives convolutions on CUDA (NCHW measured 0.06 in bf16, 0.21 in
fp32). Only fill jobs are priced so: a main job runs an engine's fused kernels (`Efficiency.fusion`).
"""
from __future__ import annotations

__all__ = ["EAGER_HBM", "eager_share"]

EAGER_HBM: dict[str, dict[str, float]] = {
    "bfloat16": {"layer_norm": 0.32, "layer_norm_wide": 0.56, "softmax": 0.49, "softmax_wide": 0.38,
                 "gelu": 0.65, "batch_norm": 0.15, "copy": 0.30},
    "float32": {"layer_norm": 0.47, "layer_norm_wide": 0.62, "softmax": 0.86, "softmax_wide": 0.78,
                "gelu": 0.87, "batch_norm": 0.54, "copy": 0.51},
}
"""dtype -> kernel kind -> share of HBM bandwidth. "_wide": rows of 2048 elements and more (measured at 4096 for a
LayerNorm, 2048 for a softmax; the others at 768 and 128)."""


def eager_share(key: str, default: float) -> float:
    """Share of HBM bandwidth of the eager kernel `key` ("kind/dtype", passes.units.Part.memory_bound)."""
    kind, _, dtype = key.partition("/")
    return EAGER_HBM.get("bfloat16" if dtype == "float16" else dtype, {}).get(kind, default)
