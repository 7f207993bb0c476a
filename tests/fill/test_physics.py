"""Fill priced as the runtime runs it (planner/fill/physics.py): the margin, per-chunk and per-unit costs, the
shortest bubble worth filling, and memory from the main job's ledger."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from costmodels.hardware import Hardware
from planner.fill.assign import best_fill, held_bytes
from planner.fill.packing import BubbleSlot, FillUnit, greedy_pack, validate_packing
from planner.fill.physics import (
    BATCH_WORK_S,
    DEFAULT_SAFETY_MARGIN,
    FILL_CONTEXT_BYTES,
    STEP_ALLOWANCE_S,
    STEP_SAFETY,
    TIMESLICE_S,
    batched,
    chunk_overhead_s,
    runtime_unit_s,
    shared_unit_s,
    shortest_bubble_s,
    unit_overhead_s,
)
from planner.fill.profiles import FillProfile
from planner.fill.spec import FillSpec
from planner.runtime.fill_executor import FillExecutorOptions
from targets.registry import get_target

HW = Hardware(target=get_target("a100-80gb"))
GiB = 1 << 30
MS = 1e-3


def _profile(kind: str, times_ms: list[float], *, mem: int = GiB, state: int = 0, resident: int = GiB) -> FillProfile:
    units = tuple(FillUnit(name=f"u{i}", time_s=t * MS, mem_bytes=mem, flops=t * 1e9, state_bytes=state)
                  for i, t in enumerate(times_ms))
    return FillProfile(job="j", kind=kind, batch_size=8, config="plain", units=units, resident_bytes=resident,
                       layers=(), params=1, sha256="")


def test_defaults_are_the_papers_and_the_runtimes():
    assert DEFAULT_SAFETY_MARGIN == pytest.approx(0.32)  # PipeFill filled 68% of each bubble (001 l.231)
    assert FillSpec(jobs=[{"name": "a", "model": "m.py", "kind": "infer", "batch_sizes": [1],
                           "work": {"samples": 1}}]).safety_margin == DEFAULT_SAFETY_MARGIN
    opts = FillExecutorOptions()  # the planner prices a step's admission exactly as the runtime applies it
    assert (opts.step_safety, opts.step_overhead_s) == (STEP_SAFETY, STEP_ALLOWANCE_S)


def test_the_shortest_bubble_worth_filling_is_where_one_unit_first_fits():
    prof = _profile("infer", [2.0, 2.0, 2.0])
    shortest = shortest_bubble_s([u.time_s for u in prof.units], HW.eff.launch_s, DEFAULT_SAFETY_MARGIN)
    assert shortest == pytest.approx((0.25 * 2 * MS + STEP_ALLOWANCE_S + 2 * MS + unit_overhead_s(HW.eff.launch_s))
                                     / (1 - DEFAULT_SAFETY_MARGIN))
    assert chunk_overhead_s([2 * MS, 3 * MS]) == pytest.approx((STEP_SAFETY - 1) * 3 * MS + STEP_ALLOWANCE_S)
    below = [BubbleSlot(id=0, duration_s=shortest * 0.99, free_bytes=80 * GiB)]
    above = [BubbleSlot(id=0, duration_s=shortest * 1.01, free_bytes=80 * GiB)]
    assert best_fill(0, below, [prof], HW) is None
    got = best_fill(0, above, [prof], HW)
    assert got is not None and all(c.num_units == 1 for c in got.packing.chunks)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 20), min_size=1, max_size=6), st.lists(st.integers(0, 80), min_size=1, max_size=4),
       st.sampled_from([0.0, 50e-6]), st.sampled_from([0.0, 0.32]))
def test_per_unit_overhead_is_charged_but_not_counted_as_work(times, bubbles, per_unit, margin):
    units = [FillUnit(name=f"u{i}", time_s=t * MS, mem_bytes=1, flops=t * 1e9) for i, t in enumerate(times)]
    cycle = [BubbleSlot(id=i, duration_s=d * MS, free_bytes=10) for i, d in enumerate(bubbles)]
    pk = greedy_pack(units, cycle, safety_margin=margin, launch_overhead_s=1 * MS, cycles=3, unit_overhead_s=per_unit)
    validate_packing(pk, units, cycle)
    for c in pk.chunks:
        work = sum(units[p % len(units)].time_s for p in range(c.first_unit, c.end_unit))
        assert c.time_s == pytest.approx(work, abs=1e-8)
        assert c.overhead_s == pytest.approx(1 * MS + c.num_units * per_unit, abs=1e-8)
        assert c.time_s + c.overhead_s <= cycle[c.slot].duration_s * (1 - margin) + 1e-8
    plain = greedy_pack(units, cycle, safety_margin=margin, launch_overhead_s=1 * MS, cycles=3)
    assert pk.units_completed <= plain.units_completed


def test_what_a_job_holds_between_bubbles_must_fit_beside_the_main_jobs_peak():
    # a training job mid-iteration keeps 6 GiB of activations for its backward; resident 2 GiB
    train = _profile("train", [5.0] * 4, mem=GiB, state=6 * GiB, resident=2 * GiB)
    assert held_bytes(train) == FILL_CONTEXT_BYTES + 8 * GiB
    cycle = [BubbleSlot(id=0, duration_s=0.5, free_bytes=20 * GiB)]
    assert best_fill(0, cycle, [train], HW, hold_free=held_bytes(train)) is not None
    assert best_fill(0, cycle, [train], HW, hold_free=held_bytes(train) - 1) is None  # every bubble has room
    # an inference job that cannot stay resident is loaded per bubble: its weights count only while it runs
    infer = _profile("infer", [5.0] * 4, mem=GiB, resident=4 * GiB)
    streamed = best_fill(0, cycle, [infer], HW, hold_free=FILL_CONTEXT_BYTES + GiB)
    assert streamed is not None and not streamed.resident
    assert max(c.mem_bytes for c in streamed.packing.chunks) == GiB + 4 * GiB + FILL_CONTEXT_BYTES
    resident = best_fill(0, cycle, [infer], HW, hold_free=held_bytes(infer))
    assert resident is not None and resident.resident
    # the streamed job carries PipeSwitch's transfer groups for the runtime: contiguous, covering its layers
    from dataclasses import replace

    from planner.fill.assign import load_grouping
    from planner.fill.pipeswitch import Layer

    layered = replace(infer, layers=tuple(Layer(name=f"u{i}", param_bytes=GiB, exec_time_s=5 * MS) for i in range(4)))
    streamed = best_fill(0, cycle, [layered], HW, hold_free=FILL_CONTEXT_BYTES + GiB)
    assert streamed.load_groups == tuple(load_grouping(layered, HW).groups)
    assert [a for a, _ in streamed.load_groups] == [0] + [b for _, b in streamed.load_groups][:-1]
    assert streamed.load_groups[-1][1] == 4 and resident.load_groups == ()


def test_a_bubble_without_room_for_the_fill_processs_context_runs_nothing():
    prof = _profile("infer", [1.0], mem=GiB, resident=GiB)
    tight = [BubbleSlot(id=0, duration_s=0.5, free_bytes=2 * GiB)]  # unit + weights fit, the context does not
    assert best_fill(0, tight, [prof], HW, hold_free=10 * GiB) is None
    roomy = [BubbleSlot(id=0, duration_s=0.5, free_bytes=2 * GiB + FILL_CONTEXT_BYTES)]
    assert best_fill(0, roomy, [prof], HW, hold_free=10 * GiB) is not None


def test_data_parallel_training_pays_its_gradient_copies_in_the_optimizer_unit():
    """A training job's stage replicas average gradients in host memory: fp32 down after the backward and back
    up for the step (2 x 4 bytes per parameter over PCIe); under offload they stay on the host."""
    from dataclasses import replace

    from planner.fill.assign import data_parallel

    hw = Hardware(target=get_target("a100-80gb"))
    plain = replace(_profile("train", [1.0, 2.0, 0.5]), params=110_000_000)
    plain = replace(plain, units=plain.units[:-1] + (replace(plain.units[-1], name="OPT"),))
    dp = data_parallel(plain, hw)
    extra = [b.time_s - a.time_s for a, b in zip(plain.units, dp.units)]
    assert extra[:-1] == [0.0] * (len(extra) - 1)
    assert extra[-1] == pytest.approx(2 * plain.params * 4 / hw.gpu.pcie_bw)
    assert data_parallel(replace(plain, config="offload"), hw).units == plain.units


COLOCATE = Path(__file__).resolve().parents[2] / "bench" / "results" / "cuda_colocate_h100_2026-11-26.json"
SIZES = {"bert_b8": (8 * 128, 768, 3072), "large": (8192, 8192, 8192)}  # bench/cuda_colocate.py's products


def test_time_slicing_reproduces_the_measured_shares_of_a_fill_process_beside_a_waiting_receive():
    """The constant against its source (bench/cuda_colocate.py on an H100): each row's share of the GPU a fill
    process got beside a spinning kernel, from its work between synchronizes alone; under MPS, its own speed."""
    measured = json.loads(COLOCATE.read_text())
    rows = {k: v for k, v in measured["time_sliced"].items() if "_k" in k}  # "<size>_k<products per synchronize>"
    assert len(rows) == 5
    for key, row in rows.items():
        size, k = key.rsplit("_k", 1)
        m, kk, n = SIZES[size]
        work = int(k) * 2.0 * m * kk * n / (row["alone_tflops"] * 1e12)
        assert work / shared_unit_s(work, "timeslice") == pytest.approx(row["share_beside_recv"], rel=0.1), key
        assert row["share_beside_idle"] == pytest.approx(1.0, abs=0.05), key  # a context with nothing to run
    for key, row in measured["mps"].items():
        if "_k" in key:
            assert shared_unit_s(1e-3, "mps") == 1e-3 and row["share_beside_recv"] == pytest.approx(1.0, abs=0.1)


def test_the_fill_runtimes_own_task_beside_a_waiting_receive_takes_the_time_slicing_predicts():
    """The runtime's task (UnitRunner, BERT-base inference, one synchronize a unit) on an H100: each unit's time
    beside the spinning receive against shared_unit_s of its time alone (bench/cuda_colocate.py --runner-only)."""
    runner = json.loads(COLOCATE.with_name("cuda_colocate_runner_h100_2026-11-26.json").read_text())
    row = runner["runner_time_sliced"]
    predicted = sum(shared_unit_s(a * MS, "timeslice") for a in row["alone_ms"]) / MS
    assert row["iteration_beside_recv_ms"] == pytest.approx(predicted, rel=0.15)
    blocks = [(a, b) for a, b in zip(row["alone_ms"], row["beside_recv_ms"]) if 0.5 < a < TIMESLICE_S / MS]
    assert len(blocks) >= 10 and all(b == pytest.approx(a + TIMESLICE_S / MS, rel=0.1) for a, b in blocks)


@given(st.floats(1e-6, 0.5))
def test_a_time_sliced_unit_gives_the_receive_at_least_one_slice_and_at_most_half_the_gpu(compute):
    shared = shared_unit_s(compute, "timeslice")
    assert shared >= compute + TIMESLICE_S
    assert shared <= 2 * compute + TIMESLICE_S + 1e-12
    assert shared_unit_s(compute, "mps") == compute


@given(st.floats(1e-7, 0.5))
def test_the_runtime_batches_a_unit_where_that_beats_its_own_synchronize(compute):
    """Batched: twice its compute plus its share of a full batch's slice, less than what a synchronize of its own
    costs it; every unit under 0.8 of a slice is; the others keep their own synchronize where that is cheaper."""
    t = runtime_unit_s(compute, "timeslice")
    own = shared_unit_s(compute, "timeslice")
    if batched(compute, "timeslice"):
        assert t == pytest.approx(2 * compute * (1 + TIMESLICE_S / (2 * BATCH_WORK_S))) and t < own
    else:
        assert compute >= 0.8 * TIMESLICE_S and t == own
        assert t <= 2 * compute * (1 + TIMESLICE_S / (2 * BATCH_WORK_S)) or compute > BATCH_WORK_S
    assert 2 * compute <= t <= 2 * compute + TIMESLICE_S + 1e-12
    assert runtime_unit_s(compute, "mps") == runtime_unit_s(compute, "none") == compute
    assert not batched(compute, "mps") and not batched(compute, "none")


def test_time_sliced_fill_is_packed_at_its_shared_speed_and_saves_its_dedicated_time():
    """The units a plan packs and hands the runtime are the shared times; the GPU time a job saves is its own."""
    from planner.fill.profiles import profile_job
    from planner.fill.spec import FillJobSpec, Work
    job = FillJobSpec(name="mlp", model=str(Path(__file__).resolve().parents[2] / "examples" / "mlp.py"),
                      kind="infer", batch_sizes=[64], work=Work(samples=6400))
    (alone,), (sliced,), (mps,) = (profile_job(job, HW, "bf16", s) for s in (None, "timeslice", "mps"))
    assert any(u.gpu_s is not None for u in alone.units)  # a small job: the host issues its units slower
    assert [u.time_s for u in sliced.units] == [runtime_unit_s(u.time_s, "timeslice") if u.gpu_s is None else
                                                runtime_unit_s(u.gpu_s, "timeslice", host_s=u.time_s)
                                                for u in alone.units]
    assert all(s.time_s >= a.time_s for s, a in zip(sliced.units, alone.units))
    assert [u.time_s for u in mps.units] == [u.time_s for u in alone.units]
    assert sliced.dedicated_s == pytest.approx(alone.iteration_s) and alone.dedicated_s == alone.iteration_s
    assert sliced.flops_per_iteration == alone.flops_per_iteration


def test_a_node_that_shares_its_gpus_otherwise_than_planned_is_told(monkeypatch):
    """The runtime asks MPS's control socket (where nvidia-cuda-mps-control listens) whether the daemon serves the
    node, and says in one sentence when the node does not share the GPU the way the fill was priced."""
    import socket
    import tempfile

    from planner.runtime.bubbles import mps_running, sharing_mismatch

    with tempfile.TemporaryDirectory(prefix="mps", dir="/tmp") as tmp:  # short: unix socket paths take ~100 chars
        pipes = Path(tmp)
        monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", tmp)
        assert not mps_running()
        with socket.socket(socket.AF_UNIX) as daemon:
            daemon.bind(str(pipes / "control"))
            daemon.listen()
            assert mps_running()
        assert (pipes / "control").exists() and not mps_running()  # what a quit daemon leaves
    assert "nvidia-cuda-mps-control -d" in sharing_mismatch("mps", False)
    assert "gpu_sharing: mps" in sharing_mismatch("timeslice", True)
    assert all(sharing_mismatch(p, m) is None for p, m in (("mps", True), ("timeslice", False), ("none", True),
                                                           ("none", False)))


SPEED = COLOCATE.with_name("cuda_fill_speed_h100_2026-11-27.json")
SPEED_JOBS = {"bert-base-infer-b8": ("bert.py", {"preset": "base", "seq": 128}, "infer", 8),
              "bert-base-infer-b128": ("bert.py", {"preset": "base", "seq": 128}, "infer", 128),
              "resnet18-train-b64": ("vision.py", {"arch": "resnet18"}, "train", 64),
              "resnet50-train-b64": ("vision.py", {"arch": "resnet50"}, "train", 64),
              "vgg19-train-b64": ("vision.py", {"arch": "vgg19"}, "train", 64)}


@pytest.mark.parametrize("key", sorted(SPEED_JOBS))
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_a_fill_unit_takes_no_less_than_the_host_takes_to_issue_it(key, precision):
    """On the H100 machine (bench/cuda_fill_speed.py) each unit's host seconds, queued with the GPU idle, against
    host_unit_s of the planner's kernel count: per iteration within 0.7-1.3x (training's first unit, which waits for
    its batch, left out); and the priced units alone are no faster than that, nor than their GPU time."""
    from planner.fill.physics import HOST_OPTIMIZER_TENSOR_S, host_unit_s
    from planner.fill.profiles import profile_job
    from planner.fill.spec import FillJobSpec, Work

    model, args, kind, batch = SPEED_JOBS[key]
    measured = json.loads(SPEED.read_text())["jobs"][f"{key}-{precision}"]["measured"]["unit_host_s"]
    job = FillJobSpec(name="j", model=str(Path(__file__).resolve().parents[2] / "examples" / model), model_args=args,
                      kind=kind, batch_sizes=[batch], work=Work(iterations=1))
    prof = next(p for p in profile_job(job, Hardware(target=get_target("h100-sxm")), precision) if p.config == "plain")
    assert len(prof.units) == len(measured)
    from passes.pipeline import analyze
    units = analyze(job.model, args, dtype=precision)[0].units
    kernels = [u.sharded.kernels + u.replicated.kernels for u in units]
    if kind == "infer":
        host = [host_unit_s("infer", k) for k in kernels]
    else:
        tensors = sum(1 for u in units for part in (u.sharded, u.replicated) for _, n in part.weights if n)
        host = ([host_unit_s("forward", k) for k in kernels] + [host_unit_s("backward", k) for k in reversed(kernels)]
                + [HOST_OPTIMIZER_TENSOR_S * tensors])
    skip = 1 if kind == "train" else 0
    assert sum(host[skip:]) / sum(measured[skip:]) == pytest.approx(1.0, abs=0.3)
    for u, h in zip(prof.units, host):
        assert u.time_s == pytest.approx(max(h, u.time_s if u.gpu_s is None else u.gpu_s))
        assert u.time_s >= h * (1 - 1e-9) and (u.gpu_s is None or u.gpu_s < u.time_s)


@given(st.floats(1e-6, 0.05), st.floats(0.0, 0.05))
def test_a_host_bound_unit_is_no_faster_in_a_bubble_than_alone(compute, host):
    """Beside the main job a unit takes no less than alone (the longer of its GPU and host time); time-sliced, more
    than under MPS; with no host time it is priced as before."""
    alone = max(compute, host)
    for sharing in ("timeslice", "mps", "none"):
        assert runtime_unit_s(compute, sharing, host_s=host) >= alone * (1 - 1e-12)
    assert runtime_unit_s(compute, "mps", host_s=host) == runtime_unit_s(compute, "none", host_s=host) == alone
    assert runtime_unit_s(compute, "timeslice", host_s=host) > alone
    assert runtime_unit_s(compute, "timeslice", host_s=0.0) == runtime_unit_s(compute, "timeslice")


def test_a_plan_says_which_fill_jobs_the_host_binds():
    """A job whose units the host issues slower than the GPU runs them is noted in the plan (with the GPU's share of
    that time); one the GPU binds is not."""
    from planner.fill.profiles import profile_job
    from planner.fill.section import _host_note
    from planner.fill.spec import FillJobSpec, Work

    job = FillJobSpec(name="bert", model=str(Path(__file__).resolve().parents[2] / "examples" / "bert.py"),
                      model_args={"preset": "base", "seq": 128}, kind="infer", batch_sizes=[8, 128],
                      work=Work(iterations=1))
    small, large = profile_job(job, Hardware(target=get_target("h100-sxm")), "bf16")
    (note,) = _host_note(small)
    assert "the host issues" in note and "at batch 8" in note
    assert _host_note(large) == []
