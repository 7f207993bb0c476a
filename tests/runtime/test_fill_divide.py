"""A fill job's work divided, not repeated, and a rank's jobs run in their turns, under real torchrun on CPU.

One launch of 4 ranks (p=2, d=2, GPipe, a tiny GPT) runs three plans in turn, each with the planner's own fill
section:
- an inference job: its batches are split between the two pipeline ranks (by their rates) and, on each, between
  the two replicas; the batches the four GPUs ran are disjoint and together are the job's batches, each once;
- a training job: the planner places it on one stage, data parallel over that stage's two GPUs; the replicas ran
  disjoint batches, took the same steps (equal weights) and end where one process training on both batches of
  every step ends;
- three inference jobs of 12, 4 and 8 batches on every rank, SJF: each GPU runs them shortest first, one at a time;
- the training job under the fill configurations (the planner's choice, optimizer offload, and activation
  checkpointing): the same weights both times, checkpointing keeps fewer bytes for the backward than the plain
  units do, offload steps host copies.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from passes.load import load_model_file
from planner.api import make_plan
from planner.fill.spec import FillJobSpec, FillSpec, Work
from planner.metrics import FillReport, RunEntry, load_metrics
from planner.plan import Plan, save_plan
from planner.runtime.fill_executor import TaskOptions
from planner.runtime.fill_task import UnitRunner
from planner.search import Pins

from ._util import GPT, ROOT, torchrun

pytestmark = pytest.mark.multiprocess

STEPS = 12
MLP = ROOT / "examples" / "mlp.py"
MLP_ARGS = {"features": 32, "width": 64, "depth": 2}
CPU_TARGET = ROOT / "examples" / "targets" / "cpu-core.yaml"
BATCH = 8
GRACE_S = 0.3
"""12 processes on 2 cores: a unit may be descheduled for a while; a killed replica would end its DP job."""
MAIN_ARGS = {"preset": "tiny", "layers": 4, "hidden": 256, "seq": 64, "dropout": 0}
"""Stages of ~10 ms per microbatch on a CPU core: bubbles long enough for a few MLP units each."""
PLANS = ("infer", "train", "three", "train-checkpoint", "stream")
CONFIGS = {"train": "offload", "train-checkpoint": "checkpoint"}


def _job(name: str, kind: str, batches: int) -> FillJobSpec:
    return FillJobSpec(name=name, model=str(MLP), model_args=MLP_ARGS, kind=kind, batch_sizes=[BATCH],
                       work=Work(iterations=batches))


def _plan(*jobs: FillJobSpec) -> Plan:
    plan, _ = make_plan(str(GPT), gpus=4, global_batch=16, target=str(CPU_TARGET), gpus_per_node=4,
                        model_args=MAIN_ARGS, fill=FillSpec(jobs=list(jobs), policy="sjf", gpu_sharing="none"),
                        pins=Pins(tp=1, pp=2, dp=2, b=2, v=1, schedule="gpipe", recompute="none", precision="fp32"))
    return plan


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("fill_divide")
    plans = {"infer": _plan(_job("infer", "infer", 12)),
             "train": _plan(_job("train", "train", 4)),
             "three": _plan(_job("big", "infer", 12), _job("small", "infer", 4), _job("mid", "infer", 8))}
    for name, config in CONFIGS.items():  # the planned training job, run under each configuration (PipeFill 4.3)
        job = plans["train"].fill.jobs[0].model_copy(update={"config": config})
        plans[name] = plans["train"].model_copy(update={"fill": plans["train"].fill.model_copy(update={"jobs": [job]})})
    infer = plans["infer"].fill.jobs[0]  # the inference job streamed in per bubble (PipeSwitch), two groups
    streamed = infer.model_copy(update={"resident": False, "load_groups": [[0, 2], [2, len(infer.units)]]})
    plans["stream"] = plans["infer"].model_copy(update={"fill": plans["infer"].fill.model_copy(
        update={"jobs": [streamed]})})
    for name, plan in plans.items():
        save_plan(plan, tmp / f"{name}.json")
    for _ in range(3):  # again when a loaded 2-core machine measured a GPU's bubbles too short for any unit,
        # or descheduled a step past its grace period (a killed replica ends its data-parallel job)
        proc = torchrun(4, [*(str(tmp / f"{n}.json") for n in PLANS), "--steps", str(STEPS), "--fill-grace",
                            str(GRACE_S), "--metrics", str(tmp / "metrics.json")], cwd=tmp, timeout=420)
        assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
        runs = dict(zip(PLANS, load_metrics(tmp / "metrics.json").runs))
        if all(j.stop_reason == "done" for entry in runs.values() for _, rep in _reports(entry) for j in rep.jobs):
            break
    return {"plans": plans, "runs": runs}


def _reports(entry: RunEntry) -> list[tuple[int, FillReport]]:
    return [(r.rank, r.fill_report) for r in entry.ranks if r.fill_report is not None]


def _batches(report: FillReport, job: str) -> list[int]:
    """The job's batches this GPU completed, from its steps."""
    return [s.batch for b in report.bubbles for s in b.steps if s.job == job and s.batch is not None]


