"""The minimum separation between a client's contributions, in aggregations.

The banded matrix-factorisation mechanism (``privacy.mechanism: banded_mf``) bounds its
sensitivity only for clients whose contributions fall in aggregations at least ``bands`` apart
(the columns of a b-banded factor that far apart have disjoint supports). The orchestrator
enforces it, in both shells: a client that contributed to aggregation t is not selected to train,
and a reply of its is not applied, until aggregation t + b; several updates of one client in the
same aggregation are one contribution (the server's mechanism clips their sum). With b larger
than the run, no client contributes twice.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class Separation:
    """Who contributed to one of the last ``bands - 1`` aggregations (``bands = 1``: no rule)."""

    def __init__(self, bands: int = 1) -> None:
        if bands < 1:
            raise ValueError(f"bands must be >= 1, not {bands}")
        self.bands = int(bands)
        self._last: dict[int, int] = {}  # client -> the last aggregation (version) it contributed to

    @property
    def active(self) -> bool:
        return self.bands > 1

    def allows(self, client_id: int, version: int) -> bool:
        """Whether an update of ``client_id`` may enter the buffer that becomes version + 1."""
        last = self._last.get(client_id)
        return last is None or version + 1 - last >= self.bands

    def blocked(self, pending: list[int]) -> np.ndarray:
        """The clients that may not train now: those in the last ``bands - 1`` aggregations and,
        under a rule, those with an update in the buffer (``pending``), whose next update would
        reach a later aggregation than the buffered one."""
        if not self.active:
            return np.empty(0, dtype=np.int64)
        ids = np.fromiter(self._last, dtype=np.int64, count=len(self._last))
        return np.concatenate([ids, np.asarray(pending, dtype=np.int64)])

    def aggregated(self, client_ids: list[int], version: int) -> None:
        """Aggregation ``version`` took ``client_ids``' updates; forget who may contribute again."""
        if not self.active:
            return
        for cid in client_ids:
            self._last[cid] = version
        self._last = {c: v for c, v in self._last.items() if version + 1 - v < self.bands}

    def state_dict(self) -> dict[str, Any]:
        return {
            "ids": np.fromiter(self._last.keys(), dtype=np.int64, count=len(self._last)),
            "versions": np.fromiter(self._last.values(), dtype=np.int64, count=len(self._last)),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._last = dict(
            zip(np.asarray(state["ids"]).tolist(), np.asarray(state["versions"]).tolist(), strict=True)
        )


__all__ = ["Separation"]
