"""Every thesis Table 4.1 preset, traced on meta: parameters (eq. 4.3) and per-layer FLOPs."""
from __future__ import annotations

import importlib.util

import pytest

from passes.pipeline import analyze
from tests.conftest import EXAMPLES

V, S = 51200, 2048
TABLE_4_1 = ["1.7b", "3.6b", "7.5b", "18b", "39b", "76b", "145b", "310b", "530b", "1t"]


def _presets() -> dict[str, tuple[int, int, int]]:
    spec = importlib.util.spec_from_file_location("gpt_example", EXAMPLES / "gpt.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.PRESETS


@pytest.mark.parametrize("preset", TABLE_4_1)
def test_preset_matches_thesis(preset):
    heads, h, layers = _presets()[preset]
    prof, _ = analyze(EXAMPLES / "gpt.py", {"preset": preset})
    eq_4_3 = 12 * layers * h * h * (1 + 13 / (12 * h) + (V + S) / (12 * layers * h))
    assert prof.total_params == pytest.approx(eq_4_3, rel=0.005)
    blocks = [u for u in prof.units if u.kind == "block"]
    assert len(blocks) == layers
    assert [u.kind for u in (prof.units[0], prof.units[-1])] == ["embedding", "head"]
    for b in (1, 4):  # one trace, any microbatch size
        layer_flops = 24 * b * S * h * h + 4 * b * S * S * h
        assert blocks[0].fwd_flops(b) == pytest.approx(layer_flops, rel=0.01)
        assert blocks[-1].fwd_flops(b) == pytest.approx(layer_flops, rel=0.01)