def test_the_plan_counts_each_batch_once(run: dict) -> None:
    infer = run["plans"]["infer"].fill.jobs[0]
    assert {s.rank for s in infer.shards} == {0, 1}
    covered = [i for s in infer.shards for i in range(s.first_batch, s.first_batch + s.batches)]
    assert sorted(covered) == list(range(infer.iterations)) == list(range(12))
    (train,) = run["plans"]["train"].fill.jobs[0].shards
    assert (train.first_batch, train.batches) == (0, 4)  # one stage, its 2 GPUs each take 2 steps


@pytest.mark.parametrize("name", ["infer", "stream"])
def test_inference_replicas_did_disjoint_work_summing_to_the_job(run: dict, name: str) -> None:
    reports = _reports(run["runs"][name])
    assert len(reports) == 4, "every GPU of both stages runs a share"
    done = {rank: _batches(rep, rep.jobs[0].name) for rank, rep in reports}
    every = [b for batches in done.values() for b in batches]
    assert len(every) == len(set(every)), f"a batch ran twice: {done}"
    assert sorted(every) == list(range(12)), done
    for _, rep in reports:
        (job,) = rep.jobs
        assert job.stop_reason == "done" and job.samples_done == BATCH * job.planned_iterations
        assert job.batch_stride == rep.replicas == 2
        assert all((b - job.batch_first) % job.batch_stride == 0 for b in _batches(rep, job.name))


def _reference_checksum(steps: int, replicas: int) -> float:
    """One process, each step on the replicas' batches with their gradients averaged, AdamW(lr=1e-4) as the
    fill task builds it for a model file without build_optimizer."""
    mf = load_model_file(MLP, MLP_ARGS)
    torch.manual_seed(0)
    net = mf.build("cpu")
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        for k in range(replicas):
            inputs, targets = mf.call("sample_batch", BATCH, step * replicas + k)
            (mf.module.loss_fn(net(*inputs), targets) / replicas).backward()
        opt.step()
    return float(sum(p.detach().double().sum() for p in net.parameters()))


@pytest.mark.parametrize("name", CONFIGS)
def test_training_replicas_are_data_parallel(run: dict, name: str) -> None:
    reports = [rep for _, rep in _reports(run["runs"][name])]
    assert len(reports) == 2, "one stage's two GPUs run the training job"
    jobs = [rep.jobs[0] for rep in reports]
    assert all(j.dp_size == 2 for j in jobs), jobs
    assert [(j.stop_reason, j.iterations_done) for j in jobs] == [("done", 2)] * 2, jobs
    done = [_batches(rep, jobs[0].name) for rep in reports]
    assert sorted(done[0] + done[1]) == list(range(4)) and not set(done[0]) & set(done[1])
    assert jobs[0].checksum == pytest.approx(jobs[1].checksum, rel=1e-9)
    assert jobs[0].checksum == pytest.approx(_reference_checksum(2, 2), rel=1e-5)


def test_three_jobs_run_in_their_sjf_turns(run: dict) -> None:
    plan = run["plans"]["three"]
    order = {r: [j.name for j in sorted((j for j in plan.fill.jobs for s in j.shards if s.rank == r),
                                         key=lambda j: next(s.start_s for s in j.shards if s.rank == r))]
             for r in range(2)}
    assert all([n.split("@")[0] for n in names] == ["small", "mid", "big"] for names in order.values()), order
    for rank, rep in _reports(run["runs"]["three"]):
        here = {j.name for j in rep.jobs}  # a GPU whose share of a job is empty has no task for it
        expected = [n for n in order[rep.pipeline_rank] if n in here]
        assert [t.job for t in rep.turns] == expected, (rank, rep.turns)
        stops = {t.job: t.t for t in rep.transitions if t.transition == "StopSideTask"}
        steps = {j: [s for b in rep.bubbles for s in b.steps if s.job == j] for j in expected}
        for before, after in zip(expected, expected[1:]):  # each ran only after the one before it was done
            assert all(s.start >= stops[before] for s in steps[after]), (rank, before, after)
        assert all(j.stop_reason == "done" for j in rep.jobs), [(j.name, j.stop_reason, j.error) for j in rep.jobs]


