"""Partial recomputation (Megatron's --recompute-method block --recompute-num-layers N): the first N blocks of each
model chunk redo their forward in the backward and keep only their input; the others keep everything."""
from __future__ import annotations

import dataclasses

import pytest

from costmodels.hardware import Hardware
from costmodels.recompute import RECOMPUTE
from passes.pipeline import analyze
from planner.config import ParallelConfig
from planner.evaluate import Evaluator, Rejected
from planner.export import check_megatron, to_megatron
from planner.api import make_plan
from planner.search import Pins
from targets.registry import get_target
from tests.conftest import EXAMPLES

LAYERS, BATCH = 8, 8
BASE = dict(tp=1, pp=1, dp=1, b=1, m=BATCH)


@pytest.fixture(scope="module")
def ev() -> Evaluator:
    prof, _ = analyze(EXAMPLES / "gpt.py", {"preset": "1.7b", "layers": LAYERS})
    return Evaluator(units=prof.units, hw=Hardware(target=get_target("a100-80gb")), global_batch=BATCH, n_gpus=1,
                     tokens_per_sample=prof.tokens_per_sample)


@pytest.mark.parametrize("n", [1, 3, LAYERS])
def test_memory_and_time_follow_the_closed_form_for_n_of_l_layers(ev, n):
    """Activations per microbatch: every unit's plain bytes, less (plain - input) for each of the N recomputed
    blocks; the backward grows by N blocks' forward (what full recomputation adds per block)."""
    none = ev.evaluate(ParallelConfig(**BASE))
    part = ev.evaluate(ParallelConfig(**BASE, recompute="block", recompute_layers=n))
    block = next(u for u in ev.units if u.kind == "block")
    plain = RECOMPUTE["none"].kept_bytes(block, 1, 1)
    assert part.activation_bytes[0] == pytest.approx(none.activation_bytes[0] - n * (plain - block.input_bytes(1)))
    redo = ev.unit_costs(ParallelConfig(**BASE, recompute="full"))[1][block.index] - ev.unit_costs(
        ParallelConfig(**BASE))[1][block.index]
    assert part.backward_s[0] == pytest.approx(none.backward_s[0] + n * redo)
    if n == LAYERS:
        full = ev.evaluate(ParallelConfig(**BASE, recompute="full"))
        assert part.activation_bytes == pytest.approx(full.activation_bytes)
        assert part.iteration_s == pytest.approx(full.iteration_s)
        assert part.hfu == pytest.approx(full.hfu)


def test_each_chunk_recomputes_its_own_first_blocks(ev):
    """p = 2 with two chunks per rank: four stages of two blocks (the embedding and head with the end ones); N = 1
    recomputes the first block of each."""
    c = ParallelConfig(tp=1, pp=2, dp=1, b=1, m=BATCH, v=2, schedule="interleaved", recompute="block",
                       recompute_layers=1)
    e = ev.evaluate(c)
    redo = ev._recomputed(c, e.bounds)
    blocks = [[i for i in range(a, b) if ev.units[i].kind == "block"] for a, b in zip(e.bounds, e.bounds[1:])]
    assert [list(r) for r in redo] == [b[:1] for b in blocks]


def test_the_search_takes_the_least_n_that_fits(ev):
    """Between "none" (too big) and "full", the evaluator bisects N: N fits and N - 1 does not; on a GPU with room
    for half the blocks recomputed, N is at most half."""
    half = ev.evaluate(ParallelConfig(**BASE, recompute="block", recompute_layers=LAYERS // 2))
    # room for half the blocks recomputed (the partition counts the tied embedding / LM head weight in both units)
    hbm = max(m.total for m in half.rank_memory) + 2.5 * 2**30
    target = dataclasses.replace(ev.hw.target, gpu=dataclasses.replace(ev.hw.gpu, hbm_bytes=int(hbm)))
    tight = Evaluator(units=ev.units, hw=Hardware(target=target), global_batch=BATCH, n_gpus=1,
                      tokens_per_sample=ev.tokens_per_sample)
    with pytest.raises(Rejected):
        tight.evaluate(ParallelConfig(**BASE))
    chosen = tight.evaluate(ParallelConfig(**BASE, recompute="block"))
    n = chosen.config.recompute_layers
    assert 1 <= n <= LAYERS // 2
    with pytest.raises(Rejected):
        tight.evaluate(ParallelConfig(**BASE, recompute="block", recompute_layers=n - 1) if n > 1
                       else ParallelConfig(**BASE))
    with pytest.raises(Rejected, match="nothing needs recomputing"):
        ev.evaluate(ParallelConfig(**BASE, recompute="block"))  # where "none" fits, "block" is not a choice


def test_exported_as_megatrons_block_method():
    pytest.importorskip("megatron.core")
    plan, _ = make_plan(str(EXAMPLES / "gpt.py"), target="a100-80gb", gpus=2, global_batch=8,
                        model_args={"layers": 4}, pins=Pins(pp=2, recompute="block", recompute_layers=1,
                                                            engine="megatron"))
    assert plan.config.recompute == "block" and plan.config.recompute_layers == 1
    ex = to_megatron(plan)
    assert ex.argv[ex.argv.index("--recompute-method") + 1] == "block"
    checked = check_megatron(ex)
    assert checked["recompute"] == "full" and checked["recompute_layers"] == ("block", 1)


@pytest.mark.parametrize("c", [
    ParallelConfig(tp=1, pp=2, dp=1, b=1, m=BATCH, v=2, schedule="interleaved", recompute="block", recompute_layers=1),
    ParallelConfig(tp=1, pp=2, dp=1, b=2, m=BATCH // 2, schedule="zbh1", recompute="block", recompute_layers=2),
    ParallelConfig(tp=1, pp=4, dp=1, b=1, m=BATCH, recompute="full"),
    ParallelConfig(tp=1, pp=1, dp=1, b=1, m=BATCH, recompute="selective"),
])
def test_rank_memory_from_the_unit_table_is_stage_memory(ev, c):
    """The evaluator prices each rank from the units' bytes under c worked out once (Evaluator.unit_bytes): exactly
    what stage_memory works out unit by unit."""
    from costmodels.memory import stage_memory

    bounds = ev._fastest_bounds(c)
    stages = [range(a, b) for a, b in zip(bounds, bounds[1:])]
    full = {i for r in ev._recomputed(c, bounds) for i in r}
    place = c.placement
    alone = [stage_memory([ev.units[i] for j in place.stages(r) for i in stages[j]], ev.hw, c, r, full,
                          chunks=[len(stages[j]) for j in place.stages(r)]) for r in range(c.pp)]
    assert ev._rank_memory(c, stages, full) == alone
