"""`planner export`: plans as torchtitan and Megatron-LM configurations, loaded by the engines' own config code
(the `engines` extra: torchtitan, megatron-core) with every parallel degree equal to the plan's."""
from __future__ import annotations

import importlib.util

import pytest
from typer.testing import CliRunner

from planner.api import make_plan
from planner.cli import app
from planner.export import check_megatron, check_megatron_args, check_torchtitan, layout, to_megatron, to_torchtitan
from planner.plan import save_plan
from planner.search import Pins
from tests.conftest import EXAMPLES

needs_titan = pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None,
                                 reason="torchtitan is not installed (pip install -e '.[engines]')")
needs_megatron = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                    reason="megatron-core is not installed (pip install -e '.[engines]')")


def _plan(model: str, gpus: int, batch: int, **pins):
    return make_plan(str(EXAMPLES / model), gpus=gpus, global_batch=batch, target="h100-sxm", pins=Pins(**pins))[0]


@pytest.fixture(scope="module")
def plans():
    """examples/gpt.py on 64 GPUs as planned freely; the Llama-3 8B HF example, and torchtitan's (examples/titan_llama.py,
    at p = 2); and a plan with interleaving,
    sequence parallelism, a sharded optimizer and context parallelism."""
    pytest.importorskip("transformers", reason="the hf extra is not installed")
    return {"gpt": _plan("gpt.py", 64, 512),
            "llama": _plan("hf_llama.py", 64, 256),
            "titan": _plan("titan_llama.py", 64, 256, pp=2),  # torchtitan's own Llama 3 8B, its ModuleDict split
            "modern": _plan("hf_llama.py", 64, 256, tp=2, pp=2, cp=2, v=2, zero=1, sp=True, schedule="interleaved",
                                overlap_grad_reduce=True)}


def test_the_modern_plan_has_every_dimension(plans):
    c = plans["modern"].config
    assert (c.tp, c.pp, c.cp, c.vp, c.sp, c.zero, c.schedule) == (2, 2, 2, 2, True, 1, "interleaved")
    assert c.overlap_grad_reduce


@needs_megatron
@pytest.mark.parametrize("name", ["gpt", "llama", "modern"])
def test_megatron_core_builds_the_exported_configuration_with_the_plans_degrees(plans, name):
    plan = plans[name]
    c = plan.config
    seen = check_megatron(to_megatron(plan))
    assert (seen["tp"], seen["pp"], seen["cp"], seen["vp"]) == (c.tp, c.pp, c.cp, c.vp)
    assert plan.source.gpus // (seen["tp"] * seen["pp"] * seen["cp"]) == c.dp  # Megatron's data-parallel size
    assert seen["sp"] == c.sp and seen["distributed_optimizer"] == bool(c.zero)
    assert seen["overlap"] == (c.overlap_grad_reduce, c.overlap_grad_reduce and bool(c.zero))
    assert seen["recompute"] == c.recompute and (seen["microbatch"], seen["global_batch"]) == (c.microbatch,
                                                                                              plan.source.global_batch)
    if seen["layout"] is not None:  # an uneven partition: each virtual stage holds the plan's layers
        rows = layout(plan)
        expected = [sum(1 for k, _ in row if k == "block") for row in rows]
        assert [sum(1 for ch in stage if ch == "t") for stage in str(seen["layout"]).split("|")] == expected


@needs_megatron
def test_megatron_builds_the_models_own_rotary_base_dropout_and_epsilon(plans):
    """Issue 22: Megatron's defaults (rotary base 10000, dropout 0.1) would train another model than the plan's."""
    llama, gpt = (check_megatron(to_megatron(plans[n])) for n in ("llama", "gpt"))
    assert (llama["rotary_base"], llama["dropout"], llama["norm_eps"]) == (500000, (0.0, 0.0), 1e-5)
    assert gpt["dropout"] == (0.1, 0.1) and gpt["norm_eps"] == 1e-5  # examples/gpt.py trains with Megatron's 0.1
    text = to_megatron(plans["llama"]).text
    assert "the vocabulary of 128256 tokens" in text  # what it cannot state is listed


