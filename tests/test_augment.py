"""Class-preserving augmentation that executes a plan row."""

from __future__ import annotations

import math

import pytest
import torch

from felix.strategies.dataplans.augment import (
    AUGMENTERS,
    Flip,
    Identity,
    RotateFlip,
    augment_client,
    get_augmenter,
    rotate,
)


def _client(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(12, 3, 8, 10, generator=gen)
    y = torch.tensor([0, 0, 0, 1, 2, 2, 2, 2, 2, 2, 0, 1])
    return x, y


def test_creates_exactly_the_planned_samples() -> None:
    x, y = _client()
    x_new, y_new, seconds = augment_client(x, y, [5, 3, 0, 0], get_augmenter(), seed=1)
    assert x_new.shape == (8, 3, 8, 10)
    assert x_new.dtype == x.dtype
    assert torch.bincount(y_new, minlength=4).tolist() == [5, 3, 0, 0]
    assert 0 < seconds < 30  # wall seconds of a real augmentation


def test_large_plans_are_processed_in_chunks_with_exact_counts() -> None:
    x = torch.rand(6, 1, 4, 4)
    y = torch.tensor([0, 0, 0, 1, 1, 1])
    x_new, y_new, _ = augment_client(x, y, [5000, 7], RotateFlip(), seed=0)
    assert x_new.shape == (5007, 1, 4, 4)
    assert torch.bincount(y_new).tolist() == [5000, 7]


def test_nothing_planned_gives_empty_batches() -> None:
    x, y = _client()
    x_new, y_new, _ = augment_client(x, y, [0, 0, 0], Flip(), seed=0)
    assert x_new.shape == (0, 3, 8, 10) and y_new.shape == (0,)


def test_deterministic_by_seed() -> None:
    x, y = _client()
    first = augment_client(x, y, [4, 2, 7], RotateFlip(), seed=3)
    again = augment_client(x, y, [4, 2, 7], RotateFlip(), seed=3)
    other = augment_client(x, y, [4, 2, 7], RotateFlip(), seed=4)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert not torch.equal(first[0], other[0])


def test_sources_come_from_the_right_class_and_are_spread() -> None:
    # With the identity augmenter every new sample is a copy of a source, so sources can be traced.
    x, y = _client()
    x_new, _, _ = augment_client(x, y, [7, 0, 0], Identity(), seed=5)
    class0 = [i for i in range(len(y)) if y[i] == 0]  # 4 samples
    used = [next(i for i in class0 if torch.equal(x[i], row)) for row in x_new]
    counts = sorted(used.count(i) for i in class0)
    assert counts == [1, 2, 2, 2]  # 7 over 4 sources: floor or ceil of 7/4 each


def test_flip_twice_is_identity_and_flip_mirrors() -> None:
    x, _ = _client()
    gen = torch.Generator().manual_seed(0)
    flipped = Flip()(x, gen)
    assert torch.equal(flipped[..., 0], x[..., -1])
    assert torch.equal(Flip()(flipped, gen), x)
    # RotateFlip with no rotation and certain flips is the same mirror (grid_sample rounds a little).
    assert torch.allclose(RotateFlip(max_degrees=0.0, flip_probability=1.0)(x, gen), flipped, atol=1e-5)


def test_rotation_keeps_shape_and_zero_rotation_is_near_identity() -> None:
    x, _ = _client()
    gen = torch.Generator().manual_seed(0)
    still = RotateFlip(max_degrees=0.0, flip_probability=0.0)(x, gen)
    assert still.shape == x.shape
    assert torch.allclose(still, x, atol=1e-5)
    rotated = RotateFlip()(x, gen)
    assert rotated.shape == x.shape and not torch.allclose(rotated, x)


def test_rotate_geometry() -> None:
    # A quarter turn of a square image only moves pixel centres onto pixel centres: equal to rot90
    # (counter-clockwise as displayed), up to bilinear rounding.
    square = torch.arange(16.0).reshape(1, 1, 4, 4)
    turned = rotate(square, torch.tensor([math.pi / 2]))
    assert torch.allclose(turned, torch.rot90(square, 1, dims=(2, 3)), atol=1e-4)
    # Half a turn of a non-square image is both flips: the rotation is done in pixel units, no shear.
    wide = torch.arange(12.0).reshape(1, 1, 3, 4)
    assert torch.allclose(rotate(wide, torch.tensor([math.pi])), wide.flip(-1).flip(-2), atol=1e-4)
    # Corners rotated in from outside are 0 by default, edge values with "border".
    ones = torch.ones(1, 1, 8, 8)
    assert rotate(ones, torch.tensor([math.pi / 4]))[0, 0, 0, 0] == 0.0
    assert torch.allclose(rotate(ones, torch.tensor([math.pi / 4]), padding_mode="border"), ones)
    with pytest.raises(ValueError, match="one angle per image"):
        rotate(ones, torch.tensor([0.1, 0.2]))


def test_registry() -> None:
    assert set(AUGMENTERS) == {"rotate_flip", "flip", "none"}
    assert isinstance(get_augmenter(), RotateFlip)
    assert isinstance(get_augmenter("none"), Identity)
    with pytest.raises(ValueError, match="unknown augmenter"):
        get_augmenter("mixup")


def test_errors() -> None:
    x, y = _client()
    with pytest.raises(ValueError, match="class 3"):
        augment_client(x, y, [0, 0, 0, 2], Flip(), seed=0)
    with pytest.raises(ValueError, match="negative"):
        augment_client(x, y, [1, -1, 0], Flip(), seed=0)
    with pytest.raises(ValueError, match="labels must lie"):
        augment_client(x, y, [1, 1], Flip(), seed=0)
    with pytest.raises(ValueError, match="float batch"):
        augment_client(x[0], y, [1, 1, 1], Flip(), seed=0)
    with pytest.raises(ValueError, match="labels"):
        augment_client(x, y[:5], [1, 1, 1], Flip(), seed=0)
    with pytest.raises(ValueError, match="max_degrees"):
        RotateFlip(max_degrees=math.inf)
    with pytest.raises(ValueError, match="flip_probability"):
        RotateFlip(flip_probability=2.0)
