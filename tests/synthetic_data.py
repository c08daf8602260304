"""Small datasets the tests make themselves, so the suite needs nothing outside Python and pip.

``fashion_like_idx`` writes Fashion-MNIST's idx files (28x28 unsigned bytes, ten classes) with
class-dependent images: each class is a fixed random template plus per-sample noise, so a model
learns something, and every product has felix-cpu-100's shapes (784 inputs) without Debian's
``dataset-fashion-mnist``.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np


def _write_idx(path: Path, array: np.ndarray) -> None:
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def fashion_like_idx(root: Path, per_class: int = 300, test_per_class: int = 50, seed: int = 0) -> Path:
    """``root`` holding ``{train,t10k}-{images-idx3,labels-idx1}-ubyte``; returns ``root``."""
    rng = np.random.default_rng(seed)
    templates = rng.uniform(0, 255, size=(10, 28, 28))
    root.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", per_class), ("t10k", test_per_class)):
        labels = np.repeat(np.arange(10), n)
        rng.shuffle(labels)
        images = np.clip(templates[labels] + rng.normal(0, 60, size=(len(labels), 28, 28)), 0, 255)
        _write_idx(root / f"{split}-images-idx3-ubyte", images)
        _write_idx(root / f"{split}-labels-idx1-ubyte", labels)
    return root
