"""The capture front-end on models written in the styles of the field: export first, measured costs."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from costmodels.memory import param_count
from passes.meta_keys import MODULE, TP
from planner.config import ParallelConfig
from passes.pipeline import analyze
from planner.search import tp_reason
from tests.conftest import EXAMPLES, FIXTURES


def test_a_cnn_with_conv_bias_plans_in_bf16_and_convolutions_are_counted():
    prof, ctx = analyze(FIXTURES / "cnn_bias.py", {}, dtype="bf16")
    assert prof.frontend == "export" and ctx.model.training
    assert all(p.dtype == torch.bfloat16 for p in ctx.model.parameters())
    hw = 32 * 32
    conv = 2 * (3 * 9 * 16 + 16 * 9 * 16) * hw  # 2 FLOPs per multiply-add, per output pixel
    assert sum(u.fwd_flops(1) for u in prof.units) == pytest.approx(conv + 2 * 16 * 10, rel=0.01)
    assert prof.tokens_per_sample == 0  # images: samples/s, not tokens/s


def test_an_unknown_op_is_listed_as_unpriced_with_its_share():
    prof, _ = analyze(FIXTURES / "unknown_op.py", {})
    ops = dict(prof.unpriced)
    assert list(ops) == ["special_i0"] and 0 < ops["special_i0"] < 1


def _gpt(layers: int):
    return analyze(EXAMPLES / "gpt.py", {"preset": "tiny", "layers": layers, "hidden": 96, "heads": 4, "seq": 64,
                                         "vocab": 1024})


def test_repeated_blocks_are_priced_once_and_copied_under_their_own_names():
    six, ctx = _gpt(6)
    two, _ = _gpt(2)
    blocks = [u for u in six.units if u.kind == "block"]
    assert [u.name for u in blocks] == [f"layers.{i}" for i in range(6)]
    assert [u.index for u in six.units] == list(range(len(six.units)))
    ref = next(u for u in two.units if u.kind == "block")
    for u in blocks:
        assert u.fwd_flops(3) == ref.fwd_flops(3) and u.params == ref.params
        assert u.sharded.saved_bytes(3) == ref.sharded.saved_bytes(3)
        assert {p.split(".")[1] for p, _ in u.tp_layout} == {u.name.split(".")[1]}
    assert len({n.meta[MODULE].split(".")[1] for n in ctx.gm.graph.nodes if n.meta[MODULE].startswith("layers.")}) == 2
    assert six.total_params == sum(p.numel() for p in ctx.model.parameters())


def test_mfu_counts_model_flops_as_megatron_does():
    """72 B L s h^2 (1 + s/6h + V/12hL) per iteration (Narayanan et al. 2021, without recomputation)."""
    prof, _ = _gpt(3)
    L, s, h, V = 3, 64, 96, 1024
    per_sample = 72 * L * s * h * h * (1 + s / (6 * h) + V / (12 * h * L))
    assert sum(u.model_flops(1) for u in prof.units) == pytest.approx(per_sample, rel=1e-9)


class LlamaBlock(nn.Module):
    """A Llama-style block in plain PyTorch: GQA, RoPE-like rotation, SDPA, SwiGLU."""

    def __init__(self, h: int = 64, heads: int = 4, kv: int = 2, ffn: int = 160) -> None:
        super().__init__()
        self.heads, self.kv, self.d = heads, kv, h // heads
        self.norm1, self.norm2 = nn.RMSNorm(h), nn.RMSNorm(h)
        self.q = nn.Linear(h, h, bias=False)
        self.k = nn.Linear(h, kv * self.d, bias=False)
        self.v = nn.Linear(h, kv * self.d, bias=False)
        self.o = nn.Linear(h, h, bias=False)
        self.gate = nn.Linear(h, ffn, bias=False)
        self.up = nn.Linear(h, ffn, bias=False)
        self.down = nn.Linear(ffn, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        y = self.norm1(x)
        q = self.q(y).view(b, s, self.heads, self.d).transpose(1, 2)
        k = self.k(y).view(b, s, self.kv, self.d).transpose(1, 2)
        v = self.v(y).view(b, s, self.kv, self.d).transpose(1, 2)
        q, k = torch.cat([-q[..., 1::2], q[..., ::2]], -1), torch.cat([-k[..., 1::2], k[..., ::2]], -1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, h))
        y = self.norm2(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


class Llama(nn.Module):
    def __init__(self, layers: int = 3, vocab: int = 2048, h: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, h)
        self.layers = nn.ModuleList(LlamaBlock(h) for _ in range(layers))
        self.norm = nn.RMSNorm(h)
        self.lm_head = nn.Linear(h, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("m") / "llama_plain.py"
    path.write_text(f"import sys\nsys.path.insert(0, {str(EXAMPLES.parent)!r})\n"
                    "import torch\nfrom tests.passes.test_capture import Llama\n"
                    "def build_model():\n    return Llama()\n"
                    "def example_inputs(b):\n    return (torch.zeros(b, 32, dtype=torch.long),)\n")
    return analyze(path, {})


def test_every_linear_of_a_llama_block_is_sharded_and_heads_are_found(llama):
    prof, ctx = llama
    roles = {n.meta[MODULE]: n.meta[TP] for n in ctx.gm.graph.nodes if n.meta[MODULE].startswith("layers.0.")
             and n.meta[TP] in ("col", "row")}
    assert roles == {"layers.0.q": "col", "layers.0.k": "col", "layers.0.v": "col", "layers.0.o": "row",
                     "layers.0.gate": "col", "layers.0.up": "col", "layers.0.down": "row"}
    block = next(u for u in prof.units if u.kind == "block")
    assert (block.heads, block.kv_heads) == (4, 2) and block.tp_allreduces == 2
    s, h = 32, 64  # one all-reduce of b*s*h bf16 values per column group backward (q/k/v, gate/up): thesis 4.3.2
    assert block.tp_bwd_allreduce_bytes(1) == block.tp_fwd_allreduce_bytes(1) == 2 * s * h * 2
    assert block.replicated.params == 2 * 64  # the two norms
    assert tp_reason(2, [(4, 2)]) is None and tp_reason(4, [(4, 2)]) is None
    assert "does not divide the 4 attention heads" in tp_reason(3, [(4, 2)])
    assert "key/value heads" in tp_reason(4, [(8, 3)])
    # grouped-query attention: kv heads are split up to t = kv_heads and replicated beyond
    kv = 2 * 64 * 32  # the k and v projections: h x (2 heads x head dim 16) each
    assert block.kv.params == kv
    held = lambda t: param_count(block, ParallelConfig(tp=t, pp=1, dp=1, b=1, m=1))  # noqa: E731
    assert held(2) == pytest.approx(block.sharded.params / 2 + block.replicated.params)
    assert held(4) == pytest.approx(block.sharded.params / 4 + block.replicated.params + kv / 2 - kv / 4)


def test_causal_flash_attention_is_priced_as_it_executes(llama):
    """Attention FLOPs: 4 b s^2 h forward, about half of it executed under a causal mask; the bytes
    saved are flash attention's (q, k, v, output, logsumexp), never an s x s matrix."""
    prof, _ = llama
    block = next(u for u in prof.units if u.kind == "block")
    s, h, kv, ffn = 32, 64, 32, 160
    dense = 2 * s * (2 * h * h + 2 * h * kv + 3 * h * ffn)
    attn = 4 * s * s * h
    assert block.sharded.model_flops(1) == pytest.approx(dense + attn)
    assert block.sharded.mm_flops(1) == pytest.approx(dense + attn * (s + 1) / (2 * s))
    assert block.sharded.selective_bytes(1) == pytest.approx(2 * s * h + 4 * 4 * s + 24)  # output, lse, rng state


