"""`planner rehearse`: one rank of a p = 4 plan run for real in this process, its peers replayed from the plan.

The rank executes exactly its action list, in order, every step; its stage computes what the same stage computes in
a real launch of the plan (fed the boundary tensors that launch recorded); fill runs only inside its bubbles; with
--compare-no-fill both runs are reported, and the metrics are what `planner validate` reads.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from planner.api import make_plan
from planner.cli import app
from planner.fill.spec import FillJobSpec, FillSpec, Work
from planner.metrics import load_metrics
from planner.plan import Plan, save_plan
from planner.runtime.rehearse import RehearseOptions, rehearse
from planner.search import Pins
from planner.validate import compare

from ._util import GPT, ROOT, gpt_args, torchrun

pytestmark = pytest.mark.multiprocess

CPU_TARGET = ROOT / "examples" / "targets" / "cpu-core.yaml"
MLP = ROOT / "examples" / "mlp.py"


def _plan(model: Path, fill: bool, **model_args) -> Plan:
    job = FillJobSpec(name="mlp", model=str(MLP), model_args={"features": 32, "width": 64, "depth": 2},
                      kind="train", batch_sizes=[8], work=Work(iterations=100_000))
    plan, _ = make_plan(str(model), gpus=4, global_batch=16, target=str(CPU_TARGET), gpus_per_node=4,
                        model_args={**gpt_args(4), **model_args}, fill=FillSpec(jobs=[job], gpu_sharing="none") if fill else None,
                        pins=Pins(tp=1, pp=4, dp=1, b=2, v=1, schedule="1f1b", recompute="none", precision="fp32"))
    return plan


@pytest.fixture(scope="module")
def filled(tmp_path_factory) -> tuple[Path, Plan]:
    path = tmp_path_factory.mktemp("rehearse") / "plan.json"
    plan = _plan(GPT, fill=True, hidden=256, seq=128)  # bubbles of tens of ms on a CPU core: room for fill units
    save_plan(plan, path)
    return path, plan


def test_rank_runs_its_actions_in_order_with_fill_inside_its_bubbles(filled) -> None:
    path, plan = filled
    rank = next(c.rank for c in plan.fill.chunks)  # a rank the plan gives fill
    report = rehearse(path, RehearseOptions(rank=rank, steps=3, compare_no_fill=True, fill_fractions=(None, 0.5)),
                      log=lambda _: None)
    # exactly the plan's action list, every step of every run
    assert [a["action"] for a in report["actions"]] == plan.actions[rank]
    assert all(run["in_plan_order"] for run in report["runs"])
    # the run without fill first, then one with fill per fraction, each with its slowdown against the first
    assert [(run["fill"], run["fill_fraction"]) for run in report["runs"]] == [(False, None), (True, None), (True, 0.5)]
    base = report["runs"][0]
    assert base["fill_work"] is None and base["slowdown"] is None
    for run in report["runs"][1:]:
        assert run["slowdown"] == pytest.approx(run["step_s"]["median"] / base["step_s"]["median"] - 1)
        assert run["fill_work"]["units_per_step"] > 0 and run["fill_work"]["errors"] == 0
    # every bubble of the rank measured; the stage's actions timed against the plan's
    assert [b["id"] for b in report["bubbles"]] == [b.id for b in plan.bubbles if b.rank == rank]
    assert all(b["measured_s"] is not None for b in report["bubbles"])
    assert {k["kind"] for k in report["action_kinds"]} == {"forward", "backward"}
    doc = report["metrics"]
    fill_run = doc.runs[0]
    assert fill_run.fill and fill_run.rehearsed_rank == rank and len(fill_run.ranks) == 1
    rep = fill_run.ranks[0].fill_report
    planned = {c.bubble_id for c in plan.fill.chunks if c.rank == rank}
    steps = 0
    for occ in rep.bubbles:  # fill starts only inside the bubbles the main job signalled, and only the planned ones
        assert bool(occ.jobs) == (occ.bubble_id in planned) and occ.main_end is not None
        for s in occ.steps:  # (within the grace the executor gives a bubble's end signal; when a step ends is its
            # grace kill's, tested in test_fill_e2e: on a loaded 2-core machine not to the millisecond)
            assert occ.main_begin <= s.start <= occ.main_end + rep.grace_s, (occ.bubble_id, s)
        steps += len(occ.steps)
    assert steps > 0
    # what `planner validate` reads: this rank's rows, predicted against measured
    result = compare(plan, doc)
    assert [r.rank for r in result.ranks] == [rank]
    assert any(row.what.startswith("bubble") and row.measured is not None for row in result.ranks[0].rows)


def test_stage_computes_what_a_launch_computes(tmp_path) -> None:
    """Fed the boundary tensors a real 4-process launch received, a middle rank ends with the launch's parameters
    and gradients, and the last rank's first loss is the launch's (its later ones differ: the head is tied to the
    embedding on rank 0, whose gradient a rehearsal does not have)."""
    plan = _plan(GPT, fill=False)
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    proc = torchrun(4, [str(path), "--steps", "2", "--no-fill", "--metrics", str(tmp_path / "m.json"),
                        "--dump-params", str(tmp_path / "dump"), "--record-boundary", str(tmp_path / "rec")],
                    cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    launched = load_metrics(tmp_path / "m.json").runs[0]
    for rank in (1, 3):  # (a CPU rehearsal runs one thread, as torchrun runs each rank: the same reductions)
        dump = tmp_path / f"rehearsed{rank}.pt"
        report = rehearse(path, RehearseOptions(rank=rank, steps=2, fill=False, dump=dump,
                                                boundary=tmp_path / "rec" / "0" / f"rank{rank}.pt"), log=lambda _: None)
        if rank == 3:
            assert report["runs"][0]["loss"][0] == pytest.approx(launched.loss[0], rel=1e-6)
            continue
        got, want = torch.load(dump, weights_only=True), torch.load(tmp_path / "dump" / "0" / f"rank{rank}.pt",
                                                                     weights_only=True)
        assert got["params"].keys() == want["params"].keys() and got["params"]
        for name in want["params"]:
            torch.testing.assert_close(got["params"][name], want["params"][name], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got["grads"][name].norm(), want["grads"][name].norm(), rtol=1e-5, atol=1e-7)


runner = CliRunner()


@pytest.mark.parametrize("args,needle", [
    (["--rank", "4"], "--rank 4 is out of range: the plan has 4 pipeline rank(s), 0 to 3"),
    (["--rank", "0", "--fill-fraction", "0"], "--fill-fraction must lie in (0, 1], got 0"),
    (["--rank", "0", "--fill-fraction", "1.5"], "--fill-fraction must lie in (0, 1], got 1.5"),
])
def test_bad_input_is_one_sentence(filled, tmp_path, args, needle) -> None:
    result = runner.invoke(app, ["rehearse", str(filled[0]), *args, "-o", str(tmp_path / "r.json"),
                                 "--metrics", str(tmp_path / "m.json")])
    text = result.stdout + (result.stderr or "")
    assert result.exit_code == 2 and needle in text and "Traceback" not in text, text


def test_a_plan_of_another_model_file_is_refused(tmp_path) -> None:
    model = tmp_path / "gpt.py"
    shutil.copy(GPT, model)
    path = tmp_path / "plan.json"
    save_plan(_plan(model, fill=False), path)
    model.write_text(model.read_text() + "\n# edited\n")
    result = runner.invoke(app, ["rehearse", str(path), "--rank", "0", "-o", str(tmp_path / "r.json")])
    text = result.stdout + (result.stderr or "")
    assert result.exit_code == 2 and "the file changed since planning" in text and "Traceback" not in text, text


def test_a_rank_holds_its_own_weights_and_no_gradient_copy_between_steps(tmp_path, monkeypatch) -> None:
    """Every rank builds the whole model, traces and splits it, and keeps its own stages
    (planner.runtime.stage.stage_modules). The model and its traced graphs are cyclic garbage once the stages are
    built: prepare collects them, so no other stage's weights outlive it; and the fp32 copies of the gradients a bf16
    plan steps its master weights with live through the optimizer step only. Before, the two were about 6.8 and
    3.3 GiB of the 11.4 GiB by which a Llama-3-8B-width rank on an H200 outgrew the 19.5 GiB it planned
    (bench/results/README_cuda_2026-11-28.md)."""
    import gc

    from planner.runtime import executor

    path = tmp_path / "plan.json"
    plan, _ = make_plan(str(GPT), gpus=4, global_batch=16, target=str(CPU_TARGET), gpus_per_node=4,
                        model_args={**gpt_args(4), "hidden": 256, "seq": 128},
                        pins=Pins(tp=1, pp=4, dp=1, b=2, v=1, schedule="1f1b", recompute="none", precision="bf16"))
    save_plan(plan, path)
    alive = lambda: {id(o): o for o in gc.get_objects()  # noqa: E731
                     if isinstance(o, torch.nn.Parameter) and o.device.type != "meta"}
    before, seen, prepare = alive(), {}, executor.prepare

    def spy(*args, **kwargs):
        ex = prepare(*args, **kwargs)
        mine = {id(p) for st in ex.stages.values() for p in st.parameters()} | {id(m) for m in ex.sync.masters}
        seen.update(ex=ex, others=[o for k, o in alive().items() if k not in before and k not in mine])
        return ex

    monkeypatch.setattr(executor, "prepare", spy)
    rehearse(path, RehearseOptions(rank=1, steps=2), log=lambda _: None)
    assert seen["others"] == []  # the whole model's other weights are gone before the first step
    masters = seen["ex"].sync.masters
    assert masters and all(m.grad is None for m in masters)  # stepped (bf16), no fp32 gradient kept
