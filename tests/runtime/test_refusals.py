"""What the runtime cannot run is refused in one sentence naming the op and the model's source line (issue 22):
at plan time, and at launch for a plan pointed at another model file after planning."""
from __future__ import annotations

import pytest

from passes.errors import UserError
from passes.load import file_sha256
from planner.api import make_plan
from planner.plan import save_plan
from planner.search import Pins

from ._util import GPT, ROOT, torchrun

pytestmark = pytest.mark.multiprocess

CUMSUM = ROOT / "tests" / "runtime" / "fixtures" / "cumsum_mlp.py"
LINE = "cumsum_mlp.py:14 (`return self.fc2(F.gelu(self.fc1(x)).cumsum(-1))`)"
KW = dict(gpus=2, global_batch=4, target=str(ROOT / "examples" / "targets" / "cpu-core.yaml"), gpus_per_node=2,
          model_args={"preset": "tiny", "layers": 2, "dropout": 0})


def test_the_planner_leaves_out_or_refuses_a_split_the_runtime_cannot_run():
    """cumsum over the features cannot run on a tensor-parallel shard: sequence parallelism and then tensor
    parallelism are left out where the search chose them, refused in one sentence where the user pinned them."""
    plan, _ = make_plan(str(CUMSUM), pins=Pins(pp=1, precision="fp32"), **KW)
    assert plan.config.tp == 1
    with pytest.raises(UserError, match=r"the plan splits this model over 2 tensor-parallel ranks, .*`cumsum` "
                                        r"\(cumsum along the split dim\) at .*cumsum_mlp\.py:14.*re-plan with --tp 1"):
        make_plan(str(CUMSUM), pins=Pins(tp=2, pp=1, dp=1, precision="fp32"), **KW)
    with pytest.raises(UserError, match=r"the plan runs sequence parallelism, .*`cumsum`.* at .*cumsum_mlp\.py:14"):
        make_plan(str(CUMSUM), pins=Pins(tp=2, pp=1, dp=1, sp=True, precision="fp32"), **KW)


def test_the_runtime_refusal_names_the_op_and_its_line(tmp_path):
    """A plan made for examples/gpt.py, then pointed at the same model with the op the layout has no rule for."""
    plan, _ = make_plan(str(GPT), pins=Pins(tp=2, pp=1, dp=1, sp=True, precision="fp32"), **KW)
    source = plan.source.model_copy(update={"model_file": str(CUMSUM), "model_sha256": file_sha256(CUMSUM)})
    save_plan(plan.model_copy(update={"source": source}), tmp_path / "sp.json")
    proc = torchrun(2, [str(tmp_path / "sp.json"), "--steps", "1"], cwd=tmp_path)
    assert proc.returncode != 0
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "Megatron layout does not know" in line]
    assert lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "`cumsum`" in lines[0] and LINE in lines[0] and "re-plan with --no-sequence-parallel" in lines[0]


def test_a_cnn_is_not_credited_with_sequence_parallelism():
    """Issue 22: a CNN's plan credited sequence parallelism with halving its convolutions, which never split; the
    runtime's layout splits no module of it, so the planner leaves sequence parallelism out and says so."""
    plan, _ = make_plan(str(ROOT / "examples" / "vision.py"), gpus=2, global_batch=16, target="a100-80gb",
                        gpus_per_node=2, model_args={"arch": "resnet18"}, pins=Pins(tp=2, pp=1, dp=1))
    assert not plan.config.sp
    assert any("it splits no module of this model" in k for k in plan.search.rejected)
