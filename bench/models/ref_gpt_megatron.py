"""../shared/references/models/ref_gpt.py as Megatron-LM ran the SC21 runs (Narayanan et al., thesis Table 4.1).

The same GPT (pre-LayerNorm blocks, GELU MLP of 4h, learned positions, untied head), plus the dropouts Megatron-LM's
GPT applies at its defaults (megatron/arguments.py: --attention-dropout 0.1, --hidden-dropout 0.1), which the SC21
launch scripts did not change and which the reference file omits: on the attention probabilities after the fused
scale-mask-softmax (ParallelAttention.attention_dropout), on the attention and MLP outputs before their residual adds
(the fused bias-dropout-add the thesis names in 4.4.2), and on the embeddings' sum (Embedding.embedding_dropout).
"""
import math

import torch
from torch import nn


class Attention(nn.Module):
    def __init__(self, hidden, heads, attention_dropout):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.drop = nn.Dropout(attention_dropout)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(x).split(h, dim=-1)
        q = q.view(b, s, self.heads, h // self.heads).transpose(1, 2)
        k = k.view(b, s, self.heads, h // self.heads).transpose(1, 2)
        v = v.view(b, s, self.heads, h // self.heads).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(h // self.heads)
        att = self.drop(att.softmax(dim=-1))
        y = (att @ v).transpose(1, 2).reshape(b, s, h)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, hidden, heads, attention_dropout, hidden_dropout):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads, attention_dropout)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)
        self.drop1 = nn.Dropout(hidden_dropout)
        self.drop2 = nn.Dropout(hidden_dropout)

    def forward(self, x):
        x = x + self.drop1(self.attn(self.ln1(x)))
        return x + self.drop2(self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x)))))


class GPT(nn.Module):
    def __init__(self, layers, hidden, heads, seq, vocab, attention_dropout, hidden_dropout):
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)
        self.drop = nn.Dropout(hidden_dropout)
        self.blocks = nn.ModuleList(Block(hidden, heads, attention_dropout, hidden_dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.register_buffer("positions", torch.arange(seq), persistent=False)

    def forward(self, idx):
        x = self.drop(self.tok(idx) + self.pos(self.positions))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def build_model(layers=4, hidden=256, heads=8, seq=128, vocab=1024, attention_dropout=0.1, hidden_dropout=0.1):
    return GPT(int(layers), int(hidden), int(heads), int(seq), int(vocab), float(attention_dropout),
               float(hidden_dropout))


def example_inputs(batch_size, layers=4, hidden=256, heads=8, seq=128, vocab=1024, attention_dropout=0.1,
                   hidden_dropout=0.1):
    return (torch.randint(0, int(vocab), (int(batch_size), int(seq))),)
