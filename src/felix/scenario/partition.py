"""How the training set is split over clients: Dirichlet label skew, or an explicit count table."""
from __future__ import annotations

import numpy as np


def dirichlet_partition(labels: np.ndarray, num_clients: int, alpha: float, rng: np.random.Generator,
                        min_samples: int = 1) -> list[np.ndarray]:
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


def count_table_partition(labels: np.ndarray, table: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
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
            parts[k].extend(idx[start:start + n].tolist())
            start += n
    return [np.sort(np.array(p, dtype=np.int64)) for p in parts]
