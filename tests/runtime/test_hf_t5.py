"""An encoder-decoder under the runtime (issue 22): Hugging Face T5 split into pipeline stages across the encoder
and the decoder (three segments outside the blocks share the root module's name), under 1F1B and a zero-bubble V
schedule, trains as one process does."""
from __future__ import annotations

import pytest

from planner.api import make_plan
from planner.search import Pins

from ._util import ROOT, launch_plans, reference

pytestmark = pytest.mark.multiprocess

T5 = ROOT / "examples" / "hf_t5.py"
TINY = {"layers": 2, "d_model": 64, "d_ff": 128, "heads": 4, "vocab": 256, "seq": 16}
B, STEPS, LR = 4, 3, 0.01
CASES = {"p2": dict(pp=2, v=1, schedule="1f1b"), "p2_zbv": dict(pp=2, v=2, schedule="zbv")}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    pytest.importorskip("transformers", reason="the hf extra is not installed")
    tmp = tmp_path_factory.mktemp("t5")
    plans = {}
    for name, pins in CASES.items():
        plan, _ = make_plan(str(T5), gpus=2, global_batch=B, target="a100-80gb", gpus_per_node=2, model_args=TINY,
                            pins=Pins(tp=1, dp=1, b=1, recompute="none", precision="fp32", **pins))
        assert [u for s in plan.partition for u in s.units].count("t5") == 3  # same-named segments, three stages
        plans[name] = plan
    return {"plans": plans, "runs": launch_plans(plans, tmp, steps=STEPS, optimizer="sgd", lr=LR)}


@pytest.mark.parametrize("name", list(CASES))
def test_t5_split_across_encoder_and_decoder_trains_as_one_process_does(run, name):
    ref = reference(T5, TINY, global_batch=B, steps=STEPS, optimizer="sgd", lr=LR)
    assert run["runs"][name].loss == pytest.approx(ref["loss"], rel=1e-5)  # fp32: summation order only
