"""What the runtime cannot run is refused in one sentence naming the op and the model's source line (issue 22)."""
from __future__ import annotations

import pytest

from planner.api import make_plan
from planner.plan import save_plan
from planner.search import Pins

from ._util import ROOT, torchrun

pytestmark = pytest.mark.multiprocess

CUMSUM = ROOT / "tests" / "runtime" / "fixtures" / "cumsum_mlp.py"


def test_sequence_parallelism_over_an_op_without_a_rule_names_the_op_and_its_line(tmp_path):
    plan, _ = make_plan(str(CUMSUM), gpus=2, global_batch=4, target=str(ROOT / "examples" / "targets" / "cpu-core.yaml"),
                        gpus_per_node=2, model_args={"preset": "tiny", "layers": 2, "dropout": 0},
                        pins=Pins(tp=2, pp=1, dp=1, sp=True, precision="fp32"))
    save_plan(plan, tmp_path / "sp.json")
    proc = torchrun(2, [str(tmp_path / "sp.json"), "--steps", "1"], cwd=tmp_path)
    assert proc.returncode != 0
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "Megatron layout does not know" in line]
    assert lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "`cumsum`" in lines[0] and "cumsum_mlp.py:14 (`return self.fc2(F.gelu(self.fc1(x)).cumsum(-1))`)" in lines[0]
    assert "re-plan with --no-sequence-parallel" in lines[0]
