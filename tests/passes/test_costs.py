"""Node costs and units on small real models (meta tensors)."""
from __future__ import annotations

import pytest
import sympy
import torch

from passes.costs import NodeCost, node_kind
from passes.meta_keys import COST, MODULE, TP
from passes.shapes import B
from passes.pipeline import analyze
from tests.conftest import EXAMPLES

GPT_SMALL = {"preset": "tiny", "layers": 3, "hidden": 96, "heads": 4, "seq": 64, "vocab": 1024, "dropout": 0.1}


@pytest.fixture(scope="module")
def gpt():
    return analyze(EXAMPLES / "gpt.py", GPT_SMALL)


def test_activation_bytes_match_korthikanti(gpt):
    """Bytes saved for backward per layer = sbh(34 + 5as/h) in 16-bit (Korthikanti et al. 2022), plus
    what the formula leaves out and autograd does save: each LayerNorm's fp32 mean and 1/std per token."""
    prof, _ = gpt
    s, h, a = 64, 96, 4
    block = next(u for u in prof.units if u.kind == "block")
    for b in (1, 3):
        saved = block.sharded.saved_bytes(b) + block.replicated.saved_bytes(b)
        assert saved == pytest.approx(s * b * h * (34 + 5 * a * s / h) + 2 * 2 * s * b * 4)
        # selective recomputation drops exactly the 5as^2b attention-score bytes
        assert block.sharded.selective_bytes(b) == pytest.approx(5 * a * s * s * b)


def test_costs_are_polynomials_in_b_that_match_a_new_trace(gpt):
    prof, _ = gpt
    again, _ = analyze(EXAMPLES / "gpt.py", GPT_SMALL)
    for u, w in zip(prof.units, again.units):
        for b in (5, 7):
            assert u.fwd_flops(b) == pytest.approx(w.fwd_flops(b))
    block = next(u for u in prof.units if u.kind == "block")
    assert block.fwd_flops(6) == pytest.approx(6 * block.fwd_flops(1))  # linear in b


def _node(ctx, module: str, kind: str) -> torch.fx.Node:
    """The node of op `kind` that came from module `module` (names differ between front-ends)."""
    return next(n for n in ctx.gm.graph.nodes if n.meta.get(MODULE) == module and node_kind(n, ctx.gm) == kind)


def test_matmul_backward_is_twice_forward_and_elementwise_is_counted_as_is(gpt):
    _, ctx = gpt
    lin: NodeCost = _node(ctx, "layers.0.mlp.fc1", "linear_fn").meta[COST]
    assert lin.kind == "matmul"
    assert lin.fwd_flops == 2 * GPT_SMALL["hidden"] * 4 * GPT_SMALL["hidden"] * GPT_SMALL["seq"] * B
    assert lin.bwd_flops == 2 * lin.fwd_flops
    gelu = _node(ctx, "layers.0.mlp", "gelu").meta[COST]
    assert gelu.kind == "elementwise" and gelu.mm_flops == 0
    assert gelu.bwd_flops != 2 * gelu.fwd_flops
    add = _node(ctx, "layers.0", "add").meta[COST]
    assert add.bwd_flops == 0  # a residual add passes its gradient through


def test_megatron_tensor_parallel_roles(gpt):
    prof, ctx = gpt
    role = lambda module, kind="linear_fn": _node(ctx, module, kind).meta[TP]  # noqa: E731
    assert role("layers.0.attn.qkv") == "col" and role("layers.0.attn.proj") == "row"
    assert role("layers.0.mlp.fc1") == "col" and role("layers.0.mlp.fc2") == "row"
    assert role("layers.0.attn", "softmax") == "sharded" and role("layers.0.ln1", "layer_norm") == "replicated"
    block = next(u for u in prof.units if u.kind == "block")
    assert block.tp_allreduces == 2
    s, h = 64, 96
    # 2 all-reduces of b*s*h 16-bit values forward and 2 backward: thesis 4.3.2
    assert block.tp_fwd_allreduce_bytes(2) == pytest.approx(2 * 2 * s * h * 2)
    assert block.tp_bwd_allreduce_bytes(2) == pytest.approx(2 * 2 * s * h * 2)


