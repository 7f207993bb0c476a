"""Megatron-style GPT (pre-LayerNorm decoder) as a fxplanner model file.

Presets reproduce the models of Narayanan's thesis Table 4.1 (= Megatron-LM, SC'21, Table 1) and
GPT-3 175B (Table 4.2). All use V = 51200 and s = 2048, as the thesis states. The LM head shares
the token-embedding weight, as in Megatron, so the parameter count follows eq. 4.3.

    planner profile examples/gpt.py --model-arg preset=1t
    planner plan examples/gpt.py --gpus 64 --model-arg preset=18b
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# name: (attention heads, hidden size, layers) — thesis Table 4.1, plus GPT-3 175B (Table 4.2).
PRESETS: dict[str, tuple[int, int, int]] = {
    "1.7b": (24, 2304, 24),
    "3.6b": (32, 3072, 30),
    "7.5b": (32, 4096, 36),
    "18b": (48, 6144, 40),
    "39b": (64, 8192, 48),
    "76b": (80, 10240, 60),
    "145b": (96, 12288, 80),
    "310b": (128, 16384, 96),
    "530b": (128, 20480, 105),
    "1t": (160, 25600, 128),
    "175b": (96, 12288, 96),
    "tiny": (4, 64, 4),
}
DEFAULT_PRESET = "18b"
VOCAB = 51200
SEQ = 2048
INIT_STD = 0.02  # Megatron-LM's --init-method-std default, GPT-2's initializer_range


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, dropout: float, flash: bool = False) -> None:
        super().__init__()
        self.heads, self.flash = heads, flash
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.attn_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        d = h // self.heads
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d).permute(2, 0, 3, 1, 4).unbind(0)
        if self.flash:  # one fused kernel: no s x s scores kept (Megatron-Core and NeMo today)
            p = self.attn_drop.p if self.training else 0.0
            ctx = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
            return self.proj(ctx.transpose(1, 2).reshape(b, s, h))
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(d)
        scores = scores.masked_fill(mask, float("-inf"))
        probs = self.attn_drop(torch.softmax(scores, dim=-1))
        ctx = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, h)
        return self.proj(ctx)


class MLP(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, dropout: float, flash: bool = False) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads, dropout, flash)
        self.drop1 = nn.Dropout(dropout)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden)
        self.drop2 = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.drop1(self.attn(self.ln1(x), mask))
        return x + self.drop2(self.mlp(self.ln2(x)))


class Embedding(nn.Module):
    def __init__(self, vocab: int, seq: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)
        self.drop = nn.Dropout(dropout)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.drop(self.tok(tokens) + self.pos(positions))


class Head(nn.Module):
    """Final LayerNorm and the logit layer, tied to the token embedding (Megatron)."""

    def __init__(self, hidden: int, tok: nn.Embedding) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.tok = tok

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.ln(x), self.tok.weight)


class GPT(nn.Module):
    def __init__(self, *, layers: int, hidden: int, heads: int, seq: int, vocab: int,
                 dropout: float = 0.0, flash: bool = False, init: str = "megatron", init_std: float = INIT_STD) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden {hidden} is not divisible by heads {heads}")
        if init not in ("megatron", "pytorch"):
            raise ValueError(f"init takes megatron or pytorch, got {init!r}")
        self.embedding = Embedding(vocab, seq, hidden, dropout)
        self.layers = nn.ModuleList(Block(hidden, heads, dropout, flash) for _ in range(layers))
        self.head = Head(hidden, self.embedding.tok)
        causal = torch.ones(seq, seq, dtype=torch.bool).triu(1)
        self.register_buffer("mask", causal, persistent=False)
        if init == "megatron":
            self._init_weights(layers, init_std)

    def _init_weights(self, layers: int, std: float) -> None:
        """Megatron-LM's (and GPT-2's) initialization: N(0, std) for the embeddings and the linear layers, zero
        biases, and the two projections that end a residual branch (attention's proj, the MLP's fc2) at
        std / sqrt(2 layers) (Megatron's output_layer_init_method, GPT-2's c_proj). PyTorch's defaults (N(0, 1)
        embeddings, which the tied head reuses) would start the loss far above ln(vocab)."""
        scaled = std / math.sqrt(2 * max(layers, 1))
        for name, m in self.named_modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0.0, scaled if name.endswith(("attn.proj", "mlp.fc2")) else std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, 0.0, std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        for layer in self.layers:
            x = layer(x, self.mask)
        return self.head(x)


def _config(preset: str | None, layers, hidden, heads, seq, vocab) -> dict[str, int]:
    if preset is not None and preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    preset = preset or DEFAULT_PRESET
    a, h, l = PRESETS[preset]
    tiny = preset == "tiny"
    return {
        "layers": int(layers if layers is not None else l),
        "hidden": int(hidden if hidden is not None else h),
        "heads": int(heads if heads is not None else a),
        "seq": int(seq if seq is not None else (32 if tiny else SEQ)),
        "vocab": int(vocab if vocab is not None else (128 if tiny else VOCAB)),
    }


def build_model(preset: str | None = None, layers=None, hidden=None, heads=None, seq=None,
                vocab=None, dropout: float = 0.1, flash: bool = False, init: str = "megatron",
                init_std: float = INIT_STD) -> nn.Module:
    """Megatron's GPT trains with dropout 0.1; pass dropout=0 for bit-exact pipeline tests. flash=True runs
    attention as one fused kernel (F.scaled_dot_product_attention, causal), as Megatron-Core does today.
    init: megatron (GPT._init_weights, with init_std as Megatron's --init-method-std) or pytorch (the layers' own
    defaults, this file's init before issue 51: tests calibrated on its larger activations keep it)."""
    return GPT(**_config(preset, layers, hidden, heads, seq, vocab), dropout=float(dropout), flash=bool(flash),
               init=str(init), init_std=float(init_std))


def example_inputs(batch_size: int, preset: str | None = None, layers=None, hidden=None,
                   heads=None, seq=None, vocab=None, **_: object) -> tuple[torch.Tensor]:
    cfg = _config(preset, layers, hidden, heads, seq, vocab)
    return (torch.randint(0, cfg["vocab"], (batch_size, cfg["seq"])),)


def sample_batch(batch_size: int, step: int, **kwargs: object) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    """Deterministic synthetic next-token data: inputs and targets for `step`."""
    cfg = _config(kwargs.get("preset"), kwargs.get("layers"), kwargs.get("hidden"),
                  kwargs.get("heads"), kwargs.get("seq"), kwargs.get("vocab"))
    gen = torch.Generator().manual_seed(1234 + step)
    data = torch.randint(0, cfg["vocab"], (batch_size, cfg["seq"] + 1), generator=gen)
    return (data[:, :-1],), data[:, 1:]


def loss_fn(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), targets.reshape(-1))
