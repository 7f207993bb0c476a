"""Each bad input gives one short message and a nonzero exit, never a traceback."""
from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from planner.cli import app
from tests.conftest import EXAMPLES, FIXTURES

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
    (["show", str(FIXTURES / "bad_target.yaml")], "not valid JSON"),
])
def test_bad_input_is_one_clear_message(args, needle):
    result, text = run(*args)
    assert result.exit_code != 0
    assert needle in text
    assert "Traceback" not in text
    assert len(text.strip().splitlines()) <= 6


def test_untraceable_names_module_and_line():
    _, text = run("profile", str(FIXTURES / "untraceable.py"))
    assert "module 'gate' (Gate)" in text and "untraceable.py:7" in text


def test_model_that_fits_nowhere_says_what_would_fit():
    _, text = run("plan", str(EXAMPLES / "gpt.py"), "--gpus", "8", "--model-arg", "preset=1t")
    assert "GiB per GPU against 80 GiB" in text
    more = int(re.search(r"use about (\d+) or more GPUs \((\d+) nodes of 8\)", text).group(1))
    assert more % 8 == 0 and more > 8  # whole nodes
