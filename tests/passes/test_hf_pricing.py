"""Hugging Face models priced from their transformers configs (meta tensors, no downloads).

For each family: parameters exact against the closed form of its config, forward FLOPs of a block
within 2% of the closed form, bytes saved per block within 5% of what autograd saves on real CPU
tensors at a small size, every linear of a block tensor-parallel, and the conservation check.
"""
from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

transformers = pytest.importorskip("transformers")

from passes.meta_keys import TP, UNIT  # noqa: E402
from passes.pipeline import analyze  # noqa: E402
from examples._hf_models import PRESETS  # noqa: E402
from planner.search import tp_reason  # noqa: E402
from tests.conftest import EXAMPLES  # noqa: E402

SEQ = 128


def _dense_llama(c: dict) -> tuple[int, int, int, int, int]:
    h, ffn, L = c["hidden_size"], c["intermediate_size"], 2
    kv = c["num_key_value_heads"] * h // c["num_attention_heads"]
    return h, ffn, L, kv, c["vocab_size"]


def llama_params(c: dict, bias: bool = False) -> int:
    h, ffn, L, kv, V = _dense_llama(c)
    block = 2 * h * h + 2 * h * kv + 3 * h * ffn + 2 * h + ((h + 2 * kv) if bias else 0)
    return V * h + L * block + h + (0 if c.get("tie_word_embeddings") else V * h)


def llama_block_flops(c: dict) -> float:
    h, ffn, _, kv, _ = _dense_llama(c)
    return 2 * SEQ * (2 * h * h + 2 * h * kv + 3 * h * ffn) + 4 * SEQ * SEQ * h


def gpt2_params(c: dict) -> int:
    h, L = c["n_embd"], 2
    return c["vocab_size"] * h + c["n_positions"] * h + L * (12 * h * h + 13 * h) + 2 * h


def bert_params(c: dict) -> int:
    h, ffn, L, V = c["hidden_size"], c["intermediate_size"], 2, c["vocab_size"]
    emb = (V + c["max_position_embeddings"] + 2) * h + 2 * h
    block = 4 * h * h + 4 * h + 2 * h + 2 * h * ffn + ffn + h + 2 * h
    head = h * h + h + 2 * h + V  # transform dense, LayerNorm, decoder bias (weight tied)
    return emb + L * block + head


def wide_flops(c: dict, h_key: str) -> float:
    h = c[h_key]
    return 24 * SEQ * h * h + 4 * SEQ * SEQ * h


