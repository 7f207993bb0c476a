"""Plans for an engine (--engine megatron | torchtitan): they choose among what that engine runs (expert parallelism,
FP8, its schedules), their launch is the export's, and fxplanner's runtime refuses them in one sentence."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

pytest.importorskip("transformers")

from costmodels.compute import MEGATRON_MOE_HOST_S  # noqa: E402
from passes.errors import UserError  # noqa: E402
from planner.api import make_plan  # noqa: E402
from planner.engines import ENGINES  # noqa: E402
from planner.plan import save_plan  # noqa: E402
from planner.runtime import check_plan  # noqa: E402
from planner.search import Pins  # noqa: E402
from tests.conftest import EXAMPLES  # noqa: E402


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    """Mixtral 8x7B on 64 H100, planned for Megatron-Core and for fxplanner's runtime."""
    path = tmp_path_factory.mktemp("engines") / "plan.json"
    kw = dict(gpus=64, global_batch=256, target="h100-sxm", plan_path=str(path))
    mega, _ = make_plan(str(EXAMPLES / "hf_mixtral.py"), pins=Pins(engine="megatron"), **kw)
    own, _ = make_plan(str(EXAMPLES / "hf_mixtral.py"), **kw)
    return mega, own, path


def test_megatron_plan_divides_the_experts_where_it_wins(mixtral):
    mega, own, _ = mixtral
    assert mega.source.engine == "megatron" and mega.config.ep > 1
    assert mega.config.schedule in ENGINES["megatron"].schedules
    assert mega.predictions.iteration_s < own.predictions.iteration_s  # what EP wins, with the experts' all-to-alls
    assert own.config.ep == 1 and any("expert parallelism, which the fxplanner runtime does not run" in k
                                      for k in own.search.rejected)
    assert {"experts": 8, "top_k": 2, "moe_ffn": 14336}.items() <= mega.source.model_shape.items()
    # Megatron-Core's MoE layers wait for its host (costmodels.compute.MEGATRON_MOE_HOST_S), and the plan says so
    assert mega.source.efficiency["moe_host_s"] == MEGATRON_MOE_HOST_S and own.source.efficiency["moe_host_s"] == 0


def test_a_plan_whose_moe_layers_wait_for_the_host_says_so():
    """Qwen3-30B-A3B's MoE layers at one 4096-token sequence a microbatch take less GPU time than Megatron-Core's host
    does for them: the plan says how long each waits and what would hide it; padded to a capacity they do not wait."""
    kw = dict(gpus=8, global_batch=64, target="h100-sxm", model_args={"preset": "qwen3-30b-a3b", "layers": 2})
    pins = Pins(engine="megatron", tp=1, pp=1, ep=8, b=1)
    plan, _ = make_plan(str(EXAMPLES / "hf_qwen3_moe.py"), pins=pins, **kw)
    note = next(n for n in plan.source.notes if n.startswith("each MoE layer's forward waits"))
    assert "a larger microbatch, --moe-capacity, or a full-iteration CUDA graph hides it" in note
    padded, _ = make_plan(str(EXAMPLES / "hf_qwen3_moe.py"), pins=replace(pins, moe_capacity=1.0), **kw)
    assert not any(n.startswith("each MoE layer's forward waits") for n in padded.source.notes)
    assert padded.predictions.iteration_s < plan.predictions.iteration_s


def test_an_engine_plans_launch_is_its_export_and_the_runtime_refuses_it(mixtral, tmp_path):
    mega, _, path = mixtral
    assert mega.launch.commands[0].startswith(f"planner export {path} --to megatron -o ")
    assert "--expert-model-parallel-size" in mega.launch.script and len(mega.launch.commands) == mega.launch.nnodes
    save_plan(mega, tmp_path / "mega.json")
    with pytest.raises(UserError, match=r"was made for megatron: launch it with `planner export"):
        check_plan(tmp_path / "mega.json", 64)
    data = json.loads((tmp_path / "mega.json").read_text())
    data["source"]["engine"] = "fxplanner"
    (tmp_path / "hand.json").write_text(json.dumps(data))
    with pytest.raises(UserError, match=r"divides its experts over \d+ expert-parallel ranks, which this runtime"):
        check_plan(tmp_path / "hand.json", 64)


