"""Issue 49: hybrid-sharded data parallelism (HSDP, --dp-replicate R with --zero 3): FSDP within each of R replicas of
d/R ranks, the gradient shards all-reduced across the replicas (torch FSDP2's foreach_reduce with an all_reduce_group;
torchtitan's data_parallel_replicate_degree; Megatron-FSDP's --num-distributed-optimizer-instances). Memory as FSDP
over the shard group holds it, the step's communication with the all-reduce over R, the pins and the exports."""
from __future__ import annotations

import importlib.util

import pytest
from typer.testing import CliRunner

from costmodels.comm import allreduce_time
from costmodels.hardware import Hardware
from costmodels.memory import param_count
from passes.errors import UserError
from passes.pipeline import analyze
from planner.api import make_plan
from planner.cli import app
from planner.config import ConfigError, ParallelConfig
from planner.evaluate import Evaluator
from planner.search import Pins
from targets.registry import get_target
from tests.conftest import EXAMPLES

needs_titan = pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None,
                                 reason="torchtitan is not installed (pip install -e '.[engines]')")
M = 4  # microbatches per step


@pytest.fixture(scope="module")
def units():
    prof, _ = analyze(EXAMPLES / "gpt.py", {"preset": "1.7b", "layers": 8})
    return prof


def _ev(prof, gpus: int) -> Evaluator:
    return Evaluator(units=prof.units, hw=Hardware(target=get_target("h100-sxm")), global_batch=gpus * M,
                     n_gpus=gpus, tokens_per_sample=prof.tokens_per_sample)


def _cfg(dp: int, replicate: int = 1, **kw) -> ParallelConfig:
    return ParallelConfig(**{**dict(tp=1, pp=1, dp=dp, b=1, m=M, zero=3, dp_replicate=replicate,
                                    overlap_grad_reduce=False), **kw})


def test_memory_under_hsdp_is_fsdp_over_the_shard_group(units):
    """HSDP 2 x 8 on 16 GPUs holds per GPU what FSDP over 8 GPUs holds: parameters, gradients and optimizer state
    sharded over the 8 ranks of a replica, not over all 16."""
    hsdp = _ev(units, 16).evaluate(_cfg(16, 2)).rank_memory[0]
    fsdp8 = _ev(units, 8).evaluate(_cfg(8)).rank_memory[0]
    fsdp16 = _ev(units, 16).evaluate(_cfg(16)).rank_memory[0]
    for part in ("weights", "grads", "optimizer", "activations", "total"):
        assert getattr(hsdp, part) == pytest.approx(getattr(fsdp8, part)), part
    assert hsdp.optimizer == pytest.approx(2 * fsdp16.optimizer)  # (sharded over half the ranks)


def test_the_step_prices_the_all_reduce_over_the_replicas(units):
    """Without overlap the step's data-parallel communication under HSDP 2 x 8 is FSDP's over the 8 ranks of a node
    (all-gathers and reduce-scatters on NVLink) plus, every microbatch, an all-reduce of each rank's fp32 gradient
    shard over the 2 replicas, one per node (torch FSDP2 all-reduces the reduce-scatter's output)."""
    ev16, ev8 = _ev(units, 16), _ev(units, 8)
    c = _cfg(16, 2, grad_fp32=True)
    hsdp, fsdp8 = ev16.evaluate(c).allreduce_s[0], ev8.evaluate(_cfg(8, grad_fp32=True)).allreduce_s[0]
    shard = sum(param_count(u, c) for u in units.units) / 8  # (a tied weight reduced with each unit: the evaluator's)
    across = allreduce_time(shard * 4, 1, 2, ev16.hw.links)  # fp32 gradients, one replica per node
    assert hsdp == pytest.approx(fsdp8 + M * across, rel=1e-9)
    assert ev16.dp_comm_floor(c) == pytest.approx(hsdp, rel=1e-9)
    # within a node the shard group's collectives take NVLink: cheaper than FSDP's over both nodes
    assert hsdp < ev16.evaluate(_cfg(16, grad_fp32=True)).allreduce_s[0]


def test_the_rules():
    with pytest.raises(ConfigError, match="needs zero 3"):
        _cfg(16, 2, zero=2)
    with pytest.raises(ConfigError, match="does not divide"):
        _cfg(12, 8)
    for pins, said in ((dict(dp_replicate=2), "needs --zero 3"), (dict(dp_replicate=2, zero=1), "got 1"),
                       (dict(dp_replicate=4, zero=3, dp=6), "does not divide the data-parallel degree --dp 6")):
        with pytest.raises(UserError) as e:
            Pins(**pins)
        msg = str(e.value)
        assert said in msg and "--dp-replicate" in msg and msg.count(". ") == 0 and "\n" not in msg, msg


@pytest.mark.parametrize("engine", ["fxplanner"])
def test_refused_in_one_sentence_where_the_engine_lacks_it(engine):
    with pytest.raises(UserError) as e:
        make_plan(str(EXAMPLES / "gpt.py"), gpus=8, global_batch=16, target="h100-sxm",
                  model_args={"preset": "tiny", "layers": 2}, pins=Pins(engine=engine, zero=3, dp_replicate=2))
    msg = str(e.value)
    assert "--dp-replicate 2" in msg and "--engine torchtitan" in msg and "--engine megatron" in msg, msg
    assert msg.count(". ") == 0 and "\n" not in msg


