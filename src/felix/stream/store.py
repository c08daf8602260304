"""A client's local store (``stream.store``): the samples it holds, oldest dropped past the cap,
and what a task trains on: the labelled samples present when it starts, within a recency window."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_FIELDS = (
    ("arrival", np.float64),
    ("label_time", np.float64),
    ("index", np.int64),
    ("label", np.int32),
    ("proxy", np.int32),
)


@dataclass(frozen=True)
class Snapshot:
    """The samples a task trains on, in arrival order: pool indices, the labels it sees (the true
    label once known, else the proxy), their arrival and label times. ``held``: samples in the
    store (labelled or not); ``proxied``: how many of the chosen carry a proxy label."""

    index: np.ndarray
    label: np.ndarray
    arrival: np.ndarray
    label_time: np.ndarray
    held: int
    proxied: int

    def __len__(self) -> int:
        return len(self.index)

    @property
    def span(self) -> tuple[float, float] | None:
        """The arrival times of the oldest and newest sample trained on (None: no samples)."""
        return None if not len(self.arrival) else (float(self.arrival[0]), float(self.arrival[-1]))


class LocalStore:
    """A ring buffer of at most ``cap`` samples, grown by doubling up to the cap (a client with
    few samples holds little). Samples are pushed in arrival order, so the oldest is dropped first."""

    def __init__(self, cap: int) -> None:
        if cap < 1:
            raise ValueError(f"store cap must be >= 1, not {cap}")
        self.cap = cap
        self._cols = {name: np.zeros(min(cap, 16), dtype=dt) for name, dt in _FIELDS}
        self._start = 0
        self.size = 0
        self.dropped = 0  # samples evicted by the cap

    @property
    def capacity(self) -> int:
        return len(self._cols["arrival"])

    def _ordered(self, name: str) -> np.ndarray:
        col = self._cols[name]
        if self._start + self.size <= len(col):
            return col[self._start : self._start + self.size]
        return np.concatenate([col[self._start :], col[: (self._start + self.size) % len(col)]])

    def push(
        self,
        arrival: np.ndarray,
        label_time: np.ndarray,
        index: np.ndarray,
        label: np.ndarray,
        proxy: np.ndarray,
    ) -> None:
        """Append samples (in arrival order), dropping the oldest beyond the cap."""
        n = len(arrival)
        if n == 0:
            return
        new = {"arrival": arrival, "label_time": label_time, "index": index, "label": label, "proxy": proxy}
        total = self.size + n
        if total > self.capacity and self.capacity < self.cap:
            size = min(self.cap, max(2 * self.capacity, total))
            self._cols = {
                k: np.concatenate([self._ordered(k), np.zeros(size - self.size, dtype=v.dtype)])
                for k, v in self._cols.items()
            }
            self._start = 0
        cap = self.capacity
        if n >= cap:  # the newest ``cap`` replace everything
            self.dropped += self.size + n - cap
            for k, v in new.items():
                self._cols[k][:] = v[n - cap :]
            self._start, self.size = 0, cap
            return
        pos = (self._start + self.size + np.arange(n)) % cap
        for k, v in new.items():
            self._cols[k][pos] = v
        over = max(0, total - cap)
        self.dropped += over
        self._start = (self._start + over) % cap
        self.size = min(total, cap)

    def snapshot(
        self, now: float, proxy: bool, window_s: float | None = None, window_count: int | None = None
    ) -> Snapshot:
        """What a task starting at ``now`` trains on: the samples whose label is known by ``now``
        (all of them with their proxy label when ``proxy``), younger than ``window_s``, the
        newest ``window_count`` of those."""
        arrival = self._ordered("arrival")
        label_time = self._ordered("label_time")
        known = label_time <= now
        keep = np.ones(len(arrival), dtype=bool) if proxy else known.copy()
        keep &= arrival <= now
        if window_s is not None:
            keep &= arrival > now - window_s
        rows = np.flatnonzero(keep)
        if window_count is not None and len(rows) > window_count:
            rows = rows[-window_count:]
        labels = np.where(known[rows], self._ordered("label")[rows], self._ordered("proxy")[rows])
        return Snapshot(
            self._ordered("index")[rows],
            labels.astype(np.int64),
            arrival[rows],
            label_time[rows],
            self.size,
            int((~known[rows]).sum()),
        )

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in self._cols.values())