def test_what_fxplanners_runtime_cannot_run_is_refused_at_plan_time():
    kw = dict(gpus=8, global_batch=16, target="h100-sxm")
    with pytest.raises(UserError, match=r"expert parallelism \(--ep 2\) runs in Megatron-Core or torchtitan"):
        make_plan(str(EXAMPLES / "hf_mixtral.py"), model_args={"layers": 2}, pins=Pins(ep=2), **kw)
    from planner.fill.spec import load_fill_spec

    # fill runs in the engines' bubbles too (planner/engines/megatron_fill.py, titan.py): the plan carries its fill
    filled, _ = make_plan(str(EXAMPLES / "gpt.py"), pins=Pins(engine="megatron", pp=2),
                          fill=load_fill_spec(EXAMPLES / "fill" / "jobs.yaml"), **kw)
    assert filled.source.engine == "megatron" and filled.fill is not None and filled.config.pp == 2
    with pytest.raises(UserError, match="Megatron-Core runs the 1f1b and interleaved schedules, not zbv"):
        make_plan(str(EXAMPLES / "gpt.py"), pins=Pins(engine="megatron", schedule="zbv"), **kw)


@pytest.mark.skipif(__import__("importlib").util.find_spec("megatron") is None, reason="megatron-core is not installed")
@pytest.mark.parametrize(("dispatcher", "overlap"), [("alltoall", False), ("deepep", True)])
def test_megatron_core_builds_the_plans_experts(mixtral, dispatcher, overlap):
    from planner.export import check_megatron, to_megatron

    mega = mixtral[0]
    plan = mega.model_copy(update={"config": mega.config.model_copy(update={
        "moe_dispatcher": dispatcher, "moe_a2a_overlap": overlap, "expert_load": 1.25})})
    kind = "alltoall" if dispatcher == "alltoall" else "flex"
    # dropless routing whose router loads the busiest rank 1.25x: no capacity, nothing dropped
    assert check_megatron(ex := to_megatron(plan))["moe"] == (8, 2, mega.config.ep, kind, overlap)
    assert "--moe-expert-capacity-factor" not in ex.argv
    padded = plan.model_copy(update={"config": plan.config.model_copy(update={"moe_capacity": 1.25})})
    ex = to_megatron(padded)
    assert ex.argv[ex.argv.index("--moe-expert-capacity-factor") + 1] == "1.25"
    assert "--moe-pad-expert-input-to-capacity" in ex.argv
    if dispatcher == "deepep":  # megatron-core refuses to pad experts behind DeepEP, and so does the planner
        with pytest.raises(ValueError, match="does not support moe_pad_expert_input_to_capacity"):
            check_megatron(ex)
        with pytest.raises(UserError, match="DeepEP does not pad experts to a capacity"):
            make_plan(str(EXAMPLES / "hf_mixtral.py"), gpus=64, global_batch=256, target="h100-sxm",
                      pins=Pins(engine="megatron", moe_dispatcher="deepep", moe_capacity=1.25))
    else:
        assert check_megatron(ex)["moe"] == (8, 2, mega.config.ep, kind, overlap)


def test_a_torchtitan_plan_of_a_family_torchtitan_does_not_ship_names_what_to_fill_in(tmp_path):
    plan, _ = make_plan(str(EXAMPLES / "hf_mixtral.py"), model_args={"layers": 4}, gpus=16, global_batch=32,
                        target="h100-sxm", pins=Pins(engine="torchtitan"), plan_path=str(tmp_path / "p.json"))
    assert plan.source.engine == "torchtitan" and plan.config.ep >= 1
    assert "--titan-module MODULE --titan-config CONFIG" in plan.launch.commands[0]
    assert any("torchtitan ships no model matching" in n for n in plan.source.notes)
    assert not any(n.startswith("the fxplanner runtime") for n in plan.source.notes)


