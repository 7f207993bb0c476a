"""The rehearsal's and the one-GPU launch's CUDA paths, on a GPU (skipped without one): the spinning receive, the
ready event a bubble hands the fill executor, the fill memory cap, per-step peak memory, NCCL at world size 1."""
from __future__ import annotations

import time

import pytest
import torch

from planner.api import make_plan
from planner.fill.spec import FillJobSpec, FillSpec, Work
from planner.plan import save_plan
from planner.runtime import launch_local
from planner.runtime.rehearse import RehearseOptions, _Hold, rehearse
from planner.search import Pins

from ._util import GPT, ROOT, gpt_args, plan_file

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CPU_TARGET = ROOT / "examples" / "targets" / "cpu-core.yaml"
MLP = ROOT / "examples" / "mlp.py"


def test_a_receive_spins_the_gpu_until_it_arrives():
    hold = _Hold(cuda=True)
    hold.cycles_per_s()  # timed once, outside the wait
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    start.record()
    hold.until(t0 + 0.05)
    end.record()
    end.synchronize()
    assert time.perf_counter() - t0 >= 0.05 * 0.98  # the host waited for the spin, as it waits for a receive
    assert start.elapsed_time(end) / 1e3 >= 0.05 * 0.8  # and the GPU was held for (nearly) all of it


def test_a_one_gpu_plan_launches_locally_on_nccl(tmp_path):
    path = tmp_path / "plan.json"
    plan_file(path, GPT, gpt_args(2), gpus=1, global_batch=4, t=1, p=1, d=1, b=2, v=1, schedule="1f1b",
              precision="bf16")
    run = launch_local(path, steps=2, fill=False, on_line=lambda _: None)
    assert run.returncode == 0 and run.metrics is not None
    entry = run.metrics.runs[0]
    assert entry.device.startswith("cuda") and entry.world == 1
    assert all(s.peak_memory_bytes for s in entry.ranks[0].steps)


def test_rehearsal_on_the_gpu_spins_its_receives_and_caps_its_fill(tmp_path):
    """A plan priced for a CPU core (bubbles of milliseconds) rehearsed on the GPU: its peers replayed at the plan's
    speed, the rank's own stage at the GPU's; every bubble handed to the fill executor behind a ready event, the fill
    job capped at the bubble's free memory."""
    job = FillJobSpec(name="mlp", model=str(MLP), model_args={"features": 32, "width": 64, "depth": 2},
                      kind="train", batch_sizes=[8], work=Work(iterations=100_000))
    plan, _ = make_plan(str(GPT), gpus=2, global_batch=16, target=str(CPU_TARGET), gpus_per_node=2,
                        model_args={**gpt_args(2), "hidden": 256, "seq": 128}, fill=FillSpec(jobs=[job]),
                        pins=Pins(tp=1, pp=2, dp=1, b=2, v=1, schedule="gpipe", recompute="none", precision="bf16"))
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    rank = next(c.rank for c in plan.fill.chunks)
    report = rehearse(path, RehearseOptions(rank=rank, steps=4, compare_no_fill=True, device="cuda:0"),
                      log=lambda _: None)
    mem = report["memory"]
    assert mem["allocated_peak_bytes"] > 0 and mem["reserved_peak_bytes"] >= mem["allocated_peak_bytes"]
    assert all(run["in_plan_order"] for run in report["runs"])
    fill_run = report["metrics"].runs[0]
    rep = fill_run.ranks[0].fill_report
    assert rep is not None and not rep.errors
    steps = 0
    for occ in rep.bubbles:
        assert occ.gpu_idle >= occ.main_begin  # the executor started when the ready event fired, not before
        for s in occ.steps:
            assert occ.main_begin <= s.start <= s.end <= occ.main_end + rep.grace_s
            assert s.allocated_bytes is None or s.allocated_bytes <= occ.free_bytes  # the memory cap held
        steps += len(occ.steps)
    assert steps > 0