@needs_titan
@pytest.mark.parametrize("name", ["gpt", "llama", "modern", "titan"])
def test_torchtitan_parses_the_exported_job_with_the_plans_degrees(plans, name):
    plan = plans[name]
    c = plan.config
    kw = {"module": "llama3", "config": "llama3_debugmodel"} if name == "gpt" else {}  # torchtitan ships no GPT
    seen = check_torchtitan(to_torchtitan(plan, **kw), plan.source.gpus)
    assert (seen["tp"], seen["pp"], seen["cp"], seen["dp_replicate"] * seen["dp_shard"]) == (c.tp, c.pp, c.cp, c.dp)
    assert seen["dp_shard"] == (c.dp if c.zero else 1)  # the sharded optimizer is FSDP there
    assert seen["global_batch"] == plan.source.global_batch and seen["sequence_parallel"] == c.sp
    if c.pp > 1:
        assert seen["microbatch"] == c.microbatch and seen["local_batch"] == c.microbatch * c.microbatches
        assert seen["parts"] == c.pp * c.vp
    assert seen["recompute"] == {"none": "none", "selective": "SelectiveAC", "full": "FullAC"}[c.recompute]
    if name != "gpt":
        assert seen["seq"] == 8192


def test_what_an_engine_cannot_express_heads_the_file(plans):
    modern = to_torchtitan(plans["modern"])
    assert any("ZeRO-1" in u for u in modern.unexpressed)
    assert "# not expressed:" in modern.text and "ZeRO-1" in modern.text.split("set -euo")[0]
    # fill jobs the packer placed nowhere: nothing to run, nothing to say (tests/engines: exports that run fill)
    for plan in (plans["llama"], plans["modern"]):
        filled = plan.model_copy(update={"fill": _fill()})
        for ex in (to_megatron(filled), to_torchtitan(filled)):
            assert not any("fill" in u for u in ex.unexpressed) and "planner.engines" not in ex.text


def _fill():
    from planner.plan import Fill, FillJob, FillPredictions

    job = FillJob(name="bert-infer", model_file="bert.py", model_sha256="0" * 64, model_args={}, kind="infer", config="plain",
                  batch_size=1, units=["a"], unit_time_s=[0.1], resident=True)
    return Fill(safety_margin=0.1, jobs=[job], chunks=[], predictions=FillPredictions(
        fill_tflops_per_gpu=0, bubble_time_used=0, total_useful_tflops_per_gpu=0, offload_optimizer=False))


def test_export_cli_writes_the_file_and_refuses_what_it_cannot_name(plans, tmp_path):
    path = tmp_path / "plan.json"
    save_plan(plans["gpt"], path)
    runner = CliRunner()
    res = runner.invoke(app, ["export", str(path), "--to", "megatron"])
    assert res.exit_code == 0, res.output
    text = (tmp_path / "megatron.sh").read_text()
    assert "pretrain_gpt.py" in text and f"--tensor-model-parallel-size {plans['gpt'].config.tp}" in text
    assert "--untie-embeddings-and-output-weights" not in text  # examples/gpt.py's head reuses the embedding
    assert "--untie-embeddings-and-output-weights" in to_megatron(plans["llama"]).text  # Llama 3 does not
    bad = runner.invoke(app, ["export", str(path), "--to", "torchtitan"])
    assert bad.exit_code == 2 and "--titan-config" in bad.output and "Traceback" not in bad.output
    other = runner.invoke(app, ["export", str(path), "--to", "deepspeed"])
    assert other.exit_code == 2 and "megatron or torchtitan" in other.output
    ok = runner.invoke(app, ["export", str(path), "--to", "torchtitan", "--titan-module", "llama3", "--titan-config",
                             "llama3_debugmodel", "-o", str(tmp_path / "job.sh")])
    assert ok.exit_code == 0 and "torchtitan.train" in (tmp_path / "job.sh").read_text()


