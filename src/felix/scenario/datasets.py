"""Datasets as in-memory tensors.

Three sources per dataset where it makes sense: a local folder or archive (what CI and offline
users have), the standard download (torchvision, for users with internet), and for the default
scenario a dataset bundled inside an installed package (scikit-learn's 8x8 digits), so that
``felix run`` works with no download at all.

``DATASETS`` is the dataset registry: a loader is ``loader(root: str | None, download: bool,
**params) -> (train, test)`` returning two ``ArrayDataset`` (``test`` may be None, see
felix.scenario.build); a config names it ``dataset.name: NAME`` or ``package.module:loader``.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import logging
import os
import struct
import tarfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from felix.config import ConfigError
from felix.core.registry import CallShape, Registry
from felix.scenario.errors import DatasetError

log = logging.getLogger("felix")

CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
FASHION_CLASSES = [
    "t-shirt",
    "trouser",
    "pullover",
    "dress",
    "coat",
    "sandal",
    "shirt",
    "sneaker",
    "bag",
    "boot",
]
FASHION_DEFAULT_ROOT = "/usr/share/datasets/fashion-mnist"
IMAGE_EXTS = {".jpg", ".jpeg", ".png", ".bmp"}


@dataclass
class ArrayDataset:
    x: torch.Tensor  # float32, N x C x H x W, normalised
    y: torch.Tensor  # int64, N
    classes: list[str]
    # int64, N: who produced each sample (a speaker), for partitions that split by it
    # (felix.scenario.partition's ``speaker``); None for datasets without such groups
    groups: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.y.shape[0])

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def sample_shape(self) -> tuple[int, ...]:
        return tuple(self.x.shape[1:])

    def subset(self, idx: np.ndarray) -> ArrayDataset:
        t = torch.as_tensor(idx, dtype=torch.long)
        return ArrayDataset(
            self.x[t], self.y[t], self.classes, None if self.groups is None else self.groups[t]
        )

    def class_counts(self) -> np.ndarray:
        return np.bincount(self.y.numpy(), minlength=self.num_classes)


@dataclass(frozen=True)
class LazyDataset:
    """A training set's labels, its samples read only for the rows asked (``rows``): a deployed
    client process partitions the labels and reads its own clients' rows, not the whole set.
    ``read`` maps row indices to float32 samples, normalised as the dataset's loader does, so a
    row read here is the loader's row to the bit."""

    y: torch.Tensor  # int64, N
    classes: list[str]
    sample_shape: tuple[int, ...]
    read: Callable[[np.ndarray], torch.Tensor]
    groups: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.y.shape[0])

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def rows(self, idx: np.ndarray) -> torch.Tensor:
        """The samples of rows ``idx``, in that order."""
        return self.read(np.asarray(idx, dtype=np.int64))

    def subset(self, idx: np.ndarray) -> LazyDataset:
        keep = np.asarray(idx, dtype=np.int64)
        t = torch.as_tensor(keep)
        base = self.read
        return LazyDataset(
            self.y[t],
            self.classes,
            self.sample_shape,
            lambda rows: base(keep[rows]),
            None if self.groups is None else self.groups[t],
        )


def lazy_train_set(name: str, root: str | None) -> LazyDataset | None:
    """The training set of built-in dataset ``name`` with its samples read on demand, where the
    dataset can (Fashion-MNIST's idx files, found locally); else None (load it whole)."""
    if name != "fashion_mnist":
        return None
    base = Path(root or FASHION_DEFAULT_ROOT)
    if not base.is_dir():
        return None
    xs = _read_idx(_find(base, "train-images-idx3-ubyte"))
    ys = _read_idx(_find(base, "train-labels-idx1-ubyte")).astype(np.int64)
    if len(xs) != len(ys):
        raise DatasetError(f"{base}: train has {len(xs)} images but {len(ys)} labels")
    return LazyDataset(
        torch.from_numpy(ys), FASHION_CLASSES, (1, *xs.shape[1:]), lambda rows: _normalise(xs[rows][:, None])
    )


def cache_dir() -> Path:
    return Path(os.environ.get("FELIX_CACHE", Path.home() / ".cache" / "felix-fl"))


