"""A BERT-style encoder for batch-inference fill jobs (bidirectional attention, no mask)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

PRESETS = {"base": (12, 768, 12), "large": (16, 1024, 24), "tiny": (2, 64, 2)}


class EncoderLayer(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.ln1 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        d = h // self.heads
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d).permute(2, 0, 3, 1, 4).unbind(0)
        probs = torch.softmax(torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(d), dim=-1)
        ctx = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, h)
        x = self.ln1(x + self.out(ctx))
        return self.ln2(x + self.fc2(F.gelu(self.fc1(x))))


class Bert(nn.Module):
    def __init__(self, *, layers: int, hidden: int, heads: int, seq: int, vocab: int, classes: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)
        self.ln = nn.LayerNorm(hidden)
        self.layers = nn.ModuleList(EncoderLayer(hidden, heads) for _ in range(layers))
        self.classifier = nn.Linear(hidden, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.ln(self.tok(tokens) + self.pos(positions))
        for layer in self.layers:
            x = layer(x)
        return self.classifier(x[:, 0])


def _cfg(preset: str, seq, vocab) -> tuple[int, int, int, int, int]:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    heads, hidden, layers = PRESETS[preset]
    tiny = preset == "tiny"
    return heads, hidden, layers, int(seq or (16 if tiny else 128)), int(vocab or (128 if tiny else 30522))


def build_model(preset: str = "base", seq=None, vocab=None, classes: int = 2) -> nn.Module:
    heads, hidden, layers, s, v = _cfg(preset, seq, vocab)
    return Bert(layers=layers, hidden=hidden, heads=heads, seq=s, vocab=v, classes=int(classes))


def example_inputs(batch_size: int, preset: str = "base", seq=None, vocab=None, **_: object):
    _, _, _, s, v = _cfg(preset, seq, vocab)
    return (torch.randint(0, v, (batch_size, s)),)


def sample_batch(batch_size: int, step: int, preset: str = "base", seq=None, vocab=None,
                 classes: int = 2, **_: object):
    _, _, _, s, v = _cfg(preset, seq, vocab)
    gen = torch.Generator().manual_seed(7 + step)
    return (torch.randint(0, v, (batch_size, s), generator=gen),), torch.randint(0, int(classes), (batch_size,), generator=gen)


def loss_fn(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, targets)