def test_torchtitan_toml_job_for_versions_before_0_3_holds_the_plans_degrees(plans):
    """torchtitan 0.1-0.2 read a TOML job file (run on an H100 with torchtitan 0.2.2: see bench/titan_smoke.py)."""
    import tomllib

    for name in ("llama", "modern"):
        plan = plans[name]
        c = plan.config
        job = tomllib.loads(to_torchtitan(plan, toml=True).text)
        par = job["parallelism"]
        assert (par["tensor_parallel_degree"], par["pipeline_parallel_degree"], par["context_parallel_degree"]) == (
            c.tp, c.pp, c.cp)
        assert par["data_parallel_replicate_degree"] * par["data_parallel_shard_degree"] == c.dp
        assert job["model"] == {"name": "llama3", "flavor": "8B"}
        assert job["activation_checkpoint"]["mode"] == c.recompute and job["training"]["seq_len"] == 8192
        if c.pp > 1:
            assert len(par["module_fqns_per_model_part"]) == c.pp * c.vp
            assert par["pipeline_parallel_schedule"] == {"1f1b": "1F1B", "interleaved": "Interleaved1F1B",
                                                         "gpipe": "GPipe"}[c.schedule]
    no_sp = plans["modern"].model_copy(update={"config": plans["modern"].config.model_copy(update={"sp": False})})
    assert any("always runs it with sequence parallelism" in u for u in to_torchtitan(no_sp, toml=True).unexpressed)


@needs_megatron
@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_megatron_accepts_each_recomputation_mode(plans, recompute):
    plan = plans["modern"]
    plan = plan.model_copy(update={"config": plan.config.model_copy(update={"recompute": recompute})})
    seen = check_megatron(to_megatron(plan))
    assert seen["recompute"] == recompute


@needs_megatron
def test_megatron_reduces_gradients_in_fp32_when_the_plan_does(plans):
    plan = plans["modern"]
    plan = plan.model_copy(update={"config": plan.config.model_copy(update={"grad_fp32": True})})
    ex = to_megatron(plan)
    assert "--accumulate-allreduce-grads-in-fp32" in ex.argv and check_megatron(ex)["grad_fp32"] is True


@needs_megatron
def test_interleaving_m_not_a_multiple_of_p_exports_megatron_cores_microbatch_group():
    plan = _plan("gpt.py", 8, 6, tp=2, pp=4, v=2, b=1, schedule="interleaved")
    c = plan.config
    assert (c.pp, c.vp, c.microbatches) == (4, 2, 6)
    ex = to_megatron(plan)
    assert ex.argv[ex.argv.index("--microbatch-group-size-per-virtual-pipeline-stage") + 1] == "6"
    assert check_megatron(ex)["microbatch_group"] == 6
    titan = to_torchtitan(plan, module="llama3", config="llama3_debugmodel")
    assert not any("groups of" in n for n in titan.unexpressed)
    assert "--parallelism.pipeline_parallel_schedule_csv" in titan.argv  # torchtitan runs the plan's own groups


@needs_titan
def test_torchtitan_check_compares_the_configs_model_with_the_plans(plans):
    """Issue 22: a 40-layer plan checked against llama3_8b's 32 layers is refused, not passed."""
    plan = plans["llama"]
    seen = check_torchtitan(to_torchtitan(plan), plan.source.gpus, plan)
    assert (seen["layers"], seen["hidden"]) == (32, 4096)
    shape = {**plan.source.model_shape, "layers": 40}
    forty = plan.model_copy(update={"source": plan.source.model_copy(update={"model_shape": shape})})
    with pytest.raises(ValueError, match="llama3_8b builds 32 layers of width 4096, the plan's model 40"):
        check_torchtitan(to_torchtitan(forty, module="llama3", config="llama3_8b"), plan.source.gpus, forty)


