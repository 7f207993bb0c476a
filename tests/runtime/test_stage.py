"""Stage building without processes: split programs, routing of skip values, tied weights, checks."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from passes.errors import UserError
from passes.load import load_model_file
from planner.metrics import METRICS_SCHEMA, MetricsDocument
from planner.plan import Plan, load_plan
from planner.runtime import check_plan, summarize
from planner.runtime.executor import ActionError, failure_text
from planner.runtime.stage import StageModule, TensorSpec, boundary_specs, build_split
from planner.schedule_ir import Action

from ._util import GPT, SKIPNET, gpt_args, plan_file


@pytest.fixture(scope="module")
def gpt_plan(tmp_path_factory) -> Plan:
    path = tmp_path_factory.mktemp("stage") / "gpt.json"
    return plan_file(path, GPT, gpt_args(4), gpus=2, global_batch=4, t=1, p=2, d=1, b=1, v=2,
                     schedule="interleaved", recompute="full")


@pytest.fixture(scope="module")
def skip_plan(tmp_path_factory) -> Plan:
    path = tmp_path_factory.mktemp("stage") / "skip.json"
    return plan_file(path, SKIPNET, {}, gpus=4, global_batch=8, t=1, p=4, d=1, b=2, v=1, schedule="1f1b")


def _pipeline(plan: Plan, model_path: Path, model_args: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Run every stage in order in this process (no p2p): the pipeline's output and the model's."""
    mf = load_model_file(model_path, model_args)
    torch.manual_seed(0)
    model = mf.build("cpu", torch.float32)
    split = build_split(model, plan, mf)
    specs = boundary_specs(mf, plan)
    consts = {k: v for k, v in specs.items() if not isinstance(v, TensorSpec)}
    stages = [StageModule(split, k, consts) for k in range(len(plan.partition))]
    inputs, _ = mf.call("sample_batch", plan.config.microbatch, 0)
    received: dict = {}
    out = None
    for st in stages:
        assert set(received) == set(st.program.recv)
        for name, value in received.items():  # tensors as the shape pass says; a size (export's) is a constant
            spec = specs[name]
            assert tuple(value.shape) == spec.shape if isinstance(spec, TensorSpec) else value == spec == consts[name]
        sends, out = st.run(received, inputs)
        received = dict(zip(st.program.send, sends))
    return out, model(*inputs)


def test_stages_in_sequence_equal_the_model(gpt_plan: Plan) -> None:
    got, want = _pipeline(gpt_plan, GPT, gpt_args(4))
    assert torch.equal(got, want)


def test_skip_value_travels_through_middle_stages(skip_plan: Plan) -> None:
    mf = load_model_file(SKIPNET)
    split = build_split(mf.build("cpu", torch.float32), skip_plan, mf)
    # the stem's output, read again by the head on the last stage, crosses every boundary
    crossing = set.intersection(*(set(p.recv) for p in split.programs[1:]))
    assert len(crossing) == 1 and all(crossing <= set(p.send) for p in split.programs[:-1])
    assert all(len(p.send) == 2 for p in split.programs[:-1])
    got, want = _pipeline(skip_plan, SKIPNET, {})
    assert torch.equal(got, want)


def test_tied_weight_has_both_end_ranks_as_holders(gpt_plan: Plan) -> None:
    mf = load_model_file(GPT, gpt_args(4))
    split = build_split(mf.build("cpu", torch.float32), gpt_plan, mf)
    assert split.holders["embedding.tok.weight"] == {0, 1}  # stage 0 on rank 0, stage 3 on rank 1
    assert all(len(r) == 1 for n, r in split.holders.items() if n != "embedding.tok.weight")
    assert [p.rank for p in split.programs] == [0, 1, 0, 1]
    # recompute 'full': every block unit is its own checkpointed piece
    assert sum(pc.checkpoint for pc in split.pieces) == 4


