"""ZeRO-2 and ZeRO-3 / FSDP as data-parallel strategies: memory per rank, communication, the search's choice of the
least sharding that fits, and the exports (Megatron-FSDP, torchtitan's FSDP)."""
from __future__ import annotations

import dataclasses

import pytest

from costmodels.hardware import Hardware
from costmodels.memory import expert_count, param_count, rank_param_count
from passes.pipeline import analyze
from planner.api import make_plan
from planner.config import ParallelConfig
from planner.evaluate import Evaluator
from planner.export import check_megatron, to_megatron, to_torchtitan
from planner.search import Pins, search
from targets.registry import get_target
from tests.conftest import EXAMPLES

D, BATCH = 8, 32


@pytest.fixture(scope="module")
def ev() -> Evaluator:
    prof, _ = analyze(EXAMPLES / "gpt.py", {"preset": "1.7b", "layers": 8})
    return Evaluator(units=prof.units, hw=Hardware(target=get_target("h100-sxm")), global_batch=BATCH, n_gpus=D,
                     tokens_per_sample=prof.tokens_per_sample)


def _cfg(zero: int, **kw) -> ParallelConfig:
    return ParallelConfig(**{**dict(tp=1, pp=1, dp=D, b=1, m=BATCH // D, zero=zero, overlap_grad_reduce=True,
                                    grad_fp32=True), **kw})


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_memory_per_rank_is_the_shards_plus_what_is_gathered_in_flight(ev, zero):
    """Weights, gradients and optimizer state over the d shards from stages 3, 2 and 1 on; whole beside them: under
    ZeRO-3 the two largest units' weights (the one computing and the one prefetched), under ZeRO-2 and -3 the
    largest unit's gradient until its reduce-scatter."""
    c = _cfg(zero)
    mem = ev.evaluate(c).rank_memory[0]
    params = rank_param_count(list(ev.units), c)
    largest = sorted((param_count(u, c) for u in ev.units), reverse=True)
    assert all(expert_count(u, c) == 0 for u in ev.units)
    w, g, o = 2, 4, 12  # bf16 weights, fp32 gradients, Adam's fp32 master and moments
    assert mem.optimizer == pytest.approx(params * o / D)
    assert mem.grads == pytest.approx(params * g / D + largest[0] * g if zero >= 2 else params * g)
    assert mem.weights == pytest.approx(params * w / D + sum(largest[:2]) * (1 - 1 / D) * w if zero == 3
                                        else params * w)


def test_more_sharding_moves_more_bytes(ev):
    """ZeRO-2 reduce-scatters every microbatch's gradients (m of them), ZeRO-3 also all-gathers the weights before
    each forward and backward: with no compute to hide them behind they all show."""
    t = {z: ev.evaluate(_cfg(z, overlap_grad_reduce=False)).allreduce_s[0] for z in (1, 2, 3)}
    m = BATCH // D  # ZeRO-1: t1 = G (one fp32 reduce-scatter) + A (one bf16 all-gather)
    assert t[2] > t[1] and t[3] > t[2]
    assert t[2] == pytest.approx(t[1] + (m - 1) * (t[1] - _gather(ev)), rel=1e-6)
    assert t[3] == pytest.approx(m * (t[1] - _gather(ev)) + 2 * m * _gather(ev), rel=1e-6)


def _gather(ev: Evaluator) -> float:
    """The bf16 all-gather of one rank's weights over the d replicas, as ZeRO-1 runs it after the step."""
    c = _cfg(1, overlap_grad_reduce=False)
    return ev.evaluate(dataclasses.replace(c, grad_fp32=False)).allreduce_s[0] / 2


def test_the_search_shards_more_only_where_less_does_not_fit(ev):
    """On a GPU with room for ZeRO-2 but not ZeRO-1, the search (zero not pinned) plans ZeRO-2; with room for
    ZeRO-1 it keeps ZeRO-1."""
    pins = Pins(tp=1, pp=1, dp=D, b=1, recompute="none", grad_fp32=True, engine="megatron",
                schedules=("1f1b",))
    roomy = search(ev, pins).best
    assert roomy.config.zero == 1
    one, two = (max(m.total for m in ev.evaluate(_cfg(z)).rank_memory) for z in (1, 2))
    target = dataclasses.replace(ev.hw.target, gpu=dataclasses.replace(ev.hw.gpu, hbm_bytes=int((one + two) / 2)))
    tight = Evaluator(units=ev.units, hw=Hardware(target=target), global_batch=BATCH, n_gpus=D,
                      tokens_per_sample=ev.tokens_per_sample)
    assert search(tight, pins).best.config.zero == 2


def test_exported_as_megatron_fsdp_and_torchtitan_fsdp():
    pytest.importorskip("megatron.core")
    for zero, strategy, reshard in ((2, "optim_grads", "never"), (3, "optim_grads_params", "always")):
        plan, _ = make_plan(str(EXAMPLES / "gpt.py"), target="h100-sxm", gpus=8, global_batch=16,
                            model_args={"layers": 4}, pins=Pins(tp=1, pp=1, dp=8, zero=zero, engine="megatron"))
        assert plan.config.zero == zero
        checked = check_megatron(to_megatron(plan))
        assert checked["fsdp"] == strategy and checked["distributed_optimizer"]
        titan = to_torchtitan(plan, module="llama3", config="llama3_debugmodel")
        i = titan.argv.index("--parallelism.fsdp_reshard_after_forward")
        assert titan.argv[i + 1] == reshard


def test_the_fxplanner_runtime_runs_up_to_zero2(tmp_path):
    from passes.errors import UserError
    from planner.plan import save_plan
    from planner.runtime import check_plan

    args = dict(target="a100-80gb", gpus=2, global_batch=4, model_args={"layers": 2})
    with pytest.raises(UserError, match="--zero 3, FSDP"):  # refused at plan time
        make_plan(str(EXAMPLES / "gpt.py"), **args, pins=Pins(tp=1, pp=1, dp=2, zero=3))
    plan, _ = make_plan(str(EXAMPLES / "gpt.py"), **args, pins=Pins(tp=1, pp=1, dp=2, zero=2))
    edited = plan.model_copy(update={"config": plan.config.model_copy(update={"zero": 3})})
    save_plan(edited, tmp_path / "plan.json")  # and by the runtime, should a plan say so
    with pytest.raises(UserError, match="ZeRO-3"):
        check_plan(tmp_path / "plan.json", 2)