@needs_megatron
@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "blockwise", "mxfp8"])
def test_megatron_runs_the_plans_fp8_recipe(plans, recipe):
    """An FP8 plan exports Transformer Engine's recipe (E4M3 forward, E5M2 gradients) as megatron-core reads it; a
    torchao recipe is listed as unexpressed for Megatron, and torchtitan is told which converter to add."""
    plan = plans["modern"]
    plan = plan.model_copy(update={"config": plan.config.model_copy(update={"fp8": recipe})})
    assert check_megatron(to_megatron(plan))["fp8"] == ("hybrid", recipe)
    titan = to_torchtitan(plan)
    assert any(f"the FP8 recipe {recipe} is Transformer Engine's" in u for u in titan.unexpressed)
    torchao = plan.model_copy(update={"config": plan.config.model_copy(update={"fp8": "torchao-rowwise"})})
    ex = to_megatron(torchao)
    assert "--fp8-recipe" not in ex.argv and any("torchao's" in u for u in ex.unexpressed)
    assert any('Float8LinearConverter.Config(recipe_name="rowwise")' in u for u in to_torchtitan(torchao).unexpressed)


@needs_megatron
def test_megatron_builds_multi_token_prediction_with_the_loss():
    """A model planned with a multi-token-prediction layer (_hf_models, mtp=1): Megatron-Core takes --mtp-num-layers
    and the layout's last stage holding it beside the loss ('mL'), as Megatron-Bridge's DeepSeek-V3 layouts do."""
    pytest.importorskip("transformers", reason="the hf extra is not installed")
    plan, _ = make_plan(str(EXAMPLES / "hf_llama.py"), gpus=16, global_batch=64, target="h100-sxm",
                        model_args={"layers": 8, "mtp": 1}, pins=Pins(pp=2, tp=1, layout="Ettttt|tttmL"))
    ex = to_megatron(plan)
    assert "--mtp-num-layers 1" in " ".join(ex.argv)
    seen = check_megatron(ex)
    assert seen["mtp"] == 1 and str(seen["layout"]).split("|") == ["Ettttt", "tttmL"]
    titan = next(u for u in to_torchtitan(plan, module="llama3", config="llama3_debugmodel").unexpressed
                 if "multi-token" in u)
    assert "1 multi-token-prediction layer" in titan


@pytest.fixture(scope="module")
def megatron_plans():
    """examples/gpt.py on 64 H100 as the megatron engine plans it (Megatron-FSDP), and with tensor and sequence
    parallelism under a sharded optimizer (ZeRO-1) and under Megatron-FSDP."""
    plan = lambda **pins: _plan("gpt.py", 64, 512, engine="megatron", **pins)  # noqa: E731
    return {"free": plan(), "tp_sp": plan(tp=4, sp=True, zero=1), "tp_sp_fsdp": plan(tp=8, sp=True, zero=3)}


@needs_megatron
@pytest.mark.parametrize("name", ["free", "tp_sp", "tp_sp_fsdp"])
def test_megatron_engine_plans_pass_megatron_lms_validate_args(megatron_plans, name, tmp_path):
    """Issue 51: Megatron-FSDP runs with --ckpt-format fsdp_dtensor and CUDA_DEVICE_MAX_CONNECTIONS not 1; tensor (or
    context) parallelism without it with CUDA_DEVICE_MAX_CONNECTIONS=1; `planner export --check` runs those rules."""
    plan = megatron_plans[name]
    c = plan.config
    assert c.zero >= 2 or name == "tp_sp"  # the megatron engine's own choice runs Megatron-FSDP (ZeRO-2 or -3)
    assert (c.tp > 1 and c.sp) or name == "free"
    ex = to_megatron(plan)
    check_megatron_args(ex.argv, ex.env, plan.source.gpus)
    assert check_megatron(ex, plan.source.gpus)["sp"] == c.sp
    head, _, launch = ex.text.partition("torchrun ")
    if c.zero >= 2:
        assert "--use-megatron-fsdp" in ex.argv and ex.argv[ex.argv.index("--ckpt-format") + 1] == "fsdp_dtensor"
        assert ex.env == {"CUDA_DEVICE_MAX_CONNECTIONS": None} and "\nunset CUDA_DEVICE_MAX_CONNECTIONS\n" in head
    else:
        assert "--ckpt-format" not in ex.argv
        assert ex.env == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"} and "\nexport CUDA_DEVICE_MAX_CONNECTIONS=1\n" in head
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    res = CliRunner().invoke(app, ["export", str(path), "--to", "megatron", "--check"])
    assert res.exit_code == 0 and "megatron reads: " in res.stdout, res.output


