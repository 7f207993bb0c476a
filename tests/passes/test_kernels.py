"""A model priced as Megatron-Core with Transformer Engine runs it (passes.kernels), however the file writes it.

The same Llama written op by op (tests/fixtures/llama_unfused.py: unfused RMSNorm, repeat_interleave of the kv
heads, silu * mul) and as Hugging Face writes it (fp32 norms, SDPA with grouped keys/values) plans to the same time
and memory under --engine megatron; what a block keeps equals Megatron-Core's closed form; the loss is Megatron's
vocabulary-parallel cross-entropy; context parallelism's ring passes the grouped keys and values.
"""
from __future__ import annotations

import pytest
import sympy

from passes.pipeline import analyze
from planner.api import make_plan
from planner.search import Pins
from tests.conftest import EXAMPLES, ROOT

UNFUSED = ROOT / "tests" / "fixtures" / "llama_unfused.py"
H, HEADS, KV, FFN, SEQ, VOCAB = 1024, 8, 2, 3584, 512, 32000
SHAPE = dict(layers=2, hidden=H, heads=HEADS, kv_heads=KV, ffn=FFN, seq=SEQ, vocab=VOCAB)


@pytest.fixture(scope="module")
def unfused():
    return {kernels: analyze(UNFUSED, SHAPE, kernels=kernels)[0] for kernels in ("traced", "megatron")}


def _block(profile):
    return next(u for u in profile.units if u.kind == "block")


def test_a_block_keeps_what_megatron_core_keeps(unfused):
    """Per token of a Llama block with Transformer Engine (no recomputation, t = 1): the first norm's input and its
    output (the q/k/v projections' input), q, k and v after the rotary embedding at their own head counts, the
    attention output and its fp32 log-sum-exp per head, the second norm's input and output, SwiGLU's input (gate and
    up) and output (the down projection's input), and a per-row statistic for each norm (bf16 here, as the file
    computes it); the flash kernel's random-number seed and offset are 24 bytes per microbatch."""
    hd = H // HEADS
    per_token = 2 * (6 * H + 2 * KV * hd + 3 * FFN) + 4 * HEADS + 2 * 2
    block = _block(unfused["megatron"])
    assert block.sharded.saved_bytes(1) + block.replicated.saved_bytes(1) == SEQ * per_token + 24
    # as traced: a norm keeps its input and its weighted copy, the attention the repeated keys/values, SwiGLU its silu
    traced = _block(unfused["traced"])
    extra = 2 * (2 * H + 2 * (H - KV * hd) + FFN)
    assert traced.sharded.saved_bytes(1) + traced.replicated.saved_bytes(1) == SEQ * (per_token + extra) + 24


def test_fused_kernels_move_each_tensor_once(unfused):
    """Under the engine a block's replicated part is three kernels (the first norm; the residual add with the second
    norm; the last residual add) and its sharded part runs the rotary embeddings and SwiGLU as one kernel each; the
    repeated keys/values cost no copy."""
    fused, traced = _block(unfused["megatron"]), _block(unfused["traced"])
    assert fused.replicated.kernels == 3
    hd = H // HEADS
    norm1, add_norm2, add = 2 * 2 * H, 4 * 2 * H, 3 * 2 * H  # bytes per token: read x, write; read 2, write 2; 2 + 1
    assert fused.replicated.fwd_bytes(1) == SEQ * (norm1 + add_norm2 + add) + 2 * 2 * H  # + the two norms' weights
    assert fused.sharded.fwd_bytes(1) < traced.sharded.fwd_bytes(1) - 2 * SEQ * 2 * (H - KV * hd)
    assert fused.fwd_flops(1) == traced.fwd_flops(1)  # the same arithmetic, fused


def test_megatron_runs_its_own_cross_entropy(unfused):
    """The head keeps Megatron's fp32 softmax over the (vocabulary-parallel) logits, and the file's loss_fn is not
    what runs."""
    head = unfused["megatron"].units[-1]
    assert head.loss_bytes(1) == 0 and head.loss_work(1) == 0  # (nor its backward's gradients)
    assert head.sharded.saved_bytes(1) == 4 * SEQ * VOCAB
    assert head.sharded.fwd_bytes(1) - _head_fwd_bytes(unfused["traced"]) == 38 * SEQ * VOCAB


