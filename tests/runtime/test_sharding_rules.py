"""The Megatron layout's rules, op by op (planner/runtime/megatron_tp.py, issue 22): on small traced modules, which
ops a tensor-parallel split passes through (and how it rewrites them), and which it refuses, naming the op. The
numerics of the same rules under torchrun are tests/runtime/test_styles.py's; the pricing side (what the planner
credits as split) is checked here too, on the same models."""
from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from passes.pipeline import analyze
from passes.sharding import Rows
from passes.sharding.walk import Refusal, plan_shards

from ._util import ROOT

STYLES = ROOT / "tests" / "fixtures" / "styles"
B, S, H, HEADS = 2, 8, 32, 4


def place(module: nn.Module, *inputs: torch.Tensor, styles: dict[str, str], heads: set[int], t: int = 2):
    """plan_shards on the module's symbolic_trace graph with the shapes of a meta pass: (rewrites, outputs) or a
    Refusal, and the column-parallel row groups it chose."""
    gm = fx.symbolic_trace(module)
    interp = fx.Interpreter(gm, garbage_collect_values=False)
    with torch.no_grad():
        interp.run(*inputs)
    shapes = {n.name: tuple(v.shape) if isinstance(v, torch.Tensor) else v for n, v in interp.env.items()}
    paths = {id(m): path for path, m in gm.named_modules()}
    colwise: dict[str, Rows] = {}
    out = plan_shards(gm, shapes, styles, paths, t, heads, colwise, [None] * len(inputs))
    return out, colwise, gm