def _without(argv: list[str], *flags: str) -> list[str]:
    """argv less each flag and its values."""
    out, skip = [], False
    for a in argv:
        if a.startswith("--"):
            skip = a in flags
        if not skip:
            out.append(a)
    return out


@pytest.mark.parametrize("break_it, rule", [
    (lambda argv, env: (_without(argv, "--ckpt-format"), env),
     "--use-megatron-fsdp runs with --ckpt-format fsdp_dtensor (got torch_dist)"),
    (lambda argv, env: (argv, {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}),
     "Megatron-FSDP (--use-megatron-fsdp) runs without CUDA_DEVICE_MAX_CONNECTIONS=1"),
    (lambda argv, env: (_without(argv, "--use-megatron-fsdp", "--data-parallel-sharding-strategy"), env),
     "--ckpt-format fsdp_dtensor runs with --use-megatron-fsdp"),
    (lambda argv, env: (_without(argv, "--overlap-grad-reduce"), env),
     "--overlap-param-gather runs with --overlap-grad-reduce"),
    (lambda argv, env: (_without(argv, "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "--ckpt-format",
                                 "--use-distributed-optimizer"), {}),
     "--overlap-param-gather runs with --use-distributed-optimizer or --use-megatron-fsdp"),
    (lambda argv, env: (_without(argv, "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "--ckpt-format"),
                        {}),
     "tensor or context parallelism runs with CUDA_DEVICE_MAX_CONNECTIONS=1"),
    (lambda argv, env: (argv + ["--tensor-model-parallel-size", "1", "--micro-batch-size", "1"], env),
     "--sequence-parallel runs with --tensor-model-parallel-size > 1"),
    (lambda argv, env: (_without(argv, "--sequence-parallel") + ["--tp-comm-overlap"], env),
     "--tp-comm-overlap runs with --sequence-parallel"),
    (lambda argv, env: (argv + ["--global-batch-size", "500"], env),
     "--global-batch-size (500) is divisible by --micro-batch-size x data-parallel size"),
    (lambda argv, env: (argv + ["--pipeline-model-parallel-size", "3"], env),
     "the world size (64) is divisible by tensor x pipeline x context parallel size (8 x 3 x 1)"),
    (lambda argv, env: (argv + ["--pipeline-model-parallel-size", "2", "--num-layers", "39", "--micro-batch-size",
                                "1"], env),
     "--num-layers (39) is divisible by --pipeline-model-parallel-size (2)"),
    (lambda argv, env: (argv + ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "10",
                                "--no-overlap-p2p-communication", "--micro-batch-size", "1"], env),
     "the interleaved schedule runs with --pipeline-model-parallel-size > 2"),
    (lambda argv, env: (argv + ["--fp8-param-gather"], env), "--fp8-param-gather runs with --fp8-format"),
    (lambda argv, env: (argv + ["--seq-length", "4096"], env),
     "--max-position-embeddings (2048) is at least --seq-length (4096)"),
])
def test_a_hand_broken_megatron_argument_list_fails_with_the_rule_it_breaks(megatron_plans, break_it, rule):
    """Each of Megatron-LM's validate_args rules the export must meet, broken by hand, is refused in one sentence
    naming the rule (the export of the same plan passes: the test above)."""
    ex = to_megatron(megatron_plans["tp_sp_fsdp"])
    argv, env = break_it(list(ex.argv), dict(ex.env))
    with pytest.raises(ValueError) as e:
        check_megatron_args(argv, env, 64)
    msg = str(e.value)
    assert msg.startswith("Megatron-LM's validate_args (core_v0.16.1) requires that ") and rule in msg, msg
    assert ". " not in msg and "\n" not in msg  # one sentence


