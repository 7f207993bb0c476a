"""The fill mechanisms' CUDA paths, on a GPU (skipped without one): the main job's optimizer state offloaded to
pinned host memory on a side stream and back (PipeFill 4.2), a fill job's weights streamed in by PipeSwitch's
groups on a side stream, and an offloaded fill job's optimizer on the host."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from planner.plan import FillJob
from planner.runtime.fill_executor import TaskOptions
from planner.runtime.fill_task import UnitRunner
from planner.runtime.optim import GradSync

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MLP = str(Path(__file__).resolve().parents[2] / "examples" / "mlp.py")
ARGS = {"features": 256, "width": 1024, "depth": 4}


def _sync(net: nn.Module) -> GradSync:
    return GradSync(dict(net.named_parameters()), shared=(), dp_group=None, dp_size=1, dp_rank=0, zero=False,
                    overlap=False, optimizer="adam", lr=1e-3)


def test_offloaded_optimizer_state_lives_in_pinned_host_memory_and_the_steps_match():
    torch.manual_seed(0)
    nets = [nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512)).cuda() for _ in range(2)]
    nets[1].load_state_dict(nets[0].state_dict())
    plain, offloading = (_sync(n) for n in nets)
    x = torch.randn(64, 512, device="cuda")
    for step in range(4):
        moved = offloading.offload(1 << 40)
        state = [t for st in offloading.optimizer.state.values() for t in st.values() if t.dim()]
        if step:  # Adam's state exists from the first step on
            assert moved == sum(t.nbytes for t in state) > 0
            assert all(t.device.type == "cpu" and t.is_pinned() for t in state)
        for net in nets:
            net.zero_grad(set_to_none=True)
            net(x).square().mean().backward()
        offloading.restore()
        plain.step()
        offloading.step()
        assert all(t.is_cuda for st in offloading.optimizer.state.values() for t in st.values() if t.dim())
    torch.cuda.synchronize()
    for a, b in zip(nets[0].parameters(), nets[1].parameters()):
        assert torch.equal(a, b)


def _runner(kind: str = "infer", **job) -> UnitRunner:
    job = FillJob(name="mlp", model_file=MLP, model_sha256="", model_args=ARGS, kind=kind, batch_size=64,
                  units=[], unit_time_s=[], **{"config": "plain", "resident": True, **job})
    return UnitRunner(job, TaskOptions(device="cuda:0", interface="iterative", iterations=None))


def test_streamed_job_loads_its_groups_onto_the_gpu_and_leaves_with_the_bubble():
    streamed = _runner(resident=False, load_groups=((0, 3), (3, 6)))
    streamed.to_device()
    assert all(p.device.type == "cpu" and p.is_pinned() for p in streamed.module.parameters())
    while not streamed.step():
        pass
    assert all(p.is_cuda for p in streamed.module.parameters())
    loads = streamed.progress()["loads"]
    assert [(ld["group"], ld["prefetched"]) for ld in loads] == [(0, False), (1, True)]
    assert sum(ld["bytes"] for ld in loads) == sum(p.nbytes for p in streamed.module.parameters())
    streamed.unload()
    assert all(p.device.type == "cpu" and p.is_pinned() for p in streamed.module.parameters())
    resident = _runner()
    resident.to_device()
    x = torch.randn(8, ARGS["features"], device="cuda")
    with torch.no_grad():
        want = resident.module(x)
        streamed.streamer.ensure(0)
        streamed.streamer.ensure(3)
        got = streamed.module(x)
    assert torch.equal(got, want)


def test_offloaded_fill_training_keeps_its_optimizer_on_the_host():
    runner = _runner(kind="train", config="offload")
    runner.to_device()
    while not runner.step():
        pass
    state = runner.optimizer_state()
    assert state["optimizer_on"] == "host" and not state["optimizer_steps_module_weights"]
    assert state["optimizer_state_bytes"] > 0
    assert all(t.device.type == "cpu" for st in runner.optimizer.state.values() for t in st.values() if t.dim())
    assert all(p.is_cuda for p in runner.module.parameters())


def test_a_paired_jobs_release_hands_its_freed_activations_back_to_the_device():
    """Waterwave's allocator hand-off between two fill processes: after a deallocation group, a paired task empties
    its cache (fill_task._timed_step(release=True)), so what its backward freed is no longer reserved by its process
    and the partner's process can allocate it; the step reports the live bytes its hooks measured and CUDA's."""
    from planner.runtime.fill_task import _timed_step

    runner = _runner(kind="train")
    runner.to_device()
    n = len(runner.calls)
    for _ in range(n):  # the forward: activations pile up
        _timed_step(runner, "step")
    peak = torch.cuda.memory_reserved()
    for _ in range(n - 1):  # the backward but the last unit, keeping the cache
        _timed_step(runner, "step")
    kept = torch.cuda.memory_reserved()
    msg = _timed_step(runner, "step", True)  # the last backward unit ends a deallocation group: released
    info = msg[-1]
    assert info["live_bytes"] == 0 and info["allocated_bytes"] == torch.cuda.memory_allocated()
    assert kept >= peak * 0.5 and torch.cuda.memory_reserved() < kept


def test_a_batch_of_units_synchronizes_once_and_times_each_unit_on_the_gpu():
    """fill_task._timed_steps: a training job's whole iteration in one batch; the units' event times tile the
    batch and the stream ends where single steps would have left it."""
    from planner.runtime.fill_task import _timed_steps

    torch.manual_seed(0)
    runner = _runner(kind="train")
    runner.to_device()
    n = len(runner.linearized)
    kind, records = _timed_steps(runner, n)
    assert kind == "steps" and [r[1] for r in records] == list(range(n)) and runner.pos == n
    assert records[-1][6] and runner.iterations == 1  # the last unit completed the iteration
    for prev, rec in zip(records, records[1:]):
        assert rec[2] == prev[3] and rec[4] == prev[5]  # each unit starts where the previous ended
    assert all(r[3] >= r[2] for r in records) and records[-1][5] > records[0][4]
