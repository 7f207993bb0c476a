"""The flash attention kernel is the engine's (planner.engines Engine.attention), its share of the peak the target's
(targets.specs GPUSpec.attention), each figure with its source in targets/builtin.py.

On Hopper, torch's scaled_dot_product_attention (torchtitan, the fxplanner runtime) takes its FlashAttention-2
backend: 308 TFLOP/s forward and backward, causal, head dimension 128, sequence 8k, on H100 SXM5 (FlashAttention-2's
H100 benchmark); Transformer Engine (Megatron-Core) runs FlashAttention-3 / cuDNN: "up to 740 TFLOPs/s" (Shah et al.
2024). On Ampere both are FlashAttention-2 (0.73, Dao 2023).
"""
from __future__ import annotations

import pytest

from costmodels.hardware import Hardware
from planner.engines import ENGINES
from targets.registry import get_target, load_target_yaml
from targets.specs import ATTENTION_KERNELS, TargetError


def test_each_engine_names_a_known_attention_kernel():
    assert {e.name: e.attention for e in ENGINES.values()} == {"fxplanner": "sdpa", "megatron": "te",
                                                                "torchtitan": "sdpa"}
    assert all(e.attention in ATTENTION_KERNELS for e in ENGINES.values())


@pytest.mark.parametrize("target", ["h100-sxm", "h100-96gb-hbm2e-500w", "h200", "h100-pcie"])
def test_on_hopper_sdpa_runs_at_flashattention2s_share_and_transformer_engine_at_flashattention3s(target):
    gpu = get_target(target).gpu
    assert gpu.attention("sdpa") == pytest.approx(308 / 989)
    assert gpu.attention("te") == pytest.approx(740 / 989) == gpu.attention_ceiling


@pytest.mark.parametrize("target", ["a100-80gb", "b200", "gb200-nvl72"])
def test_where_no_other_kernel_is_measured_sdpa_takes_the_fused_kernels_share(target):
    """Ampere: FlashAttention-2 is the best kernel either way; Blackwell: SDPA prefers cuDNN there."""
    gpu = get_target(target).gpu
    assert gpu.attention("sdpa") == gpu.attention("te") == gpu.attention_ceiling


def test_the_attention_rate_differs_by_engine_and_nothing_else_does():
    target = get_target("h100-sxm")
    titan, megatron = (Hardware(target=target, attention=ENGINES[e].attention) for e in ("torchtitan", "megatron"))
    big = 1e12
    assert titan.matmul_rate(big, "bf16", attention=True) / megatron.matmul_rate(big, "bf16", attention=True) == \
        pytest.approx(308 / 740)
    assert titan.matmul_rate(big, "bf16") == megatron.matmul_rate(big, "bf16")  # GEMMs: the same cuBLAS
    assert Hardware(target=target).attention == "te"  # (fill jobs' and benches' hardware: as before)


def test_an_unknown_kernel_is_refused():
    with pytest.raises(TargetError, match="unknown attention kernel 'flash4'"):
        get_target("h100-sxm").gpu.attention("flash4")


def test_a_target_file_sets_sdpas_share(tmp_path):
    """A run on torch >= 2.11, whose SDPA takes cuDNN on Hopper, is priced by setting the share in a target file."""
    f = tmp_path / "t.yaml"
    f.write_text("base: h100-sxm\ngpu:\n  sdpa_attention_ceiling: 0.535\n")
    gpu = load_target_yaml(f).gpu
    assert gpu.attention("sdpa") == 0.535 and gpu.attention("te") == pytest.approx(740 / 989)
    f.write_text("base: h100-sxm\ngpu:\n  sdpa_attention_ceiling: 5\n")
    with pytest.raises(TargetError, match="sdpa_attention_ceiling"):
        load_target_yaml(f)
