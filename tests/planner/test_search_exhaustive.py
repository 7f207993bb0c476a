"""The search finds its own model's optimum: on small problems it equals the best of exhaustive simulation, and
the lower bound it prunes simulations with is never above a simulated time."""
from __future__ import annotations

from collections import Counter

import pytest

from costmodels.hardware import Hardware
from passes.pipeline import analyze
from planner.evaluate import Evaluator, Rejected
from planner.search import Pins, candidates, search
from targets.registry import get_target
from tests.conftest import EXAMPLES

PROBLEMS = [(8, 16, 2), (8, 32, 4), (16, 32, 2), (16, 64, 4), (16, 32, 8), (8, 64, 8), (32, 64, 4), (32, 128, 8),
            (16, 16, 4), (8, 8, 2), (4, 16, 4), (4, 32, 2), (16, 128, 2), (32, 32, 8), (8, 24, 4)]  # GPUs, batch, p


@pytest.fixture(scope="module")
def units():
    prof, _ = analyze(EXAMPLES / "gpt.py", {"preset": "18b", "layers": 16})
    return prof


def _exhaustive(ev: Evaluator, pins: Pins):
    out = []
    for c in candidates(len(ev.units), ev.n_gpus, ev.hw.cluster.gpus_per_node, ev.global_batch, pins, Counter(),
                        heads=((u.heads, u.kv_heads) for u in ev.units), seq=ev.tokens_per_sample):
        try:
            e = ev.evaluate(c)
        except Rejected:
            continue
        out.append((e, ev.simulate_config(e)[0]))
    return out


@pytest.mark.parametrize("gpus,batch,pp", PROBLEMS)
def test_search_equals_exhaustive_simulation(units, gpus, batch, pp):
    ev = Evaluator(units=units.units, hw=Hardware(target=get_target("a100-80gb")), global_batch=batch, n_gpus=gpus,
                   tokens_per_sample=units.tokens_per_sample)
    pins = Pins(pp=pp)  # pipelining pinned: the problems where the analytic ranking and the simulation disagree
    every = _exhaustive(ev, pins)
    for e, sim in every:
        assert sim.iteration_s >= e.lower_bound_s() * (1 - 1e-9), e.config
    best = min(sim.iteration_s for _, sim in every)
    assert search(ev, pins).best.iteration_s == pytest.approx(best, rel=1e-12)