@needs_titan
def test_torchaos_tensorwise_float8_plans_for_torchtitan_and_exports_as_its_versions_run_it(plans):
    """Issue 49: torchao's dynamic tensorwise scaling, torchtitan's float8 recipe through 2025, plans under --engine
    torchtitan; torchtitan 0.2's job turns it on with FSDP's float8 all-gather, torchtitan 0.3 (rowwise only) is told
    so in one line."""
    pytest.importorskip("transformers", reason="the hf extra is not installed")
    plan, _ = make_plan(str(EXAMPLES / "hf_llama.py"), gpus=8, global_batch=16, target="h100-sxm",
                        model_args={"layers": 2}, pins=Pins(engine="torchtitan", fp8="torchao-tensorwise", zero=3))
    assert (plan.config.fp8, plan.config.zero) == ("torchao-tensorwise", 3)
    modern = plans["modern"]
    f8 = modern.model_copy(update={"config": modern.config.model_copy(update={"fp8": "torchao-tensorwise", "zero": 3})})
    (line,) = [u for u in to_torchtitan(f8).unexpressed if "FP8" in u]
    assert "rowwise recipes only" in line and "--toml" in line
    toml = to_torchtitan(f8, toml=True)
    assert 'converters = ["float8"]' in toml.text and "enable_fsdp_float8_all_gather = true" in toml.text
    assert "precompute_float8_dynamic_scale_for_fsdp = true" in toml.text and not any("FP8" in u for u in toml.unexpressed)


@needs_titan
def test_compile_pins_plans_and_exports_for_torchtitan(tmp_path):
    """Issue 49: --compile (torch.compile of each block; under --engine torchtitan the default, --no-compile turns it
    off) plans under --engine torchtitan, priced as Inductor runs the
    blocks (fewer bytes moved: faster than the same plan eager), and exports as torchtitan's --compile.enable with the
    model's blocks only (the loss stays eager, as priced); torchtitan 0.2's job as its [compile] section."""
    pytest.importorskip("transformers", reason="the hf extra is not installed")
    kw = dict(gpus=8, global_batch=16, target="h100-sxm", model_args={"layers": 2})
    pins = dict(engine="torchtitan", zero=3, dp=8, b=2, recompute="selective")
    compiled, _ = make_plan(str(EXAMPLES / "hf_llama.py"), pins=Pins(**pins), **kw)  # (compiled unless pinned off)
    eager, _ = make_plan(str(EXAMPLES / "hf_llama.py"), pins=Pins(**pins, compile=False), **kw)
    assert compiled.config.compile and not eager.config.compile
    assert compiled.predictions.iteration_s < eager.predictions.iteration_s
    # eager, each memory-bound op is eager PyTorch's own kernel at its measured speed (costmodels.eager), nothing fused;
    # compiled, the blocks are Inductor's fused regions (priced fused: nothing more to discount)
    assert (eager.source.efficiency["eager"], eager.source.efficiency["fusion"]) == (True, 0.0)
    assert (compiled.source.efficiency["eager"], compiled.source.efficiency["fusion"]) == (False, 0.0)
    assert any("torch.compile" in n for n in compiled.source.notes)
    names = dict(module="llama3", config="llama3_8b")  # (two layers: no model torchtitan ships)
    ex = to_torchtitan(compiled, **names)
    assert "--compile.enable" in ex.argv and not ex.unexpressed
    assert check_torchtitan(ex, 8)["compile"] == (True, ("model",))
    assert check_torchtitan(to_torchtitan(eager, **names), 8)["compile"][0] is False
    toml = to_torchtitan(compiled, toml=True, **names).text
    assert "\n[compile]\nenable = true\ncomponents = [\"model\"]\n" in toml
    assert "[compile]" not in to_torchtitan(eager, toml=True, **names).text


