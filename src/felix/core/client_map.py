"""The ClientMap (FeLiX §4): one compact record per client plus per-tier pools.

Selection must cost in proportion to the clients that can be picked, not the population, so the
map keeps the AVL_TRAIN / AVL_EVAL members and the idle subset as insertion-ordered sets.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

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
