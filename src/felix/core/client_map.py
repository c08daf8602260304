"""The ClientMap (FeLiX §4): one compact record per client plus per-tier pools.

Selection must cost in proportion to the clients that can be picked, not the population, so the
map keeps the AVL_TRAIN / AVL_EVAL members and the idle subset as insertion-ordered sets.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import numpy as np

from felix.core.types import Tier


@dataclass(slots=True)
class ClientRecord:
    client_id: int
    num_samples: int
    tier: Tier
    reported_tier: Tier
    stat_utility: float | None = None
    last_utility_round: int = -1  # version at which the utility was last measured (train or eval)
    last_duration: float | None = None  # seconds of the last training task, the system metric
    in_flight: int | None = None  # task id holding this client's slot
    selected_round: int = -1  # round in which the client was last selected to train
    blocked_round: int = -1  # round whose task it dropped: TierTrack does not pick it again in that round
    times_selected: int = 0
    times_updated: int = 0
    times_evaluated: int = 0
    times_dropped: int = 0
    class_counts: tuple[int, ...] = ()

    @property
    def explored(self) -> bool:
        return self.stat_utility is not None


class ClientMap:
    def __init__(self) -> None:
        self._records: dict[int, ClientRecord] = {}
        self._pools: dict[Tier, dict[int, None]] = {t: {} for t in Tier}
        self._idle: dict[int, None] = {}  # registered and not holding a slot (any tier)

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, client_id: object) -> bool:
        return client_id in self._records

    def __getitem__(self, client_id: int) -> ClientRecord:
        return self._records[client_id]

    def __iter__(self) -> Iterator[ClientRecord]:
        return iter(self._records.values())

    def add(self, record: ClientRecord) -> None:
        if record.client_id in self._records:
            raise ValueError(f"client {record.client_id} is already registered")
        self._records[record.client_id] = record
        self._pools[record.tier][record.client_id] = None
        if record.in_flight is None:
            self._idle[record.client_id] = None

    def set_tier(self, client_id: int, tier: Tier) -> Tier:
        """Move a client between pools; returns the tier it had."""
        rec = self._records[client_id]
        old = rec.tier
        if old is not tier:
            del self._pools[old][client_id]
            self._pools[tier][client_id] = None
            rec.tier = tier
        return old

    def set_in_flight(self, client_id: int, task_id: int | None) -> None:
        self._records[client_id].in_flight = task_id
        if task_id is None:
            self._idle[client_id] = None
        else:
            self._idle.pop(client_id, None)

    def idle_in(self, *tiers: Tier) -> list[int]:
        """Clients of the given tiers holding no slot, in a deterministic (id) order."""
        out = [c for t in tiers for c in self._pools[t] if c in self._idle]
        out.sort()
        return out

    def idle_all(self) -> list[int]:
        return sorted(self._idle)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The records as columns (numpy arrays, insertion order): a checkpoint costs a few array
        copies, not a Python object per client. ``None`` is -1 for ids and NaN for measurements."""
        recs = list(self._records.values())
        n = len(recs)

        def col(name: str, dtype: Any) -> np.ndarray:
            return np.fromiter(map(attrgetter(name), recs), dtype=dtype, count=n)

        def opt(name: str, none: float) -> np.ndarray:
            return np.array([none if v is None else v for v in map(attrgetter(name), recs)], dtype=np.float64 if
                            math.isnan(none) else np.int64).reshape(n)

        counts = list(map(attrgetter("class_counts"), recs))
        return {
            "client_id": col("client_id", np.int64),
            "num_samples": col("num_samples", np.int64),
            "tier": col("tier", np.int8),
            "reported_tier": col("reported_tier", np.int8),
            "stat_utility": opt("stat_utility", math.nan),
            "last_utility_round": col("last_utility_round", np.int64),
            "last_duration": opt("last_duration", math.nan),
            "in_flight": opt("in_flight", -1),
            "selected_round": col("selected_round", np.int64),
            "blocked_round": col("blocked_round", np.int64),
            "times_selected": col("times_selected", np.int64),
            "times_updated": col("times_updated", np.int64),
            "times_evaluated": col("times_evaluated", np.int64),
            "times_dropped": col("times_dropped", np.int64),
            "class_counts_len": np.fromiter(map(len, counts), dtype=np.int64, count=n),
            "class_counts": np.fromiter((c for cc in counts for c in cc), dtype=np.int64),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace every record by those of ``state`` (from ``state_dict``); pools are rebuilt."""
        self._records = {}
        self._pools = {t: {} for t in Tier}
        self._idle = {}
        ids = np.asarray(state["client_id"], dtype=np.int64)
        lens = np.asarray(state["class_counts_len"], dtype=np.int64)
        flat = np.asarray(state["class_counts"], dtype=np.int64).tolist()
        ends = np.cumsum(lens).tolist()
        cols = {k: np.asarray(state[k]).tolist() for k in (
            "num_samples", "tier", "reported_tier", "stat_utility", "last_utility_round", "last_duration",
            "in_flight", "selected_round", "blocked_round", "times_selected", "times_updated", "times_evaluated",
            "times_dropped")}
        for i, cid in enumerate(ids.tolist()):
            su, ld, fl = cols["stat_utility"][i], cols["last_duration"][i], cols["in_flight"][i]
            start = ends[i] - int(lens[i])
            self.add(ClientRecord(
                client_id=cid, num_samples=cols["num_samples"][i], tier=Tier(cols["tier"][i]),
                reported_tier=Tier(cols["reported_tier"][i]), stat_utility=None if math.isnan(su) else su,
                last_utility_round=cols["last_utility_round"][i], last_duration=None if math.isnan(ld) else ld,
                in_flight=None if fl < 0 else fl, selected_round=cols["selected_round"][i],
                blocked_round=cols["blocked_round"][i], times_selected=cols["times_selected"][i],
                times_updated=cols["times_updated"][i], times_evaluated=cols["times_evaluated"][i],
                times_dropped=cols["times_dropped"][i], class_counts=tuple(flat[start:ends[i]]),
            ))
