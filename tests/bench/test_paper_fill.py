"""bench/paper_fill.py's FreeRide computation: A.3's metrics in closed form, FreeRide's whole-step packing on
made-up bubbles, one side task end to end (invariants only, not the 0.5-1.6x band), and examples/vision.py's
torchvision shapes."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from planner.fill.assign import plan_hold_free
from planner.fill.packing import FillUnit
from planner.fill.physics import FILL_CONTEXT_BYTES
from planner.fill.profiles import FillProfile

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_paper_fill", ROOT / "bench" / "paper_fill.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench
_spec.loader.exec_module(bench)

GiB = 1 << 30


def test_time_increase_is_relative_extra_time():
    assert bench.time_increase(2.2, 2.0) == pytest.approx(0.1)
    assert bench.time_increase(2.0, 2.0) == 0.0


def test_cost_savings_equals_a3_from_its_dollar_costs():
    """S from A.3's definitions, in dollars over N main iterations, equals the per-iteration closed form."""
    p_i, p_ii = 3.96, 0.18  # $/h, 000 l.269
    n, t_iter, samples, th_ii, inc = 1000, 2.0, 1500.0, 800.0, 0.01
    t_no = n * t_iter / 3600  # hours
    c_no, c_with = p_i * t_no, p_i * t_no * (1 + inc)
    c_side = p_ii * (n * samples / th_ii) / 3600
    expected = (c_side - (c_with - c_no)) / c_no
    assert bench.cost_savings(samples, t_iter, th_ii, inc, p_ii / p_i) == pytest.approx(expected, rel=1e-12)
    assert bench.cost_savings(0.0, t_iter, th_ii, inc, p_ii / p_i) == pytest.approx(-inc)


def test_row_ratio_is_predicted_over_paper():
    assert bench._row("x", 3.0, 2.0)["ratio"] == pytest.approx(1.5)
    assert bench._row("x", 3.0, (2.0, 4.0))["ratio"] == pytest.approx([0.75, 1.5])
    assert bench._row("x", 3.0, None)["ratio"] is None


