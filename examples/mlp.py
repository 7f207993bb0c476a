"""A residual MLP: the smallest real training job (fill job, and the profiler's test model)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MLPBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.relu(self.up(self.norm(x))))


class MLP(nn.Module):
    def __init__(self, features: int, width: int, depth: int, classes: int) -> None:
        super().__init__()
        self.stem = nn.Linear(features, width)
        self.blocks = nn.ModuleList(MLPBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model(features: int = 256, width: int = 512, depth: int = 4, classes: int = 10) -> nn.Module:
    return MLP(int(features), int(width), int(depth), int(classes))


def example_inputs(batch_size: int, features: int = 256, **_: object) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, int(features)),)


def sample_batch(batch_size: int, step: int, features: int = 256, classes: int = 10,
                 **_: object) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(99 + step)
    x = torch.randn(batch_size, int(features), generator=gen)
    return (x,), torch.randint(0, int(classes), (batch_size,), generator=gen)


def loss_fn(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, targets)
