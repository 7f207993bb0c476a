"""`planner show` says what it leaves out and explains the bubble kinds."""
from __future__ import annotations

from typer.testing import CliRunner

from planner.cli import _ms, app, out
from planner.cli_plan import bubble_summary
from planner.plan import load_plan, plan_schedule
from planner.schedule_ir import _GRID_OPS
from tests.conftest import EXAMPLES


def test_show_says_what_it_cuts_and_explains_bubble_kinds(tmp_path):
    path = tmp_path / "plan.json"
    runner = CliRunner()
    made = runner.invoke(app, ["plan", str(EXAMPLES / "gpt.py"), "--gpus", "64", "--pp", "8", "--schedule", "1f1b",
                               "-o", str(path)])
    assert made.exit_code == 0, made.stdout
    res = runner.invoke(app, ["show", str(path)], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.stdout
    assert "A = fill/drain" in res.stdout and "B = before a backward" in res.stdout
    # issue 51: each grid row fits the console, its middle left out, so that both the warm-up and the drain show
    plan = load_plan(path)
    rows = [line for line in res.stdout.splitlines() if line.startswith("rank ")]
    assert len(rows) == plan.config.pp and all(len(r) <= out.width for r in rows)
    assert all(" steps … " in r for r in rows)
    assert "--full | less -S` prints every step of every rank" in " ".join(res.stdout.split())
    for rank, row in enumerate(rows):
        cells = [str(a) for a in plan_schedule(plan).ranks[rank] if a.op in _GRID_OPS]
        assert row.split("|")[1].split()[0] == cells[0] and row.split()[-1] == cells[-1]  # the drain's last step
    # a summary per pipeline rank instead of rank 0's first 60 bubbles
    assert_bubble_summary(res.stdout, plan)
    full = runner.invoke(app, ["show", str(path), "--full"])
    assert full.exit_code == 0 and "steps …" not in full.stdout and "cut to" not in full.stdout
    wide = [line for line in full.stdout.splitlines() if line.startswith("rank ")]
    assert [r.split("|")[1].split() for r in wide] == \
        [[str(a) for a in acts if a.op in _GRID_OPS] for acts in plan_schedule(plan).ranks]


def assert_bubble_summary(stdout: str, plan) -> None:
    """The per-rank bubble table's figures are the plan's bubbles'."""
    lines = stdout.split("bubbles per pipeline rank")[1].splitlines()
    rows = ([c.strip() for c in line.strip("│").split("│")] for line in lines if line.startswith("│"))
    table = {int(cells[0]): cells for cells in rows if cells[0].isdigit()}
    for row in bubble_summary(plan):
        mine = [b for b in plan.bubbles if b.rank == row["rank"]]
        assert row["bubbles"] == len(mine) and row["total_s"] == sum(b.duration_s for b in mine)
        assert row["largest_s"] == max(b.duration_s for b in mine)
        assert [row[k] for k in "ABC"] == [sum(b.kind == k for b in mine) for k in "ABC"]
        cells = table[row["rank"]]
        assert cells[1:5] == [str(row["A"]), str(row["B"]), str(row["C"]), str(len(mine))]
        assert cells[5:7] == [_ms(row["total_s"]), _ms(row["largest_s"])]


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
    res = CliRunner().invoke(app, ["plan", str(EXAMPLES / "gpt.py"), "--gpus", "64", "--zero", "1", "--pp", "2",
                                   "--fill", str(EXAMPLES / "fill" / "jobs.yaml"), "-o", str(path)])  # (pipelined: bubbles)
    assert res.exit_code == 0, res.stdout
    fill = load_plan(path).fill
    placed = {j.name.split("@")[0] for j in fill.jobs}
    accounted = placed | set(fill.predictions.unplaceable) | set(fill.predictions.not_chosen)
    assert accounted == {"bert-infer", "mlp-train", "resnet-train", "resnet-wide-train"}
    for name, why in fill.predictions.not_chosen.items():
        assert f"not chosen {name}: it fits" in " ".join(res.stdout.split())
    bound = [j for j in fill.jobs if j.notes]  # the example's small jobs wait for their host (fill/physics.py)
    assert bound and all(f"note {j.name}: the host issues" in " ".join(res.stdout.split()) for j in bound)
    # `show` stars the bubbles fill runs in and says how much of each rank's bubble time it uses (issue 51)
    shown = CliRunner().invoke(app, ["show", str(path)])
    assert shown.exit_code == 0, shown.stdout
    plan = load_plan(path)
    assert "BUBBLEn* runs fill" in shown.stdout
    for c in fill.chunks:
        row = next(line for line in shown.stdout.splitlines() if line.startswith(f"rank {c.rank} "))
        assert f"BUBBLE{c.bubble_id}*" in row or "steps …" in row
    assert_bubble_summary(shown.stdout, plan)
    table = shown.stdout.split("bubbles per pipeline rank")[1].splitlines()
    for row in bubble_summary(plan):
        if any(pair.rank == row["rank"] for pair in fill.pairs):
            continue  # a pair's jobs run together: their shares add up
        jobs = {c.job for c in fill.chunks if c.rank == row["rank"]}  # one at a time: the busiest
        if not jobs:  # a rank whose bubbles hold no chunk (too short for any unit)
            assert row["fill_s"] == 0
            continue
        used = max((sum(c.expected_s for c in fill.chunks if c.rank == row["rank"] and c.job == j) for j in jobs),
                   default=0.0)
        assert used > 0 and row["fill_s"] == used
        line = next(line for line in table if line.startswith(f"│ {row['rank']:>4} │"))
        assert line.rstrip(" │").endswith(f"{used / row['total_s']:.0%}")


def test_validate_keeps_the_rank_prefix_of_the_log_lines(tmp_path, monkeypatch):
    """Issue 51: rich took "[rank 0]" for markup and printed nothing of it."""
    import types

    import planner.runtime

    path = tmp_path / "plan.json"
    made = CliRunner().invoke(app, ["plan", str(EXAMPLES / "gpt.py"), "--gpus", "2", "--model-arg", "preset=tiny",
                                    "-o", str(path)])
    assert made.exit_code == 0, made.stdout

    def fake(plan_file, *, on_line, **_):
        on_line("[rank 0] plan.json: step 1: loss 4.85 [bold]x[/bold]")
        on_line("[rank 1] plan.json: step 1: loss 4.85")
        return types.SimpleNamespace(returncode=1, metrics=None)

    monkeypatch.setattr(planner.runtime, "launch_local", fake)
    res = CliRunner().invoke(app, ["validate", str(path), "-o", str(tmp_path / "v.json")])
    assert res.exit_code != 0 and "the run failed" in res.output
    assert "[rank 0] plan.json: step 1: loss 4.85 [bold]x[/bold]" in res.output
    assert "[rank 1] plan.json: step 1: loss 4.85" in res.output


def test_the_example_pairs_two_training_jobs_on_one_rank_and_says_so(tmp_path):
    """Issue 24: the 64-GPU example places the sweep's two ResNet trials on one rank, paired (Waterwave), within
    the memory the rank leaves them, and the plan command says so."""
    from planner.plan import load_plan

    path = tmp_path / "plan.json"
    res = CliRunner().invoke(app, ["plan", str(EXAMPLES / "gpt.py"), "--gpus", "64", "--tp", "8", "--pp", "8",
                                   "--global-batch", "64", "--schedule", "1f1b", "--fill",
                                   str(EXAMPLES / "fill" / "jobs.yaml"), "-o", str(path)])
    assert res.exit_code == 0, res.stdout
    fill = load_plan(path).fill
    (pair,) = fill.pairs
    assert {n.split("@")[0] for n in pair.jobs} == {"resnet-train", "resnet-wide-train"}
    jobs = {j.name: j for j in fill.jobs}
    assert {s.rank for n in pair.jobs for s in jobs[n].shards} == {pair.rank}
    assert pair.peak_bytes <= pair.budget_bytes and pair.held_bytes <= pair.budget_bytes
    assert {c.job for c in fill.chunks if c.rank == pair.rank} >= set(pair.jobs)
    text = " ".join(res.stdout.split())
    assert f"paired (Waterwave) on rank {pair.rank}:" in text and "their node groups taking turns" in text


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


def test_cpsat_fill_has_one_time_limit_and_reports_its_gap(tmp_path, monkeypatch):
    """Where chunk boundaries cost nothing (the planner's model) greedy is proven optimal: CP-SAT is not run, and the
    report says so instead of a time limit it never reached. (Asserted by what ran, not by the wall clock: a busy
    machine makes any time bound flaky.)"""
    import json

    from planner.fill import packing

    solves = []
    monkeypatch.setattr(packing, "_solve_cpsat", lambda *a, **k: solves.append(1) or (None, "UNKNOWN"))
    path = tmp_path / "plan.json"
    jobs = str(EXAMPLES / "fill" / "jobs.yaml")
    made = CliRunner().invoke(app, ["plan", str(EXAMPLES / "gpt.py"), "--gpus", "64", "--fill", jobs, "--fill-solver",
                                    "cpsat", "--fill-time-limit", "30", "-o", str(path)])
    assert made.exit_code == 0, made.stdout
    assert not solves  # no CP-SAT solve was started, so none could wait out its limit
    solver = json.loads(path.read_text())["fill"]["predictions"]["solver"]
    honest = "greedy (proven optimal: chunk boundaries cost nothing here; CP-SAT not needed)"
    assert solver == honest
    text = " ".join(made.stdout.split())
    assert f"packing: {honest}" in text and "time limit" not in text


def test_plan_says_whether_shrinking_or_filling_the_bubbles_won_with_both_figures(tmp_path):
    from planner.plan import load_plan

    path = tmp_path / "plan.json"
    res = CliRunner().invoke(app, ["plan", str(EXAMPLES / "gpt.py"), "--gpus", "64", "--zero", "1", "--pp", "2",
                                   "--fill", str(EXAMPLES / "fill" / "jobs.yaml"), "-o", str(path)])  # (pipelined: bubbles)
    assert res.exit_code == 0, res.stdout
    plan = load_plan(path)
    choice = plan.fill.predictions.choice
    text = " ".join(res.stdout.split())
    assert f"shrink or fill: {choice}" in text
    won = "shrinking" if plan.config.schedule in ("zbh1", "zbv") else "filling"
    assert choice.startswith(f"{won} won (")
    # both figures: the chosen plan's own, and the other side's
    pr = plan.predictions
    assert f"{pr.iteration_s:.3f} s (MFU {pr.mfu:.1%}, bubbles {pr.bubble_fraction:.1%}" in choice
    assert choice.count(" s (MFU ") == 2 and choice.count("bubbles ") >= 2
    assert "TFLOP/s/GPU" in choice and "GPU-s/s" in choice
    # the other side: the best plan keeping a pipeline's bubbles, or not pipelining at all where that is faster
    assert any(f"{kind} (t=" in choice for kind in ("gpipe", "1f1b", "interleaved", "zbh1", "zbv", "not pipelining"))
    assert "keeping the bubbles of " in choice or "leaves no bubbles to fill" in choice


def test_a_negative_fill_value_is_one_sentence():
    res = CliRunner().invoke(app, ["plan", str(EXAMPLES / "gpt.py"), "--gpus", "64", "--fill",
                                   str(EXAMPLES / "fill" / "jobs.yaml"), "--fill-value", "-1", "-o", "/dev/null"])
    assert res.exit_code != 0 and isinstance(res.exception, SystemExit)  # a clean exit, not an exception
    out = res.stdout + (res.stderr or "")
    assert out.startswith("error: --fill-value must be a finite number >= 0") and "got -1" in out
    assert "Traceback" not in out and len(out.strip().splitlines()) == 1


def test_profile_says_why_tied_rows_add_up_to_more_than_the_total():
    import pytest

    pytest.importorskip("transformers", reason="the hf extra is not installed")
    res = CliRunner().invoke(app, ["profile", str(EXAMPLES / "hf_gpt2.py")])
    assert res.exit_code == 0, res.stdout
    text = " ".join(res.stdout.split())
    assert "80.41 M of them are shared between units" in text and "counts each parameter once" in text
