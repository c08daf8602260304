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

from felix.config import ConfigError
from felix.scenario.registry import Registry


class FelixCifarCNN(nn.Module):
    """The FeLiX authors' CIFAR-10 CNN: 537,610 parameters (unpadded 3x3 convs, 2x2 pools)."""

    sequential_forward = ("features", "classifier")  # the cohort trainer's stacked-chain kernel applies

    def __init__(self, in_channels: int = 3, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 64, 3),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(64, 128, 3),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(128, 256, 3),
            nn.ReLU(),
            nn.MaxPool2d(2),
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
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
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


ModelFactory = Callable[..., nn.Module]
MODELS: Registry[ModelFactory] = Registry(
    "model",
    "model",
    "model factory(sample_shape: tuple[int, ...], num_classes: int, **model_params) -> torch.nn.Module",
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
