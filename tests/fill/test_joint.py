"""Joint choice and main-job optimizer offload (PipeFill 4.2)."""
from __future__ import annotations

import pytest

from passes.pipeline import analyze
from planner.evaluate import Evaluator
from planner.fill.joint import bubble_cycles, choose_joint, offload_bytes
from planner.fill.profiles import profile_job
from planner.fill.spec import FillJobSpec, Work
from planner.search import Pins, search
from costmodels.hardware import Hardware
from targets.registry import get_target
from tests.conftest import EXAMPLES


@pytest.fixture(scope="module")
def setup():
    tg = get_target("a100-80gb")
    prof, _ = analyze(EXAMPLES / "gpt.py", {"preset": "3.6b"})
    ev = Evaluator(units=prof.units, hw=Hardware(target=tg), global_batch=128, n_gpus=32)
    result = search(ev, Pins(schedule="1f1b", recompute="selective"), top=8, simulate_top=8)
    job = FillJobSpec(name="bert", model=str(EXAMPLES / "bert.py"), model_args={"preset": "base"}, kind="infer",
                      batch_sizes=[8, 32], work=Work(samples=10_000))
    jobs = {"bert": profile_job(job, ev.hw, "bf16")}
    return ev, [result.best, *result.runners_up], jobs


def _total(j):
    return j.main_useful_per_gpu + j.fill.fill_flops_per_gpu_s


def test_more_slack_never_lowers_total_useful_work(setup):
    ev, cands, jobs = setup
    strict = choose_joint(ev, cands, jobs, main_slack=0.0)
    loose = choose_joint(ev, cands, jobs, main_slack=0.5)
    assert strict.evaluation.iteration_s == pytest.approx(min(e.iteration_s for e in cands[:1]), rel=1e-6)
    assert _total(loose) >= _total(strict) * (1 - 1e-9)
    assert loose.considered >= strict.considered


def test_offload_raises_every_bubble_only_when_pcie_fits(setup):
    ev, cands, _ = setup
    offloaded = 0
    for e in cands:
        moved = offload_bytes(ev, e)
        e_sim, sim = ev.simulate_config(e)
        if moved is None:
            continue
        c = e.config
        offloaded += 1
        for r, mem in enumerate(e.rank_memory):
            assert moved[r] <= mem.optimizer
            assert moved[r] / ev.hw.gpu.pcie_bw <= e.allreduce_s[r] * (1 + 1e-9)
        plain, raised = bubble_cycles(sim, c.pp), bubble_cycles(sim, c.pp, moved)
        for r in range(c.pp):
            for a, b in zip(plain[r], raised[r]):
                assert b.free_bytes == a.free_bytes + moved[r]
    assert offloaded > 0
    # no data parallelism -> no gradient all-reduce to hide the reload in -> no offload
    solo = Evaluator(units=ev.units, hw=ev.hw, global_batch=16, n_gpus=8)
    e = search(solo, Pins(dp=1, pp=2)).best
    assert offload_bytes(solo, e) is None
