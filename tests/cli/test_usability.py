"""Issue 22's usability: several key=value words after one --model-arg (as the README writes them), and help that
shows every option's full name in pipes and narrow terminals."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from planner.cli import app, run, spread_model_args
from tests.conftest import EXAMPLES


def test_key_value_words_after_one_model_arg_become_model_args():
    assert spread_model_args(["plan", "m.py", "--model-arg", "preset=tiny", "layers=4", "seq=128", "--gpus", "8"]) == \
        ["plan", "m.py", "--model-arg", "preset=tiny", "--model-arg", "layers=4", "--model-arg", "seq=128", "--gpus",
         "8"]
    assert spread_model_args(["plan", "m.py", "--model-arg=preset=tiny", "layers=4"]) == \
        ["plan", "m.py", "--model-arg=preset=tiny", "--model-arg", "layers=4"]
    assert spread_model_args(["plan", "--gpus", "8", "layers=4"]) == ["plan", "--gpus", "8", "layers=4"]
    assert spread_model_args(["plan", "--model-arg", "a=1", "m.py"]) == ["plan", "--model-arg", "a=1", "m.py"]


def test_the_planner_command_takes_the_readmes_model_args(tmp_path, capsys):
    """cli.run is what the `planner` entry point (cli.main) runs before it exits."""
    out = tmp_path / "plan.json"
    code = run(["plan", str(EXAMPLES / "gpt.py"), "--gpus", "8", "--model-arg", "preset=tiny", "layers=4", "-o",
                str(out)])
    assert code == 0, capsys.readouterr()
    assert json.loads(out.read_text())["source"]["model_args"] == {"preset": "tiny", "layers": 4}


@pytest.mark.parametrize("columns", ["80", "200"])
def test_help_names_every_option_in_full(columns):
    result = CliRunner().invoke(app, ["plan", "--help"], env={"COLUMNS": columns, "TERMINAL_WIDTH": columns})
    assert result.exit_code == 0
    assert "--shard-optimizer / --no-shard-optimizer" in result.output and "…" not in result.output
