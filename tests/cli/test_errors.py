"""Each bad input gives one short message and a nonzero exit, never a traceback."""
from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from planner.cli import app
from tests.conftest import EXAMPLES, FIXTURES, ROOT

runner = CliRunner()


def run(*args: str):
    result = runner.invoke(app, list(args))
    text = result.stdout + (result.stderr or "")
    return result, text


@pytest.mark.parametrize("args,needle", [
    (["profile", str(FIXTURES / "untraceable.py")], "mark it a leaf with --leaf Gate"),
    (["profile", str(FIXTURES / "raises.py")], "raises.py:6"),
    (["profile", str(FIXTURES / "no_build.py")], "does not define build_model()"),
    (["profile", str(FIXTURES / "missing.py")], "does not exist"),
    (["profile", str(EXAMPLES / "mlp.py"), "--target", "a100"], "unknown target 'a100'"),
    (["profile", str(EXAMPLES / "mlp.py"), "--target", str(FIXTURES / "bad_target.yaml")], "hbm_bytes"),
    (["profile", str(EXAMPLES / "mlp.py"), "--model-arg", "width"], "not key=value"),
    (["profile", str(EXAMPLES / "gpt.py"), "--model-arg", "layers=2", "--tp", "5"],
     "t=5 does not divide the 48 attention heads"),
    (["plan", str(EXAMPLES / "gpt.py"), "--gpus", "64", "--target", "v100-32gb"], "plan with --dtype fp16"),
    (["plan", str(EXAMPLES / "gpt.py"), "--gpus", "48", "--gpus-per-node", "6", "--tp", "5"],
     "t=5 does not divide the 48 attention heads"),
    (["plan", str(EXAMPLES / "gpt.py"), "--gpus", "12"], "do not fill whole nodes of 8"),
    (["plan", str(EXAMPLES / "gpt.py"), "--gpus", "64", "--dp", "8", "--global-batch", "100"],
     "global batch 100 is not divisible by d*b"),
    (["plan", str(EXAMPLES / "gpt.py"), "--gpus", "8", "--model-arg", "preset=1t"], "fits no configuration"),
    (["plan", str(EXAMPLES / "gpt.py"), "--gpus", "8", "--schedule", "zigzag"], "--schedule must be one of"),
    (["plan", str(EXAMPLES / "gpt.py"), "--gpus", "8", "--model-arg", "layers=2", "--engine", "megatron",
      "--moe-capacity", "0.5"], "--moe-capacity must be 0 (dropless) or a capacity factor of at least 1, got 0.5"),
    (["plan", str(EXAMPLES / "gpt.py"), "--gpus", "8", "--moe-capacity", "1.5"],
     "experts padded to a capacity (--moe-capacity) run in Megatron-Core; fxplanner routes every token"),
    (["plan", str(EXAMPLES / "gpt.py"), "--gpus", "8", "--moe-capacity", "1.25", "--expert-load", "1.5"],
     "--expert-load 1.5 is a dropless router's balance, but --moe-capacity 1.25 pads every expert to that share"),
    (["show", str(FIXTURES / "bad_target.yaml")], "not valid JSON"),
    (["plan", str(EXAMPLES / "gpt.py"), "--gpus", "16", "--fill", str(EXAMPLES / "fill" / "jobs.yaml"),
      "--fill-solver", "cpsat", "--fill-time-limit", "0"], "--fill-time-limit must be positive"),
    (["export", str(FIXTURES / "bad_target.yaml"), "--to", "megatron"], "not valid JSON"),
    (["calibrate", str(EXAMPLES / "gpt.py"), "--measure", "--no-comm", "--model-arg", "preset=1t"],
     "B parameters in fp32 with their gradients"),
    (["plan", str(EXAMPLES / "mlp.py"), "--gpus", "2", "-o", "/nonexistent-folder/plan.json"],
     "cannot write plan /nonexistent-folder/plan.json: folder /nonexistent-folder does not exist"),
    (["calibrate", str(EXAMPLES / "mlp.py"), "--measure", "--no-comm", "-o", "/nonexistent-folder/cal.json"],
     "cannot write calibration /nonexistent-folder/cal.json: folder /nonexistent-folder does not exist"),
    # issue 22: a tensor-parallel split the runtime cannot run is refused at plan time, naming the op and its line
    (["plan", str(ROOT / "tests" / "runtime" / "fixtures" / "cumsum_mlp.py"), "--gpus", "2", "--gpus-per-node", "2",
      "--tp", "2", "--global-batch", "4", "--model-arg", "preset=tiny", "--model-arg", "layers=2"],
     "`cumsum` (cumsum along the split dim) at " + str(ROOT / "tests" / "runtime" / "fixtures" / "cumsum_mlp.py")
     + ":14"),
    (["plan", str(ROOT / "tests" / "runtime" / "fixtures" / "cumsum_mlp.py"), "--gpus", "2", "--gpus-per-node", "2",
      "--tp", "2", "--sequence-parallel", "--global-batch", "4", "--model-arg", "preset=tiny", "--model-arg",
      "layers=2"], "the plan runs sequence parallelism, but this model's graph applies an op to a split tensor"),
])
def test_bad_input_is_one_clear_message(args, needle):
    result, text = run(*args)
    assert result.exit_code != 0
    assert needle in " ".join(text.split())  # (rich wraps a long sentence at spaces)
    assert "Traceback" not in text
    assert len(text.strip().splitlines()) < 5


