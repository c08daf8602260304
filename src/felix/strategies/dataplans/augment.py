"""Class-preserving image augmentation that carries out a client's row of a DAFL plan.

The paper augments with "low-complexity methods such as rotation within
[-30, 30] degrees and horizontal flipping". torchvision is not a dependency, so
the transforms are written with ``torch.nn.functional.affine_grid`` /
``grid_sample`` on float batches ``[N, C, H, W]``. Flips use ``torch.flip``,
which is exact, so flipping twice gives back the input bit for bit.

Augmenters are plain callables ``(x_batch, generator) -> x_batch`` so that any
other class-preserving transform can be plugged in (DAFL decides *how many*
samples, not how they are made); all randomness comes from the generator, which
makes a client's augmented data a pure function of its seed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final, Literal, Protocol

import torch
import torch.nn.functional as F

__all__ = [
    "AUGMENTERS",
    "Augmenter",
    "Flip",
    "Identity",
    "RotateFlip",
    "augment_client",
    "get_augmenter",
    "rotate",
]


class Augmenter(Protocol):
    """A class-preserving transform of a batch ``[N, C, H, W]`` into a batch of the same shape."""

    def __call__(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor: ...


@dataclass(frozen=True)
class RotateFlip:
    """The paper's augmentation: a uniform rotation in ``[-max_degrees, max_degrees]``
    and a horizontal flip with probability ``flip_probability``, drawn per sample.

    Rotation is about the image centre in pixel units (so non-square images are
    not sheared) with bilinear interpolation. Corners rotated in from outside
    the image are 0 by default, as with torchvision's ``RandomRotation``;
    ``padding_mode="border"`` repeats the edge pixels instead.
    """

    max_degrees: float = 30.0
    flip_probability: float = 0.5
    padding_mode: Literal["zeros", "border", "reflection"] = "zeros"

    def __post_init__(self) -> None:
        if not (math.isfinite(self.max_degrees) and self.max_degrees >= 0):
            raise ValueError(f"max_degrees must be a finite number >= 0, got {self.max_degrees!r}")
        if not 0.0 <= self.flip_probability <= 1.0:
            raise ValueError(f"flip_probability must be in [0, 1], got {self.flip_probability!r}")
        if self.padding_mode not in ("zeros", "border", "reflection"):
            raise ValueError(f"padding_mode must be zeros, border or reflection, got {self.padding_mode!r}")

    def __call__(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        _check_batch(x)
        n = x.shape[0]
        flips = torch.rand(n, generator=generator) < self.flip_probability
        angles = (torch.rand(n, generator=generator, dtype=torch.float64) * 2 - 1) * math.radians(
            self.max_degrees
        )
        x = torch.where(flips.to(x.device)[:, None, None, None], x.flip(-1), x)
        return rotate(x, angles, padding_mode=self.padding_mode)


def rotate(
    x: torch.Tensor, angles: torch.Tensor, padding_mode: Literal["zeros", "border", "reflection"] = "zeros"
) -> torch.Tensor:
    """Rotate each image of ``x`` ``[N, C, H, W]`` by ``angles[i]`` radians about its centre
    (counter-clockwise as displayed with row 0 at the top), bilinear.

    ``affine_grid`` works in ``[-1, 1]`` on both axes, so the rotation is done in
    pixel units and rescaled per axis; a plain rotation matrix would shear
    non-square images.
    """
    _check_batch(x)
    n, _, height, width = x.shape
    if angles.shape != (n,):
        raise ValueError(f"need one angle per image ({n}), got shape {tuple(angles.shape)}")
    angles = angles.to(torch.float64).cpu()
    cos, sin = torch.cos(angles), torch.sin(angles)
    theta = torch.zeros(n, 2, 3, dtype=torch.float64)
    theta[:, 0, 0] = cos
    theta[:, 0, 1] = -sin * (height / width)  # grid maps output to input coordinates
    theta[:, 1, 0] = sin * (width / height)
    theta[:, 1, 1] = cos
    grid = F.affine_grid(theta.to(device=x.device, dtype=x.dtype), list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode=padding_mode, align_corners=False)


@dataclass(frozen=True)
class Flip:
    """Mirror every image left-right: the cheapest class-preserving transform."""

    def __call__(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        _check_batch(x)
        return x.flip(-1)


@dataclass(frozen=True)
class Identity:
    """Copies of the sources: plain oversampling, the no-augmentation baseline."""

    def __call__(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        _check_batch(x)
        return x.clone()


#: Samples transformed at once: local balancing can ask one client for tens of thousands of
#: images, and grid_sample's sampling grid alone is N x H x W x 2 floats.
_CHUNK: Final = 4096

#: Augmenter factories by name; "rotate_flip" is the paper's choice.
AUGMENTERS: Final[Mapping[str, Callable[[], Augmenter]]] = MappingProxyType(
    {"rotate_flip": RotateFlip, "flip": Flip, "none": Identity}
)


def get_augmenter(name: str = "rotate_flip") -> Augmenter:
    """The registered augmenter called ``name``."""
    try:
        return AUGMENTERS[name]()
    except KeyError:
        raise ValueError(f"unknown augmenter {name!r}; expected one of {', '.join(AUGMENTERS)}") from None


def augment_client(
    x: torch.Tensor,
    y: torch.Tensor,
    plan_row: Sequence[int],
    augmenter: Augmenter,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Create exactly ``plan_row[c]`` new samples of every class ``c`` from the client's data.

    Returns only the new samples ``(x_new, y_new)``, class by class, and the
    seconds spent making them (the per-client augmentation time that the paper
    reports as the slowest client's). Sources for class ``c`` are taken from a
    seeded random permutation of that class's samples, cycled, so every source
    is used ``floor`` or ``ceil`` of ``plan_row[c] / count`` times: spreading the
    load keeps near-duplicates of a single image to a minimum.
    """
    start = time.perf_counter()
    _check_batch(x)
    if y.ndim != 1 or y.shape[0] != x.shape[0]:
        raise ValueError(f"y must be a vector of {x.shape[0]} labels, got shape {tuple(y.shape)}")
    if y.dtype.is_floating_point or y.dtype == torch.bool:
        raise ValueError(f"y must hold integer class labels, got {y.dtype}")
    wanted = [int(v) for v in plan_row]
    if any(v < 0 for v in wanted):
        raise ValueError(f"plan_row must not be negative, got {wanted}")
    if y.numel() and (int(y.min()) < 0 or int(y.max()) >= len(wanted)):
        raise ValueError(
            f"labels must lie in [0, {len(wanted)}) to match plan_row, got {int(y.min())}..{int(y.max())}"
        )
    generator = torch.Generator().manual_seed(seed)
    labels = y.cpu()
    sources: list[torch.Tensor] = []
    for c, count in enumerate(wanted):
        if count == 0:
            continue
        members = torch.nonzero(labels == c).flatten()
        if members.numel() == 0:
            raise ValueError(
                f"plan asks for {count} new samples of class {c}, but the client has none to augment"
            )
        order = members[torch.randperm(members.numel(), generator=generator)]
        sources.append(order[torch.arange(count) % order.numel()])
    if not sources:
        return x[:0].clone(), y[:0].clone(), time.perf_counter() - start
    index = torch.cat(sources)
    parts = []
    for chunk in index.split(_CHUNK):
        batch = x[chunk.to(x.device)]
        out = augmenter(batch, generator)
        if out.shape != batch.shape:
            raise ValueError(
                f"augmenter changed the batch shape from {tuple(batch.shape)} to {tuple(out.shape)}"
            )
        parts.append(out)
    return torch.cat(parts), y[index.to(y.device)], time.perf_counter() - start


def _check_batch(x: torch.Tensor) -> None:
    if x.ndim != 4 or not x.dtype.is_floating_point:
        raise ValueError(f"expected a float batch [N, C, H, W], got {x.dtype} of shape {tuple(x.shape)}")
