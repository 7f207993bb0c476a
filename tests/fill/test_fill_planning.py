"""Fill planning end to end: spec validation, profiles, joint choice, the plan's fill section."""
from __future__ import annotations

import pytest
from typer.testing import CliRunner

from passes.errors import UserError
from planner.api import make_plan
from planner.cli import app
from planner.fill.packing import validate_packing
from planner.fill.profiles import profile_job
from planner.fill.spec import FillJobSpec, FillSpec, Work, load_fill_spec
from planner.search import Pins
from costmodels.hardware import Hardware
from targets.registry import get_target
from tests.conftest import EXAMPLES, FIXTURES

GPT = {"preset": "7.5b"}


@pytest.fixture(scope="module")
def fill_plan():
    spec = load_fill_spec(EXAMPLES / "fill" / "jobs.yaml")
    plan, result = make_plan(str(EXAMPLES / "gpt.py"), gpus=32, global_batch=128, target="a100-80gb",
                             model_args=GPT, fill=spec, main_slack=0.05, pins=Pins(zero=0))  # replicated
    return plan, result  # optimizer state: the model needs a pipeline, whose bubbles the fill jobs take


def test_spec_paths_resolve_and_bad_fields_are_named(tmp_path):
    spec = load_fill_spec(EXAMPLES / "fill" / "jobs.yaml")
    assert all(j.model.endswith(".py") and j.model.startswith("/") for j in spec.jobs)
    with pytest.raises(UserError, match=r"jobs\.0\.kind"):
        load_fill_spec(FIXTURES / "bad_fill.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("jobs: [\n  - name: x\n")
    with pytest.raises(UserError, match="not valid YAML"):
        load_fill_spec(broken)
    with pytest.raises(ValueError, match="exactly one of samples or iterations"):
        Work(samples=1, iterations=2)


def test_training_profiles_cover_the_three_configurations():
    job = FillJobSpec(name="mlp", model=str(EXAMPLES / "mlp.py"), kind="train", batch_sizes=[16, 64],
                      work=Work(iterations=10))
    profs = profile_job(job, Hardware(target=get_target("a100-80gb")), "bf16")
    assert {(p.batch_size, p.config) for p in profs} == {(b, c) for b in (16, 64) for c in ("plain", "checkpoint", "offload")}
    by = {(p.batch_size, p.config): p for p in profs}
    plain, ckpt, off = by[64, "plain"], by[64, "checkpoint"], by[64, "offload"]
    n = (len(plain.units) - 1) // 2
    assert [u.name[:2] for u in plain.units] == ["F:"] * n + ["B:"] * n + ["OP"]
    assert max(u.mem_bytes for u in ckpt.units) < max(u.mem_bytes for u in plain.units)  # recomputation saves memory
    assert ckpt.iteration_s > plain.iteration_s  # ... and costs time
    assert off.resident_bytes == plain.resident_bytes // 4  # optimizer state left on the host


def test_joint_choice_packs_within_bubbles_and_reports(fill_plan):
    plan, result = fill_plan
    f = plan.fill
    assert f is not None and f.chunks
    bubbles = {(b.rank, b.id): b for b in plan.bubbles}
    for ch in f.chunks:
        b = bubbles[(ch.rank, ch.bubble_id)]
        assert ch.expected_s <= b.duration_s * (1 - f.safety_margin) + 1e-9
        assert ch.memory_bytes <= b.free_bytes
    assert 0 < f.predictions.bubble_time_used <= 1
    main_useful = f.predictions.total_useful_tflops_per_gpu - f.predictions.fill_tflops_per_gpu
    assert main_useful > 0
    # within the 5% slack of the best main configuration
    assert plan.predictions.iteration_s <= result.best.iteration_s * 1.05 + 1e-9


def test_unplaceable_job_is_reported_not_fatal():
    spec = load_fill_spec(FIXTURES / "huge_fill.yaml")
    plan, _ = make_plan(str(EXAMPLES / "gpt.py"), gpus=8, global_batch=32, target="a100-80gb",
                        model_args={"preset": "1.7b"}, fill=spec, pins=Pins(pp=4, schedule="1f1b"))
    assert "big-bert" in plan.fill.predictions.unplaceable
    assert "bubble" in plan.fill.predictions.unplaceable["big-bert"]
    assert any(c.job.startswith("mlp") for c in plan.fill.chunks)


def test_cli_fill_errors_are_one_clear_message():
    runner = CliRunner()
    for fill, needle in ((FIXTURES / "bad_fill.yaml", "jobs.0.kind"),
                         (FIXTURES / "untraceable_fill.yaml", "mark it a leaf")):
        res = runner.invoke(app, ["plan", str(EXAMPLES / "gpt.py"), "--gpus", "8", "--model-arg", "preset=1.7b",
                                  "--fill", str(fill)])
        text = res.stdout + (res.stderr or "")
        assert res.exit_code != 0 and needle in text and "Traceback" not in text


def test_simulate_fill_cli_runs_a_trace_through_a_plan(tmp_path):
    plan_path = tmp_path / "plan.json"
    runner = CliRunner()
    res = runner.invoke(app, ["plan", str(EXAMPLES / "gpt.py"), "--gpus", "8", "--model-arg", "preset=1.7b",
                              "--pp", "4", "--schedule", "1f1b", "-o", str(plan_path)])
    assert res.exit_code == 0, res.stdout
    for policy in ("fifo", "sjf"):
        res = runner.invoke(app, ["simulate-fill", str(plan_path), str(EXAMPLES / "fill" / "jobs.yaml"),
                                  "--policy", policy, "--json"])
        assert res.exit_code == 0, res.stdout
        import json

        data = json.loads(res.stdout)
        assert data["policy"] == policy and data["fill_tflops_per_gpu"] > 0
        assert 0 < data["bubble_time_used"] <= 1
        assert all(j["work_done"] <= j["work"] + 1e-6 for j in data["jobs"])


def test_fp16_main_job_on_a_v100_plans_with_a_fill_job():
    """Fill jobs are traced and priced in the main job's precision (they used to ask a V100 for a bf16 peak)."""
    spec = load_fill_spec(EXAMPLES / "fill" / "tiny-mlp.yaml")
    plan, _ = make_plan(str(EXAMPLES / "gpt.py"), gpus=8, global_batch=32, target="v100-32gb",
                        model_args={"preset": "1.7b"}, fill=spec, pins=Pins(pp=4, schedule="1f1b", precision="fp16"))
    assert plan.config.precision == "fp16" and plan.fill is not None
    assert plan.fill.chunks and not plan.fill.predictions.unplaceable


def test_fill_shared_by_mps_starts_the_daemon_before_torchrun_and_is_kept_by_a_repack():
    """A plan whose fill jobs share the GPUs by MPS launches the MPS control daemon on each node first, and packs
    the units at their own speed; re-packing it (validate --refit) keeps the sharing it was planned with."""
    from planner.launch import MPS_START

    spec = load_fill_spec(EXAMPLES / "fill" / "tiny-mlp.yaml")
    kw = dict(gpus=8, global_batch=32, target="a100-80gb", model_args={"preset": "1.7b"},
              pins=Pins(tp=1, pp=4, dp=2, b=1, schedule="1f1b", recompute="none"))
    sliced, mps = (make_plan(str(EXAMPLES / "gpt.py"), fill=spec.model_copy(update={"gpu_sharing": g}), **kw)[0]
                   for g in ("timeslice", "mps"))
    assert (sliced.fill.gpu_sharing, mps.fill.gpu_sharing) == ("timeslice", "mps")
    assert all(c.startswith(MPS_START + "; ") for c in mps.launch.commands)
    assert MPS_START in mps.launch.script and MPS_START not in sliced.launch.script
    assert not any(MPS_START in c for c in sliced.launch.commands)
    a, b = sliced.fill.jobs[0], mps.fill.jobs[0]  # tiny-mlp has one batch size: the same units, slower time-sliced
    assert a.units == b.units and all(x > y for x, y in zip(a.unit_time_s, b.unit_time_s))
    assert FillSpec.of_plan(mps.fill).gpu_sharing == "mps"
    fp = sliced.fill.predictions  # what MPS would buy on the time-sliced plan, reported beside it
    assert fp.under_mps_tflops_per_gpu > fp.fill_tflops_per_gpu and mps.fill.predictions.under_mps_tflops_per_gpu is None
    assert mps.config == sliced.config and mps.fill.predictions.offload_optimizer == fp.offload_optimizer  # pinned
    assert fp.under_mps_tflops_per_gpu == pytest.approx(mps.fill.predictions.fill_tflops_per_gpu, rel=1e-6)


def test_fill_jobs_are_priced_with_the_calibration():
    """A calibration scales the fill jobs' unit times as it scales the main model's."""
    from costmodels.calibration import Calibration, UnitFactor

    spec = load_fill_spec(EXAMPLES / "fill" / "tiny-mlp.yaml").model_copy(update={"gpu_sharing": "mps"})  # compute alone
    cal = Calibration(target="a100-80gb", device="cpu", dtype="bf16", model_file="mlp.py", batch=8,
                      unit_factors={"block": UnitFactor(fwd=3.0, bwd=3.0, units=2)})
    plans = [make_plan(str(EXAMPLES / "gpt.py"), gpus=8, global_batch=32, target="a100-80gb",
                       model_args={"preset": "1.7b"}, fill=spec, calibration=c,
                       pins=Pins(tp=1, pp=4, dp=2, b=1, schedule="1f1b", recompute="none"))[0]
             for c in (None, cal)]
    plain, calibrated = ({u: t for u, t in zip(p.fill.jobs[0].units, p.fill.jobs[0].unit_time_s)} for p in plans)
    blocks = [u for u in plain if u.startswith(("F:blocks", "B:blocks"))]
    assert blocks, list(plain)
    from planner.fill.profiles import profile_job
    from planner.plan import plan_hardware  # what simulate-fill prices fill jobs on: the plan's own efficiency

    def gpu(plan):  # each unit's GPU seconds (the plan's times are no less than the host's, which no calibration scales)
        prof = next(p for p in profile_job(spec.jobs[0], plan_hardware(plan), plan.config.precision)
                    if p.config == plan.fill.jobs[0].config)
        return {u.name: u.time_s if u.gpu_s is None else u.gpu_s for u in prof.units}

    gpu_plain, gpu_calibrated = gpu(plans[0]), gpu(plans[1])
    for u in blocks:
        assert gpu_calibrated[u] == pytest.approx(3.0 * gpu_plain[u]), u
        assert calibrated[u] >= plain[u] and calibrated[u] == pytest.approx(max(plain[u], 3.0 * gpu_plain[u])), u
    assert calibrated["OPT"] == pytest.approx(plain["OPT"])

    assert plan_hardware(plans[1]).eff.unit_factors == (("block", 3.0, 3.0),)
    assert plan_hardware(plans[0]).eff == Hardware(target=get_target("a100-80gb")).eff
