"""The ClientMap (FeLiX §4): per-client state in numpy columns, plus per-tier member sets.

Selection must cost in proportion to the clients that can be picked, never the population. Every
field of every client lives in a column (a numpy array indexed by the client's dense *row*: 0, 1,
2... in registration order, grown geometrically), so a selector reads a field of all its
candidates with one gather instead of one Python object per client. Each tier keeps its members
in an unordered row array with O(1) insert and remove (swap with the last), so a tier event costs
the same at any population. Candidate lists come out sorted by client id, as they always have, so
that a seed reproduces a selection.

``map[client_id]`` returns a ``ClientView``, a write-through view of one row with the record's
field names; ``ClientRecord`` is the plain record a client is registered with.
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from felix.core.types import Tier

_TIERS = tuple(Tier)  # indexed by the tier's code
_INT_FIELDS = ("num_samples", "last_utility_round", "in_flight", "selected_round", "blocked_round",
               "times_selected", "times_updated", "times_evaluated", "times_dropped")
_FLOAT_FIELDS = ("stat_utility", "last_duration")  # NaN stands for None (never measured)
_TIER_FIELDS = ("tier", "reported_tier")
_COLUMNS = ("client_id", *_INT_FIELDS, *_FLOAT_FIELDS, *_TIER_FIELDS)
_DTYPES = {"client_id": np.int64, **dict.fromkeys(_INT_FIELDS, np.int64), **dict.fromkeys(_FLOAT_FIELDS, np.float64),
           **dict.fromkeys(_TIER_FIELDS, np.int8)}
_NO_TASK = -1  # in_flight of a client holding no slot
_TABLE_MIN = 1 << 16  # ids below max(this, 4 x population) are looked up in a flat table, others in a dict
_I64 = np.iinfo(np.int64)


@dataclass(slots=True)
class ClientRecord:
    """One client's fields, as registered (``ClientMap.add``); the map stores them in columns."""

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


def _int_field(name: str) -> property:
    def get(self: ClientView) -> int:
        return int(self._map._cols[name][self.row])

    def put(self: ClientView, value: int) -> None:
        self._map._cols[name][self.row] = value

    return property(get, put)


def _float_field(name: str) -> property:
    def get(self: ClientView) -> float | None:
        v = float(self._map._cols[name][self.row])
        return None if math.isnan(v) else v

    def put(self: ClientView, value: float | None) -> None:
        self._map._cols[name][self.row] = np.nan if value is None else value

    return property(get, put)


class ClientView:
    """One client's row, read and written through the map's columns (the fields of ``ClientRecord``).

    ``tier`` and ``in_flight`` writes go through ``ClientMap.set_tier`` / ``set_in_flight`` so
    that the tier pools stay consistent.
    """

    __slots__ = ("_map", "row")

    def __init__(self, cmap: ClientMap, row: int) -> None:
        self._map = cmap
        self.row = row

    num_samples = _int_field("num_samples")
    last_utility_round = _int_field("last_utility_round")
    selected_round = _int_field("selected_round")
    blocked_round = _int_field("blocked_round")
    times_selected = _int_field("times_selected")
    times_updated = _int_field("times_updated")
    times_evaluated = _int_field("times_evaluated")
    times_dropped = _int_field("times_dropped")
    stat_utility = _float_field("stat_utility")
    last_duration = _float_field("last_duration")

    @property
    def client_id(self) -> int:
        return int(self._map._cols["client_id"][self.row])

    @property
    def tier(self) -> Tier:
        return _TIERS[self._map._cols["tier"][self.row]]

    @tier.setter
    def tier(self, tier: Tier) -> None:
        self._map.set_tier(self.client_id, tier)

    @property
    def reported_tier(self) -> Tier:
        return _TIERS[self._map._cols["reported_tier"][self.row]]

    @reported_tier.setter
    def reported_tier(self, tier: Tier) -> None:
        self._map._cols["reported_tier"][self.row] = tier

    @property
    def in_flight(self) -> int | None:
        t = int(self._map._cols["in_flight"][self.row])
        return None if t == _NO_TASK else t

    @in_flight.setter
    def in_flight(self, task_id: int | None) -> None:
        self._map.set_in_flight(self.client_id, task_id)

    @property
    def class_counts(self) -> tuple[int, ...]:
        return self._map._class_counts[self.row]

    @property
    def explored(self) -> bool:
        return not np.isnan(self._map._cols["stat_utility"][self.row])

    def __repr__(self) -> str:
        return f"ClientView(client_id={self.client_id}, row={self.row}, tier={self.tier.name})"