def test_boundary_specs_are_microbatch_shaped(gpt_plan: Plan) -> None:
    specs = boundary_specs(load_model_file(GPT, gpt_args(4)), gpt_plan)
    mf = load_model_file(GPT, gpt_args(4))
    split = build_split(mf.build("meta", torch.float32), gpt_plan, mf)
    for prog in split.programs[:-1]:
        assert [specs[n] for n in prog.send if isinstance(specs[n], TensorSpec)] == [
            TensorSpec(shape=(1, 32, 64), dtype=torch.float32)]


def test_failure_shows_grid_with_mark(gpt_plan: Plan) -> None:
    acts = gpt_plan.actions[1]
    step = next(i for i, a in enumerate(acts) if a.endswith("B0") and "SEND" not in a and "RECV" not in a)
    text = failure_text(gpt_plan, ActionError(1, step, Action.parse(acts[step]), ValueError("boom")))
    assert "pipeline rank 1" in text and "ValueError: boom" in text
    assert f"> rank 1, step {step}: {acts[step]}" in text
    assert any(line.startswith("rank 1") and ">" + acts[step] in line for line in text.splitlines())


# ---------------------------------------------------------------------------------------------
# Checks before any collective (no processes needed)


def test_check_plan_accepts_good_plan(small_plan: Path) -> None:
    checked = check_plan(small_plan, 2)
    assert checked.plan.config.pp == 2 and checked.model_file == GPT


@pytest.mark.parametrize("edit, world, message", [
    (lambda d: d["source"].update(model_sha256="0" * 64), 2, "has sha256"),
    (lambda d: d.update(schema="fxplanner.plan/v0"), 2, "has schema 'fxplanner.plan/v0'"),
    (lambda d: None, 4, "needs tp*cp*pp*dp = 1*1*2*1 = 2 processes, but this launch has WORLD_SIZE=4"),
    (lambda d: d["source"].update(model_file="/nonexistent/model.py"), 2, "does not exist here"),
    (lambda d: d["source"].update(global_batch=5), 2, "is inconsistent: config.dp*microbatch*microbatches = 4 samples "
     "but source.global_batch = 5"),
    (lambda d: d["actions"][1].remove("1RECV_F0"), 2, "(1F0): needs 1RECV_F0 earlier on rank 1"),
    (lambda d: (d["config"].update(tp=2, sp=True, tp_comm_overlap=True), d["source"].update(gpus=4),
                d["launch"].update(nproc_per_node=4)), 4,
     "tensor-parallel communication overlap (Transformer Engine's userbuffers), which this runtime does not run"),
    (lambda d: d["config"].update(vp=2), 2, "field config: schedule 1f1b with pp=2 v=2"),
    (lambda d: d["config"].update(fp8="delayed", precision="bf16"), 2, "runs its linear layers' GEMMs in FP8 (delayed), which this "
     "runtime does not run"),
])
def test_check_plan_rejects(small_plan: Path, tmp_path: Path, edit, world: int, message: str) -> None:
    data = json.loads(small_plan.read_text())
    edit(data)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(UserError, match=re.escape(message)):
        check_plan(bad, world)


def test_model_path_relative_to_plan(small_plan: Path, tmp_path: Path) -> None:
    shutil.copy(GPT, tmp_path / "gpt.py")
    data = json.loads(small_plan.read_text())
    data["source"]["model_file"] = "gpt.py"
    (tmp_path / "plan.json").write_text(json.dumps(data))
    assert check_plan(tmp_path / "plan.json", 2).model_file == tmp_path / "gpt.py"
    assert load_plan(tmp_path / "plan.json").source.model_file == "gpt.py"