CASES = {  # family: (preset, params(config), block FLOPs(config))
    "llama": ("llama3-8b", llama_params, llama_block_flops),
    "mistral": ("mistral-7b", llama_params, llama_block_flops),
    "qwen2": ("qwen2-7b", lambda c: llama_params(c, bias=True), llama_block_flops),
    "gpt2": ("gpt2-xl", gpt2_params, lambda c: wide_flops(c, "n_embd")),
    "bert": ("bert-large", bert_params, lambda c: wide_flops(c, "hidden_size")),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def priced(request):
    family = request.param
    preset = CASES[family][0]
    prof, ctx = analyze(EXAMPLES / f"hf_{family}.py", {"layers": 2, "seq": SEQ})
    return family, PRESETS[preset][1], prof, ctx


def test_parameters_are_exact(priced):
    family, config, prof, ctx = priced
    assert prof.total_params == CASES[family][1](config)
    assert prof.frontend == "export"


def test_block_flops_match_the_closed_form(priced):
    family, config, prof, _ = priced
    block = next(u for u in prof.units if u.kind == "block")
    flops = block.sharded.model_flops(1) + block.replicated.model_flops(1)
    assert flops == pytest.approx(CASES[family][2](config), rel=0.02)
    assert block.fwd_flops(1) == pytest.approx(flops, rel=0.02)  # causal halving and elementwise are small here


def test_every_linear_of_a_block_is_tensor_parallel(priced):
    family, config, prof, ctx = priced
    block = next(u for u in prof.units if u.kind == "block")
    roles = Counter(n.meta[TP] for n in ctx.gm.graph.nodes if n.meta.get(UNIT) == block.index)
    cols = {"gpt2": 2, "bert": 4}.get(family, 5)  # GPT-2's fused c_attn; BERT's q, k, v, intermediate
    if family == "gpt2":  # Conv1D is no nn.Linear: the fxplanner runtime cannot split it, so neither is it priced
        assert (roles["col"], roles["row"], block.tp_layout) == (0, 0, ())  # split; Megatron's own linears are:
        prof, ctx = analyze(EXAMPLES / "hf_gpt2.py", {"layers": 2, "seq": SEQ}, kernels="megatron")
        block = next(u for u in prof.units if u.kind == "block")
        roles = Counter(n.meta[TP] for n in ctx.gm.graph.nodes if n.meta.get(UNIT) == block.index)
    assert (roles["col"], roles["row"]) == (cols, 2)
    if family != "gpt2":
        assert len(block.tp_layout) == cols + 2
    t = 5 if family == "gpt2" else 2  # GPT-2 XL has 25 heads
    assert tp_reason(t, [(block.heads, block.kv_heads)]) is None
    assert block.tp_allreduces == 2
    assert ctx.conservation.flops_ok and not prof.unpriced


TINY = {
    "llama": dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=512),
    "mistral": dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                    vocab_size=512),
    "qwen2": dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=512),
    "gpt2": dict(n_embd=128, n_head=4, vocab_size=512, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "bert": dict(hidden_size=128, intermediate_size=512, num_attention_heads=4, vocab_size=512,
                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
}


def _saved_on_cpu(model: torch.nn.Module, ids: torch.Tensor, block: torch.nn.Module) -> int:
    """Bytes autograd saves while `block` runs forward, on real CPU tensors (storages once, no weights)."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}
    active = [False]

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if active[0] and ptr not in weights:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    hooks = [block.register_forward_pre_hook(lambda m, a: active.__setitem__(0, True)),
             block.register_forward_hook(lambda m, a, o: active.__setitem__(0, False))]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids)
    for h in hooks:
        h.remove()
    return sum(seen.values())


@pytest.mark.parametrize("family", sorted(TINY))
def test_bytes_saved_per_block_match_autograd_on_cpu(family, tmp_path):
    preset = CASES[family][0]
    fields = PRESETS[preset][1] | TINY[family]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(fields))
    args = {"config": str(path), "layers": 2, "seq": 64}
    prof, _ = analyze(EXAMPLES / f"hf_{family}.py", args, dtype="bf16")
    planned = next(u for u in prof.units if u.kind == "block")
    from examples import _hf_models as hf

    torch.manual_seed(0)
    model = hf.build(family, config=str(path), layers=2).to(torch.bfloat16).train()
    blocks = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)][0]
    ids = torch.randint(0, 512, (2, 64))
    measured = _saved_on_cpu(model, ids, blocks[1])
    priced_bytes = planned.sharded.saved_bytes(2) + planned.replicated.saved_bytes(2)
    assert priced_bytes == pytest.approx(measured, rel=0.05)


def test_a_config_json_on_disk_and_a_bad_preset(tmp_path):
    from passes.errors import ModelFileError
    from examples import _hf_models as hf

    path = tmp_path / "config.json"
    path.write_text(json.dumps(PRESETS["llama3-8b"][1]))
    with torch.device("meta"):
        model = hf.build("llama", config=str(path), layers=1)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.use_cache is False
    with pytest.raises(ModelFileError, match="unknown llama preset 'llama9'; known: llama3-8b"):
        hf.build("llama", "llama9")


def test_mixture_of_experts_is_priced_at_the_routed_top_k():
    c = PRESETS["mixtral-8x7b"][1]
    prof, _ = analyze(EXAMPLES / "hf_mixtral.py", {"layers": 2, "seq": SEQ})
    block = next(u for u in prof.units if u.kind == "block")
    h, ffn, kv = c["hidden_size"], c["intermediate_size"], 1024
    routed = 2 * SEQ * (2 * h * h + 2 * h * kv + 2 * 3 * h * ffn + h * 8) + 4 * SEQ * SEQ * h  # top-2, router
    assert block.sharded.model_flops(1) + block.replicated.model_flops(1) == pytest.approx(routed, rel=0.02)
    assert block.params == 2 * h * h + 2 * h * kv + 8 * 3 * h * ffn + 8 * h + 2 * h  # all 8 experts in the unit
    assert (block.experts, block.top_k, block.moe.params) == (8, 2, 8 * 3 * h * ffn)  # what expert parallelism divides
    assert any("expert parallelism divides the experts" in n for n in prof.notes)


def test_planning_the_llama_example_on_64_a100s_prints_an_honest_mfu():
    import re

    from typer.testing import CliRunner

    from planner.cli import app

    res = CliRunner().invoke(app, ["plan", str(EXAMPLES / "hf_llama.py"), "--gpus", "64", "--target", "a100-80gb",
                                   "--model-arg", "layers=8", "-o", "/dev/null"])
    assert res.exit_code == 0, res.stdout
    mfu = float(re.search(r"MFU ([0-9.]+)% \(PaLM\)", res.stdout).group(1))
    from costmodels.hardware import Efficiency
    from targets.registry import get_target

    gemms = 100 * get_target("a100-80gb").gpu.matmul_ceiling * Efficiency().gemm_max  # 67% of the A100 peak
    assert 30 < mfu <= gemms  # flash attention runs slower still: no step beats its GEMMs' rate
    assert "tokens/s" in res.stdout


def test_the_losss_saved_tensors_are_priced_on_the_last_unit():
    """Cross-entropy keeps an fp32 log-softmax of the logits for its backward (4 bytes x s x V per sample, 4.2 GB
    for Llama 3 at s = 8192): measured by running the model file's loss_fn on meta tensors, on the last unit."""
    c = PRESETS["llama3-8b"][1]
    prof, _ = analyze(EXAMPLES / "hf_llama.py", {"layers": 2, "seq": SEQ})
    last = prof.units[-1]
    per_sample = 4 * SEQ * c["vocab_size"] + 8 * SEQ  # fp32 log-probabilities, int64 targets
    assert last.loss_bytes(1) == pytest.approx(per_sample, rel=1e-3)
    assert last.loss_bytes(4) == pytest.approx(4 * per_sample, rel=1e-3)
    assert all(not u.loss_bytes(1) for u in prof.units[:-1])
    # its backward holds two fp32 logit-sized gradients at once (nll_loss's, log_softmax's) beside it
    assert last.loss_work(2) == pytest.approx(2 * 2 * 4 * SEQ * c["vocab_size"], rel=1e-3)
    assert all(not u.loss_work(1) for u in prof.units[:-1])


def test_multi_head_latent_attention_splits_as_megatron_core_splits_it():
    """DeepSeek-V3's MLA: the down-projections and the latents' norms stay whole on every tensor-parallel rank, the
    up-projections are column-parallel over the 128 heads and the output projection row-parallel; the rotary key,
    one head shared by all, is read whole. A per-head q/k norm (Qwen3) splits with its heads."""
    from passes.meta_keys import MODULE, TP
    from passes.tp import linear_shape

    prof, ctx = analyze(EXAMPLES / "hf_deepseek_v3.py", {"layers": 2, "first_k_dense_replace": 1, "seq": 512})
    roles = {n.meta[MODULE].rsplit(".", 1)[-1]: n.meta[TP] for n in ctx.gm.graph.nodes
             if linear_shape(n, ctx.gm) and n.meta.get(MODULE, "").startswith("model.layers.1.self_attn")}
    assert roles == {"q_a_proj": "replicated", "q_b_proj": "col", "kv_a_proj_with_mqa": "replicated",
                     "kv_b_proj": "col", "o_proj": "row"}
    assert [(u.heads, u.kv_heads) for u in prof.units if u.kind == "block"] == [(128, 128)] * 2
    qwen, _ = analyze(EXAMPLES / "hf_qwen3_moe.py", {"preset": "qwen3-30b-a3b", "layers": 2, "seq": 512})
    block = next(u for u in qwen.units if u.kind == "block")
    assert (block.heads, block.kv_heads) == (32, 4) and block.sharded.fused_attention


def test_multi_token_prediction_is_priced_with_the_loss():
    """DeepSeek-V3's multi-token prediction (mtp=1, _hf_models.MultiTokenPrediction) lives in the head unit, with the
    loss, as Megatron-Core runs it: one more layer of the model's last kind (a mixture-of-experts layer, routed as
    the others), the 2h -> h projection of its two normalized inputs, its own copy of the embedding, and a second
    vocabulary-parallel pass of the shared output layer with its cross-entropy. The export writes --mtp-num-layers
    and an 'mL' last stage."""
    from planner.export import _pipeline_layout_arg

    args = {"layers": 2, "first_k_dense_replace": 1, "seq": SEQ}
    plain, _ = analyze(EXAMPLES / "hf_deepseek_v3.py", args, kernels="megatron")
    prof, ctx = analyze(EXAMPLES / "hf_deepseek_v3.py", {**args, "mtp": 1}, kernels="megatron")
    c = PRESETS["deepseek-v3"][1]
    h, V = c["hidden_size"], c["vocab_size"]
    moe = prof.units[2]
    head, old = prof.units[-1], plain.units[-1]
    assert [u.kind for u in prof.units] == ["embedding", "block", "block", "head"]
    assert head.params == old.params + V * h + moe.params + 2 * h * h + 3 * h  # + embedding copy, layer, eh_proj, norms
    assert prof.total_params == plain.total_params + moe.params + 2 * h * h + 3 * h  # the copy is the same tensor
    mm = lambda u: u.model_flops(1) / 3  # noqa: E731  (forward matrix products)
    assert mm(head) == pytest.approx(2 * mm(old) + mm(moe) + 2 * SEQ * 2 * h * h, rel=1e-6)
    assert (head.experts, head.top_k) == (c["n_routed_experts"], c["num_experts_per_tok"])
    logits = [n for n in ctx.gm.graph.nodes if n.meta.get(UNIT) == len(prof.units) - 1 and n.meta.get(TP) == "vocab-col"]
    assert len(logits) == 2  # both passes of the output layer split over the vocabulary
    assert head.sharded.kernels - old.sharded.kernels >= 7  # Megatron's cross-entropy once more (7 kernels)
    assert prof.model_shape["mtp_layers"] == 1 and "mtp_layers" not in plain.model_shape
    assert _pipeline_layout_arg([[("embedding", -1), ("block", 0)], [("block", 1), ("head", -1)]], 1) == "Et|tmL"


def test_multi_token_prediction_of_a_dense_llama_adds_one_block_and_its_projection():
    c = PRESETS["llama3-8b"][1]
    h, ffn, _, kv, _ = _dense_llama(c)
    prof, _ = analyze(EXAMPLES / "hf_llama.py", {"layers": 2, "seq": SEQ, "mtp": 1})
    block = 2 * h * h + 2 * h * kv + 3 * h * ffn + 2 * h
    assert prof.total_params == llama_params(c) + block + 2 * h * h + 3 * h
    with pytest.raises(Exception, match="multi-token-prediction layers is 0 or more"):
        analyze(EXAMPLES / "hf_llama.py", {"layers": 2, "seq": SEQ, "mtp": -1})