def test_llama3_405b_as_meta_ran_it_plans_an_interleaved_schedule():
    """Llama-3-405B on 8,192 and 16,384 H100 (t8 p16, global batch 2048 and 4096 of 8192 tokens, no recomputation,
    as Meta ran it; issue 25): the first ranks' first chunks hold about twice the microbatches of their later ones
    (interleaved.chunk_peaks), so their layers go to those later chunks and the schedule fits interleaved."""
    from costmodels.hardware import Hardware
    from passes.pipeline import analyze
    from planner.api import engine_pins
    from planner.evaluate import Evaluator
    from planner.search import search
    from targets.registry import get_target

    hw = Hardware(target=get_target("h100-sxm"))
    units = analyze(str(EXAMPLES / "hf_llama.py"), {"preset": "llama3-405b", "seq": 8192}, kernels="megatron")[0].units
    hw = hw.with_eff(fusion=0.0)
    for gpus in (8192, 16384):
        pins = engine_pins(Pins(engine="megatron", tp=8, pp=16, recompute="none"), hw)
        ev = Evaluator(units=units, hw=hw, global_batch=gpus // 4, n_gpus=gpus, tokens_per_sample=8192)
        best = search(ev, pins).best
        assert best.config.schedule == "interleaved" and best.config.v > 1, (gpus, str(best.config))
        assert max(m.total for m in best.rank_memory) <= hw.capacity
        one_f_one_b = search(ev, replace(pins, schedule="1f1b")).best
        assert best.iteration_s < one_f_one_b.iteration_s


def test_an_interleaved_partition_with_memory_to_spare_is_megatrons_even_one():
    """Llama 3.1 405B (the DGX Cloud shape: 126 layers, 16 query groups) on 576 H100, t8 p9 d4 cp2 v7 in FP8: every
    rank has memory to spare, so each of the 63 chunks takes 2 of the 126 layers (Megatron's layout, the embedding on
    the first and the head on the last). Splitting each rank's memory among its chunks by their microbatches in flight
    (the split a full rank needs) gave the first chunks 1 layer and the last 3, which the interleaved schedule stalls
    on: 13.1 s against 11.0 s, and a 1% change of GEMM speed flipped it."""
    from tests.conftest import ROOT

    shape = dict(layers=126, hidden=16384, heads=128, kv_heads=16, ffn=53248, seq=8192, vocab=51200)  # written op
    # by op (tests/fixtures/llama_unfused.py), priced as Megatron-Core runs it
    pins = Pins(tp=8, pp=9, dp=4, cp=2, b=1, v=7, recompute="none", sp=True, zero=1, overlap_grad_reduce=True,
                schedule="interleaved", engine="megatron", fp8="delayed", tp_comm_overlap=True, fp8_params=True,
                grad_fp32=False)
    plan, res = make_plan(str(ROOT / "tests" / "fixtures" / "llama_unfused.py"), gpus=576,
                          global_batch=252, target="h100-sxm", model_args=shape, pins=pins)
    bounds = res.best.bounds
    assert [b - a for a, b in zip(bounds, bounds[1:])] == [3] + [2] * 61 + [3]
    assert max(m.total for m in plan.predictions.memory) < 0.85 * plan.predictions.memory[0].capacity


def test_a_rank_a_tie_loaded_over_its_memory_is_mended_to_megatrons_layout():
    """Llama 3.1 405B on 512 H100 at t8 p8 d4 cp2 v8 in FP8, as the DGX Cloud benchmark ran it: the fastest chunks
    (each chunk the rank's whole memory) tie between the embedding with two layers first and NeMo's embedding with
    one (its account_for_embedding/loss_in_pipeline_split: Et|(tt|)*62tL); the first tie put rank 0 over its memory,
    and the search used to fall back to a partition with 3-layer chunks the schedule stalls on (12.8 s). Repairing
    the tie (moving one layer off rank 0) is Megatron's layout, and faster (12.1 s)."""
    from tests.conftest import ROOT

    shape = dict(layers=126, hidden=16384, heads=128, kv_heads=16, ffn=53248, seq=8192, vocab=128256)
    pins = Pins(tp=8, pp=8, dp=4, cp=2, b=1, v=8, recompute="none", sp=True, zero=1, overlap_grad_reduce=True,
                schedule="interleaved", engine="megatron", fp8="delayed", tp_comm_overlap=True, grad_fp32=False)
    plan, res = make_plan(str(ROOT / "tests" / "fixtures" / "llama_unfused.py"), gpus=512,
                          global_batch=256, target="h100-sxm", model_args=shape, pins=pins)
    bounds = res.best.bounds
    assert [b - a for a, b in zip(bounds, bounds[1:])] == [2] * 64
    assert max(m.total for m in plan.predictions.memory) <= plan.predictions.memory[0].capacity


def test_torchtitan_is_planned_only_at_the_zero_stages_fsdp2_runs():
    """torchtitan shards with FSDP2 only (torchtitan/distributed/parallel_dims.py: dp_shard, dp_replicate): its
    sharded steps are ZeRO-2 (fully_shard without resharding after the forward) and ZeRO-3, never a sharded optimizer
    alone. The search starts replicated runs at ZeRO-2 and falls back to ZeRO-3; a pinned --zero 1 is refused in
    one sentence that names what to do; Megatron-Core keeps its distributed optimizer (ZeRO-1)."""
    assert ENGINES["torchtitan"].zero_stages == (0, 2, 3) and ENGINES["megatron"].zero_stages == (0, 1, 2, 3)
    assert ENGINES["fxplanner"].zero_stages == (0, 1, 2)
    kw = dict(gpus=8, global_batch=16, target="h100-sxm", model_args={"preset": "tiny", "layers": 2})
    titan, _ = make_plan(str(EXAMPLES / "gpt.py"), pins=Pins(engine="torchtitan", dp=8), **kw)
    megatron, _ = make_plan(str(EXAMPLES / "gpt.py"), pins=Pins(engine="megatron", dp=8), **kw)
    assert (titan.config.zero, megatron.config.zero) == (2, 1)
    with pytest.raises(UserError) as e:
        make_plan(str(EXAMPLES / "gpt.py"), pins=Pins(engine="torchtitan", dp=8, zero=1), **kw)
    msg = str(e.value)
    assert "--zero 2" in msg and "--zero 3" in msg and "--engine megatron" in msg, msg
    assert msg.count(". ") == 0 and "\n" not in msg


def test_torchtitan_reduces_gradients_in_fp32_only():
    """torchtitan's training.mixed_precision_reduce takes "float32" only (torchtitan/config/configs.py): its bf16
    plans reduce in fp32 unless told otherwise, and --grad-reduce-in-bf16 is refused in one sentence naming the
    engine that can."""
    kw = dict(gpus=8, global_batch=16, target="h100-sxm", model_args={"preset": "tiny", "layers": 2})
    titan, _ = make_plan(str(EXAMPLES / "gpt.py"), pins=Pins(engine="torchtitan", dp=8, precision="bf16"), **kw)
    assert titan.config.grad_fp32
    with pytest.raises(UserError) as e:
        make_plan(str(EXAMPLES / "gpt.py"), pins=Pins(engine="torchtitan", dp=8, grad_fp32=False), **kw)
    msg = str(e.value)
    assert "--grad-reduce-in-bf16" in msg and "--engine megatron" in msg, msg
    assert msg.count(". ") == 0 and "\n" not in msg


def test_torchtitan_waits_for_its_all_to_alls_and_says_which_dispatcher_its_job_cannot_choose():
    """torchtitan's MoE layers read the combine's result at once (its standard, DeepEP and HybridEP dispatchers
    alike): --moe-a2a-overlap is refused in one sentence naming Megatron-Core. A DeepEP plan exports with one line
    saying that torchtitan's model config, not its job, chooses that dispatcher."""
    from planner.export import to_torchtitan

    kw = dict(gpus=8, global_batch=16, target="h100-sxm", model_args={"layers": 2, "seq": 1024})
    with pytest.raises(UserError) as e:
        make_plan(str(EXAMPLES / "hf_mixtral.py"), pins=Pins(engine="torchtitan", ep=8, moe_a2a_overlap=True), **kw)
    msg = str(e.value)
    assert "--engine megatron" in msg and "--moe-a2a-overlap" in msg and "torchtitan" in msg, msg
    assert msg.count(". ") == 0 and "\n" not in msg
    plan, _ = make_plan(str(EXAMPLES / "hf_mixtral.py"), pins=Pins(engine="torchtitan", ep=8, tp=1, pp=1, dp=8,
                                                                  moe_dispatcher="deepep"), **kw)
    (line,) = [u for u in to_torchtitan(plan, module="qwen3", config="qwen3_moe_debug").unexpressed if "deepep" in u]
    assert 'moe_comm_backend="deepep"' in line