def test_untraceable_names_module_and_line():
    _, text = run("profile", str(FIXTURES / "untraceable.py"))
    assert "module 'gate' (Gate)" in text and "untraceable.py:7" in text


def test_model_that_fits_nowhere_says_what_would_fit():
    _, text = run("plan", str(EXAMPLES / "gpt.py"), "--gpus", "8", "--model-arg", "preset=1t")
    assert "GiB per GPU against 80 GiB" in text
    more = int(re.search(r"use about (\d+) or more GPUs \((\d+) nodes of 8\)", text).group(1))
    assert more % 8 == 0 and more > 8  # whole nodes


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    made = runner.invoke(app, ["plan", str(EXAMPLES / "gpt.py"), "--gpus", "16", "--pp", "4", "-o", str(path)])
    assert made.exit_code == 0, made.stdout
    return path


def _edit(data: dict, where: str, value) -> None:
    *keys, last = where.split(".")
    for k in keys:
        data = data[int(k)] if k.isdigit() else data[k]
    last = int(last) if last.isdigit() else last
    data[last] = value(data[last]) if callable(value) else value


@pytest.mark.parametrize("where,value,needle", [
    ("config.pp", 2, "GPUs but source.gpus = 16"),
    ("config.microbatch", lambda b: b * 2, "samples but source.global_batch"),
    ("predictions.iteration_s", lambda t: t / 10, "is not global_batch / iteration_s"),
    ("predictions.samples_per_s", lambda x: x * 10, "is not global_batch / iteration_s"),
    ("partition.0.rank", 3, "each on the rank of the"),
    ("actions.1", lambda a: a[:-3], "actions:"),
])
@pytest.mark.parametrize("command", ["show", "export"])
def test_an_edited_plan_is_refused_on_every_load_with_one_sentence(plan_file, tmp_path, where, value, needle, command):
    import json

    data = json.loads(plan_file.read_text())
    _edit(data, where, value)
    bad = tmp_path / "edited.json"
    bad.write_text(json.dumps(data))
    args = [command, str(bad)] + (["--to", "megatron"] if command == "export" else [])
    result, text = run(*args)
    assert result.exit_code == 2 and "is inconsistent" in text and needle in " ".join(text.split()), text
    assert "Traceback" not in text and len(text.strip().splitlines()) < 5


@pytest.mark.parametrize("args,needle", [
    (["launch", "{plan}", "--local"], "local launch: 16 rank processes on"),  # 16 ranks, beyond what this machine holds
    (["validate", "{plan}", "--metrics", "{other}"], "holds runs of other plans than"),  # metrics of another plan
    (["refit", "{plan}", "--measured", "{other}"], "holds runs of other plans than"),
])
def test_a_plan_and_what_its_commands_are_given_must_match(plan_file, args, needle):
    """Issue 22: a launch this machine cannot hold, and metrics from another plan (tests/fixtures/
    metrics_other_plan.json: a real run of a CNN), are one sentence each."""
    other = FIXTURES / "metrics_other_plan.json"
    result, text = run(*(a.format(plan=plan_file, other=other) for a in args))
    assert result.exit_code != 0 and needle in " ".join(text.split()), text
    assert "Traceback" not in text and len(text.strip().splitlines()) < 5


def test_outputs_into_a_missing_folder_are_one_sentence_and_nothing_is_half_written(tmp_path):
    plan = tmp_path / "plan.json"
    made, _ = run("plan", str(EXAMPLES / "mlp.py"), "--gpus", "2", "-o", str(plan))
    assert made.exit_code == 0
    result, text = run("chart", str(plan), "-o", str(tmp_path / "nowhere" / "c.png"))
    assert result.exit_code == 2 and "Traceback" not in text
    assert "cannot write chart" in " ".join(text.split()) and "does not exist" in text
    result, _ = run("export", str(plan), "--to", "megatron", "-o", str(tmp_path / "made" / "job.sh"))
    assert result.exit_code == 0 and (tmp_path / "made" / "job.sh").is_file()  # export makes its folder
    assert not any(p.name.endswith(".tmp") for p in tmp_path.rglob("*"))


def test_rich_markup_in_a_message_is_printed_as_written(tmp_path):
    bad = tmp_path / "[bold]weird[/bold].py"
    result, text = run("profile", str(bad))
    assert result.exit_code != 0 and "[bold]weird[/bold].py" in text


def test_a_torchtitan_check_of_another_models_config_is_one_sentence(tmp_path):
    """Issue 22: `export --to torchtitan --check` of a 40-layer Llama plan against llama3_8b (32 layers) is refused."""
    pytest.importorskip("transformers", reason="the hf extra is not installed")
    pytest.importorskip("torchtitan", reason="the engines extra is not installed")
    plan = tmp_path / "plan.json"
    made, text = run("plan", str(EXAMPLES / "hf_llama.py"), "--gpus", "64", "--model-arg", "layers=40",
                     "-o", str(plan))
    assert made.exit_code == 0, text
    result, text = run("export", str(plan), "--to", "torchtitan", "--titan-module", "llama3", "--titan-config",
                       "llama3_8b", "--check")
    assert result.exit_code != 0 and "Traceback" not in text, text
    (error,) = " ".join(text.split()).split("error: ")[1:]  # after the export's notes, one sentence
    assert "llama3_8b builds 32 layers of width 4096, the plan's model 40" in error