def _profile(step_s: float, act_bytes: int, resident_bytes: int) -> FillProfile:
    units = (FillUnit(name="F:a", time_s=step_s / 3, flops=1e9, mem_bytes=act_bytes // 2),
             FillUnit(name="B:a", time_s=2 * step_s / 3, flops=2e9, mem_bytes=act_bytes),
             FillUnit(name="OPT", time_s=0.0, flops=0.0, mem_bytes=0))
    return FillProfile(job="t", kind="train", batch_size=64, config="plain", units=units,
                       resident_bytes=resident_bytes, layers=(), params=1, sha256="")


def test_freeride_steps_follow_its_artifacts_loop():
    """A 24 ms step is checked as 36 ms (rounded up to 30 ms, x1.2) and takes 29 ms with the loop's sleep; the task
    starts 7.5 ms into the bubble."""
    assert bench.freeride_steps_in(0.0434, 0.024) == 0  # under 36 ms left after the start
    assert bench.freeride_steps_in(0.0436, 0.024) == 1
    assert bench.freeride_steps_in(0.0436 + 0.029, 0.024) == 2
    assert bench.freeride_steps_in(0.0434 + 0.029, 0.024) == 1
    assert bench.freeride_steps_in(0.0075 + 0.0359, 0.030) == 0  # a step of exactly 30 ms is checked as 36 ms
    assert bench.freeride_steps_in(0.0075 + 0.0361, 0.030) == 1
    assert bench.freeride_steps_in(1.0, 0.030) == int((1.0 - 0.0075 - 0.036) // 0.035) + 1


def test_step_packing_runs_whole_steps_where_the_task_fits():
    prof = _profile(0.2, 1 * GiB, 1 * GiB)
    need = prof.resident_bytes + FILL_CONTEXT_BYTES + 1 * GiB
    steps = bench.step_packing(prof, [[1.0, 0.19], [1.0], [0.2 + 0.0075 + 0.24 + 1e-3], []],
                               [need, need - 1, need, need])
    # 1 s: the start at 7.5 ms, checks of 240 ms, steps of 205 ms -> 4; 0.19 s none; rank 1 lacks one byte;
    # rank 2's bubble holds one step and the check of a second; rank 3 has no bubble
    assert steps == [4.0, 0.0, 1.0, 0.0]


def test_freeride_reports_every_bubble_but_the_last_stages_drain(freeride_resnet18):
    main, _, _ = freeride_resnet18
    reported = bench.freeride_reported(main)
    for r in range(main.config.pp):
        mine = [b.duration_s for b in sorted((b for b in main.bubbles if b.rank == r), key=lambda b: b.start_s)]
        assert reported[r] == (mine[:-1] if r == main.config.pp - 1 else mine)


@pytest.fixture(scope="module")
def freeride_resnet18():
    main = bench.freeride_plan()
    ratio = bench.FREERIDE["price_server_ii"] / bench.FREERIDE["price_server_i"]
    return main, ratio, bench.freeride_task("resnet18", main, ratio)


def test_freeride_task_invariants(freeride_resnet18):
    main, ratio, t = freeride_resnet18
    assert main.config.pp == 4 and main.config.microbatches == 4 and main.config.microbatch == 3
    assert t["time_increase"] >= 0
    assert len(t["steps_per_rank"]) == 4 and all(s >= 0 for s in t["steps_per_rank"])
    assert set(t["workers_plan"]) <= {0, 1, 2, 3} and set(t["workers_steps"]) <= {0, 1, 2, 3}
    t_no = main.predictions.iteration_s
    for which in ("plan", "steps"):
        s = bench.cost_savings(t[f"samples_per_s_{which}"] * t_no, t_no, t["samples_per_s_rtx3080"],
                               t["time_increase"], ratio)
        assert t[f"cost_savings_{which}"] == pytest.approx(s, rel=1e-9)
        assert t[f"cost_savings_{which}"] + t["time_increase"] >= 0
    # no more side-task work than all the bubble time at the side task's own rate on the RTX 6000 Ada
    bubble_s = sum(b.duration_s for b in main.bubbles)
    ceiling = bubble_s / t["step_s_ada"] * bench.FR_BATCH / t_no
    assert 0 < t["samples_per_s_steps"] <= ceiling
    assert 0 < t["samples_per_s_plan"] <= ceiling * (1 + 1e-9)
    assert t["samples_per_s_steps"] == pytest.approx(sum(t["steps_per_rank"]) * bench.FR_BATCH / t_no)
    assert t["cost_savings_steps_stated"] == t["cost_savings_steps"]  # FreeRide names no stage resnet18 misses


def test_freeride_free_memory_grows_along_the_pipeline(freeride_resnet18):
    """000 l.132-137: the later stages hold fewer activations, so their bubbles have more memory free."""
    main, _, _ = freeride_resnet18
    free = plan_hold_free(main)
    assert free == sorted(free) and free[0] > 0


@pytest.mark.parametrize(("arch", "params", "gmacs"), [("resnet18", 11_689_512, 1.814), ("resnet50", 25_557_032, 4.089),
                                                       ("vgg19", 143_667_240, 19.632)])
def test_vision_models_have_torchvision_shapes(arch, params, gmacs):
    """Parameter counts and forward FLOPs (2 x torchvision's GMACs at 224x224) of the traced models."""
    from passes.pipeline import analyze

    prof, _ = analyze(str(ROOT / "examples" / "vision.py"), {"arch": arch}, dtype="fp32")
    assert prof.total_params == params
    assert sum(u.fwd_flops(1) for u in prof.units) == pytest.approx(2 * gmacs * 1e9, rel=0.02)


def test_pipeswitch_row_prices_the_transmission_its_grouping_cannot_hide():
    out = bench.pipeswitch()
    row, resnet = out["rows"]
    assert row["paper"] == pytest.approx(10.27) and 0 < row["predicted"]
    assert row["ratio"] == pytest.approx(row["predicted"] / row["paper"])
    assert resnet["paper"] == pytest.approx(32.0) and 0 < resnet["predicted"]


def test_largest_finds_the_last_batch_size_that_fits():
    assert bench._largest(lambda b: b <= 137) == 137
    assert bench._largest(lambda b: False) == 0
    assert bench._largest(lambda b: True, hi=64) == 64


def test_waterwave_rows_pairing_keeps_most_of_one_jobs_batch():
    """Invariants of the Waterwave comparison (not the band): each of two paired jobs reaches at most the batch size
    of one job alone, and more than half of it (staggering, not halving); the paired throughput is not above running
    the two one after the other (our pair runs one unit at a time)."""
    rows = {r["figure"]: r["predicted"] for r in bench.waterwave()["rows"]}
    for name in bench.WATERWAVE_V100:
        alone, paired = rows[f"{name}: largest batch alone"], rows[f"{name}: largest batch, each of two paired"]
        assert 0.5 * alone < paired <= alone
    assert 0.9 < rows["resnet152 b32: paired throughput / one after the other"] <= 1.0