@pytest.mark.parametrize("name", PLANS)
def test_no_step_runs_past_its_bubble_by_more_than_the_grace_period(run: dict, name: str) -> None:
    """From the metrics: every unit a fill job ran started inside its bubble and ended before the main job's
    resume plus the grace period (a later one would have been killed, and a kill is recorded)."""
    for rank, rep in _reports(run["runs"][name]):
        assert rep.kills == [] and rep.errors == [], (rank, rep.kills, rep.errors)
        for occ in rep.bubbles:
            for s in occ.steps:
                assert occ.gpu_idle <= s.start <= s.end <= occ.main_end + rep.grace_s, (rank, occ.bubble_id, s)


def _train_job(run: dict, name: str):
    return [rep.jobs[0] for _, rep in _reports(run["runs"][name])]


def _plain_run(job) -> UnitRunner:
    """The job's units run plain in this process for one iteration: the baseline of what each keeps."""
    plain = job.model_copy(update={"config": "plain", "resident": True, "load_groups": []})
    runner = UnitRunner(plain, TaskOptions(device="cpu", interface="iterative", iterations=None))
    while not runner.step():
        pass
    return runner


def test_fill_configurations_run_as_priced(run: dict) -> None:
    ckpt, offload = (_train_job(run, n) for n in ("train-checkpoint", "train"))
    assert {j.config for j in ckpt} == {"checkpoint"} and {j.config for j in offload} == {"offload"}
    plain = _plain_run(run["plans"]["train-checkpoint"].fill.jobs[0])
    blocks = [u for u in plain.saved_bytes if "blocks" in u]
    for c in ckpt:  # block units keep only their inputs; the others what they keep when run plain
        assert blocks and all(c.saved_bytes[u] < plain.saved_bytes[u] for u in blocks), (plain.saved_bytes, c)
        assert all(c.saved_bytes[u] == plain.saved_bytes[u] for u in plain.saved_bytes if u not in blocks)
        assert c.optimizer_on == "cpu" and c.optimizer_steps_module_weights and c.optimizer_state_bytes > 0
    state = plain.optimizer_state()
    assert state["optimizer_steps_module_weights"] and state["optimizer_state_bytes"] > 0
    for j in offload:  # Adam's state in host memory, over host copies of the weights
        assert j.optimizer_on == "host" and not j.optimizer_steps_module_weights and j.optimizer_state_bytes > 0


def test_streamed_inference_job_is_loaded_by_groups(run: dict) -> None:
    """PipeSwitch: a job that is not resident loads its weights group by group in each bubble it runs in, the
    second group's transfer started while the first computes; all its weights come in, each group's once per
    load; the first group's load is exposed, never a prefetch."""
    mf = load_model_file(MLP, MLP_ARGS)
    total = sum(p.nbytes for p in mf.build("cpu").parameters())
    prefetches = 0
    for rank, rep in _reports(run["runs"]["stream"]):
        (job,) = rep.jobs
        assert not job.resident and job.loads and job.loads_total >= len(job.loads), (rank, job)
        size = {ld.group: ld.bytes for ld in job.loads}
        assert sorted(size) == [0, 1] and sum(size.values()) == total, (rank, size)
        assert all(ld.bytes == size[ld.group] and ld.start <= ld.end for ld in job.loads)
        assert not any(ld.prefetched for ld in job.loads if ld.group == 0)
        for ld in job.loads:  # every transfer happened inside a bubble (bounded by its resume + grace)
            assert any(o.gpu_idle <= ld.start and ld.end <= o.main_end + rep.grace_s for o in rep.bubbles), ld
            assert 0 <= ld.overlap_s <= ld.end - ld.start + 1e-6
        prefetches += sum(ld.prefetched for ld in job.loads)
    assert prefetches > 0
