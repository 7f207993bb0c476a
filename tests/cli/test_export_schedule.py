"""`planner export --to torchtitan` writes the plan's per-rank pipeline order as torch's compute-only schedule CSV
and names it with --parallelism.pipeline_parallel_schedule_csv; torch's own parser and pipeline runtime read it back
as the plan (cells, stage -> rank), and --check says in one sentence where a CSV differs."""
from __future__ import annotations

import csv
import importlib.util
import re

import pytest
from typer.testing import CliRunner

from passes.errors import UserError
from planner.api import make_plan
from planner.cli import app
from planner.export import check_schedule_csv, placement, to_megatron, to_torchtitan
from planner.plan import inconsistency, save_plan
from planner.schedules import SCHEDULES
from planner.search import Pins
from tests.conftest import EXAMPLES

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None,
                                reason="torchtitan is not installed (pip install -e '.[engines]')")
TITAN = {"module": "llama3", "config": "llama3_debugmodel"}  # torchtitan ships no GPT: name a model
DEBUGMODEL = {"layers": 6, "hidden": 256, "heads": 16}
"""A GPT of llama3_debugmodel's depth and width (--check compares them with the plan's)."""


def _plan(**pins):
    return make_plan(str(EXAMPLES / "gpt.py"), gpus=8, global_batch=16, target="h100-sxm", model_args=DEBUGMODEL,
                     pins=Pins(**pins))[0]


@pytest.fixture(scope="module")
def plans():
    return {"1f1b": _plan(tp=2, pp=4, b=1, schedule="1f1b"),
            "interleaved": _plan(tp=2, pp=4, v=2, b=1, schedule="interleaved"),
            "two_ranks": _plan(tp=2, pp=2, v=2, b=1, dp=2, schedule="interleaved"),
            "flat": _plan(pp=1)}


def _compute(acts: list[str]) -> list[str]:
    """The plan's compute actions, told apart from communication and fxplanner's own actions by name."""
    return [a for a in acts if "SEND" not in a and "RECV" not in a and a not in ("ALLREDUCE", "OPT")
            and not a.startswith("BUBBLE")]


def _rows(path) -> list[list[str]]:
    with open(path, newline="") as f:
        return list(csv.reader(f))


def _export(plan, tmp_path, *extra: str):
    save_plan(plan, tmp_path / "plan.json")
    return CliRunner().invoke(app, ["export", str(tmp_path / "plan.json"), "--to", "torchtitan", "--titan-module",
                                    TITAN["module"], "--titan-config", TITAN["config"], *extra])


@pytest.mark.parametrize("name", ["1f1b", "interleaved"])
def test_the_schedule_csv_holds_the_plans_compute_actions_and_torch_loads_it_as_planned(plans, name, tmp_path):
    from torch.distributed.pipelining.schedules import _Action, _validate_schedule

    plan = plans[name]
    c = plan.config
    res = _export(plan, tmp_path, "-o", str(tmp_path / "job.sh"), "--check")
    assert res.exit_code == 0, res.output
    path = tmp_path / "job.schedule.csv"
    assert str(path) in res.output and "schedule_csv=" in res.output
    rows = _rows(path)
    assert rows == [_compute(acts) for acts in plan.actions]
    assert sum(map(len, rows)) == 2 * c.pp * c.vp * c.microbatches  # one F and one B per stage and microbatch
    actions = {r: [_Action.from_str(cell) for cell in row] for r, row in enumerate(rows)}
    assert all(repr(a) == cell and a.is_compute_op for r, row in enumerate(rows) for a, cell in zip(actions[r], row))
    planned = {s.stage: s.rank for s in plan.partition}
    assert _validate_schedule(actions, c.pp, c.pp * c.vp, c.microbatches) == planned
    schedule = {"1f1b": "1F1B", "interleaved": "Interleaved1F1B"}[name]
    assert check_schedule_csv(plan, path, schedule) == planned  # torch's _PipelineScheduleRuntime._load_csv
    text = (tmp_path / "job.sh").read_text()
    assert '--parallelism.pipeline_parallel_schedule_csv "$(dirname "$0")"/job.schedule.csv' in text
    assert f"--parallelism.pipeline_parallel_schedule {schedule}" in text


