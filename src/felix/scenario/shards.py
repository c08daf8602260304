"""The clients' training data as row indices into one training pool, gathered on demand.

A partition is decided on the labels alone, so the facts every part of a run reads about the
clients (their sizes and class counts: runtimes, traces, registration bounds, per-client
measures) come from the indices without moving a sample. The samples are gathered only where
they train: the simulator gathers every client at once into one client-ordered tensor whose row
slices are the clients (a cohort's data pool adopts it whole), a deployed client process gathers
only its own rows.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

from felix.client.trainer import ClientData
from felix.scenario.datasets import ArrayDataset, LazyDataset


class Shards:
    """Each client's rows of ``pool`` (``parts[cid]``), or, for a population whose clients are
    held already (``of_held``), those clients' data as they are."""

    def __init__(self, pool: ArrayDataset | LazyDataset, parts: Sequence[np.ndarray]) -> None:
        self.pool = pool
        self.parts = [np.asarray(p, dtype=np.int64) for p in parts]
        self._held: list[ClientData] | None = None

    @classmethod
    def of_held(cls, pool: ArrayDataset, held: list[ClientData]) -> Shards:
        """Clients whose data are held already (a prepared or a built population)."""
        shards = cls(pool, [])
        shards._held = held
        return shards

    def __len__(self) -> int:
        return len(self.parts) if self._held is None else len(self._held)

    @functools.cached_property
    def sizes(self) -> list[int]:
        """Each client's number of training samples."""
        return [len(p) for p in (self.parts if self._held is None else self._held)]

    @functools.cached_property
    def class_counts(self) -> np.ndarray:
        """Clients x classes: each client's training samples per class, from the labels alone."""
        c = self.pool.num_classes
        if self._held is not None:
            labels = [d.y.numpy() for d in self._held]
        else:
            y = self.pool.y.numpy()
            labels = [y[p] for p in self.parts]
        if not labels:
            return np.zeros((0, c), dtype=np.int64)
        return np.stack([np.bincount(lab, minlength=c) for lab in labels]).astype(np.int64)

    def client(self, cid: int) -> ClientData:
        """Client ``cid``'s data, gathered alone (a deployed client process's own shard)."""
        if self._held is not None:
            return self._held[cid]
        return self._take(self.parts[cid])

    def gather(self) -> list[ClientData]:
        """Every client's data: one gather into client order, each client a row slice of it."""
        if self._held is not None:
            return self._held
        whole = self._take(np.concatenate(self.parts) if self.parts else np.zeros(0, dtype=np.int64))
        xs, ys = whole.x, whole.y
        ends = np.cumsum(self.sizes).tolist()
        return [ClientData(xs[a:b], ys[a:b]) for a, b in zip([0, *ends[:-1]], ends, strict=True)]

    def _take(self, rows: np.ndarray) -> ClientData:
        """The pool's ``rows``, gathered (read, for a pool read on demand)."""
        idx = torch.as_tensor(rows)
        pool = self.pool
        x = pool.rows(rows) if isinstance(pool, LazyDataset) else pool.x.index_select(0, idx)
        return ClientData(x, pool.y.index_select(0, idx))