@pytest.mark.parametrize("path,args,blocks,kinds", [
    ("mlp.py", {}, 4, ("embedding", "head")),
    ("resnet.py", {}, 8, ("embedding", "head")),
    ("bert.py", {"preset": "tiny"}, 2, ("embedding", "head")),
])
def test_units_follow_the_module_hierarchy(path, args, blocks, kinds):
    prof, ctx = analyze(EXAMPLES / path, args)
    assert sum(u.kind == "block" for u in prof.units) == blocks
    assert (prof.units[0].kind, prof.units[-1].kind) == kinds
    covered = [n for u in prof.units for n in u.nodes]
    assert sorted(covered) == sorted(n.name for n in ctx.gm.graph.nodes)  # every node in one unit
    assert prof.total_params == sum(p.numel() for p in ctx.model.parameters())


def test_planning_never_materializes_weights(gpt):
    _, ctx = gpt
    assert all(p.device.type == "meta" for p in ctx.model.parameters())
    assert all(p.dtype == torch.bfloat16 for p in ctx.model.parameters())


@pytest.mark.parametrize("t", [1, 2, 4])
def test_activations_under_tensor_parallelism_match_korthikanti(gpt, t):
    """Per GPT layer and TP rank: sbh(10 + 24/t + 5as/ht) (Korthikanti et al. 2022, eq. 2). The 10sbh are
    the norms' inputs, the column-parallel linears' inputs and the residual dropout masks: whole on every
    rank. Plus each LayerNorm's fp32 mean and 1/std, also whole."""
    from costmodels.recompute import RECOMPUTE

    prof, _ = gpt
    s, h, a, b = 64, 96, 4, 2
    block = next(u for u in prof.units if u.kind == "block")
    expected = s * b * h * (10 + 24 / t + 5 * a * s / (h * t)) + 2 * 2 * s * b * 4
    assert RECOMPUTE["none"].kept_bytes(block, b, t) == pytest.approx(expected)
    assert RECOMPUTE["selective"].kept_bytes(block, b, t) == pytest.approx(expected - 5 * a * s * s * b / t)
    # sequence parallelism splits the 10sbh (and the norms' statistics) over t too: sbh(34/t + 5as/ht)
    with_sp = s * b * h * (34 / t + 5 * a * s / (h * t)) + 2 * 2 * s * b * 4 / t
    assert RECOMPUTE["none"].kept_bytes(block, b, t, t) == pytest.approx(with_sp)


@pytest.fixture(scope="module", params=[False, True], ids=["math-attention", "flash-attention"])
def gpt8(request):
    prof, _ = analyze(EXAMPLES / "gpt.py", {**GPT_SMALL, "heads": 8, "flash": request.param})
    return prof, request.param


@pytest.mark.parametrize("t", [1, 2, 8])
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_layer_activations_are_korthikantis_closed_forms(gpt8, t, sp, mode):
    """Per GPT layer and tensor-parallel rank, in 16-bit (Korthikanti et al. 2022, table 2): sbh(10 + 24/t +
    5as/ht) without sequence parallelism, sbh/t (34 + 5as/h) with it; selective recomputation drops the 5as/h
    term, full keeps the layer's input 2sbh (over t under sequence parallelism). Under flash attention the
    kernel keeps no s x s scores: the 5as/h term is gone and its logsumexp (fp32, a s per sample) is kept
    instead (and a few bytes of its dropout's random seed and offset). What the formula leaves out and autograd
    saves: each LayerNorm's fp32 mean and 1/std per token."""
    from costmodels.recompute import RECOMPUTE

    prof, flash = gpt8
    s, h, a, b = 64, 96, 8, 2
    r = t if sp else 1
    block = next(u for u in prof.units if u.kind == "block")
    sbh, norms = s * b * h, 2 * 2 * 4 * s * b
    core = 4 * a * s * b if flash else 5 * a * s * s * b  # what the attention core keeps
    plain = (sbh * 34 / t if sp else sbh * (10 + 24 / t)) + core / t + norms / r
    expected = {"none": plain, "selective": plain - core / t, "full": 2 * sbh / r}[mode]
    seed = 64 if flash and mode == "none" else 0  # the fused kernel's RNG seed and offset: bytes, not tokens
    assert RECOMPUTE[mode].kept_bytes(block, b, t, r) == pytest.approx(expected, rel=1e-12, abs=seed)