def test_without_o_the_csv_is_named_after_the_plan_and_the_toml_job_names_it_too(plans, tmp_path):
    import tomllib

    res = _export(plans["interleaved"], tmp_path)
    assert res.exit_code == 0, res.output
    assert (tmp_path / "plan.schedule.csv").is_file() and str(tmp_path / "plan.schedule.csv") in res.output
    res = _export(plans["interleaved"], tmp_path, "--toml", "-o", str(tmp_path / "job.toml"))
    assert res.exit_code == 0, res.output
    par = tomllib.loads((tmp_path / "job.toml").read_text())["parallelism"]
    assert par["pipeline_parallel_schedule_csv"] == str(tmp_path / "job.schedule.csv")
    assert _rows(tmp_path / "job.schedule.csv") == _rows(tmp_path / "plan.schedule.csv")


def test_a_plan_without_pipelining_writes_no_csv(plans, tmp_path):
    ex = to_torchtitan(plans["flat"], **TITAN)
    assert ex.files == {} and not any("schedule_csv" in a for a in ex.argv)
    res = _export(plans["flat"], tmp_path, "-o", str(tmp_path / "job.sh"))
    assert res.exit_code == 0 and not (tmp_path / "job.schedule.csv").exists()


def test_module_names_are_torchtitans_own_per_version(plans):
    """torchtitan 0.3 calls the output layer lm_head (its own split names it so); 0.1-0.2 called it output."""
    import tomllib

    from torchtitan.distributed.pipeline_parallel import _generate_llm_fqn_per_model_part

    plan = plans["interleaved"]
    ex = to_torchtitan(plan, **TITAN)
    i = ex.argv.index("--parallelism.module_fqns_per_model_part")
    parts = [part.split(",") for part in ex.argv[i + 1:i + 1 + len(plan.partition)]]
    layers = plan.source.model_shape["layers"]
    assert {n for p in parts for n in p} == {n for p in _generate_llm_fqn_per_model_part(len(parts), layers) for n in p}
    toml = tomllib.loads(to_torchtitan(plan, toml=True, **{"module": "llama3", "config": "8B"}).text)
    assert toml["parallelism"]["module_fqns_per_model_part"][-1][-2:] == ["norm", "output"]


def _with_rows(plan, rows):
    """The plan with its compute actions replaced (communication dropped: the exporter and torch read only these)."""
    return plan.model_copy(update={"actions": rows})


def test_check_names_the_rank_and_cell_where_the_csv_differs_from_the_plan(plans, tmp_path):
    plan = plans["1f1b"]
    rows = [_compute(acts) for acts in plan.actions]
    path = tmp_path / "s.csv"
    tampered = [list(r) for r in rows]
    tampered[1][0], tampered[1][1] = tampered[1][1], tampered[1][0]
    path.write_text("".join(",".join(r) + "\n" for r in tampered))
    with pytest.raises(UserError, match=r"rank 1, cell 0: torch reads 1F1 where the plan has 1F0"):
        check_schedule_csv(plan, path, "1F1B")
    path.write_text("".join(",".join(r) + "\n" for r in rows))
    with pytest.raises(UserError, match=r"torchtitan builds stages \[0, 7\] on rank 0 under pipeline_parallel_schedule "
                                        r"ZBVZeroBubble"):
        check_schedule_csv(plans["interleaved"], _write(tmp_path, plans["interleaved"]), "ZBVZeroBubble")
    # an order the plan's own validator would refuse, as torch refuses it: a backward before its forward ...
    early = [list(r) for r in rows]
    early[0].insert(0, early[0].pop(early[0].index("0B0")))
    with pytest.raises(UserError, match=r"refuses the schedule CSV .*: Rank 0, step 0: Running Full Backward for "
                                        r"stage 0, microbatch 0 without first running Forward"):
        check_schedule_csv(_with_rows(plan, early), _write(tmp_path, _with_rows(plan, early)), "1F1B")
    # ... and a cycle between ranks: rank 0 waits for 1B0 before sending 0F1, rank 1 wants 1F1 first
    cycle = [list(r) for r in rows]
    cycle[0].insert(1, cycle[0].pop(cycle[0].index("0B0")))
    cycle[1].insert(0, cycle[1].pop(cycle[1].index("1F1")))
    with pytest.raises(UserError, match=r"cannot lower .* rank 0, cell 1 \(0B0\) waits"):
        check_schedule_csv(_with_rows(plan, cycle), _write(tmp_path, _with_rows(plan, cycle)), "1F1B")


