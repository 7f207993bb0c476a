"""How fast a matrix product runs: each product on its own roofline, at its GPU generation's measured ceiling."""
from __future__ import annotations

import pytest

from costmodels.compute import _part_time
from costmodels.hardware import Hardware
from passes.poly import Poly
from passes.units import Part
from targets.registry import get_target, load_target_yaml
from targets.specs import TargetError

A100, H100 = Hardware(target=get_target("a100-80gb")), Hardware(target=get_target("h100-sxm"))
BIG = 1e13  # FLOPs: far past the size where a product fills the device


def _part(*products) -> Part:
    """Products as (forward FLOPs, forward bytes, backward FLOPs, fused attention?[, dW FLOPs: 0])."""
    products = tuple((*p, 0.0)[:5] for p in products)
    fwd, moved = sum(p[0] for p in products), sum(p[1] for p in products)
    return Part(fwd_flops=Poly.const(fwd), bwd_flops=Poly.const(sum(p[2] for p in products)),
                wgrad_flops=Poly.const(sum(p[4] for p in products)), mm_flops=Poly.const(fwd),
                mm_bytes=Poly.const(moved), fwd_bytes=Poly.const(moved), bwd_bytes=Poly.const(2 * moved),
                products=tuple((Poly.const(f), Poly.const(by), Poly.const(bf), fused, Poly.const(w), Poly(), Poly())
                               for f, by, bf, fused, w in products))


def test_each_generation_runs_gemms_at_its_measured_ceiling():
    for hw, ceiling in ((A100, 267.9 / 312), (H100, 792.1 / 989)):
        rate = hw.matmul_rate(BIG, "bf16")
        assert rate == pytest.approx(hw.gpu.peak("bf16") * ceiling * hw.eff.gemm_max, rel=1e-3)
    # the flash kernel: FlashAttention-2 on A100 below its GEMMs, FlashAttention-3 on H100 close to them
    assert A100.matmul_rate(BIG, "bf16", attention=True) / A100.matmul_rate(BIG, "bf16") == pytest.approx(0.73 / 0.859, rel=1e-2)
    assert H100.matmul_rate(BIG, "bf16", attention=True) / H100.matmul_rate(BIG, "bf16") == pytest.approx(740 / 792.1, rel=1e-3)


def test_a_memory_bound_product_is_priced_by_its_bytes_even_beside_compute_bound_ones():
    bw = A100.gpu.hbm_bw * A100.eff.hbm
    gemm = (BIG, 1e9, 2 * BIG, False)  # compute-bound: 1e13 FLOPs over 1 GB
    scores = (3e11, 3.2e9, 6e11, False)  # Q K^T with head dimension 96: ~94 FLOPs per byte, under the A100's ridge
    fwd, bwd, _ = _part_time(_part(gemm, scores), 1, 1, A100, "bf16")
    alone, _, _ = _part_time(_part(gemm), 1, 1, A100, "bf16")
    assert fwd == pytest.approx(alone + 3.2e9 / bw, rel=1e-6)  # not hidden under the GEMM's compute time
    assert bwd == pytest.approx(2 * alone + 2 * 3.2e9 / bw, rel=1e-6)


def test_a_fused_attention_backward_is_five_products_at_the_kernel_rate():
    fwd, bwd, _ = _part_time(_part((BIG, 1e8, 2.5 * BIG, True)), 1, 1, H100, "bf16")
    assert bwd == pytest.approx(2.5 * fwd, rel=1e-6)
    assert fwd == pytest.approx(BIG / H100.matmul_rate(BIG, "bf16", attention=True), rel=1e-6)


def test_a_target_file_may_state_its_own_ceilings(tmp_path):
    f = tmp_path / "mine.yaml"
    f.write_text("base: h100-sxm\ngpu:\n  matmul_ceiling: 0.7\n")
    assert load_target_yaml(f).gpu.matmul_ceiling == 0.7
    assert load_target_yaml(f).gpu.attention_ceiling == pytest.approx(740 / 989)
    f.write_text("base: h100-sxm\ngpu:\n  matmul_ceiling: 80\n")
    with pytest.raises(TargetError, match="share of the peak"):
        load_target_yaml(f)


def test_a_weight_gradient_runs_at_its_products_rate_compute_or_memory_bound():
    """dW is one more product of the forward's size: a compute-bound GEMM's takes its forward's time, a
    memory-bound product's its bytes' time, each with a launch of its own; a product of two activations has none."""
    bw = A100.gpu.hbm_bw * A100.eff.hbm
    gemm = (BIG, 1e9, 2 * BIG, False, BIG)
    thin = (1e9, 1e9, 2e9, False, 1e9)  # 1 FLOP per byte: memory-bound
    scores = (3e11, 3.2e9, 6e11, False)
    fwd, bwd, wgrad = _part_time(_part(gemm, thin, scores), 1, 1, A100, "bf16")
    gemm_fwd, _, _ = _part_time(_part(gemm), 1, 1, A100, "bf16")
    assert wgrad == pytest.approx(gemm_fwd + 1e9 / bw + 2 * A100.eff.launch_s, rel=1e-9)
    assert 0 < wgrad < bwd
    assert _part_time(_part(scores), 1, 1, A100, "bf16")[2] == 0.0