class GQA(nn.Module):
    """torchtitan's attention: RoPE tables as buffers, kv heads repeated with repeat_interleave, SDPA."""

    def __init__(self, kv_heads: int) -> None:
        super().__init__()
        self.kv, self.hd = kv_heads, H // HEADS
        self.wq, self.wo = nn.Linear(H, H, bias=False), nn.Linear(H, H, bias=False)
        self.wk, self.wv = nn.Linear(H, kv_heads * self.hd, bias=False), nn.Linear(H, kv_heads * self.hd, bias=False)
        self.register_buffer("cos", torch.randn(S, self.hd))
        self.register_buffer("sin", torch.randn(S, self.hd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q = self.wq(x).view(b, s, HEADS, self.hd).transpose(1, 2)
        k = self.wk(x).view(b, s, self.kv, self.hd).transpose(1, 2)
        v = self.wv(x).view(b, s, self.kv, self.hd).transpose(1, 2)
        q, k = q * self.cos + q.flip(-1) * self.sin, k * self.cos + k.flip(-1) * self.sin
        k = k.repeat_interleave(HEADS // self.kv, dim=1)
        v = v.repeat_interleave(HEADS // self.kv, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, h))


GQA_STYLES = {"wq": "colwise", "wk": "colwise", "wv": "colwise", "wo": "rowwise"}


def test_grouped_kv_heads_repeated_for_the_heads_rope_buffers_and_sdpa_split_by_heads():
    out, colwise, _ = place(GQA(2), torch.randn(B, S, H), styles=GQA_STYLES, heads={HEADS, 2})
    assert not isinstance(out, Refusal), out
    assert colwise == {"wq": Rows(), "wk": Rows(), "wv": Rows()}  # each rank: its 2 heads and their 1 kv head
    rewrites, outputs = out
    assert outputs == [None]  # the row-parallel product leaves whole (all-reduced)


def test_one_kv_head_for_two_ranks_is_held_whole_and_repeated_for_the_ranks_own_heads():
    out, colwise, gm = place(GQA(1), torch.randn(B, S, H), styles=GQA_STYLES, heads={HEADS, 1})
    assert not isinstance(out, Refusal), out
    assert colwise["wk"] == colwise["wv"] == Rows(1, 2)  # one kv head, on both ranks
    repeats = {n.name: new for n, _, new in (r for r in out[0] if isinstance(r[0], fx.Node))
               if n.target == "repeat_interleave"}
    assert repeats == {"repeat_interleave": 2, "repeat_interleave_1": 2}  # 4 repeats of it globally, 2 per rank


class FusedQKV(nn.Module):
    """nanoGPT's c_attn split into q, k, v by size, and the fused view (b, s, 3, heads, d) unpacked by index."""

    def __init__(self, unpack: bool) -> None:
        super().__init__()
        self.unpack = unpack
        self.c_attn, self.c_proj = nn.Linear(H, 3 * H), nn.Linear(H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, c = x.size()
        if self.unpack:
            q, k, v = self.c_attn(x).view(b, s, 3, HEADS, c // HEADS).permute(2, 0, 3, 1, 4)
        else:
            q, k, v = self.c_attn(x).split(c, dim=2)
            q, k, v = (z.view(b, s, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, s, c))


@pytest.mark.parametrize("unpack", [False, True])
def test_a_fused_qkv_keeps_each_ranks_heads_of_q_k_and_v(unpack):
    out, colwise, _ = place(FusedQKV(unpack), torch.randn(B, S, H), styles={"c_attn": "colwise", "c_proj": "rowwise"},
                            heads={HEADS})
    assert not isinstance(out, Refusal), out
    assert colwise == {"c_attn": Rows(3)}  # its rows in 3 strided groups: q's, k's and v's heads of this rank


class Scores(nn.Module):
    """Attention written out (ALBERT, BERT): q @ k^T, softmax, @ v, the heads merged back by flatten; `bias` adds
    a position bias over every head (T5's), `bad_merge` flattens the heads into the sequence."""

    def __init__(self, bias: bool = False, bad_merge: bool = False) -> None:
        super().__init__()
        self.bias, self.bad_merge = bias, bad_merge
        self.q, self.k, self.v, self.o = (nn.Linear(H, H) for _ in range(4))
        self.register_buffer("pos", torch.randn(1, HEADS, S, S))

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(B, S, HEADS, H // HEADS).permute(0, 2, 1, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = torch.matmul(self.heads(self.q(x)), self.heads(self.k(x)).transpose(-1, -2))
        if self.bias:
            scores = scores + self.pos
        ctx = torch.matmul(F.softmax(scores, dim=-1), self.heads(self.v(x))).transpose(2, 1)
        return self.o(ctx.flatten(1, 2).reshape(B, S, H) if self.bad_merge else ctx.flatten(2))


SCORE_STYLES = {"q": "colwise", "k": "colwise", "v": "colwise", "o": "rowwise"}


def test_attention_written_out_splits_by_heads_and_merges_them_back_by_flatten():
    out, colwise, _ = place(Scores(), torch.randn(B, S, H), styles=SCORE_STYLES, heads={HEADS})
    assert not isinstance(out, Refusal), out


@pytest.mark.parametrize("module,why", [
    (Scores(bias=True), "a replicated operand spans the sharded dim"),  # T5's bias: every head's, on every rank
    (Scores(bad_merge=True), "merges a split dim into the one before it"),
])
def test_what_the_rules_cannot_place_is_refused_naming_the_op(module, why):
    out, _, _ = place(module, torch.randn(B, S, H), styles=SCORE_STYLES, heads={HEADS})
    assert isinstance(out, Refusal) and why in out.why and out.node is not None, out


class Indexed(nn.Module):
    def __init__(self, index: object, down: int = 2 * H) -> None:
        super().__init__()
        self.index = index
        self.up, self.down = nn.Linear(H, 2 * H), nn.Linear(down, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.gelu(self.up(x))
        y = y[self.index]
        return self.down(y.unsqueeze(-1) if self.index[0] is Ellipsis and isinstance(self.index[-1], int) else y)


MLP = {"up": "colwise", "down": "rowwise"}


def test_indexing_keeps_the_split_unless_it_selects_within_it():
    out, _, _ = place(Indexed((slice(None), 0)), torch.randn(B, S, H), styles=MLP, heads=set())
    assert not isinstance(out, Refusal), out  # the first position's features: still split on them
    out, _, _ = place(Indexed((Ellipsis, 0), down=1), torch.randn(B, S, H), styles=MLP, heads=set())
    assert isinstance(out, Refusal) and "indexes the split dim" in out.why and out.node.target is operator.getitem
    out, _, _ = place(Indexed((Ellipsis, slice(0, 3)), down=3), torch.randn(B, S, H), styles=MLP, heads=set())
    assert isinstance(out, Refusal) and "not a multiple of 2" in out.why, out


def test_a_fused_projection_sliced_into_parts_deals_each_part_over_the_ranks():
    """Phi-3's qkv_proj cut by slices (`qkv[..., :q]`): the projection's rows come in segments at the slices' bounds,
    each split over the ranks, and each slice takes the rank's part of its segment."""
    out, colwise, _ = place(Indexed((Ellipsis, slice(0, H)), down=H), torch.randn(B, S, H), styles=MLP, heads=set())
    assert not isinstance(out, Refusal), out
    assert colwise == {"up": Rows(segments=(H, H))}
    (node, setter, new), = [r for r in out[0] if isinstance(r[0], fx.Node)]
    assert node.target is operator.getitem and new == (Ellipsis, slice(0, H // 2))


class Along(Indexed):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.gelu(self.up(x))
        return self.down(y.cumsum(self.index) + F.softmax(y, dim=self.index) + torch.flip(y, dims=[self.index]))


def test_ops_along_a_dim_keep_the_split_unless_it_is_theirs():
    out, _, _ = place(Along(1), torch.randn(B, S, H), styles=MLP, heads=set())
    assert not isinstance(out, Refusal), out  # along the sequence: each rank its features
    out, _, _ = place(Along(-1), torch.randn(B, S, H), styles=MLP, heads=set())
    assert isinstance(out, Refusal) and out.node.target == "cumsum" and "along the split dim" in out.why


def test_multihead_attention_and_convolutions_are_priced_whole_as_the_runtime_runs_them():
    """nn.MultiheadAttention's packed in_proj_weight is no nn.Linear the runtime can split: its region is priced
    replicated (the plan credited it split while the ranks held it whole: +30.6% parameters in validate). Under
    --engine megatron the engine's own attention is split. Convolutions never are."""
    prof, _ = analyze(STYLES / "vit_mha.py", {})
    block = next(u for u in prof.units if u.kind == "block")
    assert {path for path, _ in block.tp_layout} == {"layers.0.mlp.0", "layers.0.mlp.3"}
    attention = 4 * 64 * 64 + 4 * 64  # in_proj (3h x h) and out_proj (h x h), with biases
    assert block.replicated.params >= attention
    engine, _ = analyze(STYLES / "vit_mha.py", {}, kernels="megatron")
    block = next(u for u in engine.units if u.kind == "block")
    assert block.replicated.params < attention
    cnn, _ = analyze(STYLES / "cnn.py", {})
    assert not any("conv" in path for u in cnn.units for path, _ in u.tp_layout)


class Rolled(Indexed):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.roll(F.gelu(self.up(x)), 1, dims=1))  # along the sequence, each rank its features


def test_an_op_is_taught_by_registering_its_rule():
    """Adding an op is one rule in passes/sharding/: `roll` along another dim than the split one."""
    from passes.sharding import Refuse, Rule, register, unregister

    out, _, _ = place(Rolled(None), torch.randn(B, S, H), styles=MLP, heads=set())
    assert isinstance(out, Refusal) and out.why.endswith(": roll"), out

    def roll(state, n, x, dim, kind):
        dims = n.args[2] if len(n.args) > 2 else n.kwargs.get("dims")
        if dims is None or any(d % len(state.shape(x)) == dim for d in (dims if isinstance(dims, (list, tuple))
                                                                       else [dims])):
            raise Refuse(f"{n.name}: rolls the split dim")
        state.passes(n, x, dim)

    rule = register(Rule(("roll",), roll, "a roll along another dim"))
    try:
        out, _, _ = place(Rolled(None), torch.randn(B, S, H), styles=MLP, heads=set())
        assert not isinstance(out, Refusal), out
    finally:
        unregister(rule)


def test_what_context_parallelism_cannot_place_is_known_at_trace_time():
    """Issue 47: context parallelism's rules (passes/sharding/context.py) run at trace time as the runtime runs them,
    so the search never proposes a context-parallel split the runtime would refuse at launch (the default GPT's
    attention dropout), a pinned one is refused in one sentence naming the op and line, and the split that places
    runs (tests/runtime/test_styles.py, cp2)."""
    from passes.errors import UserError
    from planner.api import make_plan
    from planner.search import Pins

    gpt, tiny = ROOT / "examples" / "gpt.py", {"layers": 2, "hidden": 64, "heads": 4, "seq": 64, "vocab": 256}
    profile, _ = analyze(gpt, tiny)
    assert "dropout inside attention" in profile.tp_refusals["cp"] and "gpt.py:" in profile.tp_refusals["cp"]
    assert "cp" not in analyze(gpt, {**tiny, "dropout": 0.0})[0].tp_refusals
    assert "cp" not in analyze(ROOT / "tests" / "fixtures" / "llama_unfused.py", {"layers": 2})[0].tp_refusals
    kw = dict(gpus=4, global_batch=8, target="a100-80gb", gpus_per_node=4, model_args=tiny)
    with pytest.raises(UserError) as err:
        make_plan(str(gpt), pins=Pins(cp=2), **kw)
    why = str(err.value)
    assert "dropout inside attention" in why and why.count(";") == 2 and "re-plan with --cp 1" in why
    plan, _ = make_plan(str(gpt), pins=Pins(tp=1, pp=1), **kw)
    assert plan.config.cp == 1
