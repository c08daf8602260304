"""How the training set is split over clients: Dirichlet label skew, IID, or an explicit count table.

``PARTITIONERS`` is the partitioner registry. A partitioner is
``partitioner(labels, num_classes, cfg, rng, **params) -> list[np.ndarray]``: ``labels`` the
training set's int labels, ``cfg`` the run's ``PartitionCfg`` (``num_clients``, ``alpha``, ...),
``rng`` the scenario's partition stream, ``params`` ``partition.params``; it returns one array of
training-set indices per client (``cfg.num_clients`` of them). A config names it
``partition.kind: NAME`` or ``package.module:partitioner``. A partitioner with the attribute
``needs_groups = True`` (``speaker``) also gets ``groups=``: each sample's group id (its speaker,
``ArrayDataset.groups``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from felix.config import ConfigError
from felix.core.registry import CallShape, Registry

if TYPE_CHECKING:
    from felix.config import PartitionCfg

Partitioner = Callable[..., list[np.ndarray]]
PARTITIONERS: Registry[Partitioner] = Registry(
    "partitioner",
    modules=("felix.scenario.long_tail",),
    key="partition.kind",
    call=CallShape(
        "partitioner(labels: np.ndarray, num_classes: int, cfg: PartitionCfg, "
        "rng: np.random.Generator, **params) -> list[np.ndarray] (one index array per client)",
        "partition.params",
        passed=4,
        injected=("groups",),
    ),
)


def partition(
    cfg: PartitionCfg,
    labels: np.ndarray,
    num_classes: int,
    rng: np.random.Generator,
    groups: np.ndarray | None = None,
) -> list[np.ndarray]:
    """Split ``labels``' indices over ``cfg.num_clients`` clients with the configured partitioner,
    checking what it returns (one int index array per client, every index in range). ``groups``:
    each sample's group id (speaker), for a partitioner that ``needs_groups``."""
    fn = PARTITIONERS.resolve(cfg.kind)
    extra: dict[str, np.ndarray] = {}
    if getattr(fn, "needs_groups", False):
        if groups is None:
            raise ConfigError(
                f"partition.kind {cfg.kind!r} splits by speaker, but the dataset gives no speaker "
                "per sample (ArrayDataset.groups; fsdd and speech_commands do)"
            )
        extra["groups"] = groups
    try:
        parts = fn(labels, num_classes, cfg, rng, **extra, **cfg.params)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"partition.kind {cfg.kind!r}: {exc}") from None
    if not isinstance(parts, (list, tuple)) or len(parts) != cfg.num_clients:
        got = f"{len(parts)} parts" if isinstance(parts, (list, tuple)) else f"a {type(parts).__name__}"
        raise PARTITIONERS.wrong(cfg.kind, f"returned {got} for {cfg.num_clients} clients")
    out = []
    for k, p in enumerate(parts):
        a = np.asarray(p)
        if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
            raise PARTITIONERS.wrong(
                cfg.kind, f"gave client {k} a {a.dtype} array of shape {a.shape}, not int indices"
            )
        if a.size and (a.min() < 0 or a.max() >= len(labels)):
            raise PARTITIONERS.wrong(cfg.kind, f"gave client {k} indices outside [0, {len(labels)})")
        out.append(a.astype(np.int64))
    return out


@PARTITIONERS.register("dirichlet")
def _dirichlet(
    labels: np.ndarray, num_classes: int, cfg: PartitionCfg, rng: np.random.Generator
) -> list[np.ndarray]:
    return dirichlet_partition(labels, cfg.num_clients, cfg.alpha, rng, cfg.min_samples)


@PARTITIONERS.register("iid")
def _iid(
    labels: np.ndarray, num_classes: int, cfg: PartitionCfg, rng: np.random.Generator
) -> list[np.ndarray]:
    return [np.sort(s) for s in np.array_split(rng.permutation(len(labels)), cfg.num_clients)]


@PARTITIONERS.register("table")
def _table(
    labels: np.ndarray, num_classes: int, cfg: PartitionCfg, rng: np.random.Generator
) -> list[np.ndarray]:
    table = np.array(cfg.table, dtype=np.int64)
    if table.shape[1] != num_classes:
        raise ConfigError(f"partition.table has {table.shape[1]} classes, the dataset {num_classes}")
    if table.shape[0] != cfg.num_clients:
        raise ConfigError(
            f"partition.table has {table.shape[0]} rows but partition.num_clients is {cfg.num_clients}"
        )
    empty = np.flatnonzero(table.sum(axis=1) == 0).tolist()
    if empty and (table >= 0).all():
        raise ConfigError(
            f"partition.table gives clients {empty[:10]} no samples: a client without data can only "
            "send empty updates, which the server refuses"
        )
    try:
        return count_table_partition(labels, table, rng)
    except ValueError as exc:
        raise ConfigError(f"partition.table: {exc}") from None


