"""`planner show` says what it leaves out and explains the bubble kinds."""
from __future__ import annotations

from typer.testing import CliRunner

from planner.cli import app
from tests.conftest import EXAMPLES


def test_show_says_what_it_cuts_and_explains_bubble_kinds(tmp_path):
    path = tmp_path / "plan.json"
    runner = CliRunner()
    made = runner.invoke(app, ["plan", str(EXAMPLES / "gpt.py"), "--gpus", "64", "--pp", "8", "--schedule", "1f1b",
                               "-o", str(path)])
    assert made.exit_code == 0, made.stdout
    res = runner.invoke(app, ["show", str(path)], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.stdout
    assert "more characters)" in res.stdout  # the schedule grid is wider than what is printed
    assert "more" in res.stdout.split("bubbles (")[1]  # the bubble table says how many rows it left out
    assert "showing 60" in res.stdout
    assert "A = fill/drain" in res.stdout and "B = before a backward" in res.stdout


def test_launch_without_local_writes_the_launch_script(tmp_path):
    path = tmp_path / "plan.json"
    runner = CliRunner()
    assert runner.invoke(app, ["plan", str(EXAMPLES / "gpt.py"), "--gpus", "16", "-o", str(path)]).exit_code == 0
    res = runner.invoke(app, ["launch", str(path)])
    assert res.exit_code == 0, res.stdout
    script = tmp_path / "launch.sh"
    assert script.is_file() and script.stat().st_mode & 0o111
    text = script.read_text()
    assert "--nnodes 2 --nproc-per-node 8" in text and 'NODE_RANK="${1:?' in text and str(path) in text
    assert str(script) in res.stdout


def test_a_model_the_runtime_cannot_feed_is_flagged_at_plan_time():
    from tests.conftest import FIXTURES

    res = CliRunner().invoke(app, ["plan", str(FIXTURES / "cnn_bias.py"), "--gpus", "8", "-o", "/dev/null"])
    assert res.exit_code == 0, res.stdout
    assert "the plan cannot be launched: cnn_bias.py defines no sample_batch() and no loss_fn()" in res.stdout
    assert "samples/s" in res.stdout and "tokens/s" not in res.stdout  # an image model


def test_every_fill_job_is_accounted_for(tmp_path):
    from planner.plan import load_plan

    path = tmp_path / "plan.json"
    res = CliRunner().invoke(app, ["plan", str(EXAMPLES / "gpt.py"), "--gpus", "64", "--fill",
                                   str(EXAMPLES / "fill" / "jobs.yaml"), "-o", str(path)])
    assert res.exit_code == 0, res.stdout
    fill = load_plan(path).fill
    placed = {j.name.split("@")[0] for j in fill.jobs}
    accounted = placed | set(fill.predictions.unplaceable) | set(fill.predictions.not_chosen)
    assert accounted == {"bert-infer", "mlp-train", "resnet-train"}
    for name, why in fill.predictions.not_chosen.items():
        assert f"not chosen {name}: it fits" in " ".join(res.stdout.split())


def test_simulate_fill_says_when_no_job_finished_and_labels_gpus_saved(tmp_path):
    import json

    path = tmp_path / "plan.json"
    runner = CliRunner()
    jobs = str(EXAMPLES / "fill" / "jobs.yaml")
    made = runner.invoke(app, ["plan", str(EXAMPLES / "gpt.py"), "--gpus", "64", "--fill", jobs, "-o", str(path)])
    assert made.exit_code == 0, made.stdout
    res = runner.invoke(app, ["simulate-fill", str(path), jobs, "--horizon", "10"])
    assert res.exit_code == 0, res.stdout
    text = " ".join(res.stdout.split())
    assert "nan" not in text and "no job finished within the horizon" in text
    assert "C*B*P: 64 GPUs x bubble ratio x" in text
    data = json.loads(runner.invoke(app, ["simulate-fill", str(path), jobs, "--horizon", "10", "--json"]).stdout)
    assert data["mean_jct_s"] is None and data["jobs_finished"] == 0


def test_profile_says_how_many_units_it_left_out_and_prints_all_on_request():
    runner = CliRunner()
    args = ["profile", str(EXAMPLES / "gpt.py"), "--model-arg", "layers=48"]
    cut = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert cut.exit_code == 0 and "11 more units (--all)" in cut.stdout
    full = runner.invoke(app, [*args, "--all"], env={"COLUMNS": "200"})
    assert full.exit_code == 0 and all(f"layers.{i} " in full.stdout for i in range(48))


def test_cpsat_fill_has_one_time_limit_and_reports_its_gap(tmp_path):
    import json

    path = tmp_path / "plan.json"
    jobs = str(EXAMPLES / "fill" / "jobs.yaml")
    made = CliRunner().invoke(app, ["plan", str(EXAMPLES / "gpt.py"), "--gpus", "64", "--fill", jobs, "--fill-solver",
                                    "cpsat", "--fill-time-limit", "2", "-o", str(path)])
    assert made.exit_code == 0, made.stdout
    solver = json.loads(path.read_text())["fill"]["predictions"]["solver"]
    assert solver.startswith("CP-SAT: ") and ("optimal" in solver or "bound" in solver or "kept greedy" in solver)
    assert "packing: CP-SAT" in " ".join(made.stdout.split())


def test_profile_says_why_tied_rows_add_up_to_more_than_the_total():
    import pytest

    pytest.importorskip("transformers", reason="the hf extra is not installed")
    res = CliRunner().invoke(app, ["profile", str(EXAMPLES / "hf_gpt2.py")])
    assert res.exit_code == 0, res.stdout
    text = " ".join(res.stdout.split())
    assert "80.41 M of them are shared between units" in text and "counts each parameter once" in text