def test_summarize(gpt_plan: Plan) -> None:
    step = lambda i, t, loss: {"step": i, "iteration_s": t, "loss": loss, "fill": False, "stages": {},  # noqa: E731
                               "peak_memory_bytes": None, "bubbles": [{"id": 0, "start_s": 0.0, "duration_s": 0.01,
                                                                       "predicted_start_s": None, "predicted_s": None}]}
    rank = lambda r, steps: {"rank": r, "pp": r, "dp": 0, "tp": 0, "stages": [r], "steps": steps,  # noqa: E731
                             "fill_report": {}, "fill_client": "NullFill", "characterization": None}
    ranks = [rank(0, [step(0, 0.5, None), step(1, 0.2, None)]), rank(1, [step(0, 0.4, 2.0), step(1, 0.3, 1.0)])]
    run = {"plan": "p.json", "config": gpt_plan.config.model_dump(), "world": 2, "device": "cpu", "steps": 2,
           "fill": False, "optimizer": "adam", "lr": 1e-3, "seed": 0, "dtype": "float32", "loss": [2.0, 1.0],
           "predicted_iteration_s": 0.1, "ranks": ranks}
    rows = summarize(MetricsDocument.model_validate({"schema": METRICS_SCHEMA, "runs": [run]}))
    got = [(r["step"], r["loss"], r["iteration_s"], r["bubbles"]) for r in rows]
    assert got == [(0, 2.0, 0.5, 2), (1, 1.0, 0.3, 2)]
    assert rows[0]["bubble_s"] == pytest.approx(0.01)


def test_loss_scaler_halves_on_overflow_and_doubles_after_a_window_of_good_steps() -> None:
    from planner.runtime.executor import LossScaler

    s = LossScaler(scale=1024.0, window=3)
    assert not s.update(False) and s.applied == 1024.0 and s.scale == 512.0  # skipped; these gradients carry 1024
    assert s.update(True) and s.update(True) and s.scale == 512.0
    assert s.update(True) and s.applied == 512.0 and s.scale == 1024.0  # the third good step in a row doubles it
    assert not s.update(False) and s.scale == 512.0 and s.good == 0


CUMULATIVE = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.out = nn.Linear(16, 64)

    def forward(self, tokens):
        return self.out(self.emb(tokens).cumsum(1))  # each position sees every earlier one: not split by position


def build_model():
    return Net()


def example_inputs(batch_size=1):
    return (torch.zeros(batch_size, 16, dtype=torch.long),)


def sample_batch(batch_size, step):
    data = torch.randint(0, 64, (batch_size, 17), generator=torch.Generator().manual_seed(step))
    return (data[:, :-1],), data[:, 1:]


def loss_fn(output, targets):
    return torch.nn.functional.cross_entropy(output.reshape(-1, 64), targets.reshape(-1))
'''


def test_context_parallelism_refuses_an_op_along_the_sequence_it_cannot_split(tmp_path) -> None:
    from planner.runtime.context_parallel import ContextParallel
    from planner.runtime.stage import boundary_specs, build_split

    model = tmp_path / "cumulative.py"
    model.write_text(CUMULATIVE)
    with pytest.raises(UserError, match=r"context-parallel rules do not place \(`cumsum` \(cumsum along the sequence\) "
                                        r"at .*cumulative.py:\d+.*re-plan with --cp 1"):  # known at plan time
        plan_file(tmp_path / "plan.json", model, {}, gpus=2, global_batch=4, t=1, p=1, d=1, b=2, v=1,
                  schedule="1f1b", cp=2)
    # and the runtime's own walk (the same rules) refuses it when its ranks build their stages
    plan = plan_file(tmp_path / "plan.json", model, {}, gpus=1, global_batch=4, t=1, p=1, d=1, b=2, v=1,
                     schedule="1f1b", cp=1)
    mf = load_model_file(model, {})
    split = build_split(mf.build("cpu", torch.float32), plan, mf)
    whole: dict = {}
    specs = boundary_specs(mf, plan, whole)
    with pytest.raises(UserError, match=r"cannot place \(cumsum.*along the sequence\); re-plan with --cp 1"):
        ContextParallel(size=2, rank=0, seq=16, specs=specs, inner=whole).apply(split.split)
    with pytest.raises(UserError, match="does not split the 16-token sequence into 2\\*cp equal chunks"):
        ContextParallel(size=3, rank=0, seq=16)
