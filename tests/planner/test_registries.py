"""Schedules, recompute modes and fill packers are registries: a new schedule kind is one module
(here: one object) and it plans, round-trips through the plan file and passes the runtime's checks."""
from __future__ import annotations

import pytest
from typer.testing import CliRunner

from costmodels.precision import PRECISIONS
from costmodels.recompute import RECOMPUTE
from planner.api import make_plan
from planner.cli import app
from planner.fill.assign import PACKERS
from planner.plan import load_plan, plan_schedule, save_plan
from planner.runtime import check_plan
from planner.schedule_ir import Op, Schedule, check_shape, validate
from planner.schedules import SCHEDULES, ScheduleKind, register, unregister
from planner.schedules.gpipe import flush_analytic_s
from planner.search import Pins
from planner.simulate import SimCosts, simulate
from tests.conftest import EXAMPLES


def _lifo(p: int, m: int, v: int = 1) -> list[list[tuple[Op, int, int]]]:
    """GPipe with the backwards in reverse microbatch order (last in, first out): a compute-only program."""
    check_shape(p, m)
    return [[(Op.F, r, mb) for mb in range(m)] + [(Op.B, r, mb) for mb in reversed(range(m))] for r in range(p)]


LIFO = ScheduleKind(name="lifo", help="all forwards, then the backwards last microbatch first", compute=_lifo,
                    inflight=lambda p, v, m, rank: float(m), analytic_s=flush_analytic_s,
                    check=lambda p, v, m: None if v == 1 else "lifo runs one model chunk per rank",
                    v_choices=lambda p, max_v: (1,))


@pytest.fixture
def lifo():
    register(LIFO)
    yield LIFO
    unregister("lifo")


def test_a_schedule_added_through_the_registry_alone_plans_and_runs_the_checks(lifo, tmp_path) -> None:
    path = tmp_path / "plan.json"
    plan, result = make_plan(str(EXAMPLES / "gpt.py"), gpus=4, global_batch=16, target="a100-80gb",
                             gpus_per_node=4, model_args={"preset": "tiny", "layers": 4}, plan_path=str(path),
                             pins=Pins(pp=4, schedule="lifo", recompute="none"))
    assert plan.config.schedule == "lifo" and result.best.config.schedule == "lifo"
    save_plan(plan, path)
    loaded = load_plan(path)  # the plan file's config check reads the registry
    sched = plan_schedule(loaded)
    validate(sched)
    last = [a for a in sched.ranks[0] if a.op is Op.B]
    assert [a.mb for a in last] == list(reversed(range(plan.config.microbatches)))
    assert check_plan(path, 4).plan.config.schedule == "lifo"  # what every runtime rank checks
    # the toy kind's timeline equals GPipe's for uniform stages: same work, mirrored order
    costs = SimCosts(forward_s=(1.0,) * 4, backward_s=(2.0,) * 4, p2p_s=0.0, allreduce_s=(0.0,) * 4,
                     optimizer_s=(0.0,) * 4, static_bytes=(0,) * 4, activation_bytes=(1,) * 4, capacity_bytes=10)
    m = 6
    assert simulate(LIFO.generate(4, m), costs).iteration_s == simulate(SCHEDULES["gpipe"].generate(4, m, 1), costs).iteration_s
    res = CliRunner().invoke(app, ["plan", str(EXAMPLES / "gpt.py"), "--gpus", "4", "--gpus-per-node", "4",
                                   "--model-arg", "preset=tiny", "--model-arg", "layers=4", "--pp", "4",
                                   "--schedule", "lifo", "-B", "16", "-o", str(tmp_path / "cli.json")])
    assert res.exit_code == 0, res.stdout
    assert load_plan(tmp_path / "cli.json").config.schedule == "lifo"


def test_unregistered_schedule_is_refused_everywhere() -> None:
    assert "lifo" not in SCHEDULES
    with pytest.raises(ValueError, match="unknown schedule kind 'lifo'"):
        Schedule(kind="lifo", p=1, v=1, m=1, ranks=((),))
    res = CliRunner().invoke(app, ["plan", str(EXAMPLES / "gpt.py"), "--gpus", "4", "--schedule", "lifo"])
    assert res.exit_code != 0 and "--schedule must be one of gpipe, 1f1b, interleaved, zbh1, zbv" in res.stdout + (res.stderr or "")


def test_cli_choices_come_from_the_registries() -> None:
    res = CliRunner().invoke(app, ["plan", "--help"], env={"COLUMNS": "400"})
    text = " ".join(res.stdout.split())
    for registry in (SCHEDULES, RECOMPUTE, PACKERS, PRECISIONS):
        assert ", ".join(registry) in text, (list(registry), text)


def test_every_recompute_mode_keeps_no_more_than_none() -> None:
    from passes.pipeline import analyze

    prof, _ = analyze(EXAMPLES / "gpt.py", {"preset": "tiny", "layers": 2})
    for u in prof.units:
        plain = RECOMPUTE["none"].kept_bytes(u, 4, 1)
        for mode in RECOMPUTE.values():
            assert 0 <= mode.kept_bytes(u, 4, 1) <= plain, (mode.name, u.name)


TOY_KIND = """
from planner.schedule_ir import Op, check_shape
from planner.schedules import ScheduleKind, register
from planner.schedules.gpipe import flush_analytic_s


def _compute(p, m, v=1):
    check_shape(p, m)
    return [[(Op.F, r, mb) for mb in range(m)] + [(Op.B, r, mb) for mb in reversed(range(m))] for r in range(p)]


register(ScheduleKind(name="toylifo", help="GPipe, backwards last in first out", compute=_compute,
                      inflight=lambda p, v, m, rank: float(m), analytic_s=flush_analytic_s,
                      check=lambda p, v, m: None if v == 1 else "one chunk per rank", v_choices=lambda p, max_v: (1,)))
"""


@pytest.mark.multiprocess
def test_a_kind_outside_the_tree_plans_and_runs_under_torchrun(tmp_path, monkeypatch) -> None:
    """A kind in a module of its own, named in FXPLANNER_SCHEDULES: the planner plans it and every torchrun rank
    (which imports the registry afresh) runs it, training as one process does."""
    import importlib
    import sys

    from planner.metrics import load_metrics
    from tests.runtime._util import GPT, gpt_args, plan_file, reference, torchrun

    (tmp_path / "toy_kind.py").write_text(TOY_KIND)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("FXPLANNER_SCHEDULES", "toy_kind")
    importlib.import_module("toy_kind")
    try:
        plan_file(tmp_path / "toy.json", GPT, gpt_args(), gpus=2, global_batch=4, t=1, p=2, d=1, b=1, v=1,
                  schedule="toylifo")
        proc = torchrun(2, [str(tmp_path / "toy.json"), "--steps", "2", "--optimizer", "sgd", "--lr", "0.1",
                            "--no-fill", "--metrics", str(tmp_path / "m.json")], cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        got = load_metrics(tmp_path / "m.json").runs[0].loss
    finally:
        unregister("toylifo")
        sys.modules.pop("toy_kind", None)
    want = reference(GPT, gpt_args(), global_batch=4, steps=2, optimizer="sgd", lr=0.1)["loss"]
    assert got == pytest.approx(want, rel=1e-5)