def _write(tmp_path, plan):
    ex = to_torchtitan(plan, schedule_csv=str(tmp_path / "x.csv"), **TITAN)
    for name, text in ex.files.items():
        (tmp_path / name).write_text(text)
    return tmp_path / "x.csv"


def _v_plan(plan):
    """A hand-made V placement (rank r holds stages r and 2p-1-r) of a p=2, v=2 plan over 2 microbatches, with a
    dependency-respecting order: the exporter's V path, which no schedule kind plans yet."""
    c = plan.config.model_copy(update={"microbatches": 2})
    rows = [["0F0", "0F1", "3F0", "3B0", "3F1", "3B1", "0B0", "0B1"],
            ["1F0", "1F1", "2F0", "2F1", "2B0", "2B1", "1B0", "1B1"]]
    partition = [s.model_copy(update={"rank": min(s.stage, 3 - s.stage)}) for s in plan.partition]
    return plan.model_copy(update={"config": c, "partition": partition, "actions": rows})


def test_a_v_placement_runs_under_a_v_schedule_name_and_megatron_says_it_cannot(plans, tmp_path):
    plan = _v_plan(plans["two_ranks"])
    assert placement(plan) == "v"
    ex = to_torchtitan(plan, schedule_csv=str(tmp_path / "v.csv"), **TITAN)
    assert ex.argv[ex.argv.index("--parallelism.pipeline_parallel_schedule") + 1] == "ZBVZeroBubble"
    (tmp_path / "v.csv").write_text(ex.files[str(tmp_path / "v.csv")])
    assert check_schedule_csv(plan, tmp_path / "v.csv", "ZBVZeroBubble") == {0: 0, 1: 1, 2: 1, 3: 0}
    note = [u for u in to_megatron(plan).unexpressed if "V" in u]
    assert len(note) == 1 and "virtual stage k on rank k % p" in note[0]


def test_megatron_says_in_one_line_that_it_cannot_split_backwards(plans):
    plan = plans["1f1b"]
    zb = plan.model_copy(update={"config": plan.config.model_copy(update={"schedule": "zbh1"})})
    ex = to_megatron(zb)
    note = [u for u in ex.unexpressed if "input- and weight-gradient" in u]
    assert len(note) == 1 and "exported as 1F1B" in note[0] and "delay_wgrad_compute" in note[0]
    assert note[0] in ex.text.split("set -euo")[0]
    assert not any("weight-gradient" in u for u in to_megatron(plan).unexpressed)


def _split(rows: list[list[str]]) -> list[list[str]]:
    """Each backward kBm as its input-gradient half kIm then its weight-gradient half kWm."""
    return [[x for a in row for x in ((a.replace("B", "I"), a.replace("B", "W")) if re.fullmatch(r"\d+B\d+", a)
                                      else (a,))] for row in rows]


def test_split_backwards_are_exported_as_i_and_w_cells_torch_runs(plans, tmp_path):
    plan = plans["1f1b"]
    split = plan.model_copy(update={"actions": _split(plan.actions)})
    if inconsistency(split) is not None:
        pytest.skip("the plan loader does not take I/W actions yet (planner.schedule_ir)")
    path = _write(tmp_path, split)
    assert _rows(path) == _split([_compute(acts) for acts in plan.actions])
    assert check_schedule_csv(split, path, "1F1B") == {s.stage: s.rank for s in plan.partition}
    assert any("input- and weight-gradient" in u for u in to_megatron(split).unexpressed)


