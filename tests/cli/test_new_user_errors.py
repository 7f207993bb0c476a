"""Issue 51, what a new user hit: `planner chart` without matplotlib or to a suffix it cannot write, calibration's two
steps as the README writes them (and never into the checkout), and errors that say why. Each is one sentence, exit
code 2, no traceback."""
from __future__ import annotations

import json
import sys

import pytest
from typer.testing import CliRunner

from planner.cli import app
from tests.conftest import EXAMPLES, FIXTURES, ROOT

runner = CliRunner()


def run(*args: str, env: dict | None = None):
    result = runner.invoke(app, list(args), env=env)
    text = result.stdout + (result.stderr or "")
    return result, " ".join(text.split())  # (rich wraps a long sentence at spaces)


def one_sentence(result, text: str, needle: str) -> None:
    assert result.exit_code == 2, text
    assert needle in text, text
    assert "Traceback" not in text and text.count("error:") == 1, text


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("chart") / "plan.json"
    result, text = run("plan", str(EXAMPLES / "mlp.py"), "--gpus", "2", "--pp", "2", "-o", str(path))
    assert result.exit_code == 0, text
    return path


# --- item 7: planner chart -----------------------------------------------------------------------------------------

def test_chart_without_matplotlib_gives_the_install_hint(plan_file, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    out = tmp_path / "x.png"
    result, text = run("chart", str(plan_file), "-o", str(out))
    one_sentence(result, text, "charts need matplotlib: pip install 'fxplanner[charts]'")
    assert not out.exists()


def test_chart_to_a_suffix_matplotlib_cannot_write_is_refused_before_drawing(plan_file, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "x.txt"
    result, text = run("chart", str(plan_file), "-o", str(out))
    one_sentence(result, text, f"cannot write chart {out}: matplotlib writes images ending in")
    assert ".png" in text and ".svg" in text and text.rstrip().endswith("not .txt")
    assert not out.exists()


# --- item 8: planner calibrate's two steps -------------------------------------------------------------------------

def test_calibrate_names_both_steps_when_given_neither():
    result, text = run("calibrate")
    one_sentence(result, text, "calibrate takes MODEL.py with --measure (first step), or --from-run METRICS.json "
                               "--plan PLAN.json (second step)")


def test_calibrate_writes_outside_the_current_directory_and_prints_the_second_step(plan_file, tmp_path, monkeypatch):
    """Run from the checkout's root (where a calibrate once overwrote a tracked file), it writes nothing there: its
    outputs go to $XDG_DATA_HOME/fxplanner, and the second step, without MODEL or -o, finds the first's."""
    home = tmp_path / "data"
    env = {"XDG_DATA_HOME": str(home)}
    monkeypatch.chdir(ROOT)
    names = ("local-cpu.yaml", "calibration.json")  # what it wrote into the current directory before

    def there():  # (only these: other work may touch the checkout meanwhile)
        return {n: (ROOT / n).stat().st_mtime_ns if (ROOT / n).exists() else None for n in names}

    before = there()
    result, text = run("calibrate", str(EXAMPLES / "mlp.py"), "--measure", "--batch", "8", "--repeats", "1",
                       "--no-comm", env=env)
    assert result.exit_code == 0, text
    assert there() == before
    cal, target = home / "fxplanner" / "calibration.json", home / "fxplanner" / "local-cpu.yaml"
    assert json.loads(cal.read_text())["target"] == "local-cpu" and target.is_file()
    assert f"written {cal}; target {target}" in text
    plan, metrics = cal.parent / "calibration-plan.json", cal.parent / "calibration-metrics.json"  # (not in cwd)
    assert f"planner plan {EXAMPLES / 'mlp.py'} --gpus 2 --gpus-per-node 2 --tp 1 --pp 2 --schedule 1f1b " \
           f"--microbatch 8 --global-batch 32 --dtype fp32 --target {target} --calibration {cal} -o {plan}" in text
    assert f"planner launch {plan} --local --metrics {metrics}" in text
    assert f"planner calibrate --from-run {metrics} --plan {plan} -o {cal}" in text
    # the second step as the README writes it: no MODEL argument ("Missing argument 'model'" before), no -o
    missing = tmp_path / "m.json"
    result, text = run("calibrate", "--from-run", str(missing), "--plan", str(plan_file), env=env)
    assert "Missing argument" not in text
    one_sentence(result, text, f"metrics file {missing} does not exist")  # it read the calibration and the plan


def test_the_second_step_without_a_first_says_to_run_it(tmp_path):
    result, text = run("calibrate", "--from-run", "m.json", "--plan", "p.json",
                       env={"XDG_DATA_HOME": str(tmp_path)})
    one_sentence(result, text, f"--from-run updates the calibration {tmp_path / 'fxplanner' / 'calibration.json'}, "
                               "which does not exist: run the first step (planner calibrate MODEL.py --measure) first")


# --- item 11: errors that say why ----------------------------------------------------------------------------------

@pytest.mark.parametrize("args,needle", [
    (["--gpus", "64", "--tp", "8", "--pp", "4", "--dp", "4"],
     "--tp 8 x --pp 4 x --dp 4 is 128 GPUs, not 64: t*p*d*cp must be the GPU count (--gpus)"),
    (["--gpus", "64", "--tp", "8", "--pp", "3"], "--tp 8 x --pp 3 is 24 GPUs, which does not divide 64"),
    (["--gpus", "64", "--dp", "64", "--microbatch", "3"],
     "--dp 64 x --microbatch 3 is 192 samples a step, which does not divide the global batch of 512: d*b must divide"),
    (["--gpus", "64", "--microbatch", "3"],
     "--microbatch 3 times no data-parallel degree these 64 GPUs allow divides the global batch of 512"),
    (["--gpus", "8", "--ep", "2"], "--ep 2 divides the experts of mixture-of-experts layers over expert-parallel "
                                   "ranks, but " + str(EXAMPLES / "gpt.py") + " builds a dense model (no MoE layers)"),
    (["--gpus", "8", "--ep", "2", "--engine", "megatron"], "builds a dense model (no MoE layers): drop --ep"),
    (["--gpus", "8", "--dtype", "fp4"], "--dtype must be one of bf16, fp16, fp32, or fp8 (bf16 with the linear "
                                        "layers' GEMMs in FP8, as --fp8 auto), got 'fp4'"),
])
def test_pins_and_options_that_cannot_hold_say_why(args, needle):
    result, text = run("plan", str(EXAMPLES / "gpt.py"), *args)
    one_sentence(result, text, needle)
    assert "the pins exclude every configuration" not in text


def test_dtype_help_lists_fp8_and_says_what_it_does():
    result = runner.invoke(app, ["plan", "--help"], env={"COLUMNS": "200", "TERMINAL_WIDTH": "200"})
    text = " ".join(result.output.split())
    assert "bf16, fp16, fp32, or fp8 (bf16 with the linear layers' GEMMs in FP8" in text
    result, text = run("profile", str(EXAMPLES / "mlp.py"), "--dtype", "fp8")
    one_sentence(result, text, "`planner plan --dtype fp8` prices them")


def test_a_directory_as_the_model_file_is_called_a_directory():
    result, text = run("plan", str(FIXTURES / "styles"), "--gpus", "8")
    one_sentence(result, text, f"model file {FIXTURES / 'styles'} is a directory; pass a model file, one .py file")
    first = sorted(p.name for p in (FIXTURES / "styles").glob("*.py"))[:3]
    assert "does not exist" not in text and f"(in it: {', '.join(first)}, …)" in text


def test_a_fill_job_whose_model_is_missing_is_named(tmp_path):
    fill = tmp_path / "jobs.yaml"
    fill.write_text(f"jobs:\n  - {{name: fine, model: {EXAMPLES / 'mlp.py'}, kind: train, batch_sizes: [8], "
                    "work: {samples: 10}}\n  - {name: lost-job, model: ../nowhere/model.py, kind: infer, "
                    "batch_sizes: [8], work: {samples: 10}}\n")
    result, text = run("plan", str(EXAMPLES / "gpt.py"), "--gpus", "16", "--fill", str(fill))
    one_sentence(result, text, f"fill file {fill}: job 'lost-job': model file ../nowhere/model.py (relative to the "
                               f"fill file's folder: {tmp_path.parent / 'nowhere' / 'model.py'}) does not exist")


def test_a_fill_file_with_two_typos_names_both(tmp_path):
    fill = tmp_path / "jobs.yaml"
    fill.write_text(f"jobs:\n  - name: a\n    model: {EXAMPLES / 'mlp.py'}\n    kind: train\n    batch_size: [8]\n"
                    "    wrok: {samples: 10}\n")
    result, text = run("plan", str(EXAMPLES / "gpt.py"), "--gpus", "16", "--fill", str(fill))
    one_sentence(result, text, f"fill file {fill}: unknown field jobs.0.batch_size (did you mean batch_sizes?); "
                               "unknown field jobs.0.wrok (did you mean work?)")
    assert "Field required" not in text  # the fields the typos meant are not reported missing as well
