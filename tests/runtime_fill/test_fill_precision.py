"""A fill job runs in the plan's precision, the one its units were priced in (planner/fill/profiles.py traces the
job in the main job's precision): inference in the dtype, training under autocast over fp32 weights, fp16 with a
dynamic loss scale. Checked against the same job run in fp32."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from passes.load import file_sha256
from planner.plan import FillJob
from planner.runtime.fill_executor import FillExecutor, FillExecutorOptions, TaskOptions
from planner.runtime.fill_task import UnitRunner

ROOT = Path(__file__).resolve().parents[2]
MLP, BERT = str(ROOT / "examples/mlp.py"), str(ROOT / "examples/bert.py")
MLP_ARGS = {"features": 32, "width": 64, "depth": 2}


def _runner(path: str, args: dict, kind: str, precision: str) -> UnitRunner:
    torch.manual_seed(0)
    job = FillJob(name="j", model_file=path, model_sha256=file_sha256(path), model_args=args, kind=kind,
                  batch_size=4, config="plain", units=[], unit_time_s=[], resident=True)
    return UnitRunner(job, TaskOptions(device="cpu", interface="iterative", iterations=None, precision=precision))


def test_inference_runs_in_the_plans_dtype() -> None:
    ref, half = _runner(BERT, {"preset": "tiny"}, "infer", "fp32"), _runner(BERT, {"preset": "tiny"}, "infer", "bf16")
    assert all(p.dtype == torch.bfloat16 for p in half.module.parameters())
    assert all(p.dtype == torch.float32 for p in ref.module.parameters())
    n = len(half.calls)
    for r in (ref, half):  # every forward unit but the last: its input is the one before's output
        for _ in range(n - 1):
            r.step()
    a, b = (r.env[r.calls[n - 2].name] for r in (ref, half))
    assert a.dtype == torch.float32 and b.dtype == torch.bfloat16
    assert torch.allclose(a, b.float(), rtol=0.05, atol=0.05 * float(a.abs().max()))
    assert half.step() and half.iterations == 1


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_training_runs_under_autocast_over_fp32_weights(precision: str) -> None:
    ref, half = _runner(MLP, MLP_ARGS, "train", "fp32"), _runner(MLP, MLP_ARGS, "train", precision)
    init = torch.cat([p.detach().reshape(-1).clone() for p in ref.module.parameters()])
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    assert (half.scaler is not None) == (precision == "fp16") and ref.scaler is None
    n = len(half.calls)
    for _ in range(n - 1):  # a forward unit's output is in the half dtype, the weights stay fp32
        half.step()
    assert half.env[half.calls[n - 2].name].dtype == dtype
    assert all(p.dtype == torch.float32 for p in half.module.parameters())
    half.step()
    assert half.loss is not None and half.loss.dtype == torch.float32  # the loss in fp32
    while half.pos < 5 * len(half.linearized):
        half.step()
    while ref.pos < 5 * len(ref.linearized):
        ref.step()
    assert half.iterations == ref.iterations == 5
    # five Adam steps: the same update as in fp32 up to half-precision rounding (a skipped fp16 step would be 20% short)
    da, db = (torch.cat([p.detach().reshape(-1) for p in r.module.parameters()]) - init for r in (ref, half))
    assert float(da.norm()) > 0 and float((db - da).norm() / da.norm()) < 0.1
    if precision == "fp16":  # no step skipped: the scale kept its first value (it grows after 2000 good steps)
        assert half.scaler.get_scale() == 2.0 ** 16


def test_the_executor_gives_its_tasks_the_plans_precision() -> None:
    from tests.runtime_fill.test_fill_executor import _job, _plan

    plan = _plan([_job("mlp", MLP, MLP_ARGS, "train", 4)], {0: "mlp"}, {0: 0.2}, 0.1)
    for precision in ("bf16", "fp32"):
        p = plan.model_copy(update={"config": plan.config.model_copy(update={"precision": precision})})
        ex = FillExecutor(p, 0, 0, "cpu", None, 0.01, FillExecutorOptions(), None, None)
        assert ex._task_options(p.fill.jobs[0]).precision == precision