@pytest.mark.parametrize("kind", ["zbh1", "zbv"])
def test_a_zero_bubble_plan_exports_its_own_order(kind, tmp_path):
    if kind not in SCHEDULES:
        pytest.skip(f"no {kind} schedule kind registered (planner.schedules) yet")
    plan = _plan(tp=2, pp=4, b=1, schedule=kind, **({"v": 2} if kind == "zbv" else {}))
    res = _export(plan, tmp_path, "-o", str(tmp_path / "job.sh"), "--check")
    assert res.exit_code == 0, res.output
    rows = _rows(tmp_path / "job.schedule.csv")
    assert rows == [_compute(acts) for acts in plan.actions] and any("W" in cell for row in rows for cell in row)
    name = {"zbh1": "1F1B", "zbv": "ZBVZeroBubble"}[kind]  # the placement torchtitan builds: loop, or V
    assert f"--parallelism.pipeline_parallel_schedule {name}" in (tmp_path / "job.sh").read_text()
    assert placement(plan) == ("v" if kind == "zbv" else "loop")
    note = [u for u in to_megatron(plan).unexpressed if "Megatron-Core" in u]
    assert len(note) == 1 and "input- and weight-gradient" in note[0] and ("in a V" in note[0]) == (kind == "zbv")

def _run_rank(rank: int, path: str, schedule: str, stages: int, m: int, init: str) -> None:
    """One pipeline rank: the stages torchtitan builds there (tiny linears), torch's runtime running the CSV over
    gloo, and its gradients against the same chain run without pipelining."""
    import copy

    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime
    from torchtitan.distributed.pipeline_parallel import _get_pp_rank_to_stage_indices_mapping

    p = len(_rows(path))
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=p)
    try:
        torch.manual_seed(0)
        chain = [torch.nn.Linear(4, 4) for _ in range(stages)]
        x, target = torch.randn(m, 4), torch.randn(m, 4)
        ref = copy.deepcopy(chain)
        mine = _get_pp_rank_to_stage_indices_mapping(rank, p, schedule, stages)
        runtime = _PipelineScheduleRuntime(
            [PipelineStage(chain[k], k, stages, torch.device("cpu"), group=dist.group.WORLD) for k in mine],
            n_microbatches=m, loss_fn=lambda y, t: ((y - t) ** 2).mean(), scale_grads=False)
        runtime._load_csv(path)
        runtime.step(*((x,) if 0 in mine else ()), **({"target": target} if stages - 1 in mine else {}))
        y = x
        for layer in ref:
            y = layer(y)
        ((y - target) ** 2).mean(dim=1).sum().backward()  # per microbatch (one row each) the mean, summed
        for k in mine:
            torch.testing.assert_close(chain[k].weight.grad, ref[k].weight.grad)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["interleaved", "zbv"])
def test_torchs_runtime_runs_the_exported_order_over_gloo(plans, kind, tmp_path):
    """The plan's CSV, run by torch's _PipelineScheduleRuntime on the stages torchtitan builds per rank under the
    exported schedule name (two CPU processes), trains as the unpipelined chain does."""
    import torch.multiprocessing as mp

    if kind not in SCHEDULES:
        pytest.skip(f"no {kind} schedule kind registered (planner.schedules) yet")
    plan = plans["two_ranks"] if kind == "interleaved" else _plan(tp=2, pp=2, v=2, b=1, dp=2, schedule=kind)
    c = plan.config
    ex = to_torchtitan(plan, schedule_csv=str(tmp_path / "x.csv"), **TITAN)
    (tmp_path / "x.csv").write_text(ex.files[str(tmp_path / "x.csv")])
    schedule = ex.argv[ex.argv.index("--parallelism.pipeline_parallel_schedule") + 1]
    mp.spawn(_run_rank, args=(str(tmp_path / "x.csv"), schedule, c.pp * c.vp, c.microbatches,
                              f"file://{tmp_path}/rdzv"), nprocs=c.pp)
