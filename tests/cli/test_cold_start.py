"""The CLI answers --help, `targets` and its argument errors without importing torch (seconds, cold): the heavy
modules are imported inside the commands, after the arguments are checked. Behaviour, not timing."""
from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import EXAMPLES, ROOT

# each argv: run through planner.cli.run in a fresh interpreter; what it exits with, and whether torch was imported
_PROBE = """
import json, sys
from typer.testing import CliRunner
from planner.cli import app, run
assert "torch" not in sys.modules, "importing planner.cli imported torch"
results = []
for argv in json.loads(sys.argv[1]):
    if argv and argv[0] == "--runner":  # typer's test runner, as the other CLI tests use it
        code = CliRunner().invoke(app, argv[1:]).exit_code
    else:
        code = run(argv)
    results.append({"argv": argv, "code": code, "torch": "torch" in sys.modules})
print(json.dumps(results))
"""


def _probe(*argvs: list[str]) -> list[dict]:
    proc = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(list(argvs))], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_help_and_targets_do_not_import_torch():
    results = _probe(["--runner", "--help"], ["--help"], ["plan", "--help"], ["profile", "--help"],
                     ["launch", "--help"], ["export", "--help"], ["simulate-fill", "--help"], ["targets"],
                     ["targets", "--json"])
    assert [r["code"] for r in results] == [0] * len(results)
    assert not any(r["torch"] for r in results), results


def test_argument_errors_answer_before_torch_is_imported():
    gpt = str(EXAMPLES / "gpt.py")
    results = _probe(["plan", gpt, "--gpus", "0"],
                     ["plan", gpt, "--gpus", "12"],  # not whole nodes of the default target's 8
                     ["plan", gpt, "--gpus", "8", "--target", "no-such-gpu"],
                     ["plan", gpt, "--gpus", "8", "--dtype", "fp9"],
                     ["plan", gpt, "--gpus", "8", "--fill-solver", "nope"],
                     ["plan", gpt, "--gpus", "8", "--main-slack", "-1"],
                     ["plan", gpt, "--gpus", "8", "--model-arg", "layers"],
                     ["plan", gpt, "--gpus", "8", "--schedule", "nope"],
                     ["plan", gpt, "--gpus", "abc"],  # typer's own
                     ["profile", gpt, "--dtype", "fp9"],
                     ["profile", gpt, "--target", "no-such-gpu"])
    assert [r["code"] for r in results] == [2] * len(results), results
    assert not any(r["torch"] for r in results), results


def test_the_messages_are_the_ones_the_library_gives(tmp_path):
    """The early checks say what make_plan / the search would have said."""
    gpt = str(EXAMPLES / "gpt.py")
    for argv, message in ((["--gpus", "0"], "--gpus must be positive, got 0"),
                          (["--gpus", "12"], "12 GPUs do not fill whole nodes of 8"),
                          (["--gpus", "8", "--target", "no-such-gpu"], "unknown target 'no-such-gpu'"),
                          (["--gpus", "8", "--dtype", "fp9"], "--dtype must be one of bf16, fp16, fp32, or fp8"),
                          (["--gpus", "8", "--main-slack", "-1"], "--main-slack must be >= 0")):
        proc = subprocess.run([sys.executable, "-m", "planner", "plan", gpt, *argv, "-o", str(tmp_path / "p.json")],
                              capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert message in " ".join(proc.stderr.split()), proc.stderr
        assert proc.stdout == ""


def test_the_light_copies_equal_the_registries():
    """planner.options stands in for modules that import torch: it must say what they say."""
    from planner.fill.assign import PACKERS
    from planner.options import PACKER_NAMES, Pins, check_cluster
    from planner import search

    assert PACKER_NAMES == tuple(PACKERS)
    assert search.Pins is Pins and search.check_cluster is check_cluster
