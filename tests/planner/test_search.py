"""Search: pins, rejections, and what the chosen configuration satisfies."""
from __future__ import annotations

import pytest

from passes.pipeline import analyze
from planner.evaluate import Evaluator
from planner.search import Pins, search
from costmodels.hardware import Hardware
from targets.registry import get_target
from tests.conftest import EXAMPLES


@pytest.fixture(scope="module")
def gpt_units():
    prof, _ = analyze(EXAMPLES / "gpt.py", {"preset": "7.5b"})
    return prof.units


def _ev(units, n=64, B=256):
    return Evaluator(units=units, hw=Hardware(target=get_target("a100-80gb")), global_batch=B, n_gpus=n)


def test_pinning_every_dimension_evaluates_exactly_one_configuration(gpt_units):
    pins = Pins(tp=4, pp=4, dp=4, b=2, v=2, recompute="selective", schedule="interleaved", sp=True)
    r = search(_ev(gpt_units), pins)
    c = r.best.config
    assert (c.tp, c.pp, c.dp, c.b, c.v, c.recompute, c.schedule, c.sp) == (4, 4, 4, 2, 2, "selective", "interleaved",
                                                                          True)
    assert r.evaluated == 1 and r.runners_up == ()


def test_free_search_is_at_least_as_good_as_any_pinned_choice(gpt_units):
    free = search(_ev(gpt_units))
    for pins in (Pins(tp=8, pp=1), Pins(tp=2, pp=4, schedule="1f1b"), Pins(recompute="full")):
        assert free.best.samples_per_s >= search(_ev(gpt_units), pins).best.samples_per_s * (1 - 1e-9)


def test_chosen_configuration_fits_memory_and_factors(gpt_units):
    r = search(_ev(gpt_units, n=64, B=256))
    c = r.best.config
    assert c.tp * c.pp * c.dp == 64 and c.dp * c.b * c.m == 256 and 8 % c.tp == 0
    assert all(m.total <= 80 * 2**30 for m in r.best.rank_memory)
    assert r.best.simulated and 0 <= r.best.bubble_fraction < 1
    assert all(e.iteration_s >= r.best.iteration_s * 0.999 or not e.simulated for e in r.runners_up)


def test_rejections_are_counted_by_reason(gpt_units):
    r = search(_ev(gpt_units, n=64, B=64), Pins(zero=0))  # replicated optimizer state: some do not fit
    assert r.rejected.get("memory (lower bound)", 0) > 0
    assert sum(r.rejected.values()) < r.evaluated


def test_cross_node_tensor_parallelism_needs_the_flag(gpt_units):
    r = search(_ev(gpt_units, n=16, B=64), Pins(pp=1, recompute="full"))
    assert r.best.config.tp <= 8
    wide = search(_ev(gpt_units, n=16, B=64), Pins(tp=16, allow_cross_node_tp=True, recompute="full"))
    assert wide.best.config.tp == 16


def test_sequence_parallelism_is_searched_and_saves_memory_and_time(gpt_units):
    ev = _ev(gpt_units)
    on, off = (search(ev, Pins(tp=4, pp=4, dp=4, b=1, v=1, recompute="none", schedule="1f1b", sp=sp)).best
               for sp in (True, False))
    assert on.config.sp and not off.config.sp
    assert max(m.activations for m in on.rank_memory) < max(m.activations for m in off.rank_memory)
    assert on.iteration_s < off.iteration_s  # the norms and dropouts run on 1/t of the sequence
    assert search(ev, Pins(tp=4)).best.config.sp  # left free, the search takes it where t > 1


def test_a_pinned_vp_beyond_the_default_range_is_a_choice(gpt_units):
    """NeMo's GPT-3 175B recipe runs 12 model chunks per rank (more than the default max_v=8)."""
    r = search(_ev(gpt_units), Pins(tp=4, pp=2, dp=8, b=1, v=12, recompute="selective"))
    assert (r.best.config.v, r.best.config.schedule) == (12, "interleaved")