@pytest.mark.parametrize("engine", ["fxplanner", "megatron"])
def test_compile_is_refused_in_one_sentence_where_the_engine_does_not_compile(engine):
    from passes.errors import UserError

    with pytest.raises(UserError) as e:
        make_plan(str(EXAMPLES / "gpt.py"), gpus=8, global_batch=16, target="h100-sxm",
                  model_args={"preset": "tiny", "layers": 2}, pins=Pins(engine=engine, compile=True))
    msg = str(e.value)
    assert "without torch.compile (--compile)" in msg and "--engine torchtitan" in msg, msg
    assert msg.count(". ") == 0 and "\n" not in msg  # one sentence


@needs_titan
def test_planner_plan_compile_for_torchtitan_plans_and_exports(tmp_path):
    """The command line: `planner plan examples/hf_llama.py --model-arg preset=llama3-8b --gpus 8 --engine torchtitan
    --compile`, then `planner export --to torchtitan` (and --toml)."""
    pytest.importorskip("transformers", reason="the hf extra is not installed")
    out = tmp_path / "plan.json"
    runner = CliRunner()
    result = runner.invoke(app, ["plan", str(EXAMPLES / "hf_llama.py"), "--model-arg", "preset=llama3-8b", "--gpus",
                                 "8", "--global-batch", "16", "--target", "h100-96gb-hbm2e-500w", "--engine",
                                 "torchtitan", "--compile", "--zero", "3", "--recompute", "selective", "-o", str(out)])
    assert result.exit_code == 0, result.output
    from planner.plan import load_plan

    assert load_plan(out).config.compile
    script = tmp_path / "job.sh"
    result = runner.invoke(app, ["export", str(out), "--to", "torchtitan", "-o", str(script)])
    assert result.exit_code == 0, result.output
    assert "--compile.enable" in script.read_text()
    toml = tmp_path / "job.toml"
    result = runner.invoke(app, ["export", str(out), "--to", "torchtitan", "--toml", "-o", str(toml)])
    assert result.exit_code == 0, result.output
    assert "[compile]\nenable = true" in toml.read_text()


@needs_titan
@pytest.mark.parametrize("model, preset, config, layers, hidden", [
    ("hf_qwen3_moe.py", "qwen3-30b-a3b", ("qwen3", "qwen3_30b_a3b"), 48, 2048),
    ("hf_gpt_oss.py", "gpt-oss-20b", ("gpt_oss", "gpt_oss_20b"), 24, 2880)])
def test_a_moe_model_torchtitan_ships_exports_as_its_config_with_the_plans_expert_parallelism(model, preset, config,
                                                                                               layers, hidden):
    """Issue 49, mechanisms 7 and 8: Qwen3-30B-A3B and gpt-oss-20b written as Hugging Face writes them plan under
    --engine torchtitan (experts as torchtitan's GroupedExperts run them, gpt-oss's written-out attention as its own
    model's fused kernel) and export as torchtitan's own configs, with the plan's expert parallelism, and without the
    CUDA graphs torchtitan refuses beside its host-synchronizing token dispatcher; torchtitan parses each and builds
    the plan's layers."""
    pytest.importorskip("transformers", reason="the hf extra is not installed")
    plan, _ = make_plan(str(EXAMPLES / model), gpus=8, global_batch=16, target="h100-sxm",
                        model_args={"preset": preset},
                        pins=Pins(engine="torchtitan", tp=1, pp=1, dp=8, ep=8, zero=3, b=1))
    assert plan.source.efficiency["grouped_mm"]
    ex = to_torchtitan(plan)
    assert ex.argv[:4] == ["--module", config[0], "--config", config[1]] and not ex.unexpressed
    assert "--training.disable_cuda_graphs" in ex.argv
    seen = check_torchtitan(ex, plan.source.gpus, plan)
    assert (seen["ep"], seen["dp_shard"], seen["layers"], seen["hidden"]) == (8, 8, layers, hidden)
    if config[0] == "qwen3":  # (torchtitan 0.2 kept gpt-oss among its experiments)
        toml = to_torchtitan(plan, toml=True).text
        assert 'name = "qwen3"' in toml and 'flavor = "30B-A3B"' in toml and "expert_parallel_degree = 8" in toml
