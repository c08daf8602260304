"""Models used by the presets, and the model registry (``MODELS``).

The built-in models have parameters only; a user's model may have buffers (BatchNorm running
statistics), which travel with the weights or stay on the clients by ``client.buffers``
(felix.client.trainer). A model factory is ``factory(sample_shape, num_classes, **model_params)``
and returns a ``torch.nn.Module`` with float32 parameters; the config names it ``model: NAME`` or
``model: package.module:factory``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from felix.client.pooling import MaxPool2d
from felix.config import ConfigError
from felix.core.registry import CallShape, Registry


class FelixCifarCNN(nn.Module):
    """The FeLiX authors' CIFAR-10 CNN: 537,610 parameters (unpadded 3x3 convs, 2x2 pools)."""

    sequential_forward = ("features", "classifier")  # the cohort trainer's stacked-chain kernel applies

    def __init__(self, in_channels: int = 3, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 64, 3),
            nn.ReLU(),
            MaxPool2d(2),
            nn.Conv2d(64, 128, 3),
            nn.ReLU(),
            MaxPool2d(2),
            nn.Conv2d(128, 256, 3),
            nn.ReLU(),
            MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(1024, 128),
            nn.ReLU(),
            nn.Linear(128, 256),
            nn.ReLU(),
            nn.Linear(256, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class SmallCNN(nn.Module):
    """Two conv blocks and a linear head, sized by the input: for digits (8x8), Fashion-MNIST and
    CPU-scale CIFAR-10 runs, where the paper-scale CNN would be too slow on two cores."""

    sequential_forward = ("features", "flatten", "head")  # the stacked-chain kernel applies

    def __init__(self, in_shape: tuple[int, int, int], num_classes: int, width: int = 16) -> None:
        super().__init__()
        c, h, w = in_shape
        self.features = nn.Sequential(
            nn.Conv2d(c, width, 3, padding=1),
            nn.ReLU(),
            MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.ReLU(),
            MaxPool2d(2),
        )
        self.flatten = nn.Flatten()
        self.head = nn.Linear(2 * width * (h // 4) * (w // 4), num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.flatten(self.features(x)))


class MLP(nn.Module):
    sequential_forward = "net"  # forward(x) is self.net(x): the cohort trainer's stacked-chain kernel applies

    def __init__(self, in_shape: tuple[int, ...], num_classes: int, hidden: int = 64) -> None:
        super().__init__()
        n = 1
        for d in in_shape:
            n *= d
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(n, hidden), nn.ReLU(), nn.Linear(hidden, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class KwsCNN(nn.Module):
    """A CPU-sized keyword-spotting CNN on log-mel spectrograms (1 x mels x frames): three 3x3
    conv blocks, each halving time and frequency, and a small dense head. A plain chain, so the
    cohort trainer's stacked-chain kernel applies."""

    sequential_forward = ("features", "flatten", "head")

    def __init__(self, in_shape: tuple[int, int, int], num_classes: int, width: int = 16) -> None:
        super().__init__()
        c, h, w = in_shape
        if h < 8 or w < 8:
            raise ValueError(f"kws_cnn needs at least 8 mel bands and 8 frames, got {h} x {w}")
        self.features = nn.Sequential(
            nn.Conv2d(c, width, 3, padding=1),
            nn.ReLU(),
            MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.ReLU(),
            MaxPool2d(2),
            nn.Conv2d(2 * width, 2 * width, 3, padding=1),
            nn.ReLU(),
            MaxPool2d(2),
        )
        self.flatten = nn.Flatten()
        self.head = nn.Sequential(
            nn.Linear(2 * width * (h // 8) * (w // 8), 64), nn.ReLU(), nn.Linear(64, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.flatten(self.features(x)))


def _norm1d(kind: str, channels: int) -> nn.Module:
    return nn.BatchNorm1d(channels) if kind == "batch" else nn.GroupNorm(32, channels)


class BasicBlock1D(nn.Module):
    """ResNet's basic block with 1-D convolutions (kernel 3), as in the FeLiX authors' speech model."""

    def __init__(self, cin: int, cout: int, stride: int, norm: str) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = _norm1d(norm, cout)
        self.conv2 = nn.Conv1d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = _norm1d(norm, cout)
        self.relu = nn.ReLU()
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv1d(cin, cout, 1, stride=stride, bias=False), _norm1d(norm, cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu(out + identity)


class ResNet34_1D(nn.Module):
    """The FeLiX authors' speech network (``ResNet34_1D`` in their Flame fork,
    ``examples/async_google_speech/trainer/pytorch/main_resnet.py``): ResNet-34's stages (3, 4, 6, 3
    basic blocks of 64-512 channels) with 1-D convolutions, over a raw waveform (1 x samples) in
    their runs; 7.2M parameters for 35 words. Here the input may also be a log-mel spectrogram, its
    mel bands the input channels. Their forward ends in log-softmax for an NLL loss; this one
    returns the logits, which cross-entropy turns into the same loss.

    ``norm``: ``batch`` (theirs: BatchNorm, whose running statistics are buffers, so clients
    train one at a time) or ``group`` (GroupNorm with 32 groups: no buffers, so cohorts of clients
    train in one vectorised pass)."""

    def __init__(self, in_channels: int, num_classes: int, norm: str = "batch") -> None:
        super().__init__()
        if norm not in ("batch", "group"):
            raise ValueError(f"norm must be 'batch' or 'group', got {norm!r}")
        self.conv1 = nn.Conv1d(in_channels, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = _norm1d(norm, 64)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool1d(3, stride=2, padding=1)
        stages: list[nn.Module] = []
        cin = 64
        for cout, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            stages.append(
                nn.Sequential(
                    *(
                        BasicBlock1D(cin if b == 0 else cout, cout, stride if b == 0 else 1, norm)
                        for b in range(blocks)
                    )
                )
            )
            cin = cout
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool1d(1)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 4:  # a log-mel spectrogram 1 x mels x frames: the mel bands are the channels
            x = x.flatten(1, 2)
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


ModelFactory = Callable[..., nn.Module]
MODELS: Registry[ModelFactory] = Registry(
    "model",
    key="model",
    call=CallShape(
        "model factory(sample_shape: tuple[int, ...], num_classes: int, **model_params) -> torch.nn.Module",
        "model_params",
        passed=2,
    ),
)


@MODELS.register("felix_cnn")
def felix_cnn(sample_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    if tuple(sample_shape) != (3, 32, 32):
        raise ValueError(f"felix_cnn expects 3x32x32 images, got {sample_shape}")
    return FelixCifarCNN(sample_shape[0], num_classes)


@MODELS.register("small_cnn")
def small_cnn(sample_shape: tuple[int, ...], num_classes: int, width: int = 16) -> nn.Module:
    if len(sample_shape) != 3:
        raise ValueError(f"small_cnn expects C x H x W inputs, got {sample_shape}")
    return SmallCNN(tuple(sample_shape), num_classes, width)  # type: ignore[arg-type]


@MODELS.register("kws_cnn")
def kws_cnn(sample_shape: tuple[int, ...], num_classes: int, width: int = 16) -> nn.Module:
    if len(sample_shape) != 3 or sample_shape[0] != 1:
        raise ValueError(f"kws_cnn expects a log-mel spectrogram 1 x mels x frames, got {sample_shape}")
    return KwsCNN(tuple(sample_shape), num_classes, width)  # type: ignore[arg-type]


@MODELS.register("resnet34_1d")
def resnet34_1d(sample_shape: tuple[int, ...], num_classes: int, norm: str = "batch") -> nn.Module:
    if len(sample_shape) == 3 and sample_shape[0] == 1:
        channels = sample_shape[1]  # log-mel: the mel bands
    elif len(sample_shape) == 2:
        channels = sample_shape[0]  # a waveform (1 x samples) or channels x time
    else:
        raise ValueError(
            f"resnet34_1d expects channels x time (a waveform 1 x samples) or 1 x mels x frames, got {sample_shape}"
        )
    return ResNet34_1D(channels, num_classes, norm)


@MODELS.register("mlp")
def mlp(sample_shape: tuple[int, ...], num_classes: int, hidden: int = 64) -> nn.Module:
    return MLP(tuple(sample_shape), num_classes, hidden)


def model_ref(name: str | ModelFactory) -> str:
    """How errors name a model: its registered name or import path, or a factory's qualified name."""
    return name if isinstance(name, str) else getattr(name, "__qualname__", repr(name))


def make_model(
    name: str | ModelFactory,
    in_shape: tuple[int, ...],
    num_classes: int,
    seed: int = 0,
    params: dict[str, Any] | None = None,
) -> nn.Module:
    """Build a model with seeded initial weights (the run's seed decides the starting point).

    ``name`` is a registered name, an import path (``MODELS.resolve``) or a factory itself. The
    factory runs under a forked torch RNG seeded with ``seed``, so it needs no seed of its own.
    Raises ``ConfigError`` for a factory that fails on these inputs or does not return a module
    with float parameters.
    """
    ref = model_ref(name)
    factory = MODELS.resolve(name) if isinstance(name, str) else name
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            model = factory(tuple(in_shape), num_classes, **(params or {}))
        except (TypeError, ValueError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(
                f"model: {ref!r} on {tuple(in_shape)} inputs and {num_classes} classes: {exc}"
            ) from None
    check_model(model, ref)
    return model


def check_model_fits(model: nn.Module, x: torch.Tensor, num_classes: int, ref: str) -> None:
    """A ``ConfigError`` unless ``model`` starts from finite weights and maps the samples ``x`` to
    ``num_classes`` logits each. A model with more outputs would train silently with classes the
    data never has; NaN weights make every update refused. The forward runs in eval mode without
    gradients, so it changes no state (BatchNorm statistics, random draws)."""
    if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
        raise MODELS.wrong(ref, "starts from weights that hold NaN or infinite values")
    modes = [(m, m.training) for m in model.modules()]  # each module's own: a user may freeze some
    model.eval()
    try:
        with torch.no_grad():
            out = model(x)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise MODELS.wrong(ref, f"fails on inputs of shape {tuple(x.shape)}: {exc}") from None
    finally:
        for m, training in modes:
            m.training = training
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (x.shape[0], num_classes):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise MODELS.wrong(
            ref, f"maps inputs of shape {tuple(x.shape)} to {got}, not ({x.shape[0]}, {num_classes}) logits"
        )


def check_model(model: object, ref: str) -> None:
    """A model felix can ship as a flat float32 vector: a module with float parameters."""
    if not isinstance(model, nn.Module):
        raise MODELS.wrong(ref, f"returned a {type(model).__name__}, not a torch.nn.Module")
    params = list(model.parameters())
    if not params:
        raise MODELS.wrong(ref, "returned a module without parameters")
    bad = sorted({str(p.dtype) for p in params if p.dtype != torch.float32})
    if bad:
        raise MODELS.wrong(ref, f"has parameters of dtype {', '.join(bad)}; felix ships float32 weights")
