"""End to end under real torchrun on CPU (gloo): pipeline/data/tensor-parallel training equals
single-process training, and bad plans stop every rank before any collective.

Start-up dominates on small machines (each torchrun imports torch in every process), so the eight
world-size-4 plans run in turn in ONE torchrun launch (the runtime accepts several plans); each
plan is then checked by its own test. The optimizer is SGD with a large step so that parameters
move far from their initial values in 3 steps: Adam divides gradients by their own magnitude, which
turns float noise on analytically-zero gradients (the key bias: softmax is shift-invariant) into
lr-sized steps, so Adam parameters are compared in test_cli.py on losses only.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from itertools import groupby
from pathlib import Path

import pytest
import torch

from planner.metrics import METRICS_SCHEMA, MetricsDocument, load_metrics
from planner.runtime import child_env

from ._util import GPT, SKIPNET, exit_codes, gpt_args, plan_file, rank_lines, reference, torchrun

pytestmark = pytest.mark.multiprocess

STEPS, LR, B = 3, 0.1, 8
TOL = 1e-5
CASES = {  # name: (model, model args, pins)
    "gpipe_p2_d2": (GPT, gpt_args(), dict(t=1, p=2, d=2, b=1, v=1, schedule="gpipe", recompute="full")),
    "1f1b_p2_d2": (GPT, gpt_args(), dict(t=1, p=2, d=2, b=1, v=1, schedule="1f1b")),
    "interleaved_p2_d2": (GPT, gpt_args(), dict(t=1, p=2, d=2, b=1, v=2, schedule="interleaved")),
    "gpipe_p4": (GPT, gpt_args(), dict(t=1, p=4, d=1, b=2, v=1, schedule="gpipe")),
    "1f1b_p4": (GPT, gpt_args(), dict(t=1, p=4, d=1, b=2, v=1, schedule="1f1b")),
    "interleaved_p4": (GPT, gpt_args(6), dict(t=1, p=4, d=1, b=2, v=2, schedule="interleaved")),
    "tp2_p2": (GPT, gpt_args(), dict(t=2, p=2, d=1, b=2, v=1, schedule="1f1b", recompute="full")),
    "skip_p4": (SKIPNET, {}, dict(t=1, p=4, d=1, b=2, v=1, schedule="1f1b", recompute="full")),
    # ZeRO-1 with the reduction overlapped with the backward (and the tied embedding on both end stages)
    "interleaved_p2_d2_zero_overlap": (GPT, gpt_args(), dict(t=1, p=2, d=2, b=1, v=2, schedule="interleaved",
                                                             zero=1, overlap=True)),
    "tp2_d2_zero_overlap": (GPT, gpt_args(), dict(t=2, p=1, d=2, b=2, v=1, schedule="1f1b", zero=1, overlap=True)),
    # zero-bubble: backwards split into I and W (torch's stage_backward_input / _weight); ZB-V's V placement hands
    # the middle stages over on one rank
    "zbh1_p4": (GPT, gpt_args(), dict(t=1, p=4, d=1, b=2, v=1, schedule="zbh1")),
    "zbh1_p2_d2_zero_overlap": (GPT, gpt_args(), dict(t=1, p=2, d=2, b=1, v=1, schedule="zbh1", zero=1, overlap=True)),
    "zbv_p2_d2": (GPT, gpt_args(), dict(t=1, p=2, d=2, b=1, v=2, schedule="zbv")),
    "zbv_p4": (GPT, gpt_args(6), dict(t=1, p=4, d=1, b=1, v=2, schedule="zbv")),  # m=8 >= 2p-1
    "zbh1_tp2_p2": (GPT, gpt_args(), dict(t=2, p=2, d=1, b=2, v=1, schedule="zbh1", recompute="full")),
}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("e2e")
    plans = {}
    for name, (model, args, pins) in CASES.items():
        plans[name] = plan_file(tmp / f"{name}.json", model, args, gpus=4, global_batch=B, **pins)
    start = time.perf_counter()
    proc = torchrun(4, [*(str(tmp / f"{n}.json") for n in CASES), "--steps", str(STEPS), "--optimizer", "sgd",
                        "--lr", str(LR), "--metrics", str(tmp / "metrics.json"), "--dump-params", str(tmp / "dump")],
                    cwd=tmp)
    wall = time.perf_counter() - start
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    metrics = load_metrics(tmp / "metrics.json")
    refs = {}
    for model, args in {(m, tuple(sorted(a.items()))) for m, a, _ in CASES.values()}:
        refs[model, args] = reference(model, dict(args), global_batch=B, steps=STEPS, optimizer="sgd", lr=LR)
    print(f"torchrun with {len(CASES)} plans: {wall:.1f} s")
    return {"dir": tmp, "plans": plans, "metrics": metrics, "refs": refs, "out": proc.stdout}


def _ref(run: dict, name: str) -> dict:
    model, args, _ = CASES[name]
    return run["refs"][model, tuple(sorted(args.items()))]


def _dumps(run: dict, name: str) -> list[dict]:
    index = list(CASES).index(name)
    return [torch.load(run["dir"] / "dump" / str(index) / f"rank{r}.pt") for r in range(4)]


@pytest.mark.parametrize("name", list(CASES))
def test_matches_single_process(run: dict, name: str) -> None:
    ref = _ref(run, name)
    entry = run["metrics"].runs[list(CASES).index(name)]
    assert entry.world == 4 and len(entry.loss) == STEPS
    for step, (got, want) in enumerate(zip(entry.loss, ref["loss"])):
        assert abs(got - want) <= TOL * max(1.0, abs(want)), f"step {step}: loss {got} vs single-process {want}"
    dumps = _dumps(run, name)
    seen = set()
    for dump in dumps:
        for pname, value in dump["params"].items():
            seen.add(pname)
            assert torch.allclose(value, ref["params"][pname], rtol=0, atol=TOL), \
                f"rank {dump['coords']}: parameter {pname} off by {(value - ref['params'][pname]).abs().max():.2e}"
            grad = dump["grads"][pname]
            assert torch.allclose(grad, ref["grads"][pname], rtol=0, atol=TOL), \
                f"rank {dump['coords']}: gradient {pname} off by {(grad - ref['grads'][pname]).abs().max():.2e}"
    assert seen == set(ref["params"]), f"parameters held by no rank: {set(ref['params']) - seen}"


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n][2]["d"] > 1 or CASES[n][2]["t"] > 1])
def test_replicas_identical(run: dict, name: str) -> None:
    """Data-parallel (and tensor-parallel, gathered) copies of a stage hold identical parameters."""
    dumps = _dumps(run, name)
    key = lambda d: d["coords"][0]  # noqa: E731 - pipeline rank
    for pp, group in groupby(sorted(dumps, key=key), key=key):
        group = list(group)
        assert len(group) > 1
        for other in group[1:]:
            for pname, value in group[0]["params"].items():
                assert torch.equal(value, other["params"][pname]), f"pp {pp}: {pname} differs between replicas"


def test_tied_weight_on_first_and_last_stage(run: dict) -> None:
    """GPT ties the LM head to the token embedding: both end stages hold it, with the summed gradient."""
    for name in ("1f1b_p2_d2", "interleaved_p4"):
        holders = [d for d in _dumps(run, name) if "embedding.tok.weight" in d["params"]]
        p = CASES[name][2]["p"]
        assert {d["coords"][0] for d in holders} == {0, p - 1}


def test_metrics(run: dict) -> None:
    doc: MetricsDocument = run["metrics"]
    assert doc.schema_version == METRICS_SCHEMA and len(doc.runs) == len(CASES)
    for name, entry in zip(CASES, doc.runs):
        plan = run["plans"][name]
        assert [r.rank for r in entry.ranks] == [0, 1, 2, 3]
        for rank in entry.ranks:
            planned = sorted(b.id for b in plan.bubbles if b.rank == rank.pp)
            assert rank.stages == [s.stage for s in plan.partition if s.rank == rank.pp]
            assert rank.fill_report is None and rank.fill_client == "NullFill"  # no fill section
            for step in rank.steps:
                assert step.iteration_s > 0
                assert sorted(b.id for b in step.bubbles) == planned, (name, rank.rank)
                assert all(b.duration_s >= 0 and b.start_s >= 0 for b in step.bubbles)
                assert set(step.stages) == {str(s) for s in rank.stages}
                assert all(t.forward_s > 0 and t.backward_s > 0 for t in step.stages.values())
                assert step.peak_memory_bytes is None  # CUDA only
    assert "step 2: loss" in run["out"]


# ---------------------------------------------------------------------------------------------
# Bad plans: every rank prints one message and exits 2, before any collective


def test_bad_plans_stop_every_rank(small_plan: Path, tmp_path: Path) -> None:
    data = json.loads(small_plan.read_text())
    tampered = tmp_path / "tampered.json"
    tampered.write_text(json.dumps({**data, "source": {**data["source"], "model_sha256": "0" * 64}}))
    old = tmp_path / "old.json"
    old.write_text(json.dumps({**data, "schema": "fxplanner.plan/v0"}))
    cases = {  # name: (plan, processes, what the message says)
        "hash": (tampered, 2, "has sha256"),
        "schema": (old, 2, "has schema 'fxplanner.plan/v0'"),
        "world": (small_plan, 3, "needs tp*cp*pp*dp = 1*1*2*1 = 2 processes, but this launch has WORLD_SIZE=3"),
    }
    procs = {name: subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), "--tee", "3",
         "-m", "planner.runtime", str(plan)], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=child_env())
        for name, (plan, n, _) in cases.items()}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=120)
        _, n, expected = cases[name]
        assert proc.returncode != 0, name
        assert exit_codes(stderr) == {r: 2 for r in range(n)}, (name, stderr[-3000:])
        for r in range(n):
            lines = [line for line in rank_lines(stdout + "\n" + stderr, r) if line.strip()]
            assert len(lines) == 1, (name, r, lines)
            assert lines[0].startswith(f"error: rank {r}/{n}: ") and expected in lines[0], (name, lines[0])


def test_the_plans_launcher_ends_a_failed_rank_in_one_line(small_plan: Path, tmp_path: Path) -> None:
    """A 2-rank plan started with 3 processes through the plan's own launch command: each rank says why, and
    torchrun's ChildFailedError report and traceback are replaced by one line."""
    proc = subprocess.run(
        [sys.executable, "-m", "planner.runtime.torchrun", "--standalone", "--nproc-per-node", "3", "--tee", "3",
         "-m", "planner.runtime", str(small_plan)], cwd=tmp_path, capture_output=True, text=True, env=child_env(),
        timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == ("error: 3 rank(s) failed (rank 0, 1, 2; exit code 2); each rank's "
                                                    "message above says why")
    assert all("start it with 2 processes" in " ".join(rank_lines(proc.stdout + proc.stderr, r)) for r in range(3))