def _head_fwd_bytes(profile) -> float:
    return profile.units[-1].sharded.fwd_bytes(1)


def test_the_ring_passes_grouped_keys_and_values(unfused):
    """Context parallelism's ring moves 2 (s/cp) b kv_heads head_dim elements per step, as Transformer Engine sends
    them; as traced it moves the repeated ones."""
    hd = H // HEADS
    assert _block(unfused["megatron"]).attn_kv_bytes(1) == 2 * SEQ * KV * hd * 2
    assert _block(unfused["traced"]).attn_kv_bytes(1) == 2 * SEQ * HEADS * hd * 2


def test_the_same_llama_written_two_ways_plans_the_same():
    """Llama-3-8B's layers (two of them), seq 2048: what differs is Hugging Face's rotary tables computed in each
    forward and its causal mask handed to the attention, a few tenths of a percent."""
    pytest.importorskip("transformers")
    pins = Pins(tp=2, pp=2, engine="megatron", recompute="none")
    ours = dict(layers=4, hidden=4096, heads=32, kv_heads=8, ffn=14336, seq=2048, vocab=32000)
    hf = {"preset": "llama3-8b", "num_hidden_layers": 4, "seq": 2048, "vocab_size": 32000}
    plans = [make_plan(str(path), target="h100-sxm", gpus=8, global_batch=16, model_args=args, pins=pins)[0]
             for path, args in ((UNFUSED, ours), (EXAMPLES / "hf_llama.py", hf))]
    a, b = plans
    assert a.config.to_config() == b.config.to_config()
    assert a.predictions.iteration_s == pytest.approx(b.predictions.iteration_s, rel=0.005)
    for ma, mb in zip(a.predictions.memory, b.predictions.memory):
        assert ma.total == pytest.approx(mb.total, rel=0.002)
        assert ma.activations == pytest.approx(mb.activations, rel=0.005)


def test_an_moe_layers_experts_keep_what_megatron_cores_grouped_mlp_keeps():
    """Hugging Face's Qwen3-MoE repeats each token once per chosen expert, runs SwiGLU as silu * up and scales each
    expert's output by its routing probability after fc2. Megatron-Core (TEGroupedMLP with weighted SwiGLU, since
    Megatron-LM !2668) permutes the tokens in their own kernel, applies the probability inside the SwiGLU and keeps,
    per routed copy of a token: fc1's input (h), fc1's output (2f), fc2's input (f), all bf16, and the probability
    (bf16 here, as the file computes it): not silu's output, fc2's output, or an fp32 norm copy at the routed size."""
    pytest.importorskip("transformers", reason="the hf extra is not installed")
    seq, k, h, f = 64, 8, 2048, 768  # qwen3-30b-a3b: top-8 experts, hidden 2048, expert intermediate 768
    prof, _ = analyze(EXAMPLES / "hf_qwen3_moe.py", {"preset": "qwen3-30b-a3b", "num_hidden_layers": 2, "seq": seq},
                      kernels="megatron")
    block = _block(prof)
    assert block.experts and block.moe.saved_bytes(1) == seq * (2 * k * (h + 2 * f + f) + 2 * k)


def test_megatrons_gpt_block_keeps_korthikantis_closed_form():
    """A GPT block with Megatron-LM's dropouts (bench/models/ref_gpt_megatron.py: attention probabilities, and the
    attention and MLP outputs before their residual adds), t = 1, no recomputation, keeps sbh(34 + 5as/h) bytes
    (Korthikanti et al. 2022, eq. 1): 11sbh + 5as^2b in attention (the softmax output, its dropout mask and output),
    19sbh in the MLP, 4sbh in the two norms. Megatron's scale-mask-softmax is a kernel of its own (the dropout on its
    output another), and each dropout writes its one-byte mask: the dropout kernel moves 5 bytes per score."""
    h, a, s = 512, 8, 256
    shape = dict(layers=2, hidden=h, heads=a, seq=s, vocab=1024)
    with_dropout = _block(analyze(ROOT / "bench" / "models" / "ref_gpt_megatron.py", shape, kernels="megatron")[0])
    without = _block(analyze(ROOT / "bench" / "models" / "ref_gpt_megatron.py",
                             {**shape, "attention_dropout": 0.0, "hidden_dropout": 0.0}, kernels="megatron")[0])
    for b in (1, 3):
        assert with_dropout.sharded.saved_bytes(b) + with_dropout.replicated.saved_bytes(b) == \
            s * b * h * 34 + 5 * a * s * s * b
        assert with_dropout.sharded.fwd_bytes(b) - without.sharded.fwd_bytes(b) == 5 * a * s * s * b
        assert with_dropout.replicated.fwd_bytes(b) - without.replicated.fwd_bytes(b) == 2 * s * b * h
    assert with_dropout.sharded.kernels == without.sharded.kernels + 1