@pytest.mark.parametrize("path,args", [("gpt.py", {"preset": "tiny"}), ("mlp.py", {}), ("resnet.py", {}),
                                       ("bert.py", {"preset": "tiny"})])
def test_units_are_named_alike_by_both_front_ends(path, args):
    """The runtime splits stages from a symbolic_trace graph and places its nodes by unit name."""
    from passes.load import load_model_file
    from passes.trace import trace_model
    from passes.units import group_nodes

    prof, _ = analyze(EXAMPLES / path, args)
    model = load_model_file(EXAMPLES / path, args).build("meta")
    assert prof.frontend == "export"
    assert [u.name for u in prof.units] == [name for name, _, _ in group_nodes(trace_model(model), model)]


def test_parameters_the_forward_never_uses_are_reported(tmp_path):
    path = tmp_path / "spare.py"
    path.write_text("import torch\nfrom torch import nn\n"
                    "class Net(nn.Module):\n"
                    "    def __init__(self):\n"
                    "        super().__init__(); self.a = nn.Linear(8, 8); self.spare = nn.Linear(8, 8)\n"
                    "    def forward(self, x):\n        return self.a(x)\n"
                    "def build_model():\n    return Net()\n"
                    "def example_inputs(b):\n    return (torch.randn(b, 8),)\n")
    prof, _ = analyze(path, {})
    assert any("2 parameter tensors (72 values) are never used" in n and "spare.weight" in n for n in prof.notes)
