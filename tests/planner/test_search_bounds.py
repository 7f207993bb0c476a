"""The bounds the search prunes with are lower bounds: where memory shapes a 1F1B partition (a rank holds no more
blocks than its memory lets it) and where partial recomputation must redo blocks (no fewer than the shortfall
needs), no evaluated configuration is faster than its bound, and the share of the work a configuration enters the
queue with is below both; the fullest rank of any 1F1B partition needs no less than the blocks' least spread
(least_room, checked against enumeration), and what that spread rejects the partition search rejects too; the least
recomputation that fits a partition, found by bisection, is the least a scan finds."""
from __future__ import annotations

from collections import Counter
from dataclasses import replace
from itertools import product

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from costmodels.hardware import Hardware
from passes.pipeline import analyze
from planner.evaluate import Evaluator, Rejected, least_room
from planner.search import Pins, _least_work_s, _optimistic_iteration, candidates
from targets.registry import get_target
from tests.conftest import EXAMPLES

PROBLEMS = [(16, 64, 4), (8, 32, 4), (16, 128, 8)]  # GPUs, batch, p on A100 40GB: memory shapes the partitions


@pytest.fixture(scope="module")
def units():
    prof, _ = analyze(EXAMPLES / "gpt.py", {"preset": "18b", "layers": 16})
    return prof


def _evaluator(units, gpus: int, batch: int) -> Evaluator:
    return Evaluator(units=units.units, hw=Hardware(target=get_target("a100-40gb")), global_batch=batch, n_gpus=gpus,
                     tokens_per_sample=units.tokens_per_sample)


def _pool(ev: Evaluator, pp: int):
    for c in candidates(len(ev.units), ev.n_gpus, ev.hw.cluster.gpus_per_node, ev.global_batch, Pins(pp=pp),
                        Counter(), heads=((u.heads, u.kv_heads) for u in ev.units), seq=ev.tokens_per_sample):
        yield from (c, c.fallback(recompute="block")) if c.recompute == "none" else (c,)


def _evaluated(units, gpus: int, batch: int, pp: int):
    ev = _evaluator(units, gpus, batch)
    out = []
    for c in _pool(ev, pp):
        try:
            out.append((c, ev.evaluate(c)))
        except Rejected:
            pass
    return ev, out


@pytest.mark.parametrize("gpus,batch,pp", PROBLEMS)
def test_no_configuration_beats_its_search_bound(units, gpus, batch, pp):
    ev, evaluated = _evaluated(units, gpus, batch, pp)
    bound = 0
    for c, e in evaluated:
        assert _optimistic_iteration(ev, e.config) <= e.iteration_s * (1 + 1e-9), e.config
        assert _least_work_s(ev, c) <= _optimistic_iteration(ev, e.config) * (1 + 1e-9), e.config
        if e.config.v == 1:  # the fullest rank holds no fewer bytes than the blocks' least spread
            assert ev.least_rank_room(e.config) + ev.hw.reserve_bytes <= max(m.total for m in e.rank_memory)
        fwd, bwd, *_ = ev.unit_costs(e.config)
        if ev.least_slowest_stage_s(e.config) > sum(f + b for f, b in zip(fwd, bwd)) / e.config.stages * 1.001:
            bound += 1
            assert max(f + b for f, b in zip(e.forward_s, e.backward_s)) >= ev.least_slowest_stage_s(e.config)
    assert bound, "memory shaped no partition here: the problem does not test the memory-aware bound"


@pytest.mark.parametrize("gpus,batch,pp", PROBLEMS)
def test_partial_recomputation_redoes_no_fewer_blocks_than_its_bound(units, gpus, batch, pp):
    ev, evaluated = _evaluated(units, gpus, batch, pp)
    partial = [(c, e) for c, e in evaluated if c.recompute_mode.partial]
    assert partial
    for c, e in partial:
        short = ev.memory_lower_bound(c.fallback(recompute="none")) - ev.capacity
        if short > 0:
            assert ev.least_recompute_for(c, short) <= e.config.recompute_layers, e.config
        # the least count that fits the evaluated partition, by bisection, is the least a scan finds
        stages = [range(a, b) for a, b in zip(e.bounds, e.bounds[1:])]

        def fits(k: int) -> bool:
            ck = replace(c, recompute_layers=k)
            redo = {i for r in ev._recomputed(ck, e.bounds) for i in r}
            return max(m.total for m in ev._rank_memory(ck, stages, redo)) <= ev.capacity

        most = ev._most_recomputed(c)
        scan = next((k for k in range(1, most + 1) if fits(k)), most)
        assert ev.least_recompute_on(c, e.bounds) == scan


@given(need=st.lists(st.floats(0.1, 5.0), min_size=1, max_size=4), blocks=st.integers(0, 7))
@settings(max_examples=300, deadline=None)
def test_least_room_is_the_least_fullest_bin(need, blocks):
    """least_room against every spread of the blocks over the bins."""
    spreads = (a for a in product(range(blocks + 1), repeat=len(need)) if sum(a) == blocks)
    least = min(max(n * w for n, w in zip(a, need)) for a in spreads) if blocks else 0.0
    assert least_room(need, blocks) == pytest.approx(least, rel=1e-9)


@pytest.mark.parametrize("gpus,batch,pp", PROBLEMS)
def test_what_the_spread_rejects_no_partition_fits(units, gpus, batch, pp, monkeypatch):
    """Evaluation rejects a 1F1B configuration at once where no spread of its blocks fits its ranks (and the average
    rank does): the partition search, run without that check, finds none either."""
    ev = _evaluator(units, gpus, batch)
    early = [c for c in _pool(ev, pp) if c.v == 1 and ev.memory_lower_bound(c) <= ev.capacity
             < ev.least_rank_room(c) + ev.hw.reserve_bytes]
    assert early, "the spread rejects nothing here: the problem does not test it"
    monkeypatch.setattr(ev, "least_rank_room", lambda c: 0.0)
    for c in early:
        with pytest.raises(Rejected, match="needs|no partition fits"):
            ev.evaluate(c)