def _attention_nodes(path, args: dict, kernels: str) -> list:
    """(unit index, the block's attention node's cost, its Measured) of each block, priced as `kernels` says."""
    from passes.meta_keys import COST, MEASURED, UNIT

    profile, ctx = analyze(path, args, kernels=kernels)
    blocks = {i for i, u in enumerate(profile.units) if u.kind == "block"}
    return [(n.meta[UNIT], n.meta[COST], n.meta[MEASURED]) for n in ctx.gm.graph.nodes
            if n.meta.get(UNIT) in blocks and n.meta[COST].kind == "attention"]


def test_megatron_runs_a_sliding_window_over_its_window():
    """Mistral's SDPA with a 128-token sliding window at s = 512: as the file runs it (torch's SDPA), priced as a
    causal kernel; under Megatron-Core, Transformer Engine's window_size skips the blocks outside the window, so
    the kernel computes min(i + 1, 128) keys for query i."""
    from passes.measure import attended_fraction

    pytest.importorskip("transformers", reason="the hf extra is not installed")
    args = dict(layers=2, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                vocab_size=512, seq=512, sliding_window=128)
    titan = _attention_nodes(EXAMPLES / "hf_mistral.py", args, "titan")  # torchtitan runs the file's SDPA call
    for (_, traced, m), (_, engine, _), (_, tt, _) in zip(_attention_nodes(EXAMPLES / "hf_mistral.py", args, "traced"),
                                                          _attention_nodes(EXAMPLES / "hf_mistral.py", args, "megatron"),
                                                          titan):
        assert m.window == 128 and traced.mm_flops == m.full_flops * attended_fraction(512) == tt.mm_flops
        assert engine.mm_flops == m.full_flops * attended_fraction(512, 128)
        assert engine.bwd_flops == sympy.Rational(5, 2) * engine.mm_flops  # (flash: 5 products for 2)


@pytest.mark.parametrize("kernels", ["megatron", "titan", "inductor"])
def test_the_engines_fuse_the_attention_gpt_oss_writes_out(kernels):
    """gpt-oss writes its attention out (Hugging Face's eager attention: the sinks are concatenated to the scores);
    Megatron-Core runs it as Transformer Engine's fused kernel with learnable sinks, torchtitan (eager or compiled)
    its own gpt-oss, whose attention is torch's varlen FlashAttention with the sinks a rescale by the log-sum-exp; both
    with a 128-token window on every second layer: one kernel per layer whose FLOPs are the two products' over the
    causal (windowed) share of the scores, keeping q, the grouped k and v, the output and its log-sum-exp, not the
    s x s probabilities the file keeps."""
    from passes.measure import attended_fraction
    from passes.shapes import B

    pytest.importorskip("transformers", reason="the hf extra is not installed")
    s, heads, kv, hd = 512, 64, 8, 64  # gpt-oss-120b's heads, at a short sequence
    args = {"preset": "gpt-oss-20b", "layers": 2, "seq": s}
    assert _attention_nodes(EXAMPLES / "hf_gpt_oss.py", args, "traced") == []  # written out: two products
    fused = _attention_nodes(EXAMPLES / "hf_gpt_oss.py", args, kernels)
    assert len(fused) == 2
    full = 2 * 2 * s * s * heads * hd  # Q K^T and P V per sample, in full
    per_row = s * heads  # query rows per sample
    for (_, cost, m), window in zip(fused, (128, 0)):  # layer 0 slides, layer 1 attends to everything before
        assert m.in_causal and m.window == window
        assert cost.mm_flops.subs(B, 1) == full * attended_fraction(s, window)
        kept = 2 * per_row * hd * 2 + 2 * 2 * s * kv * hd + 4 * per_row  # q and the output; grouped k, v; lse
        assert sum(v for _, v in cost.saved).subs(B, 1) == kept
