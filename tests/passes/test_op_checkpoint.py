"""Per-op selective activation checkpointing as torchtitan runs it (passes.units.op_checkpoint; torchtitan/distributed/
activation_checkpoint.py, SelectiveAC): a Llama block keeps its input and the outputs of wq, wv, the attention kernel
(with its log-sum-exp), w1 and w2, and its backward reruns wk, wo, w3 and every elementwise op; under --engine
torchtitan, --recompute selective means that, under --engine megatron Megatron's attention-core recomputation."""
from __future__ import annotations

from dataclasses import replace

import pytest

from costmodels.recompute import RECOMPUTE
from passes.pipeline import analyze
from tests.conftest import ROOT

UNFUSED = ROOT / "tests" / "fixtures" / "llama_unfused.py"
H, HEADS, KV, FFN, SEQ, VOCAB = 1024, 8, 2, 3584, 512, 32000
SHAPE = dict(layers=2, hidden=H, heads=HEADS, kv_heads=KV, ffn=FFN, seq=SEQ, vocab=VOCAB)


@pytest.fixture(scope="module")
def block():
    profile, _ = analyze(UNFUSED, SHAPE)
    return next(u for u in profile.units if u.kind == "block")


def test_a_block_keeps_its_input_and_the_saved_ops_outputs(block):
    b, kv = 2, KV * H // HEADS
    want = 2 * b * SEQ * (H + H + kv + H + FFN + H) + 4 * b * HEADS * SEQ  # x, wq, wv, attention (+ lse), w1, w2
    op = block.op_checkpoint
    assert op.kept_sharded(b) + op.kept(b) == pytest.approx(want, abs=64)  # (and the kernel's RNG seed and offset)
    assert RECOMPUTE["selective"].kept_bytes(block, b, 1) > 2 * want  # Megatron's meaning by default
    titan = replace(block, checkpoint="op")
    assert RECOMPUTE["selective"].kept_bytes(titan, b, 1) == pytest.approx(want, abs=64)
    # its backward holds again what the block saves without checkpointing, beyond what it kept
    plain = RECOMPUTE["none"].kept_bytes(block, b, 1)
    assert RECOMPUTE["selective"].rebuilt_bytes(titan, b, 1) == pytest.approx(plain - want, abs=64)
    assert RECOMPUTE["selective"].rebuilt_bytes(block, b, 1) == 0


def test_the_backward_reruns_every_second_product_and_the_elementwise_ops(block):
    b, kv = 2, KV * H // HEADS
    op = block.op_checkpoint
    redo_mm = op.redo_sharded.mm_flops(b) + op.redo.mm_flops(b)
    assert redo_mm == 2 * b * SEQ * H * (kv + H + FFN)  # wk, wo, w3
    assert op.redo_sharded.fwd_flops(b) + op.redo.fwd_flops(b) > redo_mm  # norms, rotary, SwiGLU's silu and mul
