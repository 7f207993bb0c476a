"""T5 (encoder-decoder) from its transformers config, on meta tensors (needs `pip install -e ".[hf]"`): a model
whose pipeline split crosses from the encoder into the decoder, with the shared embedding used at both ends.

    planner plan examples/hf_t5.py --gpus 2 --pp 2 [--model-arg layers=6 d_model=512 d_ff=2048 heads=8]

`T5ForConditionalGeneration` takes the encoder's and the decoder's token ids; this file's module takes both as
positional inputs and returns the logits (teacher forcing: the decoder reads the targets shifted right).
"""
from __future__ import annotations

import torch
from torch import nn
from transformers import T5Config, T5ForConditionalGeneration


class T5(nn.Module):
    def __init__(self, cfg: T5Config) -> None:
        super().__init__()
        self.t5 = T5ForConditionalGeneration(cfg)

    def forward(self, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor) -> torch.Tensor:
        return self.t5(input_ids=input_ids, decoder_input_ids=decoder_input_ids).logits


def _config(layers: int, d_model: int, d_ff: int, heads: int, vocab: int) -> T5Config:
    return T5Config(vocab_size=int(vocab), d_model=int(d_model), d_kv=int(d_model) // int(heads), d_ff=int(d_ff),
                    num_layers=int(layers), num_heads=int(heads), dropout_rate=0.0)


def build_model(layers: int = 6, d_model: int = 512, d_ff: int = 2048, heads: int = 8, vocab: int = 32128,
                seq: int = 512) -> nn.Module:
    """T5-small's shape by default (6 + 6 layers, d_model 512)."""
    return T5(_config(layers, d_model, d_ff, heads, vocab))


def example_inputs(batch_size: int, seq: int = 512, vocab: int = 32128, **_: object) -> tuple[torch.Tensor, ...]:
    return (torch.randint(0, int(vocab), (batch_size, int(seq))), torch.randint(0, int(vocab), (batch_size, int(seq))))


def sample_batch(batch_size: int, step: int, seq: int = 512, vocab: int = 32128, **_: object):
    gen = torch.Generator().manual_seed(11 + step)
    source = torch.randint(0, int(vocab), (batch_size, int(seq)), generator=gen)
    target = torch.randint(1, int(vocab), (batch_size, int(seq)), generator=gen)
    shifted = torch.cat([torch.zeros_like(target[:, :1]), target[:, :-1]], dim=1)  # T5's decoder start token is 0
    return (source, shifted), target


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