class ClientMap:
    def __init__(self, capacity: int = 1024) -> None:
        self._n = 0
        self._cols: dict[str, np.ndarray] = {c: np.empty(max(capacity, 1), dtype=_DTYPES[c]) for c in _COLUMNS}
        self._class_counts: list[tuple[int, ...]] = []
        self._table = np.full(_TABLE_MIN, -1, dtype=np.int64)  # client id -> row, for small ids
        self._sparse: dict[int, int] = {}  # client id -> row, for ids outside the table
        self._members = [np.empty(16, dtype=np.int64) for _ in _TIERS]  # rows of each tier, unordered
        self._member_n = [0 for _ in _TIERS]
        self._slot = np.empty(max(capacity, 1), dtype=np.int64)  # row -> its position in its tier's members
        self._id_ordered = True  # rows were registered in increasing client id: row order is id order

    # ------------------------------------------------------------------ lookup
    def __len__(self) -> int:
        return self._n

    def __contains__(self, client_id: object) -> bool:
        if not isinstance(client_id, (int, np.integer)):
            return False
        return self._find(int(client_id)) >= 0

    def __getitem__(self, client_id: int) -> ClientView:
        return ClientView(self, self.row(client_id))

    def __iter__(self) -> Iterator[ClientView]:
        return (ClientView(self, r) for r in range(self._n))

    def _find(self, client_id: int) -> int:
        if 0 <= client_id < self._table.size:
            r = int(self._table[client_id])
            if r >= 0:
                return r
        return self._sparse.get(client_id, -1)

    def row(self, client_id: int) -> int:
        """The dense row of a registered client (KeyError if unknown)."""
        r = self._find(int(client_id))
        if r < 0:
            raise KeyError(client_id)
        return r

    def rows_of(self, client_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Rows of many registered clients at once, in the given order (KeyError if one is unknown)."""
        ids = np.asarray(client_ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            return np.empty(0, dtype=np.int64)
        inside = (ids >= 0) & (ids < self._table.size)
        if inside.all():
            rows = self._table[ids]
        else:
            rows = np.full(ids.size, -1, dtype=np.int64)
            rows[inside] = self._table[ids[inside]]
        missing = np.flatnonzero(rows < 0)
        for i in missing:
            r = self._sparse.get(int(ids[i]), -1)
            if r < 0:
                raise KeyError(int(ids[i]))
            rows[i] = r
        return rows

    def column(self, name: str) -> np.ndarray:
        """The live column of field ``name`` over the registered rows (read it; write through views)."""
        return self._cols[name][: self._n]

    @property
    def ids(self) -> np.ndarray:
        """Client id of each row."""
        return self._cols["client_id"][: self._n]

    # ------------------------------------------------------------------ updates
    def add(self, record: ClientRecord) -> None:
        cid = record.client_id
        if not isinstance(cid, (int, np.integer)) or not _I64.min <= cid <= _I64.max:
            raise ValueError(f"client id {cid!r} is not a 64-bit integer")
        cid = int(cid)
        if self._find(cid) >= 0:
            raise ValueError(f"client {cid} is already registered")
        r = self._n
        if r == self._cols["client_id"].size:
            self._grow(2 * r)
        self._place(cid, r)
        cols = self._cols
        cols["client_id"][r] = cid
        for name in _INT_FIELDS:
            cols[name][r] = getattr(record, name) if name != "in_flight" else _NO_TASK
        for name in _FLOAT_FIELDS:
            v = getattr(record, name)
            cols[name][r] = np.nan if v is None else v
        cols["tier"][r] = record.tier
        cols["reported_tier"][r] = record.reported_tier
        self._class_counts.append(tuple(record.class_counts))
        if r > 0 and cid < int(cols["client_id"][r - 1]):
            self._id_ordered = False
        self._n = r + 1
        self._join(r, int(record.tier))
        if record.in_flight is not None:
            cols["in_flight"][r] = record.in_flight

    def set_tier(self, client_id: int, tier: Tier) -> Tier:
        """Move a client between pools in O(1); returns the tier it had."""
        r = self.row(client_id)
        old = int(self._cols["tier"][r])
        if old != tier:
            self._leave(r, old)
            self._join(r, int(tier))
            self._cols["tier"][r] = tier
        return _TIERS[old]

    def set_in_flight(self, client_id: int, task_id: int | None) -> None:
        self._cols["in_flight"][self.row(client_id)] = _NO_TASK if task_id is None else task_id

    # ------------------------------------------------------------------ candidate sets
    def idle_rows(self, *tiers: Tier) -> np.ndarray:
        """Rows of the clients of ``tiers`` holding no slot, in client-id order.

        Costs in proportion to the members of those tiers (one filter and one sort), not the
        population.
        """
        parts = [self._members[t][: self._member_n[t]] for t in tiers]
        rows = parts[0] if len(parts) == 1 else np.concatenate(parts)
        rows = rows[self._cols["in_flight"][rows] == _NO_TASK]
        return self._id_sorted(rows)

    def idle_in(self, *tiers: Tier) -> np.ndarray:
        """Client ids of the given tiers holding no slot, in a deterministic (id) order."""
        return self._cols["client_id"][self.idle_rows(*tiers)]

    def _id_sorted(self, rows: np.ndarray) -> np.ndarray:
        if self._id_ordered:
            return np.sort(rows)
        return rows[np.argsort(self._cols["client_id"][rows], kind="stable")]

    # ------------------------------------------------------------------ storage
    def _grow(self, capacity: int) -> None:
        for name, col in self._cols.items():
            new = np.empty(capacity, dtype=col.dtype)
            new[: self._n] = col[: self._n]
            self._cols[name] = new
        slot = np.empty(capacity, dtype=np.int64)
        slot[: self._n] = self._slot[: self._n]
        self._slot = slot

    def _place(self, client_id: int, r: int) -> None:
        size = self._table.size
        if 0 <= client_id < max(_TABLE_MIN, 4 * (self._n + 1)):
            if client_id >= size:
                table = np.full(max(2 * size, client_id + 1), -1, dtype=np.int64)
                table[:size] = self._table
                self._table = table
            self._table[client_id] = r
        else:
            self._sparse[client_id] = r

    def _join(self, r: int, tier: int) -> None:
        m, n = self._members[tier], self._member_n[tier]
        if n == m.size:
            m = self._members[tier] = np.concatenate([m, np.empty(n, dtype=np.int64)])
        m[n] = r
        self._slot[r] = n
        self._member_n[tier] = n + 1

    def _leave(self, r: int, tier: int) -> None:
        m = self._members[tier]
        last = self._member_n[tier] - 1
        pos = int(self._slot[r])
        moved = int(m[last])
        m[pos] = moved
        self._slot[moved] = pos
        self._member_n[tier] = last

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Every client's fields as arrays of one entry per client (registration order); copies.

        ``class_counts`` is flattened: ``class_counts`` holds the counts back to back and
        ``class_counts_len`` how many belong to each client.
        """
        state: dict[str, Any] = {name: self._cols[name][: self._n].copy() for name in _COLUMNS}
        state["class_counts_len"] = np.fromiter((len(c) for c in self._class_counts), dtype=np.int64,
                                                count=self._n)
        state["class_counts"] = np.fromiter((v for c in self._class_counts for v in c), dtype=np.int64,
                                            count=int(state["class_counts_len"].sum()))
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the whole map by ``state`` (from ``state_dict``); ValueError on a malformed one."""
        expected = {*_COLUMNS, "class_counts", "class_counts_len"}
        if not isinstance(state, dict) or set(state) != expected:
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"ClientMap state must hold exactly {sorted(expected)}, got {got}")
        arrays = {k: np.asarray(v) for k, v in state.items()}
        n = arrays["client_id"].shape[0] if arrays["client_id"].ndim == 1 else -1
        for name in (*_COLUMNS, "class_counts_len"):
            a = arrays[name]
            if a.ndim != 1 or a.shape[0] != n:
                raise ValueError(f"ClientMap state: {name!r} must be a vector of {n} entries, got shape {a.shape}")
            kind = "f" if name in _FLOAT_FIELDS else "iu"
            if a.dtype.kind not in kind and not (a.size == 0 and a.dtype.kind in "iuf"):
                raise ValueError(f"ClientMap state: {name!r} has dtype {a.dtype}")
        tiers = np.concatenate([arrays["tier"], arrays["reported_tier"]])
        if tiers.size and (tiers.min() < 0 or tiers.max() >= len(_TIERS)):
            raise ValueError("ClientMap state: a tier code is not one of 0, 1, 2")
        lens, flat = arrays["class_counts_len"], arrays["class_counts"]
        if (lens < 0).any() or flat.ndim != 1 or int(lens.sum()) != flat.size:
            raise ValueError("ClientMap state: class_counts and class_counts_len disagree")
        ids = arrays["client_id"]
        if np.unique(ids).size != n:
            raise ValueError("ClientMap state: client ids are not unique")
        fresh = ClientMap(capacity=max(n, 1024))
        for name in _COLUMNS:
            fresh._cols[name][:n] = arrays[name]
        fresh._n = n
        ends = np.cumsum(lens)
        fresh._class_counts = [tuple(int(v) for v in flat[e - k : e]) for k, e in zip(lens.tolist(), ends.tolist())]
        for r, cid in enumerate(ids.tolist()):
            fresh._place(cid, r)
            fresh._join(r, int(arrays["tier"][r]))
        fresh._id_ordered = bool(n < 2 or (np.diff(ids) > 0).all())
        self.__dict__.update(fresh.__dict__)
