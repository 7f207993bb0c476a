"""A fill job's memory-bound kernels at eager PyTorch's measured speeds (costmodels.eager): each kind of kernel's
bytes over its own share of HBM bandwidth, nothing fused; a main job's stay at the fused prior."""
from __future__ import annotations

import pytest

from costmodels.compute import unit_time
from costmodels.eager import EAGER_HBM, eager_share
from costmodels.hardware import Hardware
from passes.pipeline import analyze
from planner.fill.profiles import job_config
from targets.registry import get_target

NORMS = """import torch
from torch import nn


class Norms(nn.Module):
    def __init__(self):
        super().__init__()
        self.narrow, self.wide = nn.LayerNorm(64), nn.LayerNorm(4096)

    def forward(self, x):
        return self.narrow(x).sum(-1, keepdim=True) + self.wide(x.repeat(1, 1, 64)).softmax(-1)


def build_model():
    return Norms()


def example_inputs(batch_size: int):
    return (torch.randn(batch_size, 16, 64),)
"""


def test_each_kernel_kind_runs_at_its_own_share(tmp_path):
    path = tmp_path / "norms.py"
    path.write_text(NORMS)
    prof, _ = analyze(path, {}, dtype="bf16")
    kinds = {k for u in prof.units for p in (u.sharded, u.replicated) for k, _, _ in p.memory_bound}
    assert {"layer_norm/bfloat16", "layer_norm_wide/bfloat16", "softmax_wide/bfloat16"} <= kinds
    hw = Hardware(target=get_target("h200"))
    eager = hw.with_eff(eager=True, fusion=0.0)
    cfg = job_config(8, "plain", "bf16")
    for unit in prof.units:
        bound = [x for p in (unit.sharded, unit.replicated) for x in p.memory_bound]
        launches = (unit.sharded.kernels + unit.replicated.kernels) * hw.eff.launch_s
        expected = sum(f(8) / (hw.gpu.hbm_bw * eager_share(k, hw.eff.hbm)) for k, f, _ in bound)
        assert unit_time(unit, eager, cfg).fwd_s == pytest.approx(expected + launches, rel=1e-6)
        fused = sum(f(8) for _, f, _ in bound) * (1 - hw.eff.fusion) / (hw.gpu.hbm_bw * hw.eff.hbm)
        assert unit_time(unit, hw, cfg).fwd_s == pytest.approx(fused + launches, rel=1e-6)
    assert EAGER_HBM["bfloat16"]["layer_norm"] < EAGER_HBM["bfloat16"]["layer_norm_wide"] < hw.eff.hbm


def test_fp16_is_priced_as_bf16_and_unknown_kernels_at_the_prior():
    assert eager_share("gelu/float16", 0.8) == EAGER_HBM["bfloat16"]["gelu"]
    assert eager_share("add/bfloat16", 0.8) == 0.8 and eager_share("copy/float64", 0.7) == 0.7