DatasetLoader = Callable[..., tuple[ArrayDataset, "ArrayDataset | None"]]
DATASETS: Registry[DatasetLoader] = Registry(
    "dataset",
    modules=("felix.scenario.audio",),
    key="dataset.name",
    call=CallShape(
        "dataset loader(root: str | None, download: bool, **params) -> "
        "(train: ArrayDataset, test: ArrayDataset | None)",
        "dataset.params",
        passed=2,
    ),
)


def load_dataset(
    name: str,
    root: str | None = None,
    download: bool = False,
    per_class_limit: int | None = None,
    params: dict[str, Any] | None = None,
) -> tuple[ArrayDataset, ArrayDataset | None]:
    """Return (train, test); ``test`` is None only for a loader that has no test set.
    ``per_class_limit`` keeps the first N images of each class per split, which keeps CPU-sized
    experiments quick to load without changing the class balance."""
    loader = DATASETS.resolve(name)
    try:
        out = loader(root, download, **(params or {}))
    except TypeError as exc:
        raise ConfigError(
            f"dataset.name: loader {name!r} cannot be called as loader(root, download, "
            f"**dataset.params): {exc}"
        ) from None
    if not (isinstance(out, tuple) and len(out) == 2):
        raise DATASETS.wrong(name, f"returned a {type(out).__name__}, not a (train, test) pair")
    train, test = out
    check_dataset(train, f"dataset {name!r} train set")
    if test is not None:
        check_dataset(test, f"dataset {name!r} test set")
        if test.sample_shape != train.sample_shape or test.classes != train.classes:
            raise DatasetError(
                f"dataset {name!r}: the test set's samples {test.sample_shape} / classes "
                f"{test.num_classes} differ from the train set's {train.sample_shape} / {train.num_classes}"
            )
    if per_class_limit is not None:
        train = limit_per_class(train, per_class_limit)
        test = None if test is None else limit_per_class(test, per_class_limit)
    return train, test


AnyDataset = TypeVar("AnyDataset", "ArrayDataset", LazyDataset)


def check_dataset(d: object, what: str) -> None:
    """What the engine needs of a dataset: an ``ArrayDataset`` of finite float32 samples and int64
    labels in ``[0, len(classes))``, as many labels as samples, at least one sample."""
    if not isinstance(d, ArrayDataset):
        raise DatasetError(f"{what}: expected a felix.scenario.datasets.ArrayDataset, got {type(d).__name__}")
    if not isinstance(d.x, torch.Tensor) or not isinstance(d.y, torch.Tensor):
        raise DatasetError(f"{what}: x and y must be torch tensors")
    if d.x.dtype != torch.float32 or d.x.ndim < 2:
        raise DatasetError(
            f"{what}: x must be a float32 tensor N x (sample shape), got {d.x.dtype} {tuple(d.x.shape)}"
        )
    if d.y.dtype != torch.int64 or d.y.ndim != 1 or d.y.shape[0] != d.x.shape[0]:
        raise DatasetError(
            f"{what}: y must be an int64 vector of {d.x.shape[0]} labels, got {d.y.dtype} {tuple(d.y.shape)}"
        )
    if len(d) == 0:
        raise DatasetError(f"{what}: no samples")
    if not bool(torch.isfinite(d.x).all()):  # every update trained on it would be refused
        raise DatasetError(f"{what}: x holds NaN or infinite values")
    if not d.classes or not all(isinstance(c, str) for c in d.classes):
        raise DatasetError(f"{what}: classes must be a non-empty list of class names")
    lo, hi = int(d.y.min()), int(d.y.max())
    if lo < 0 or hi >= d.num_classes:
        raise DatasetError(f"{what}: labels span [{lo}, {hi}] but there are {d.num_classes} classes")
    if d.groups is not None and (
        not isinstance(d.groups, torch.Tensor) or d.groups.dtype != torch.int64 or d.groups.shape != d.y.shape
    ):
        raise DatasetError(f"{what}: groups must be an int64 vector of {len(d)} group ids, or None")


def limit_per_class(d: AnyDataset, n: int) -> AnyDataset:
    """The first ``n`` samples of each class, in the set's order."""
    y = d.y.numpy()
    keep = np.concatenate([np.flatnonzero(y == c)[:n] for c in range(d.num_classes)])
    keep.sort()
    return d.subset(keep)


