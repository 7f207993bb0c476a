"""Joint choice (the main job first, fill at --fill-value; shrinking vs filling the bubbles; CP-SAT only where it
can gain) and main-job optimizer offload (PipeFill 4.2)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from passes.pipeline import analyze
from planner.evaluate import Evaluator
from planner.fill.joint import (_pick, boundaries_cost, bubble_cycles, choose_joint, choose_shrink_or_fill,
                                 greedy_proven_optimal, offload_bytes, recovered_gpu_s_per_s)
from planner.fill.packing import cpsat_budget
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


@pytest.fixture(scope="module")
def pipelined(setup):
    """Candidates with bubbles: the best few 1F1B configurations at p = 2, 4 and 8 (more stages: more bubbles, a
    slower main job, more fill)."""
    ev, _, jobs = setup
    cands = []
    for p in (2, 4, 8):
        r = search(ev, Pins(pp=p, schedule="1f1b", recompute="selective"), top=3, simulate_top=3)
        cands += [r.best, *r.runners_up]
    return ev, cands, jobs


def _simulated(ev, cands, slack):
    """Simulated iteration time of each candidate within `slack` of the best (by the time it comes with)."""
    best = min(e.iteration_s for e in cands)
    return {e.config: ev.simulate_config(e)[0].iteration_s for e in cands if e.iteration_s <= best * (1 + slack) * (1 + 1e-9)}


@pytest.mark.parametrize("slack", [0.0, 0.05, 1.0])
def test_fill_value_zero_picks_the_fastest_simulated_main_job(pipelined, slack):
    ev, cands, jobs = pipelined
    times = _simulated(ev, cands, slack)
    j = choose_joint(ev, cands, jobs, main_slack=slack)
    assert j.evaluation.iteration_s == min(times.values())
    assert j.evaluation.config == min(times, key=times.get)
    assert j.considered == len([t for t in times.values() if t <= min(times.values()) * (1 + slack) * (1 + 1e-9)])
    assert j.score == pytest.approx(1.0)


def test_a_high_fill_value_lets_a_slower_main_job_with_more_fill_win(pipelined):
    ev, cands, jobs = pipelined
    fast = choose_joint(ev, cands, jobs, main_slack=1.0)
    rich = choose_joint(ev, cands, jobs, main_slack=1.0, fill_value=1000)
    assert rich.evaluation.iteration_s > fast.evaluation.iteration_s * 1.01
    assert rich.recovered > fast.recovered * 1.2
    fastest = min(_simulated(ev, cands, 1.0).values())
    assert rich.score == pytest.approx(fastest / rich.evaluation.iteration_s + 1000 * rich.recovered)
    every = [choose_joint(ev, [e], jobs, fill_value=1000) for e in cands]
    assert rich.recovered == max(o.recovered for o in every)
    # --main-slack still bounds what is considered at all
    bounded = choose_joint(ev, cands, jobs, main_slack=0.05, fill_value=1000)
    assert bounded.evaluation.iteration_s <= fastest * 1.05 * (1 + 1e-9)


def test_a_higher_fill_value_never_buys_a_faster_main_job_or_less_fill(pipelined):
    ev, cands, jobs = pipelined
    picks = [choose_joint(ev, cands, jobs, main_slack=1.0, fill_value=v) for v in (0, 0.5, 1, 2, 5, 10, 100)]
    for a, b in zip(picks, picks[1:]):
        assert b.evaluation.iteration_s >= a.evaluation.iteration_s * (1 - 1e-12)
        assert b.recovered >= a.recovered * (1 - 1e-12)


def test_fill_breaks_only_exact_ties_at_fill_value_zero(pipelined):
    ev, cands, jobs = pipelined
    fast = choose_joint(ev, cands, jobs, main_slack=1.0)
    rich = choose_joint(ev, cands, jobs, main_slack=1.0, fill_value=1000)
    assert rich.recovered > fast.recovered
    for nudge, winner in ((1 + 1e-12, "rich"), (1 + 1e-6, "fast")):
        slow = fast.evaluation.iteration_s * nudge
        twin = replace(rich.evaluation, iteration_s=slow)
        picked = _pick([fast, replace(rich, evaluation=twin)], reference_s=fast.evaluation.iteration_s,
                       main_slack=1.0, fill_value=0.0)
        assert picked.recovered == (rich if winner == "rich" else fast).recovered


def test_recovered_gpu_seconds_are_dedicated_gpu_time_per_wall_second(pipelined):
    ev, cands, jobs = pipelined
    j = choose_joint(ev, cands, jobs, main_slack=1.0, fill_value=1000)
    ranks = [rf for q in j.fill.per_rank for rf in q]  # one job: each rank's queue holds it alone
    assert ranks and all(len(q) <= 1 for q in j.fill.per_rank)
    by_hand = sum(rf.packing.flops_per_cycle * rf.profile.iteration_s / rf.profile.flops_per_iteration
                  for rf in ranks) / (len(j.fill.per_rank) * j.evaluation.iteration_s)
    assert j.recovered == pytest.approx(by_hand) and 0 < j.recovered < 1
    assert recovered_gpu_s_per_s(j.fill, j.evaluation.iteration_s) == j.recovered


def test_cpsat_runs_only_where_chunk_boundaries_cost(pipelined):
    ev, cands, jobs = pipelined
    greedy = choose_joint(ev, cands, jobs, main_slack=1.0, fill_value=1000)
    with cpsat_budget(5.0) as budget:
        asked = choose_joint(ev, cands, jobs, main_slack=1.0, fill_value=1000, solver="cpsat")
    assert budget.solves == 0 and budget.skipped == 0  # greedy is proven optimal: CP-SAT never started
    assert asked.solver == "greedy" and asked.recovered == greedy.recovered
    assert not boundaries_cost([asked])
    rf = next(rf for q in asked.fill.per_rank for rf in q)
    swapping = replace(rf, packing=replace(rf.packing, params=replace(rf.packing.params, state_swap_bw=10e9)))
    costly = replace(asked, fill=replace(asked.fill, per_rank=((swapping,),)))
    assert boundaries_cost([asked, costly])
    assert greedy_proven_optimal("cpsat") == ("greedy (proven optimal: chunk boundaries cost nothing here; "
                                              "CP-SAT not needed)")


def test_shrinking_or_filling_says_which_won_with_both_figures(setup):
    ev, _, jobs = setup
    zb = search(ev, Pins(pp=4, schedules=("zbh1", "zbv"), recompute="selective"), top=3, simulate_top=3)
    kept = search(ev, Pins(pp=4, schedules=("gpipe", "1f1b"), recompute="selective"), top=3, simulate_top=3)
    shrink, keep = [zb.best, *zb.runners_up], [kept.best, *kept.runners_up]
    for value in (0.0, 1000.0):
        j = choose_shrink_or_fill(ev, shrink, keep, jobs, main_slack=1.0, fill_value=value)
        s = choose_joint(ev, shrink, jobs, main_slack=1.0, fill_value=value)
        k = choose_joint(ev, keep, jobs, main_slack=1.0, fill_value=value)
        reference = min(s.evaluation.iteration_s, k.evaluation.iteration_s)
        score = {id(o): reference / o.evaluation.iteration_s + value * o.recovered for o in (s, k)}
        winner, loser = (s, k) if score[id(s)] >= score[id(k)] else (k, s)
        assert j.evaluation.config == winner.evaluation.config
        won = "shrinking" if winner is s else "filling"
        assert j.choice.startswith(f"{won} won (")
        for o in (s, k):
            e = o.evaluation
            assert f"{e.iteration_s:.3f} s (MFU {e.mfu:.1%}, bubbles {e.bubble_fraction:.1%}" in j.choice
        assert f"recovers {k.fill.fill_flops_per_gpu_s / 1e12:.2f} TFLOP/s/GPU ({k.recovered:.4f} GPU-s/s)" in j.choice
        assert str(loser.evaluation.config) in j.choice and f"--fill-value {value:g}" in j.choice
    assert choose_shrink_or_fill(ev, shrink, keep, jobs, main_slack=1.0).choice.startswith("shrinking won")
    assert choose_shrink_or_fill(ev, shrink, keep, jobs, main_slack=1.0, fill_value=1000).choice.startswith(
        "filling won")


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
