"""The fill executor against a fake main job: real bubbles made of sleeps, real fill jobs in them.

Each scenario starts one executor (its fill jobs load in the background, wait_ready() waits), then a
fake main job calls bubble_begin / sleeps the bubble / bubble_end / sleeps its own "compute", and
checks that its own loop never waited on the executor.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from passes.load import file_sha256, load_model_file
from planner.metrics import FillReport
from planner.plan import (Bubble, ConfigModel, Fill, FillChunk, FillJob, FillPredictions, Launch, Plan, Predictions,
                          SearchInfo, Source)
from planner.runtime import fill_executor
from planner.runtime.fill_client import FillClient
from planner.runtime.fill_executor import (BubbleBegin, BubbleEnd, FillExecutor, FillExecutorOptions, Request,
                                           TaskOptions)
from planner.runtime.fill_task import UnitRunner

ROOT = Path(__file__).resolve().parents[2]
MLP, BERT = str(ROOT / "examples/mlp.py"), str(ROOT / "examples/bert.py")
FAULTY = str(Path(__file__).parent / "fixtures/faulty.py")
MLP_ARGS = {"features": 32, "width": 64, "depth": 2}
FREE = 1 << 30
# bubble_begin / bubble_end take microseconds; the bounds leave room for a loaded 2-core CI machine,
# where the OS may deschedule the caller for a time slice while the fill job computes.
CALL_MEDIAN_LIMIT_S, CALL_MAX_LIMIT_S = 0.0005, 0.015


def _job(name: str, path: str, args: dict, kind: str, units: int, batch: int = 4) -> FillJob:
    names = [f"F:{i}" for i in range(units)]
    if kind == "train":
        names += [f"B:{i}" for i in reversed(range(units))] + ["OPT"]
    return FillJob(name=name, model_file=path, model_sha256=file_sha256(path), model_args=args, kind=kind,
                   batch_size=batch, config="plain", units=names, unit_time_s=[1e-3] * len(names), resident=True)


def _runner(path: str, args: dict, **options: object) -> UnitRunner:
    """The unit runner of a training job made by hand, on the CPU (no plan: its units are the model's own)."""
    job = FillJob(name="j", model_file=path, model_sha256=file_sha256(path), model_args=args, kind="train",
                  batch_size=3, config="plain", units=[], unit_time_s=[], resident=True)
    return UnitRunner(job, TaskOptions(device="cpu", interface="iterative", iterations=None, **options))


def _plan(jobs: list[FillJob], placement: dict[int, str], durations: dict[int, float], margin: float) -> Plan:
    """A hand-built 2-rank GPipe plan of examples/gpt.py (preset=tiny, layers=2) whose rank 0 has the
    given bubbles, each assigned to one fill job (the parts the fill executor does not read are stubs)."""
    fill = Fill(safety_margin=margin, jobs=jobs,
                chunks=[FillChunk(job=job, rank=0, bubble_id=b, first_unit=0, units=2, expected_s=0.01,
                                  memory_bytes=1 << 20) for b, job in placement.items()],
                predictions=FillPredictions(fill_tflops_per_gpu=0.0, bubble_time_used=0.5,
                                            total_useful_tflops_per_gpu=0.0, offload_optimizer=False))
    source = Source(model_file=str(ROOT / "examples/gpt.py"), model_sha256=file_sha256(ROOT / "examples/gpt.py"),
                    model_args={"preset": "tiny", "layers": 2}, target="cpu", gpu={}, cluster={},
                    gpus=2, gpus_per_node=2, global_batch=8, tool_version="test")
    predictions = Predictions(iteration_s=1.0, samples_per_s=8.0, tokens_per_s=256.0, tflops_per_gpu=0.0, mfu=0.0, hfu=0.0,
                              hardware_tflops_per_gpu=0.0, bubble_fraction=0.5, p2p_s=0.0, tp_comm_s=0.0,
                              allreduce_s=[0.0, 0.0], optimizer_s=[0.0, 0.0], memory=[])
    return Plan(source=source, config=ConfigModel(tp=1, pp=2, dp=1, microbatch=1, microbatches=8, vp=1,
                                                  recompute="none", schedule="gpipe", precision="fp32"),
                alternatives=[], partition=[], actions=[[f"BUBBLE{b}" for b in placement], ["BUBBLE0"]],
                bubbles=[Bubble(id=b, rank=0, start_s=0.0, duration_s=d, kind="B", free_bytes=FREE)
                         for b, d in durations.items()],
                predictions=predictions, launch=Launch(nnodes=1, nproc_per_node=2, commands=[], script=""),
                search=SearchInfo(evaluated=1, rejected={}, seconds=0.0, pinned=[]), fill=fill)


def _fake_main(client: FillClient, rounds: int, durations: dict[int, float], compute_s: float = 0.05,
               ready: dict | None = None) -> dict:
    """The main job's loop: per round, every bubble (begin, sleep, end) then its own compute."""
    calls = []
    start = time.perf_counter()
    for _ in range(rounds):
        for bubble_id, duration in durations.items():
            event = (ready or {}).get(bubble_id)
            t0 = time.perf_counter()
            client.bubble_begin(bubble_id, duration, FREE, ready=event)
            t1 = time.perf_counter()
            time.sleep(duration + getattr(event, "drain_s", 0.0))  # the GPU drains, then idles `duration`
            t2 = time.perf_counter()
            client.bubble_end(bubble_id)
            calls += [t1 - t0, time.perf_counter() - t2]
            time.sleep(compute_s)
    elapsed = time.perf_counter() - start
    drains = sum(getattr(e, "drain_s", 0.0) for e in (ready or {}).values())
    planned = rounds * (sum(durations.values()) + drains + compute_s * len(durations))
    return {"calls": calls, "elapsed": elapsed, "planned": planned}


def _assert_main_job_on_time(main: dict) -> None:
    calls = sorted(main["calls"])
    assert calls[len(calls) // 2] < CALL_MEDIAN_LIMIT_S, f"median bubble call {calls[len(calls) // 2] * 1e3:.3f} ms"
    assert calls[-1] < CALL_MAX_LIMIT_S, f"slowest bubble call {calls[-1] * 1e3:.2f} ms"
    assert main["elapsed"] < main["planned"] * 1.1 + 0.1, (main["elapsed"], main["planned"])


def _start(plan: Plan, grace_s: float = 0.1, **options) -> FillClient:
    client = FillClient.start(plan, 0, 0, "cpu", grace_s=grace_s, options=FillExecutorOptions(**options))
    assert client is not None
    assert client.wait_ready(120.0), "fill jobs did not load"
    return client


def _scenario(plan: Plan, durations: dict[int, float], rounds: int, grace_s: float = 0.1, **options) -> tuple:
    """(the fake main job's timings, the executor's report) of `rounds` of the plan's bubbles."""
    client = _start(plan, grace_s=grace_s, **options)
    try:
        main = _fake_main(client, rounds=rounds, durations=durations)
        return main, client.report()
    finally:
        client.close()


# ---- the unit runner, in-process ------------------------------------------------------------------

@pytest.mark.parametrize(("path", "args"), [(MLP, MLP_ARGS),
                                            (str(ROOT / "examples/gpt.py"), {"preset": "tiny", "layers": 2,
                                                                             "dropout": 0.0})])
def test_linearized_units_give_the_whole_models_gradients(path: str, args: dict) -> None:
    runner = _runner(path, args)
    n = len(runner.unit_names)
    assert runner.linearized[:n] == [f"F:{u}" for u in runner.unit_names] and runner.linearized[-1] == "OPT"
    profile = runner.profile(1)
    assert len(profile) == 2 * n + 1 and all(t > 0 for t in profile)
    mf = load_model_file(path, args)
    torch.manual_seed(0)
    ref = mf.build("cpu")
    (x,), y = mf.call("sample_batch", 3, 0)
    mf.module.loss_fn(ref(x), y).backward()
    for _ in range(2 * n):  # all forward and backward units, not the optimizer
        runner.step()
    mine = dict(runner.module.named_parameters())
    assert len(mine) == len(list(ref.parameters()))
    ref_grads = sorted(float(p.grad.abs().sum()) for p in ref.parameters())
    assert ref_grads == pytest.approx(sorted(float(p.grad.abs().sum()) for p in mine.values()), rel=1e-5)
    assert runner.step() and runner.iterations == 1  # the optimizer step completes the iteration


def test_a_batch_runs_the_same_stream_as_single_steps() -> None:
    """fill_task._timed_steps: a batch across the iteration's end leaves the same weights as one step at a time,
    and its units' times tile the batch."""
    from planner.runtime.fill_task import _timed_steps

    torch.manual_seed(0)
    single, batched = _runner(MLP, MLP_ARGS), _runner(MLP, MLP_ARGS)
    batched.module.load_state_dict(single.module.state_dict())
    n = len(single.linearized) + 3
    for _ in range(n):
        single.step()
    kind, records = _timed_steps(batched, n)
    assert kind == "steps" and [r[1] for r in records] == list(range(n)) and batched.pos == n
    assert [r[6] for r in records].count(True) == 1 == batched.iterations
    assert all(a[3] == b[2] and a[5] == b[4] and b[3] >= b[2] for a, b in zip(records, records[1:]))
    for a, b in zip(single.module.parameters(), batched.module.parameters()):
        assert torch.equal(a, b)


def test_the_next_batch_is_made_on_a_thread_while_units_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """UnitRunner._batch: each of this GPU's batches (first 1, stride 2) is made once, all but the first on the
    runner's loader thread, and profiling passes reuse iteration 0's."""
    runner = _runner(MLP, MLP_ARGS, batch_first=1, batch_stride=2)
    made: list[tuple[int, str]] = []
    sample = runner.mf.module.sample_batch

    def logged(batch_size: int, step: int, **kw: object) -> object:
        made.append((step, threading.current_thread().name))
        return sample(batch_size, step, **kw)

    monkeypatch.setattr(runner.mf.module, "sample_batch", logged)
    runner.profile(2)
    while runner.iterations < 3:
        runner.step()
    runner._prefetched[7].result()
    assert [i for i, _ in made] == [1, 3, 5, 7]
    assert made[0][1] == threading.main_thread().name and all(t.startswith("fill-batch") for _, t in made[1:])


def test_the_plans_linearization_must_match_the_model() -> None:
    job = _job("bert", BERT, {"preset": "tiny"}, "infer", 2, batch=2)
    with pytest.raises(Exception, match="lists 2 linearized units for fill job 'bert'.* 4 for a infer job"):
        UnitRunner(job, TaskOptions(device="cpu", interface="iterative", iterations=None))


def test_no_fill_for_the_rank_starts_nothing() -> None:
    plan = _plan([_job("mlp", MLP, MLP_ARGS, "train", 4)], {0: "mlp"}, {0: 0.2}, 0.1)
    assert FillClient.start(plan, 1, 1, "cpu") is None
    assert FillClient.start(plan.model_copy(update={"fill": None}), 0, 0, "cpu") is None


def test_chunks_of_unknown_jobs_are_refused() -> None:
    plan = _plan([_job("mlp", MLP, MLP_ARGS, "train", 4)], {0: "mlp", 1: "ghost"}, {0: 0.2, 1: 0.2}, 0.1)
    with pytest.raises(ValueError, match=r"name jobs \['ghost'\]"):
        FillClient.start(plan, 0, 0, "cpu")


# ---- real executors --------------------------------------------------------------------------------

class SlowEvent:
    """Stands in for the CUDA event the main job records before a bubble: the GPU drains for 50 ms."""

    drain_s = 0.05

    def synchronize(self) -> None:
        time.sleep(self.drain_s)


@pytest.mark.flaky(reruns=2)  # wall-clock windows of real processes: a loaded 2-core machine delays them
def test_training_and_inference_fill_jobs_run_only_inside_bubbles() -> None:
    durations = {0: 0.3, 1: 0.2}
    jobs = [_job("mlp", MLP, MLP_ARGS, "train", 4), _job("bert", BERT, {"preset": "tiny"}, "infer", 4)]
    client = _start(_plan(jobs, {0: "mlp", 1: "bert"}, durations, margin=0.25))
    try:  # bubble 1 comes with a ready event: it starts when that event's synchronize() returns
        main = _fake_main(client, rounds=4, durations=durations, ready={1: SlowEvent()})
        report = client.report()
    finally:
        client.close()
    _assert_main_job_on_time(main)
    assert json.loads(json.dumps(report)) == report  # plain data, ready for metrics.json
    FillReport.model_validate(report)  # what the metrics document's model expects
    assert report["kills"] == [] and report["errors"] == [], report["kills"] + report["errors"]
    bubbles = report["bubbles"]
    assert [b["bubble_id"] for b in bubbles] == [0, 1] * 4
    for b in bubbles:
        assert b["main_begin"] <= b["gpu_idle"] < b["deadline"] <= b["main_end"] + 0.1
        if b["bubble_id"] == 1:  # the caller returned at once; the bubble started when the event fired
            assert b["gpu_idle"] - b["main_begin"] >= 0.045
        for step in b["steps"]:
            assert b["gpu_idle"] <= step["start"] <= step["end"] <= b["main_end"], (b["bubble_id"], step)
        assert {s["job"] for s in b["steps"]} <= set(b["jobs"])
    jobs_done = {j["name"]: j for j in report["jobs"]}
    mlp, bert = jobs_done["mlp"], jobs_done["bert"]
    assert sum(1 for b in bubbles if b["bubble_id"] == 0 and b["units_done"] > 0) >= 3
    assert sum(1 for b in bubbles if b["bubble_id"] == 1 and b["samples_done"] > 0) >= 3
    assert mlp["iterations_done"] >= 2 and mlp["samples_done"] == 4 * mlp["iterations_done"]
    assert bert["iterations_done"] >= 3 and bert["units"][0] == "F:tok+pos+ln"
    assert mlp["profile_s"] is not None and set(mlp["profile_s"]) == set(mlp["units"])
    # the stream is contiguous: each step is the next unit of its job
    for name in ("mlp", "bert"):
        positions = [s["pos"] for b in bubbles for s in b["steps"] if s["job"] == name]
        assert positions == list(range(len(positions)))
    assert [(t["job"], t["to"]) for t in report["transitions"] if t["transition"] == "StopSideTask"] == \
        [("mlp", "STOPPED"), ("bert", "STOPPED")]
    assert all(j["stop_reason"] == "shutdown" for j in report["jobs"])


@pytest.mark.flaky(reruns=2)  # wall-clock windows of real processes: a loaded 2-core machine delays them
def test_short_units_run_in_batches_inside_the_bubbles() -> None:
    """Batches (one request, one synchronize on CUDA, for a run of short units: physics.batched) keep
    every unit inside its bubble, the stream contiguous and each unit observed at its own time."""
    durations = {0: 0.3}
    main, report = _scenario(_plan([_job("mlp", MLP, MLP_ARGS, "train", 4)], {0: "mlp"}, durations, margin=0.25),
                             durations, rounds=4, batch_work_s=0.02)
    _assert_main_job_on_time(main)
    FillReport.model_validate(report)
    assert report["kills"] == [] and report["errors"] == [], report["kills"] + report["errors"]
    batches = [t["reason"] for t in report["transitions"] if t["transition"] == "RunNextStep"]
    assert any("one synchronize" in r for r in batches), batches[:5]
    steps = [s for b in report["bubbles"] for s in b["steps"]]
    assert len(steps) > len(batches)  # fewer requests than units
    for b in report["bubbles"]:
        for step in b["steps"]:
            assert b["gpu_idle"] <= step["start"] <= step["end"] <= b["main_end"], step
    assert [s["pos"] for s in steps] == list(range(len(steps)))
    (mlp,) = report["jobs"]
    assert mlp["iterations_done"] >= 2 and mlp["samples_done"] == 4 * mlp["iterations_done"]


def test_overrun_is_killed_after_grace_and_failures_are_recorded() -> None:
    durations = {0: 0.25, 1: 0.2, 2: 0.15, 3: 0.15}
    jobs = [_job("slow", FAULTY, {"mode": "slow", "after": 1, "seconds": 2.0}, "train", 3),
            _job("raising", FAULTY, {"mode": "raise", "after": 2}, "train", 3),
            _job("broken", FAULTY, {"mode": "build"}, "infer", 3),
            _job("crashing", FAULTY, {"mode": "crash", "after": 1}, "infer", 3)]
    grace = 0.05
    main, report = _scenario(_plan(jobs, {0: "slow", 1: "raising", 2: "broken", 3: "crashing"}, durations,
                                   margin=0.1), durations, rounds=3, grace_s=grace)
    _assert_main_job_on_time(main)
    FillReport.model_validate(report)  # kills, overruns and errors as the metrics document's model expects
    state = {j["name"]: j for j in report["jobs"]}
    assert all(j["state"] == "STOPPED" for j in state.values())
    # the slow job: iteration 1's first forward unit sleeps 2 s, it was still running at the deadline
    assert state["slow"]["stop_reason"] == "killed"
    (kill,) = report["kills"]
    assert kill["job"] == "slow" and kill["what"] == "step" and kill["unit"] == "F:blocks.0"
    occ = next(b for b in report["bubbles"] if b["kills"])
    assert kill["limit"] == pytest.approx(min(occ["deadline"], occ["main_end"]) + grace, abs=0.01)
    assert 0 <= kill["killed_at"] - kill["limit"] < 0.1  # killed as soon as the grace period ran out
    assert occ["overruns"][0]["killed"] and occ["overruns"][0]["unit"] == "F:blocks.0"
    assert state["slow"]["iterations_done"] == 1
    # the raising job ran two good iterations, then its error was recorded in the bubble it happened in
    assert state["raising"]["stop_reason"] == "failed" and state["raising"]["iterations_done"] == 2
    assert "RuntimeError: fill model exploded at step 2" in state["raising"]["error"]
    assert "faulty.py" in state["raising"]["error"]
    assert any("exploded" in e["message"] for b in report["bubbles"] for e in b["errors"])
    # the job whose model cannot be built never left CREATED
    assert state["broken"]["stop_reason"] == "failed" and "weights file missing" in state["broken"]["error"]
    assert [t["transition"] for t in report["transitions"] if t["job"] == "broken"] == \
        ["CreateSideTask", "StopSideTask"]
    # the job whose process died in the middle of a step
    assert state["crashing"]["stop_reason"] == "failed" and state["crashing"]["iterations_done"] == 1
    assert "exited with code 3" in state["crashing"]["error"]
    assert {e["job"] for e in report["errors"]} == {"raising", "broken", "crashing"}
    # nothing ran after its job stopped
    for name in ("slow", "raising"):
        stopped = next(t["t"] for t in report["transitions"] if t["job"] == name and t["to"] == "STOPPED")
        assert all(s["start"] <= stopped for b in report["bubbles"] for s in b["steps"] if s["job"] == name)


@pytest.mark.flaky(reruns=2)  # wall-clock windows of real processes: a loaded 2-core machine delays signals
def test_imperative_tasks_are_paused_by_signals() -> None:
    durations = {0: 0.25, 1: 0.15}
    jobs = [_job("loop", MLP, {"features": 64, "width": 256, "depth": 4}, "train", 6, batch=64),
            _job("short", BERT, {"preset": "tiny"}, "infer", 4)]
    # grace generous enough that a loaded CI machine's scheduling delay is not mistaken for a task
    # that ignored SIGSTOP (the kill path has its own tests)
    client = _start(_plan(jobs, {0: "loop", 1: "short"}, durations, margin=0.2), grace_s=0.4,
                    default_interface="imperative", iterations={"short": 3})
    try:
        main = _fake_main(client, rounds=4, durations=durations, compute_s=0.1)
        report = client.report()
    finally:
        client.close()
    _assert_main_job_on_time(main)
    assert report["kills"] == [] and report["errors"] == []
    bubbles = report["bubbles"]
    windows = [(b["main_begin"], b["main_end"]) for b in bubbles]
    loop_steps = [s for b in bubbles for s in b["steps"] if s["job"] == "loop"]
    # a unit that SIGSTOP cut in two finishes in the next bubble: every unit *ends* inside a bubble
    assert all(any(a <= s["end"] <= z for a, z in windows) for s in loop_steps)
    assert sum(1 for b in bubbles if b["bubble_id"] == 0 and b["units_done"] > 0) >= 3
    log = [(t["transition"], t["reason"]) for t in report["transitions"] if t["job"] == "loop"]
    assert sum(1 for tr, why in log if tr == "PauseSideTask" and why == "SIGSTOP took effect") >= 3
    assert not any(tr == "RunNextStep" for tr, _ in log)  # the imperative task runs its own loop
    short = next(j for j in report["jobs"] if j["name"] == "short")
    assert short["stop_reason"] == "done" and short["iterations_done"] == 3 and short["samples_done"] == 12


def test_a_dead_executor_never_stops_the_main_job() -> None:
    durations = {0: 0.05}
    plan = _plan([_job("mlp", MLP, MLP_ARGS, "train", 4)], {0: "mlp"}, durations, margin=0.1)
    client = FillClient.start(plan, 0, 0, "cpu")
    assert client is not None
    try:
        os.kill(client.pid, signal.SIGKILL)
        time.sleep(0.2)
        main = _fake_main(client, rounds=5, durations=durations, compute_s=0.01)
        report = client.report(timeout_s=5.0)
    finally:
        client.close()
    _assert_main_job_on_time(main)
    assert "exited" in report["error"] and report["bubbles"] == []
    assert FillReport.model_validate(report).pipeline_rank is None


def test_imperative_task_that_does_not_stop_is_killed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The executor driven directly over its pipes (in a thread of this process), with the check for
    SIGSTOP having taken effect forced to fail: the task is SIGKILLed at deadline + grace. The
    measured duration (0.15 s) caps the one the main job announces (0.25 s)."""
    monkeypatch.setattr(fill_executor, "_is_stopped", lambda pid: False)
    plan = _plan([_job("loop", MLP, MLP_ARGS, "train", 4)], {0: "loop"}, {0: 0.25}, margin=0.2)
    cmd_r, cmd_w = mp.Pipe(duplex=False)
    out_r, out_w = mp.Pipe(duplex=False)
    grace = 0.05
    executor = FillExecutor(plan, 0, 0, "cpu", {0: 0.15}, grace,
                            FillExecutorOptions(default_interface="imperative"), cmd_r, out_w)
    thread = threading.Thread(target=executor.run, daemon=True)
    thread.start()
    try:
        assert out_r.poll(120.0) and out_r.recv()[0] == "ready"
        wall, mono = time.time(), time.monotonic()
        cmd_w.send(BubbleBegin(seq=1, bubble_id=0, duration_s=0.25, free_bytes=FREE, called_at=wall,
                               start_wall=wall, start_mono=mono))
        time.sleep(0.25)
        cmd_w.send(BubbleEnd(seq=1, bubble_id=0, wall=time.time(), mono=time.monotonic()))
        time.sleep(0.1)
        cmd_w.send(Request(kind="report"))
        tag, report = out_r.recv()
    finally:
        cmd_w.send(Request(kind="close"))
        thread.join(timeout=10.0)
    assert tag == "report" and not thread.is_alive()
    FillReport.model_validate(report)
    (job,) = report["jobs"]
    assert job["stop_reason"] == "killed" and job["units_done"] > 0
    (kill,) = report["kills"]
    assert kill["what"] == "run" and kill["job"] == "loop"
    assert kill["limit"] == pytest.approx(wall + 0.15 + grace, abs=0.01)
    assert 0 <= kill["killed_at"] - kill["limit"] < 0.1
    assert [t["transition"] for t in report["transitions"]] == \
        ["CreateSideTask", "InitSideTask", "StartSideTask", "StopSideTask"]
    assert report["bubbles"][0]["kills"] == [kill]


def test_a_streamed_or_paired_job_is_refused_the_imperative_interface() -> None:
    """Only the iterative interface unloads a job loaded per bubble (PipeSwitch) when its bubble ends, or runs a
    paired job one unit at a time by its pair's rule (Waterwave): the executor says so instead of running it wrong."""
    job = _job("stream", MLP, MLP_ARGS, "infer", 4).model_copy(update={"resident": False, "load_groups": [[0, 2]]})
    plan = _plan([job], {0: "stream"}, {0: 0.25}, margin=0.2)
    with pytest.raises(ValueError, match="fill job stream is loaded per bubble .* only the iterative interface"):
        FillExecutor(plan, 0, 0, "cpu", None, 0.05, FillExecutorOptions(default_interface="imperative"), None,
                     None)
