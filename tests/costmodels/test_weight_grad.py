"""The backward split into the input gradient (I) and the weight gradients (W) that zero-bubble schedules run apart."""
from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from costmodels.compute import _gemm_s, unit_time
from costmodels.hardware import Hardware
from passes.pipeline import analyze
from planner.config import ParallelConfig
from targets.registry import get_target
from tests.conftest import EXAMPLES

GPT = {"preset": "tiny", "layers": 2, "hidden": 256, "heads": 8, "seq": 128, "vocab": 1024, "dropout": 0.1}
HW = {name: Hardware(target=get_target(name)) for name in ("a100-80gb", "h100-sxm")}


@pytest.fixture(scope="module", params=[False, True], ids=["math-attention", "flash-attention"])
def gpt(request):
    prof, _ = analyze(EXAMPLES / "gpt.py", {**GPT, "flash": request.param})
    return prof.units, request.param


@settings(max_examples=40, deadline=None)
@given(t=st.sampled_from([1, 2, 4]), sp=st.booleans(), overlap=st.booleans(), cp=st.sampled_from([1, 2]),
       b=st.integers(1, 8), target=st.sampled_from(sorted(HW)))
def test_input_and_weight_gradients_add_up_to_the_backward(gpt, t, sp, overlap, cp, b, target):
    """I + W = the backward under every recomputation mode; recomputation, the TP all-reduces and the ring are all
    I, so W is the same whatever the mode. A unit without weight products (the lookups) has no W time."""
    units, _ = gpt
    sp = sp and t > 1
    config = dict(tp=t, pp=1, dp=1, b=b, m=1, cp=cp, sp=sp, tp_comm_overlap=overlap and sp)
    for u in units:
        times = {mode: unit_time(u, HW[target], ParallelConfig(**config, recompute=mode))
                 for mode in ("none", "selective", "full")}
        for ut in times.values():
            assert ut.bwd_input_s + ut.bwd_weight_s == pytest.approx(ut.bwd_s, rel=1e-12)
            assert ut.bwd_input_s > 0 and ut.bwd_weight_s == times["none"].bwd_weight_s
            assert (ut.bwd_weight_s > 0) == (u.kind != "embedding")


@pytest.mark.parametrize("t", [1, 2, 8])
@pytest.mark.parametrize("target", sorted(HW))
def test_a_layers_weight_gradient_is_its_linears_forward_again(gpt, t, target):
    """Each linear's dW is a product of its forward's size at its forward's rate (compute- or memory-bound), with
    one launch of its own: a layer's W is its four linears' forward again (not the attention's products)."""
    units, _ = gpt
    hw, block = HW[target], next(u for u in units if u.kind == "block")
    ut = unit_time(block, hw, ParallelConfig(tp=t, pp=1, dp=1, b=2, m=1, sp=t > 1))
    linears = replace(block.sharded, products=tuple(p for p in block.sharded.products if p[4](1) > 0))
    assert len(linears.products) == 4 and not block.replicated.products
    forward = _gemm_s(linears, 2, t, hw, "bf16") + 4 * hw.eff.launch_s * hw.eff.calibration
    assert ut.bwd_weight_s == pytest.approx(forward * hw.eff.unit_factor("block")[1], rel=1e-12)