LINEAR_MLP = """import torch
from torch import nn


def build_model():
    return nn.Sequential(nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 8))


def example_inputs(batch_size: int):
    return (torch.randn(batch_size, 16),)
"""


def test_a_linear_mlps_weight_gradients_are_its_products_dw(tmp_path):
    """Each linear's W is its dW, a product the size of its forward (the traced linears count no bias FLOPs,
    forward or backward); its I the dX of the same size, except the first's: the data needs no gradient."""
    path = tmp_path / "linear_mlp.py"
    path.write_text(LINEAR_MLP)
    prof, _ = analyze(path, {})
    assert [u.kind for u in prof.units] == ["block"] * 4
    for i, (u, (fan_in, fan_out)) in enumerate(zip(prof.units, [(16, 64), (64, 64), (64, 64), (64, 8)])):
        for b in (1, 5):
            dw = 2 * b * fan_in * fan_out
            assert u.wgrad_flops(b) == dw
            assert u.bwd_flops(b) - u.wgrad_flops(b) == (0 if i == 0 else dw)
            assert [(f(b), bf(b), w(b)) for f, _, bf, _, w, *_ in u.sharded.products + u.replicated.products] \
                == [(dw, u.bwd_flops(b), dw)]


def test_a_gpt_layers_weight_gradients_are_its_linears_dw(gpt8):
    """W of a GPT layer: the dW of its linears, 2bs x 12h^2 (qkv 3h^2, proj h^2, fc1 and fc2 4h^2 each), all of
    it in the products (a norm's weight gradient is left in I); each linear's dX (I) is as large as its dW. The
    attention's products (Q K^T and P V, or the fused kernel) multiply two activations: no W."""
    prof, flash = gpt8
    s, h = 64, 96
    block = next(u for u in prof.units if u.kind == "block")
    for b in (1, 3):
        assert block.wgrad_flops(b) == 2 * b * s * 12 * h * h
        products = [(f(b), bf(b), w(b)) for f, _, bf, _, w, *_ in block.sharded.products + block.replicated.products]
        assert sum(w for _, _, w in products) == block.wgrad_flops(b)
        linears = [p for p in products if p[2]]
        assert len(linears) == 4 and all(w == f and bf == 2 * f for f, bf, w in linears)
        assert len(products) - len(linears) == (1 if flash else 2)
        assert 0 < block.wgrad_flops(b) < block.bwd_flops(b)


def test_an_embeddings_backward_is_its_tables_weight_gradient(gpt):
    """The lookups' scatter-adds are W (the token table's over b s rows, the positions' over s); the LM head
    reads the tied table as a weight: its dW is one more product of the forward's size."""
    prof, ctx = gpt
    s, h = 64, 96
    lookups = [n.meta[COST] for n in ctx.gm.graph.nodes if n.meta[COST].kind == "embedding"]
    assert len(lookups) == 2 and all(c.wgrad_flops == c.bwd_flops != 0 for c in lookups)
    emb, head = prof.units[0], prof.units[-1]
    for b in (1, 3):
        assert emb.wgrad_flops(b) == b * s * h + s * h
        assert head.wgrad_flops(b) == head.sharded.mm_flops(b) + head.replicated.mm_flops(b) > 0