def test_exported_to_megatron_fsdp():
    pytest.importorskip("megatron.core")
    from planner.export import check_megatron, to_megatron

    plan, _ = make_plan(str(EXAMPLES / "gpt.py"), target="h100-sxm", gpus=16, global_batch=32,
                        model_args={"layers": 4}, pins=Pins(tp=1, pp=1, dp=16, zero=3, dp_replicate=2,
                                                            engine="megatron"))
    assert plan.config.dp_replicate == 2
    ex = to_megatron(plan)
    i = ex.argv.index("--num-distributed-optimizer-instances")
    assert ex.argv[i + 1] == "2" and not any("replica" in u for u in ex.unexpressed)
    seen = check_megatron(ex)
    assert seen["fsdp"] == "optim_grads_params" and seen["fsdp_replicas"] == 2


@needs_titan
def test_planner_plan_dp_replicate_for_torchtitan_plans_and_exports(tmp_path):
    """`planner plan examples/hf_llama.py --model-arg preset=llama3-8b --gpus 16 --engine torchtitan --zero 3
    --dp-replicate 2` (two layers), then `planner export --to torchtitan` (and --toml): data_parallel_replicate_degree
    2, data_parallel_shard_degree 8, which torchtitan's ParallelDims takes."""
    pytest.importorskip("transformers", reason="the hf extra is not installed")
    from planner.export import check_torchtitan, to_torchtitan
    from planner.plan import load_plan

    out = tmp_path / "plan.json"
    runner = CliRunner()
    result = runner.invoke(app, ["plan", str(EXAMPLES / "hf_llama.py"), "--model-arg", "preset=llama3-8b",
                                 "--model-arg", "layers=2", "--gpus", "16", "--global-batch", "32", "--target",
                                 "h100-sxm", "--engine", "torchtitan", "--zero", "3", "--dp-replicate", "2", "--tp",
                                 "1", "--pp", "1", "--cp", "1", "-o", str(out)])
    assert result.exit_code == 0, result.output
    plan = load_plan(out)
    assert (plan.config.dp, plan.config.dp_replicate, plan.config.zero) == (16, 2, 3)
    ex = to_torchtitan(plan, module="llama3", config="llama3_8b")
    seen = check_torchtitan(ex, 16)
    assert (seen["dp_replicate"], seen["dp_shard"]) == (2, 8) and not ex.unexpressed
    script = tmp_path / "job.sh"
    result = runner.invoke(app, ["export", str(out), "--to", "torchtitan", "--titan-module", "llama3",
                                 "--titan-config", "llama3_8b", "-o", str(script)])
    assert result.exit_code == 0, result.output
    text = script.read_text()
    assert "--parallelism.data_parallel_replicate_degree 2" in text
    assert "--parallelism.data_parallel_shard_degree 8" in text
    toml = tmp_path / "job.toml"
    result = runner.invoke(app, ["export", str(out), "--to", "torchtitan", "--toml", "--titan-module", "llama3",
                                 "--titan-config", "llama3_8b", "-o", str(toml)])
    assert result.exit_code == 0, result.output
    assert "data_parallel_replicate_degree = 2\n" in toml.read_text()
    assert "data_parallel_shard_degree = 8\n" in toml.read_text()


def test_a_plan_without_replicas_reads_as_before():
    """A plan file written before the field (no dp_replicate) loads as plain FSDP / ZeRO."""
    from planner.plan import ConfigModel

    c = ConfigModel.of(_cfg(8)).model_dump()
    c.pop("dp_replicate")
    assert ConfigModel(**c).to_config().dp_replicate == 1


def test_the_search_tries_hsdp_under_zero3_and_takes_it_where_fsdp_over_every_rank_waits_on_the_network():
    """Llama-3-8B at 2K tokens, one sample per GPU on 512 H100s under --engine torchtitan --zero 3: FSDP over all
    512 ranks all-gathers and reduce-scatters across the NICs, more than the step's compute covers; sharding within
    each node (R = 64 replicas of 8) keeps those collectives on NVLink and all-reduces only the shards over the
    network. Unpinned, the search tries the whole-node shard groups (1, 2, 4, 8 nodes) beside R = 1 and takes the
    fastest; --dp-replicate 1 pins FSDP over every rank."""
    pytest.importorskip("transformers", reason="the hf extra is not installed")
    kw = dict(gpus=512, global_batch=512, target="h100-sxm", model_args={"preset": "llama3-8b", "seq": 2048})
    pins = dict(engine="torchtitan", tp=1, pp=1, b=1, zero=3, recompute="none")
    searched, _ = make_plan(str(EXAMPLES / "hf_llama.py"), pins=Pins(**pins), **kw)
    fsdp, _ = make_plan(str(EXAMPLES / "hf_llama.py"), pins=Pins(**pins, dp_replicate=1), **kw)
    assert fsdp.config.dp_replicate == 1 and searched.config.dp_replicate in (8, 16, 32, 64)
    assert searched.predictions.iteration_s < fsdp.predictions.iteration_s


def test_no_sharded_step_is_priced_shorter_than_its_data_parallel_traffic(units):
    """The communication stream runs a step's whole data-parallel traffic, hidden or not: no ZeRO-2/3 configuration
    (HSDP or not) is priced below Evaluator.dp_comm_floor, the search's own bound on it."""
    ev = _ev(units, 64)
    for zero, r, b in ((2, 1, 1), (3, 1, 1), (3, 8, 1), (3, 2, 4), (2, 1, 4)):
        c = ParallelConfig(tp=1, pp=1, dp=64, b=b, m=M // b, zero=zero, dp_replicate=r, overlap_grad_reduce=True)
        assert ev.evaluate(c).iteration_s >= ev.dp_comm_floor(c) > 0, (zero, r, b)