def first_classes(d: AnyDataset, n: int) -> AnyDataset:
    """Keep only the samples of the first ``n`` classes (label order), e.g. the DAFL paper's
    eight-class CIFAR-10 task; labels keep their values, so class ``c`` stays class ``c``."""
    if not 1 <= n <= d.num_classes:
        raise DatasetError(f"cannot keep the first {n} classes of a dataset with {d.num_classes}")
    if n == d.num_classes:
        return d
    return dataclasses.replace(d.subset(np.flatnonzero(d.y.numpy() < n)), classes=d.classes[:n])


def _normalise(x_uint8: np.ndarray) -> torch.Tensor:
    x = torch.from_numpy(x_uint8).float().div_(255.0)
    return x.sub_(0.5).div_(0.5)


# ---------------------------------------------------------------------- digits (bundled)
@DATASETS.register("digits")
def _load_digits(root: str | None, download: bool) -> tuple[ArrayDataset, ArrayDataset]:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.images.astype(np.float32) / 16.0 - 0.5) / 0.5
    y = d.target.astype(np.int64)
    order = np.random.default_rng(0).permutation(len(y))  # fixed split, independent of run seeds
    test_idx, train_idx = order[:360], order[360:]
    classes = [str(i) for i in range(10)]

    def mk(idx: np.ndarray) -> ArrayDataset:
        return ArrayDataset(torch.from_numpy(x[idx][:, None]), torch.from_numpy(y[idx]), classes)

    return mk(np.sort(train_idx)), mk(np.sort(test_idx))


# ---------------------------------------------------------------------- Fashion-MNIST (idx)
def _read_idx(path: Path) -> np.ndarray:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError) as exc:
        raise DatasetError(f"{path}: cannot read idx file ({exc})") from None
    if len(data) < 4:
        raise DatasetError(f"{path}: truncated idx file")
    zero, dtype, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype != 0x08:
        raise DatasetError(f"{path}: not an unsigned-byte idx file (magic {data[:4].hex()})")
    if len(data) < 4 + 4 * ndim:
        raise DatasetError(f"{path}: truncated idx header ({ndim} dimensions, {len(data)} bytes)")
    dims = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    body = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if body.size != int(np.prod(dims)):
        raise DatasetError(f"{path}: idx header says {dims} but holds {body.size} bytes")
    return body.reshape(dims).copy()


def _find(root: Path, stem: str) -> Path:
    for cand in (root / stem, root / f"{stem}.gz"):
        if cand.exists():
            return cand
    raise DatasetError(f"{root}: missing {stem}[.gz] (Fashion-MNIST idx files)")


@DATASETS.register("fashion_mnist")
def _load_fashion(root: str | None, download: bool) -> tuple[ArrayDataset, ArrayDataset]:
    base = Path(root or FASHION_DEFAULT_ROOT)
    if not base.is_dir():
        if download:
            return _torchvision("FashionMNIST", FASHION_CLASSES)
        raise DatasetError(
            f"Fashion-MNIST folder {base} not found: install Debian's dataset-fashion-mnist, "
            "pass dataset.root, or set dataset.download: true (needs torchvision)"
        )
    out = []
    for split in ("train", "t10k"):
        xs = _read_idx(_find(base, f"{split}-images-idx3-ubyte"))
        ys = _read_idx(_find(base, f"{split}-labels-idx1-ubyte")).astype(np.int64)
        if len(xs) != len(ys):
            raise DatasetError(f"{base}: {split} has {len(xs)} images but {len(ys)} labels")
        out.append(ArrayDataset(_normalise(xs[:, None]), torch.from_numpy(ys), FASHION_CLASSES))
    return out[0], out[1]


# ---------------------------------------------------------------------- CIFAR-10
@DATASETS.register("cifar10")
def _load_cifar10(root: str | None, download: bool) -> tuple[ArrayDataset, ArrayDataset]:
    if root is None:
        if download:
            return _torchvision("CIFAR10", CIFAR10_CLASSES)
        raise DatasetError(
            "cifar10 needs dataset.root (an image folder or .tar.gz) or dataset.download: true"
        )
    folder = _unpack_if_archive(Path(root))
    if (folder / "cifar10-jpeg").is_dir() and not (folder / "train").is_dir():
        folder = folder / "cifar10-jpeg"
    train = load_image_folder(folder / "train")
    test = load_image_folder(folder / "test", classes=train.classes)
    return train, test


