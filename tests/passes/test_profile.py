"""Measured profiling on this machine's CPU."""
from __future__ import annotations

from passes.profile import measure_units
from tests.conftest import EXAMPLES


def test_mlp_measured_times_are_positive_and_grow_with_batch():
    small = measure_units(str(EXAMPLES / "mlp.py"), {}, 8, repeats=5)
    large = measure_units(str(EXAMPLES / "mlp.py"), {}, 1024, repeats=5)
    assert len(small) == len(large) == 6
    for m in small + large:
        assert m.fwd_median_s > 0 and m.bwd_median_s > 0 and m.device == "cpu"
    total = lambda ms: sum(m.fwd_median_s + m.bwd_median_s for m in ms)  # noqa: E731
    assert total(large) > 2 * total(small)  # 128x the work: far above timer noise
