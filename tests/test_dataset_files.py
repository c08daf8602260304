"""Damaged dataset files are errors that name the file, never tracebacks: Fashion-MNIST's idx files,
an image folder's images, and the cache of decoded images (rebuilt when damaged)."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from felix.scenario.datasets import DatasetError, _read_idx, load_image_folder


def _idx(path: Path, dims: tuple[int, ...], body: bytes | None = None, header: bytes | None = None) -> Path:
    head = (
        header
        if header is not None
        else struct.pack(">HBB", 0, 8, len(dims)) + struct.pack(f">{len(dims)}I", *dims)
    )
    data = head + (body if body is not None else bytes(int(np.prod(dims))))
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return path


def test_a_good_idx_file_reads_back(tmp_path: Path) -> None:
    body = bytes(range(6))
    got = _read_idx(_idx(tmp_path / "a.gz", (2, 3), body))
    assert got.shape == (2, 3) and got.tobytes() == body


@pytest.mark.parametrize(
    ("header", "body", "needle"),
    [
        (b"\x00\x00", b"", "truncated idx file"),
        (
            struct.pack(">HBB", 0, 0x0D, 1) + struct.pack(">I", 2),
            b"\x00" * 8,
            "not an unsigned-byte idx file",
        ),
        (
            struct.pack(">HBB", 0, 8, 3) + struct.pack(">I", 2),
            b"",
            r"truncated idx header \(3 dimensions, 8 bytes\)",
        ),
        (
            struct.pack(">HBB", 0, 8, 2) + struct.pack(">2I", 4, 4),
            b"\x00" * 10,
            r"header says \(4, 4\) but holds 10 bytes",
        ),
    ],
)
def test_a_damaged_idx_file_is_named(tmp_path: Path, header: bytes, body: bytes, needle: str) -> None:
    path = tmp_path / "bad-idx"
    path.write_bytes(header + body)
    with pytest.raises(DatasetError, match=needle):
        _read_idx(path)


def test_a_gzip_that_is_not_one_is_named(tmp_path: Path) -> None:
    path = tmp_path / "train-images-idx3-ubyte.gz"
    path.write_bytes(b"not gzip at all")
    with pytest.raises(DatasetError, match="cannot read idx file"):
        _read_idx(path)


def _folder(root: Path, images: dict[str, list[bytes | tuple[int, int]]]) -> Path:
    """``root/<class>/<i>.png``: a (width, height) makes a real image, bytes are written as they are."""
    for cls, items in images.items():
        (root / cls).mkdir(parents=True)
        for i, item in enumerate(items):
            path = root / cls / f"{i}.png"
            if isinstance(item, bytes):
                path.write_bytes(item)
            else:
                Image.new("RGB", item, (i * 40, 10, 200)).save(path)
    return root


@pytest.mark.parametrize("where", [0, 1])
def test_an_image_that_is_not_one_is_named_first_or_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: int
) -> None:
    monkeypatch.setenv("FELIX_CACHE", str(tmp_path / "cache"))
    items: list[bytes | tuple[int, int]] = [(4, 4), (4, 4)]
    items[where] = b"\x89PNG but not really"
    folder = _folder(tmp_path / "train", {"a": items})
    with pytest.raises(DatasetError, match=rf"a/{where}.png: not a readable image"):
        load_image_folder(folder)


def test_a_damaged_image_cache_is_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("FELIX_CACHE", str(cache))
    folder = _folder(tmp_path / "train", {"a": [(4, 4), (4, 4)], "b": [(4, 4)]})
    first = load_image_folder(folder)
    (cached,) = cache.glob("images-*.npz")
    for damage in (b"PK\x03\x04 truncated zip", b""):
        cached.write_bytes(damage)
        again = load_image_folder(folder)
        assert again.classes == first.classes
        assert np.array_equal(again.x.numpy(), first.x.numpy()) and np.array_equal(
            again.y.numpy(), first.y.numpy()
        )
    # A cache of other arrays (not this folder's) is not trusted either.
    np.savez(cached, x=np.zeros((5, 4, 4, 3), dtype=np.uint8), y=np.zeros(5, dtype=np.int64))
    assert np.array_equal(load_image_folder(folder).y.numpy(), first.y.numpy())
