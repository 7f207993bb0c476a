"""Hugging Face models under the runtime (real torchrun, gloo, 2 processes): stages are split from the same
torch.export graph the plan was made from, and training matches a single process."""
from __future__ import annotations


import pytest

from planner.api import make_plan
from planner.search import Pins
from planner.validate import mismatches

from ._util import ROOT, launch_plans, percent, reference

pytestmark = pytest.mark.multiprocess

LLAMA = ROOT / "examples" / "hf_llama.py"
TINY = {"layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 256, "seq": 32}
B, STEPS, LR = 4, 2, 1e-3
CASES = {"p2": dict(tp=1, pp=2, dp=1, b=1, schedule="1f1b"), "d2": dict(tp=1, pp=1, dp=2, b=2, schedule="1f1b"),
         "t2": dict(tp=2, pp=1, dp=1, b=2, schedule="1f1b"),  # grouped-query attention: 4 heads, 2 kv heads
         # context parallelism: RoPE's cos/sin and the causal mask are computed whole, attention is ring attention
         "cp2": dict(tp=1, pp=1, dp=1, cp=2, b=2, schedule="1f1b"),
         # one kv head for two tensor-parallel ranks: each holds it whole, their gradients summed
         "t2_mqa": dict(tp=2, pp=1, dp=1, b=2, schedule="1f1b"),
         # sequence parallelism on the exported graph: RMSNorm written out (pow, mean, rsqrt, mul) runs on 1/t of
         # the sequence, the column-parallel linears gather it, the row-parallel ones reduce-scatter
         "t2_sp": dict(tp=2, pp=1, dp=1, b=2, schedule="1f1b", sp=True),
         # Qwen2: q, k and v projections with biases (each rank keeps its rows of them), sequence-parallel
         "qwen2_t2_sp": dict(tp=2, pp=1, dp=1, b=2, schedule="1f1b", sp=True),
         # multi-token prediction (_hf_models.MultiTokenPrediction) on the last stage, with the loss: its own copy of
         # the embedding, whose gradient joins the first stage's as a tied weight's does
         "mtp_p2": dict(tp=1, pp=2, dp=1, b=1, schedule="1f1b")}
MODELS = {"qwen2_t2_sp": ROOT / "examples" / "hf_qwen2.py"}
MODEL_ARGS = {"t2_mqa": {**TINY, "num_key_value_heads": 1}, "mtp_p2": {**TINY, "mtp": 1}}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    pytest.importorskip("transformers", reason="the hf extra is not installed")
    tmp = tmp_path_factory.mktemp("hf")
    plans = {}
    for name, pins in CASES.items():
        plan, _ = make_plan(str(MODELS.get(name, LLAMA)), gpus=2, global_batch=B, target="a100-80gb", gpus_per_node=2,
                            model_args=MODEL_ARGS.get(name, TINY),
                            pins=Pins(**{"cp": 1, "sp": False, **pins}, v=1, recompute="none", precision="fp32"))
        assert plan.source.frontend == "export"
        plans[name] = plan
    return {"plans": plans, "runs": launch_plans(plans, tmp, steps=STEPS, optimizer="adam", lr=LR)}


@pytest.mark.parametrize("name", list(CASES))
def test_llama_trains_from_its_exported_graph_as_one_process_does(run, name):
    ref = reference(MODELS.get(name, LLAMA), MODEL_ARGS.get(name, TINY), global_batch=B, steps=STEPS, optimizer="adam", lr=LR)
    assert run["runs"][name].loss == pytest.approx(ref["loss"], abs=1e-5)
    found = mismatches(run["plans"][name], run["runs"][name])
    # the last stage's logits head saves more than the plan's formula counts for a model this small; and on CPU
    # scaled_dot_product_attention writes its output (b, h, s, d), so o_proj's input is a copy of it (a GPU flash
    # kernel writes (b, s, h, d): a view), 8 KiB a layer here, past 5% of what sequence parallelism leaves
    tolerated = {"p2": ("stage 1 saved activation", 0.2), "mtp_p2": ("stage 1 saved activation", 0.2), "t2_sp": ("stage 0 saved activation", 0.1),
                 "qwen2_t2_sp": ("stage 0 saved activation", 0.1)}
    row, bound = tolerated.get(name, ("", 0.0))
    assert not [m for m in found if not (row and row in m and percent(m) < 100 * bound)], found
    if "t2" in name:  # q, k, v and the MLP split over the two ranks, attention by (kv) heads
        held = {r.holds.parameters for r in run["runs"][name].ranks}
        assert held == {run["plans"][name].predictions.memory[0].weights / 4}  # (the one kv head on both)
        assert len(run["runs"][name].ranks[0].holds.tensor_parallel) == 14
    if name == "t2_sp":  # the norms and the residual stream on half the sequence: fewer bytes kept than at t2
        sp, plain = (run["runs"][n].ranks[0].holds.saved_activation_bytes["0"] for n in ("t2_sp", "t2"))
        assert sp < 0.85 * plain

