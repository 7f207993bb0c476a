"""torchvision's ResNet18, ResNet50 and VGG19 in plain torch (no torchvision import), as a fxplanner model file.

The layer shapes are torchvision's (torchvision/models/resnet.py, vgg.py): ResNet "v1.5" (the bottleneck's
stride on its 3x3 convolution), a 7x7 stem and 3x3 max-pool, global average pool, one linear head; VGG19 is
configuration "E" without batch norm, 7x7 adaptive average pool and the 4096-4096 classifier with dropout. These
are the side tasks of FreeRide's evaluation (../shared/seeds/000_..., l.279: "out-of-the-box models from
PyTorch"), trained at batch 64 (l.306) on 224x224 RGB images with 1000 classes (torchvision's default head).

    planner profile examples/vision.py --model-arg arch=resnet50
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ARCHS = ("resnet18", "resnet50", "resnet152", "vgg19")
VGG19 = (64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M", 512, 512, 512, 512, "M")
"""torchvision's cfgs["E"]: output channels of each 3x3 convolution, "M" a 2x2 max-pool."""


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, width, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.downsample = _downsample(cin, width, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        skip = x if self.downsample is None else self.downsample(x)
        return F.relu(out + skip)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.downsample = _downsample(cin, cout, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        skip = x if self.downsample is None else self.downsample(x)
        return F.relu(out + skip)


def _downsample(cin: int, cout: int, stride: int) -> nn.Module | None:
    if stride == 1 and cin == cout:
        return None
    return nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))


class ResNet(nn.Module):
    def __init__(self, block: type, layers: tuple[int, ...], classes: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        blocks, cin = [], 64
        for i, (n, width) in enumerate(zip(layers, (64, 128, 256, 512))):
            for j in range(n):
                blocks.append(block(cin, width, 2 if (j == 0 and i > 0) else 1))
                cin = width * block.expansion
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(F.relu(self.bn1(self.conv1(x))))
        x = self.blocks(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class VGG(nn.Module):
    def __init__(self, cfg: tuple, classes: int, dropout: float) -> None:
        super().__init__()
        stages: list[nn.Module] = []
        layers: list[nn.Module] = []
        cin = 3
        for v in cfg:
            if v == "M":
                stages.append(nn.Sequential(*layers, nn.MaxPool2d(2, 2)))
                layers = []
            else:
                layers += [nn.Conv2d(cin, v, 3, padding=1), nn.ReLU()]
                cin = v
        # torchvision's `features` is one flat Sequential; here it is one Sequential per resolution (the same
        # layers in the same order). In a flat one the max-pools and the 512->512 convolutions repeat with equal
        # parameter shapes at different resolutions, and passes/repeat.py prices a repeat by its first
        # occurrence's trace (it takes class + parameter shapes to determine a block's computation).
        self.features = nn.Sequential(*stages)
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(512 * 7 * 7, 4096), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(4096, 4096), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(4096, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def build_model(arch: str = "resnet18", classes: int = 1000, dropout: float = 0.5, **_: object) -> nn.Module:
    """`arch`: resnet18, resnet50, resnet152 or vgg19; `dropout`: VGG's classifier (torchvision's 0.5)."""
    if arch == "resnet18":
        return ResNet(BasicBlock, (2, 2, 2, 2), int(classes))
    if arch == "resnet50":
        return ResNet(Bottleneck, (3, 4, 6, 3), int(classes))
    if arch == "resnet152":
        return ResNet(Bottleneck, (3, 8, 36, 3), int(classes))
    if arch == "vgg19":
        return VGG(VGG19, int(classes), float(dropout))
    raise ValueError(f"unknown arch {arch!r}; known: {', '.join(ARCHS)}")


def example_inputs(batch_size: int, image: int = 224, **_: object) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, 3, int(image), int(image)),)


def sample_batch(batch_size: int, step: int, image: int = 224, classes: int = 1000,
                 **_: object) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    """Deterministic synthetic images and labels for `step`."""
    gen = torch.Generator().manual_seed(7 + step)
    images = torch.randn(batch_size, 3, int(image), int(image), generator=gen)
    return (images,), torch.randint(0, int(classes), (batch_size,), generator=gen)


def loss_fn(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, targets)
