"""A residual MLP whose stem output skips every block: a value that crosses several pipeline stages."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class SkipNet(nn.Module):
    def __init__(self, features: int, width: int, depth: int, classes: int) -> None:
        super().__init__()
        self.stem = nn.Linear(features, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = s = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h + s)  # s is made by the first stage and read by the last


def build_model(features: int = 16, width: int = 32, depth: int = 4, classes: int = 5) -> nn.Module:
    return SkipNet(int(features), int(width), int(depth), int(classes))


def example_inputs(batch_size: int, features: int = 16, **_: object) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, int(features)),)


def sample_batch(batch_size: int, step: int, features: int = 16, classes: int = 5,
                 **_: object) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(7 + step)
    x = torch.randn(batch_size, int(features), generator=gen)
    return (x,), torch.randint(0, int(classes), (batch_size,), generator=gen)


def loss_fn(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, targets)