@PARTITIONERS.register("speaker")
def _speaker(
    labels: np.ndarray, num_classes: int, cfg: PartitionCfg, rng: np.random.Generator, groups: np.ndarray
) -> list[np.ndarray]:
    return speaker_partition(groups, cfg.num_clients, rng)


_speaker.needs_groups = True  # type: ignore[attr-defined]


def speaker_partition(groups: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Each client the samples of one or a few speakers, speech's natural non-IID split (a phone
    hears its owner). With at least as many speakers as clients, the speakers in a random order
    are dealt out in turn (client k: speakers k, k + n, ...), so clients differ in size as
    speakers do; with fewer speakers, client k takes speaker k mod S, and each speaker's samples
    are shuffled and cut into equal parts for its clients."""
    speakers = np.unique(groups)
    if num_clients <= len(speakers):
        order = rng.permutation(speakers)
        parts = [np.flatnonzero(np.isin(groups, order[k::num_clients])) for k in range(num_clients)]
    else:
        parts = [np.empty(0, dtype=np.int64)] * num_clients
        for i, s in enumerate(speakers):
            mine = list(range(i, num_clients, len(speakers)))
            idx = rng.permutation(np.flatnonzero(groups == s))
            if len(idx) < len(mine):
                raise ValueError(f"speaker {s} has {len(idx)} samples for {len(mine)} clients")
            for k, chunk in zip(mine, np.array_split(idx, len(mine))):
                parts[k] = chunk
    return [np.sort(p).astype(np.int64) for p in parts]


def dirichlet_partition(
    labels: np.ndarray, num_clients: int, alpha: float, rng: np.random.Generator, min_samples: int = 1
) -> list[np.ndarray]:
    """Per class, split its samples over clients with proportions ~ Dir(alpha) (the FeLiX authors' way).

    Clients left with fewer than ``min_samples`` get samples moved from the largest clients, so
    every client can train; the moves are few and keep the skew.
    """
    if num_clients < 1:
        raise ValueError("num_clients must be >= 1")
    if alpha <= 0:
        raise ValueError("dirichlet alpha must be > 0")
    if min_samples * num_clients > len(labels):
        raise ValueError(f"{len(labels)} samples cannot give {num_clients} clients {min_samples} each")
    parts: list[list[int]] = [[] for _ in range(num_clients)]
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        props = rng.dirichlet(np.full(num_clients, alpha))
        cuts = (np.cumsum(props) * len(idx)).astype(int)[:-1]
        for k, chunk in enumerate(np.split(idx, cuts)):
            parts[k].extend(chunk.tolist())
    sizes = np.array([len(p) for p in parts])
    for k in np.flatnonzero(sizes < min_samples).tolist():
        while len(parts[k]) < min_samples:
            donor = int(np.argmax([len(p) for p in parts]))
            parts[k].append(parts[donor].pop())
    return [np.sort(np.array(p, dtype=np.int64)) for p in parts]


def count_table_partition(
    labels: np.ndarray, table: np.ndarray, rng: np.random.Generator
) -> list[np.ndarray]:
    """Give client k exactly ``table[k, c]`` samples of class c, drawn without replacement."""
    table = np.asarray(table)
    if table.ndim != 2 or (table < 0).any():
        raise ValueError("count table must be a 2-D table of non-negative integers (clients x classes)")
    classes = np.arange(table.shape[1])
    parts: list[list[int]] = [[] for _ in range(table.shape[0])]
    for c in classes:
        idx = rng.permutation(np.flatnonzero(labels == c))
        need = int(table[:, c].sum())
        if need > len(idx):
            raise ValueError(f"class {c}: the table asks for {need} samples but the dataset has {len(idx)}")
        start = 0
        for k in range(table.shape[0]):
            n = int(table[k, c])
            parts[k].extend(idx[start : start + n].tolist())
            start += n
    return [np.sort(np.array(p, dtype=np.int64)) for p in parts]