@pytest.mark.parametrize("t", [1, 2, 8])
@pytest.mark.parametrize("sp", [False, True])
def test_what_a_layer_keeps_from_its_input_gradient_to_its_weight_gradient(gpt8, t, sp):
    """Per GPT layer and tensor-parallel rank, in 16-bit: each linear's input X (the norms' outputs, 2sbh each and
    whole on every rank as Korthikanti counts them; the attention's output 2sbh and the GeLU's 8sbh, over t) and
    the gradient of its output dY (qkv 6sbh and fc1 8sbh over t; proj and fc2 2sbh each, whole): sbh(24/t + 8/r).
    The X are among what mode "none" keeps: at most that plus the dY."""
    from costmodels.recompute import RECOMPUTE, weight_grad_bytes

    prof, _ = gpt8
    s, h, b = 64, 96, 2
    r, sbh = t if sp else 1, s * b * h
    block = next(u for u in prof.units if u.kind == "block")
    kept = weight_grad_bytes(block, b, t, r)
    assert kept == pytest.approx(sbh * (24 / t + 8 / r), rel=1e-12)
    assert 0 < kept <= RECOMPUTE["none"].kept_bytes(block, b, t, r) + sbh * (14 / t + 4 / r)


def test_every_units_weight_gradient_bytes_are_within_its_saved_bytes_and_output_gradients(gpt):
    _, ctx = gpt
    nodes = {n.name: n for n in ctx.gm.graph.nodes}
    for u in ctx.priced:
        dy = sum((c.out_bytes for c in (nodes[name].meta[COST] for name in u.nodes) if c.wgrad_mm_flops != 0),
                 sympy.Integer(0))
        for b in (1, 3):
            kept = u.sharded.wgrad_bytes(b) + u.replicated.wgrad_bytes(b)
            saved = u.sharded.saved_bytes(b) + u.replicated.saved_bytes(b)
            assert (kept > 0) == (u.kind != "embedding")  # the lookups' W reads no product's X
            assert kept <= saved + float(dy.subs(B, b))


HEADS = """import torch
from torch import nn


class Heads(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(32, 96)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 4, 8).permute(2, 0, 3, 1, 4).unbind(0)
        probs = torch.softmax(torch.matmul(q, k.transpose(-2, -1)), dim=-1)
        ctx = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, 32)
        return ctx.contiguous() + x.reshape(b, s, 32)


def build_model():
    return Heads()


def example_inputs(batch_size: int):
    return (torch.randn(batch_size, 16, 32),)
"""


def test_layout_copies_are_what_the_dispatcher_copies(tmp_path):
    """passes.measure counts the aten.clone / copy_ a node dispatches: at::matmul copies permuted heads that no
    batched view expresses (q and k for the scores, v for the context), a reshape of a transposed tensor copies it;
    a contiguous() of a contiguous tensor and a reshape of a contiguous one copy nothing. Each copy is written and
    read once by a kernel of its own (the unit's forward bytes and kernels)."""
    path = tmp_path / "heads.py"
    path.write_text(HEADS)
    prof, ctx = analyze(path, {})
    head_bytes = 16 * 32 * 2 * B  # b x s x (heads x head dim) in bf16 (the default): one of q, k, v, or the context
    copies = {n.name: n.meta[COST].copy_bytes for n in ctx.gm.graph.nodes if n.meta[COST].copy_bytes != 0}
    kinds = {n.name: node_kind(n, ctx.gm) for n in ctx.gm.graph.nodes}
    assert sorted((kinds[name], sympy.expand(v / head_bytes)) for name, v in copies.items()) == \
        [("matmul", 1), ("matmul", 2), ("reshape", 1)]
    assert all(n.meta[COST].fwd_bytes == 0 for n in ctx.gm.graph.nodes if kinds[n.name] == "contiguous")
    unit = prof.units[0]
    without = sum(n.meta[COST].fwd_bytes for n in ctx.gm.graph.nodes)
    parts = unit.sharded.fwd_bytes(3) + unit.replicated.fwd_bytes(3)
    assert parts == pytest.approx(float((without + 2 * 4 * head_bytes).subs(B, 3)))
    kernels = sum(int(n.meta[COST].kind not in ("view", "none")) for n in ctx.gm.graph.nodes)
    assert unit.sharded.kernels + unit.replicated.kernels == kernels + 3  # one copy kernel per copying node