def _unpack_if_archive(path: Path) -> Path:
    if path.is_dir():
        return path
    if not path.exists():
        raise DatasetError(f"dataset root {path} does not exist")
    if not path.name.endswith((".tar.gz", ".tgz", ".tar")):
        raise DatasetError(f"dataset root {path} is neither a folder nor a .tar/.tar.gz archive")
    stat = path.stat()
    key = hashlib.sha1(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    dest = cache_dir() / f"unpacked-{key}"
    if not (dest / ".complete").exists():
        dest.mkdir(parents=True, exist_ok=True)
        try:
            with tarfile.open(path) as tar:
                tar.extractall(dest, filter="data")
        except tarfile.TarError as exc:
            raise DatasetError(f"{path}: broken archive ({exc})") from None
        (dest / ".complete").touch()
    return dest


def load_image_folder(folder: Path, classes: list[str] | None = None) -> ArrayDataset:
    """ImageFolder layout (``folder/<class>/*.jpg``), decoded once with Pillow and cached as .npy."""
    from PIL import Image

    if not folder.is_dir():
        raise DatasetError(f"image folder {folder} not found (expected {folder}/<class>/*.jpg)")
    found = sorted(p.name for p in folder.iterdir() if p.is_dir())
    if not found:
        raise DatasetError(f"{folder}: no class sub-folders")
    classes = classes or found
    missing = set(found) - set(classes)
    if missing:
        raise DatasetError(f"{folder}: class folders {sorted(missing)} are not among the training classes")
    files = [
        (c, p)
        for c, name in enumerate(classes)
        if (folder / name).is_dir()
        for p in sorted((folder / name).iterdir())
        if p.suffix.lower() in IMAGE_EXTS
    ]
    if not files:
        raise DatasetError(f"{folder}: no images")
    key = hashlib.sha1(("|".join(f"{p}:{p.stat().st_size}" for _, p in files)).encode()).hexdigest()[:16]
    cached = cache_dir() / f"images-{key}.npz"
    decoded = _read_cache(cached, len(files))
    if decoded is not None:
        xs, ys = decoded
    else:

        def read(p: Path) -> np.ndarray:
            try:
                with Image.open(p) as img:
                    return np.asarray(img.convert("RGB"))
            # Pillow's errors for a damaged or hostile file: OSError (truncated, unidentified),
            # DecompressionBombError (a huge declared size), ValueError and SyntaxError (bad headers)
            except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
                raise DatasetError(f"{p}: not a readable image ({exc})") from None

        first = read(files[0][1])
        xs = np.empty((len(files), *first.shape), dtype=np.uint8)
        for i, (_, p) in enumerate(files):
            img = first if i == 0 else read(p)
            if img.shape != first.shape:
                raise DatasetError(f"{p}: shape {img.shape} differs from {first.shape}")
            xs[i] = img
        ys = np.array([c for c, _ in files], dtype=np.int64)
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(".tmp.npz")
        np.savez(tmp, x=xs, y=ys)
        tmp.replace(cached)
    return ArrayDataset(_normalise(xs.transpose(0, 3, 1, 2).copy()), torch.from_numpy(ys), list(classes))


def _read_cache(path: Path, n: int) -> tuple[np.ndarray, np.ndarray] | None:
    """An image folder's decoded arrays from the cache; None when absent or damaged (a run killed
    while another wrote it, a full disk): the folder is decoded again and the cache rewritten."""
    if not path.exists():
        return None
    try:
        with np.load(path) as z:
            xs, ys = z["x"], z["y"]
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
        log.warning("image cache %s unreadable (%s): decoding the images again", path, exc)
        return None
    if xs.dtype != np.uint8 or xs.ndim != 4 or ys.shape != (n,) or len(xs) != n:
        log.warning("image cache %s does not match its folder: decoding the images again", path)
        return None
    return xs, ys


def _torchvision(cls_name: str, classes: list[str]) -> tuple[ArrayDataset, ArrayDataset]:
    try:
        import torchvision.datasets as tvd
    except ImportError:
        raise DatasetError("dataset.download needs torchvision: pip install 'felix-fl[vision]'") from None
    root = cache_dir() / "torchvision"
    out = []
    for train in (True, False):
        ds = getattr(tvd, cls_name)(root=str(root), train=train, download=True)
        data = np.asarray(ds.data)
        if data.ndim == 3:
            data = data[:, None]
        else:
            data = data.transpose(0, 3, 1, 2)
        out.append(
            ArrayDataset(
                _normalise(np.ascontiguousarray(data)), torch.as_tensor(np.asarray(ds.targets)), classes
            )
        )
    return out[0], out[1]
