"""The model trained as its file writes it (issue 51, items 1-3), each at p = 2 against one process in fp32:

- torchtitan's Llama, whose RoPE is a complex64 buffer (`freqs_cis`): kept complex under the plan's precision, where
  `Module.to(dtype)` keeps its real part only and trains without rotary embedding;
- a Hugging Face causal LM whose loss_fn reads `output.logits`: the last stage hands it the ModelOutput the model
  returns, rebuilt from the exported graph's leaves;
- an encoder-decoder written with torch's nn.Transformer: the runtime splits the graph the plan was made from (its
  symbolic trace keeps each nn.Transformer layer stack as one call, other units than the plan's).
"""
from __future__ import annotations

import pytest

from planner.api import make_plan
from planner.search import Pins
from planner.validate import mismatches

from ._util import ROOT, launch_plans, reference

pytestmark = pytest.mark.multiprocess

STYLES = ROOT / "tests" / "fixtures" / "styles"
MODELS = {"titan_llama": ROOT / "examples" / "titan_llama.py", "hf_logits": STYLES / "hf_logits.py",
          "torch_transformer": STYLES / "torch_transformer.py"}
ARGS = {"titan_llama": dict(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, seq=32, vocab=256)}
B, STEPS, LR = 4, 2, 1e-3


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    pytest.importorskip("transformers", reason="the hf extra is not installed")
    plans = {}
    for name, path in MODELS.items():
        plans[name], _ = make_plan(str(path), gpus=2, global_batch=B, target="a100-80gb", gpus_per_node=2,
                                   model_args=ARGS.get(name, {}), pins=Pins(tp=1, pp=2, dp=1, precision="fp32"))
    return {"plans": plans, "runs": launch_plans(plans, tmp_path_factory.mktemp("as_written"), steps=STEPS,
                                                   optimizer="adam", lr=LR)}


@pytest.mark.parametrize("name", MODELS)
def test_trains_as_one_process_does(run, name):
    plan, measured = run["plans"][name], run["runs"][name]
    assert (plan.config.pp, plan.config.tp) == (2, 1)
    ref = reference(MODELS[name], ARGS.get(name, {}), global_batch=B, steps=STEPS, optimizer="adam", lr=LR)
    assert measured.loss == pytest.approx(ref["loss"], rel=1e-5), (measured.loss, ref["loss"])
    assert not [m for m in mismatches(plan, measured) if "saved activation" not in m]


def test_the_complex_rope_table_is_not_cast_to_real(tmp_path):
    """The one-process reference itself: torchtitan's model with its complex table against the same model whose table
    was cast as `Module.to(float32)` casts it (real part only) - they differ, so the test above can tell."""
    import torch

    from passes.load import load_model_file
    from planner.runtime.stage import to_precision

    mf = load_model_file(MODELS["titan_llama"], ARGS["titan_llama"])
    torch.manual_seed(0)
    kept = to_precision(mf.build("cpu", torch.float32), torch.float32)
    assert kept.freqs_cis.is_complex()
    torch.manual_seed(0)
    cast = mf.build("cpu", torch.float32)
    with pytest.warns(UserWarning, match="discards the imaginary part"):
        cast = cast.to(torch.float32)
    (tokens,), _ = mf.call("sample_batch", 2, 0)
    assert not torch.allclose(kept(tokens), cast(tokens))


def test_a_plan_without_a_loss_prints_no_launch_commands_and_launch_refuses_at_once(tmp_path):
    """Item 4: a model file without loss_fn plans (the planner prices it) but prints no launch commands, and `planner
    launch` refuses before torchrun starts, in one sentence."""
    from typer.testing import CliRunner

    from planner.cli import app

    runner = CliRunner()
    plan = tmp_path / "plan.json"
    result = runner.invoke(app, ["plan", str(ROOT / "tests" / "fixtures" / "no_loss.py"), "--gpus", "2",
                                 "--gpus-per-node", "2", "--target", "a100-80gb", "-o", str(plan)])
    assert result.exit_code == 0, result.stdout
    assert "torchrun" not in result.stdout and "cannot be launched" in result.stdout
    result = runner.invoke(app, ["launch", str(plan), "--local"])
    text = result.stdout + (result.stderr or "")
    assert result.exit_code == 2 and "defines no loss_fn()" in text and "Traceback" not in text, text
    assert "[rank" not in text  # refused before any rank started
