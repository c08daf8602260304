"""Models used by the presets. Parameters only (no BatchNorm buffers), so a flat float32 vector
is the whole model state that travels between server and clients."""
from __future__ import annotations

import torch
from torch import nn


class FelixCifarCNN(nn.Module):
    """The FeLiX authors' CIFAR-10 CNN: 537,610 parameters (unpadded 3x3 convs, 2x2 pools)."""

    def __init__(self, in_channels: int = 3, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 64, 3), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 128, 3), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(128, 256, 3), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(1024, 128), nn.ReLU(), nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class SmallCNN(nn.Module):
    """Two conv blocks and a linear head, sized by the input: for digits (8x8), Fashion-MNIST and
    CPU-scale CIFAR-10 runs, where the paper-scale CNN would be too slow on two cores."""

    def __init__(self, in_shape: tuple[int, int, int], num_classes: int, width: int = 16) -> None:
        super().__init__()
        c, h, w = in_shape
        self.features = nn.Sequential(
            nn.Conv2d(c, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.head = nn.Linear(2 * width * (h // 4) * (w // 4), num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.features(x), 1))


class MLP(nn.Module):
    def __init__(self, in_shape: tuple[int, ...], num_classes: int, hidden: int = 64) -> None:
        super().__init__()
        n = 1
        for d in in_shape:
            n *= d
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(n, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


MODELS = ("felix_cnn", "small_cnn", "mlp")


def make_model(name: str, in_shape: tuple[int, ...], num_classes: int, seed: int = 0) -> nn.Module:
    """Build a model with seeded initial weights (the run's seed decides the starting point)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if name == "felix_cnn":
            if tuple(in_shape) != (3, 32, 32):
                raise ValueError(f"felix_cnn expects 3x32x32 images, got {in_shape}")
            return FelixCifarCNN(in_shape[0], num_classes)
        if name == "small_cnn":
            if len(in_shape) != 3:
                raise ValueError(f"small_cnn expects C x H x W inputs, got {in_shape}")
            return SmallCNN(tuple(in_shape), num_classes)  # type: ignore[arg-type]
        if name == "mlp":
            return MLP(tuple(in_shape), num_classes)
    raise ValueError(f"unknown model {name!r}; choose one of {list(MODELS)}")
