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
