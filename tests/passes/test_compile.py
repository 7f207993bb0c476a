"""A block priced as torch.compile runs it (passes.kernels "inductor": torchtitan's --compile.enable, one compiled
region per block), the rest of the model eager as traced.

The same unfused Llama as tests/passes/test_kernels.py: compiled, a block moves fewer bytes and does the same
arithmetic; its norms and residual adds are the three kernels Inductor makes of them; the repeated keys and values
stay repeated (SDPA reads what the file passes it, unlike Transformer Engine); the embedding and the head with the
file's loss are unchanged; under torchtitan's per-op checkpointing the compiled block keeps only what its backward
reads (the down projection's output, which the eager policy's cache holds, is not kept).
"""
from __future__ import annotations

import pytest

from passes.pipeline import analyze
from tests.conftest import ROOT

UNFUSED = ROOT / "tests" / "fixtures" / "llama_unfused.py"
H, HEADS, KV, FFN, SEQ, VOCAB = 1024, 8, 2, 3584, 512, 32000
SHAPE = dict(layers=2, hidden=H, heads=HEADS, kv_heads=KV, ffn=FFN, seq=SEQ, vocab=VOCAB)


@pytest.fixture(scope="module")
def profiles():
    return {kernels: analyze(UNFUSED, SHAPE, kernels=kernels)[0] for kernels in ("traced", "megatron", "inductor")}


def _block(profile):
    return next(u for u in profile.units if u.kind == "block")


def test_a_compiled_block_moves_fewer_bytes_for_the_same_flops(profiles):
    compiled, eager = _block(profiles["inductor"]), _block(profiles["traced"])
    for part in ("sharded", "replicated"):
        c, e = getattr(compiled, part), getattr(eager, part)
        assert c.fwd_bytes(1) < e.fwd_bytes(1) and c.bwd_bytes(1) < e.bwd_bytes(1), part
        assert c.fwd_flops(1) == e.fwd_flops(1) and c.bwd_flops(1) == e.bwd_flops(1), part
        assert c.kernels < e.kernels, part
    # the first norm; the residual add with the second norm; the last residual add: each one kernel reading its
    # inputs once and writing its outputs once, as Transformer Engine's
    assert compiled.replicated.kernels == 3
    norm1, add_norm2, add = 2 * 2 * H, 4 * 2 * H, 3 * 2 * H  # bytes per token
    assert compiled.replicated.fwd_bytes(1) == SEQ * (norm1 + add_norm2 + add) + 2 * 2 * H  # + the norms' weights
    assert compiled.fwd_flops(1) == eager.fwd_flops(1)


def test_compiled_sdpa_reads_the_keys_and_values_the_file_repeats(profiles):
    """Transformer Engine reads grouped keys/values as they are; SDPA, compiled or not, reads what it is passed."""
    compiled, eager, megatron = (_block(profiles[k]) for k in ("inductor", "traced", "megatron"))
    assert compiled.attn_kv_bytes(1) == eager.attn_kv_bytes(1) > megatron.attn_kv_bytes(1)


def test_only_the_blocks_are_compiled(profiles):
    """torchtitan compiles each TransformerBlock: the embedding and the head with the file's loss run eagerly."""
    for compiled, eager in zip(profiles["inductor"].units, profiles["traced"].units):
        if compiled.kind == "block":
            continue
        assert compiled.sharded.fwd_bytes(1) == eager.sharded.fwd_bytes(1)
        assert compiled.replicated.bwd_bytes(1) == eager.replicated.bwd_bytes(1)
        assert compiled.loss_work(1) == eager.loss_work(1) and compiled.loss_bytes(1) == eager.loss_bytes(1)


def test_a_compiled_block_keeps_what_its_backward_reads(profiles):
    """Per-op checkpointing: eager, the policy's cache holds every saved matmul output (wq, wv, w1, w2: the odd
    ones) and the attention's; compiled, AOTAutograd's partitioner saves what the backward graph reads, which w2's
    output (added to the residual) is not, and reruns only what rebuilds what it reads."""
    compiled, eager = _block(profiles["inductor"]).op_checkpoint, _block(profiles["traced"]).op_checkpoint
    kept = lambda op: op.kept_sharded(1) + op.kept(1)  # noqa: E731
    assert kept(eager) - kept(compiled) == SEQ * H * 2  # w2's bf16 output
    assert compiled.redo.fwd_bytes(1) + compiled.redo_sharded.fwd_bytes(1) < \
        eager.redo.fwd_bytes(1) + eager.redo_sharded.fwd_bytes(1)


TITAN = ROOT / "examples" / "titan_llama.py"
TITAN_SHAPE = dict(layers=3, hidden=256, heads=4, kv_heads=2, ffn=512, seq=64, vocab=512)


def _rope(kernels: str) -> dict[str, tuple[int, int]]:
    """{op: (forward bytes, of the block's first rotary embedding on the queries) per sample} of torchtitan's Llama."""
    from sympy import sympify

    from passes.costs import node_kind
    from passes.meta_keys import COST, UNIT
    from passes.shapes import B

    profile, ctx = analyze(TITAN, TITAN_SHAPE, kernels=kernels)
    block = next(i for i, u in enumerate(profile.units) if u.kind == "block")
    nodes = [n for n in ctx.gm.graph.nodes if n.meta.get(UNIT) == block]
    start = next(i for i, n in enumerate(nodes) if node_kind(n, ctx.gm) == "to")  # xq.float()
    out = {}
    for n in nodes[start:]:
        kind = node_kind(n, ctx.gm)
        out.setdefault(kind, int(sympify(n.meta[COST].fwd_bytes).subs(B, 1)))
        if kind == "type_as":  # xq_out.type_as(xq)
            return out
    raise AssertionError("no rotary embedding found")


def test_torchtitans_layers_are_blocks_and_its_complex_rope_is_not_compiled():
    """torchtitan holds its layers in an nn.ModuleDict keyed "0", "1", ...: each is a block (a pipeline stage can
    hold some of them; torch.compile and per-op checkpointing apply to each). Its RoPE multiplies complex64 views:
    a view costs nothing, and Inductor, which generates no code for complex tensors, runs the product as its own
    kernel, so the cast to fp32 before it writes its output (b x s x h fp32) and the cast back reads it."""
    profile, _ = analyze(TITAN, TITAN_SHAPE)
    assert [u.name for u in profile.units if u.kind == "block"] == ["layers.0", "layers.1", "layers.2"]
    q = TITAN_SHAPE["seq"] * TITAN_SHAPE["hidden"]  # query elements per sample
    eager, compiled = _rope("traced"), _rope("inductor")
    table = TITAN_SHAPE["seq"] * TITAN_SHAPE["hidden"] // TITAN_SHAPE["heads"] // 2 * 8  # freqs_cis, complex64
    for priced in (eager, compiled):
        assert priced["view_as_complex"] == priced["view_as_real"] == 0
        assert priced["to"] == (2 + 4) * q  # bf16 read, fp32 written
        assert 2 * 4 * q < priced["mul"] <= 2 * 4 * q + table  # complex64 read and written (Inductor's fallback
        # kernel, as eager's), and the table
        assert priced["type_as"] == (4 + 2) * q
