"""The ClientMap (FeLiX §4): per-client state in numpy columns, plus per-tier member sets.

Selection must cost in proportion to the clients that can be picked, never the population. Every
field of every client lives in a column indexed by the client's dense *row* (0, 1, 2... in
registration order, grown geometrically), so a selector reads a field of all its candidates with
one gather instead of one Python object per client. The eight fields every selection reads sit
side by side in one 64-byte line per client (``_hot``, an int64 matrix, floats stored by their
bits): at a million registered clients a gather touches one cache line per candidate, not one
per field. Each tier keeps its members in a row array with O(1) insert and remove (swap with the
last), re-sorted lazily by the next selection (a nearly sorted array sorts in about linear time),
so a tier event costs the same at any population and candidate lists come out in client-id
order, as they always have, so that a seed reproduces a selection. Client ids map to rows through
a flat table (small non-negative ids) or a dict (any other 64-bit id); when every id equals its
row (the simulator registers 0..N-1 in order) no lookup is needed at all.

``map[client_id]`` returns a ``ClientView``, a write-through view of one row with the record's
field names; ``ClientRecord`` is the plain record a client is registered with.

Selectors keep population-wide summaries of the result fields (``stat_utility``, ``last_duration``,
``times_updated``: Oort's explored count, its sorted durations and its blacklist). So that they
need not re-read those fields of every candidate at every decision to notice a change, the map
logs the row of each write to them (a ring of the last ``_LOG_SIZE`` writes); a reader keeps a
``LogMark`` and asks for the rows written since (``written_since``), or is told to read the whole
map when the log cannot say (another map, a restored state, or more writes than the ring holds).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from felix.core.types import Tier

_TIERS = tuple(Tier)  # indexed by the tier's code
# Read by every selection: one int64 line per client. The last two are floats (NaN = None), by their bits.
_HOT = (
    "in_flight",
    "blocked_round",
    "selected_round",
    "last_utility_round",
    "num_samples",
    "times_updated",
    "stat_utility",
    "last_duration",
)
_HOT_AT = {name: j for j, name in enumerate(_HOT)}
_FLOAT_FIELDS = ("stat_utility", "last_duration")
_COLD = {
    "client_id": np.int64,
    "times_selected": np.int64,
    "times_evaluated": np.int64,
    "times_dropped": np.int64,
    "tier": np.int8,
    "reported_tier": np.int8,
}
_INT_FIELDS = tuple(
    f for f in (*_HOT, *_COLD) if f not in _FLOAT_FIELDS and f not in ("client_id", "tier", "reported_tier")
)
_COLUMNS = ("client_id", *_INT_FIELDS, *_FLOAT_FIELDS, "tier", "reported_tier")
_NO_TASK = -1  # in_flight of a client holding no slot
_TABLE_MIN = (
    1024  # first size of the flat id table; ids up to 4 x the population grow it, others go to a dict
)
_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1
_LOGGED = frozenset({"stat_utility", "last_duration", "times_updated"})  # writes go to the write log
_LOG_SIZE = 4096  # rows the write log remembers; a reader further behind re-reads the whole map
_tokens = itertools.count(1)  # one per map state, so that a mark never matches another map's log


@dataclass(frozen=True, slots=True)
class LogMark:
    """A point in one ClientMap's write log (``ClientMap.mark``)."""

    token: int
    position: int


@dataclass(slots=True)
class ClientRecord:
    """One client's fields, as registered (``ClientMap.add``); the map stores them in columns. A
    client registers holding no slot: ``in_flight`` is the task ledger's to set."""

    client_id: int
    num_samples: int
    tier: Tier
    reported_tier: Tier
    stat_utility: float | None = None
    last_utility_round: int = -1  # version at which the utility was last measured (train or eval)
    last_duration: float | None = None  # seconds of the last training task, the system metric
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
    if name in _LOGGED:
        j = _HOT_AT[name]

        def get(self: ClientView) -> int:
            return int(self._map._hot[self.row, j])

        def put(self: ClientView, value: int) -> None:
            self._map._hot[self.row, j] = value
            self._map._log_write(self.row)
    elif name in _HOT_AT:
        j = _HOT_AT[name]

        def get(self: ClientView) -> int:
            return int(self._map._hot[self.row, j])

        def put(self: ClientView, value: int) -> None:
            self._map._hot[self.row, j] = value
    else:

        def get(self: ClientView) -> int:
            return int(self._map._cols[name][self.row])

        def put(self: ClientView, value: int) -> None:
            self._map._cols[name][self.row] = value

    return property(get, put)


def _float_field(name: str) -> property:
    j = _HOT_AT[name]

    def get(self: ClientView) -> float | None:
        v = float(self._map._hot[self.row : self.row + 1].view(np.float64)[0, j])
        return None if math.isnan(v) else v

    def put(self: ClientView, value: float | None) -> None:
        self._map._hot[self.row : self.row + 1].view(np.float64)[0, j] = np.nan if value is None else value
        self._map._log_write(self.row)

    return property(get, put)


class ClientRows:
    """The hot fields of some clients (rows), gathered from the map in one pass, as vectors."""

    __slots__ = ("_f", "_i", "rows")

    def __init__(self, rows: np.ndarray, block: np.ndarray) -> None:
        self.rows = rows
        self._i = block
        self._f = block.view(np.float64)

    def __len__(self) -> int:
        return self.rows.size

    def take(self, keep: np.ndarray) -> ClientRows:
        """The subset selected by a boolean mask or an index array."""
        return ClientRows(self.rows[keep], self._i[keep])

    def field(self, name: str) -> np.ndarray:
        j = _HOT_AT[name]
        return self._f[:, j] if name in _FLOAT_FIELDS else self._i[:, j]


class ClientView:
    """One client's row, read and written through the map's columns (the fields of ``ClientRecord``).

    ``tier`` writes go through ``ClientMap.set_tier`` so that the tier pools stay consistent;
    ``in_flight`` is read-only here (see ``ClientMap.set_in_flight``).
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
        return _TIERS[self._map._cols["tier"][self.row]]  # type: ignore[index]

    @tier.setter
    def tier(self, tier: Tier) -> None:
        self._map.set_tier(self.client_id, tier)

    @property
    def reported_tier(self) -> Tier:
        return _TIERS[self._map._cols["reported_tier"][self.row]]  # type: ignore[index]

    @reported_tier.setter
    def reported_tier(self, tier: Tier) -> None:
        self._map._cols["reported_tier"][self.row] = tier

    @property
    def in_flight(self) -> int | None:
        t = int(self._map._hot[self.row, _HOT_AT["in_flight"]])
        return None if t == _NO_TASK else t

    @property
    def class_counts(self) -> tuple[int, ...]:
        return self._map._class_counts[self.row]

    @property
    def explored(self) -> bool:
        return self.stat_utility is not None

    def __repr__(self) -> str:
        return f"ClientView(client_id={self.client_id}, row={self.row}, tier={self.tier.name})"


class ClientMap:
    def __init__(self, capacity: int = 1024) -> None:
        cap = max(capacity, 1)
        self._n = 0
        self._hot = np.empty((cap, len(_HOT)), dtype=np.int64)
        self._cols: dict[str, np.ndarray] = {c: np.empty(cap, dtype=dt) for c, dt in _COLD.items()}
        self._class_counts: list[tuple[int, ...]] = []
        self._table = np.full(_TABLE_MIN, -1, dtype=np.int64)  # client id -> row, for small ids
        self._sparse: dict[int, int] = {}  # client id -> row, for ids outside the table
        self._members = [np.empty(16, dtype=np.int64) for _ in _TIERS]  # rows of each tier
        self._member_n = [0 for _ in _TIERS]
        self._member_sorted = [True for _ in _TIERS]  # members in client-id order (else: sort lazily)
        self._slot = np.empty(cap, dtype=np.int64)  # row -> its position in its tier's members
        self._busy: dict[int, None] = {}  # rows holding a slot: few, so idle sets skip reading in_flight
        self._id_ordered = True  # rows were registered in increasing client id: row order is id order
        self._identity = True  # every client id equals its row (the simulator's 0..N-1): no lookups
        self._log = np.empty(_LOG_SIZE, dtype=np.int64)  # rows of the last writes to _LOGGED fields (a ring)
        self._logged = 0  # writes logged since this state began
        self._token = next(_tokens)

    # ------------------------------------------------------------------ lookup
    def __len__(self) -> int:
        return self._n

    def __contains__(self, client_id: object) -> bool:
        if not isinstance(client_id, (int, np.integer)):
            return False
        return self._find(int(client_id)) >= 0

    def __getitem__(self, client_id: int) -> ClientView:
        return ClientView(self, self.row(client_id))

    def get(self, client_id: object) -> ClientView | None:
        """The view of a registered client, or None (one lookup where ``in`` and ``[]`` take two)."""
        if not isinstance(client_id, (int, np.integer)):
            return None
        r = self._find(int(client_id))
        return None if r < 0 else ClientView(self, r)

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
        lo, hi = int(ids.min()), int(ids.max())
        if self._identity and lo >= 0 and hi < self._n:
            return ids
        if lo >= 0 and hi < self._table.size:
            rows = self._table[ids]
        else:
            inside = (ids >= 0) & (ids < self._table.size)
            rows = np.full(ids.size, -1, dtype=np.int64)
            rows[inside] = self._table[ids[inside]]
        for i in np.flatnonzero(rows < 0):
            r = self._sparse.get(int(ids[i]), -1)
            if r < 0:
                raise KeyError(int(ids[i]))
            rows[i] = r
        return rows

    def ids_of(self, rows: np.ndarray) -> np.ndarray:
        """Client ids of rows."""
        return rows if self._identity else self._cols["client_id"][rows]

    def column(self, name: str) -> np.ndarray:
        """The live column of field ``name`` over the registered rows (read it; write through views)."""
        if name in _HOT_AT:
            block = self._hot[: self._n]
            return (block.view(np.float64) if name in _FLOAT_FIELDS else block)[:, _HOT_AT[name]]
        return self._cols[name][: self._n]

    def gather(self, rows: np.ndarray) -> ClientRows:
        """The hot fields (``ClientRows.field``) of ``rows`` in one gather: one cache line per client."""
        return ClientRows(rows, self._hot.take(rows, axis=0))  # take: ~3x faster than [rows] on 2-D

    @property
    def ids(self) -> np.ndarray:
        """Client id of each row."""
        return self._cols["client_id"][: self._n]

    # ------------------------------------------------------------------ updates
    def add(self, record: ClientRecord) -> None:
        cid = record.client_id
        if not isinstance(cid, (int, np.integer)) or not _I64_MIN <= cid <= _I64_MAX:
            raise ValueError(f"client id {cid!r} is not a 64-bit integer")
        cid = int(cid)
        if self._find(cid) >= 0:
            raise ValueError(f"client {cid} is already registered")
        r = self._n
        if r == self._slot.size:
            self._grow(2 * r)
        hot = self._hot[r]
        hot[:6] = (
            _NO_TASK,
            record.blocked_round,
            record.selected_round,
            record.last_utility_round,
            record.num_samples,
            record.times_updated,
        )
        hot.view(np.float64)[6:] = (
            np.nan if record.stat_utility is None else record.stat_utility,
            np.nan if record.last_duration is None else record.last_duration,
        )
        cols = self._cols
        cols["client_id"][r] = cid
        cols["times_selected"][r] = record.times_selected
        cols["times_evaluated"][r] = record.times_evaluated
        cols["times_dropped"][r] = record.times_dropped
        cols["tier"][r] = record.tier
        cols["reported_tier"][r] = record.reported_tier
        self._class_counts.append(tuple(record.class_counts))
        self._place(cid, r)
        if r > 0 and cid < int(cols["client_id"][r - 1]):
            self._id_ordered = False
        self._identity = self._identity and cid == r
        self._n = r + 1
        self._join(r, int(record.tier))
        if record.stat_utility is not None or record.last_duration is not None or record.times_updated:
            self._log_write(r)

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
        """The task holding ``client_id``'s slot. In an orchestrator only its ``TaskLedger`` calls
        this (and ``reset_in_flight``), from its transitions: the column mirrors the ledger."""
        r = self.row(client_id)
        self._hot[r, _HOT_AT["in_flight"]] = _NO_TASK if task_id is None else task_id
        if task_id is None:
            self._busy.pop(r, None)
        else:
            self._busy[r] = None

    def reset_in_flight(self, holders: Mapping[int, int]) -> None:
        """Rewrite the whole ``in_flight`` column: ``holders`` (client -> task id) hold a slot,
        nobody else does (a restored ledger publishes its open tasks so)."""
        self._hot[: self._n, _HOT_AT["in_flight"]] = _NO_TASK
        rows = self.rows_of(np.fromiter(holders.keys(), dtype=np.int64, count=len(holders)))
        self._hot[rows, _HOT_AT["in_flight"]] = np.fromiter(
            holders.values(), dtype=np.int64, count=len(holders)
        )
        self._busy = dict.fromkeys(np.sort(rows).tolist())

    # ------------------------------------------------------------------ write log
    def mark(self) -> LogMark:
        """The current end of the write log, to pass to ``written_since`` later."""
        return LogMark(self._token, self._logged)

    def written_since(self, mark: LogMark | None) -> np.ndarray | None:
        """Rows whose ``stat_utility``, ``last_duration`` or ``times_updated`` was written after
        ``mark`` (repeats possible), or None when the log cannot tell: ``mark`` is None or belongs to
        another map or to this map before a ``load_state_dict``, or more writes followed it than the
        log holds. A reader told None must read the whole map."""
        if mark is None or mark.token != self._token or self._logged - mark.position > _LOG_SIZE:
            return None
        lo, hi = mark.position % _LOG_SIZE, self._logged % _LOG_SIZE
        if self._logged - mark.position == _LOG_SIZE or hi < lo:
            return np.concatenate([self._log[lo:], self._log[:hi]])
        return self._log[lo:hi].copy()

    def _log_write(self, r: int) -> None:
        self._log[self._logged % _LOG_SIZE] = r
        self._logged += 1

    # ------------------------------------------------------------------ candidate sets
    def idle_rows(self, *tiers: Tier) -> np.ndarray:
        """Rows of the clients of ``tiers`` holding no slot, in client-id order (a new array).

        Costs in proportion to the members of those tiers (a copy, and a sort of a nearly sorted
        array when tier events have moved members since the last call), not the population. The
        few clients holding a slot are cut out by their positions in the members, so no member's
        fields are read (at a million clients each read is a cache miss).
        """
        if len(tiers) == 1:
            return self._idle_members(int(tiers[0]))
        return self._id_sorted(np.concatenate([self._idle_members(int(t)) for t in tiers]))

    def idle_in(self, *tiers: Tier) -> np.ndarray:
        """Client ids of the given tiers holding no slot, in a deterministic (id) order."""
        return self.ids_of(self.idle_rows(*tiers))

    def _idle_members(self, tier: int) -> np.ndarray:
        members = self._sorted_members(tier)
        if not self._busy:
            return members.copy()
        busy = np.fromiter(self._busy, dtype=np.int64, count=len(self._busy))
        busy = busy[self._cols["tier"][busy] == tier]
        return np.delete(members, self._slot[busy]) if busy.size else members.copy()

    def _sorted_members(self, tier: int) -> np.ndarray:
        n = self._member_n[tier]
        m = self._members[tier][:n]
        if not self._member_sorted[tier]:
            m[:] = self._id_sorted(m)
            self._slot[m] = np.arange(n)
            self._member_sorted[tier] = True
        return m

    def _id_sorted(self, rows: np.ndarray) -> np.ndarray:
        """``rows`` in client-id order; a stable sort (timsort) is near linear on nearly sorted input."""
        if self._id_ordered:
            return np.sort(rows, kind="stable")
        return rows[np.argsort(self._cols["client_id"][rows], kind="stable")]

    # ------------------------------------------------------------------ storage
    def _grow(self, capacity: int) -> None:
        hot = np.empty((capacity, len(_HOT)), dtype=np.int64)
        hot[: self._n] = self._hot[: self._n]
        self._hot = hot
        for name, col in self._cols.items():
            new = np.empty(capacity, dtype=col.dtype)
            new[: self._n] = col[: self._n]
            self._cols[name] = new
        slot = np.empty(capacity, dtype=np.int64)
        slot[: self._n] = self._slot[: self._n]
        self._slot = slot

    def _place(self, client_id: int, r: int) -> None:
        size = self._table.size
        if (
            0 <= client_id < max(size, 4 * (self._n + 1))
        ):  # fits the table, or may grow it (x4 the population)
            if client_id >= size:
                table = np.full(max(2 * size, client_id + 1), -1, dtype=np.int64)
                table[:size] = self._table
                for c in [c for c in self._sparse if 0 <= c < table.size]:  # ids that fit now move in
                    table[c] = self._sparse.pop(c)
                self._table = table
            self._table[client_id] = r
        else:
            self._sparse[client_id] = r

    def _join(self, r: int, tier: int) -> None:
        m, n = self._members[tier], self._member_n[tier]
        if n == m.size:
            m = self._members[tier] = np.concatenate([m, np.empty(n, dtype=np.int64)])
        if n and self._member_sorted[tier]:
            prev = int(m[n - 1])
            ids = self._cols["client_id"]
            self._member_sorted[tier] = prev < r if self._id_ordered else int(ids[prev]) < int(ids[r])
        m[n] = r
        self._slot[r] = n
        self._member_n[tier] = n + 1

    def _leave(self, r: int, tier: int) -> None:
        m = self._members[tier]
        last = self._member_n[tier] - 1
        pos = int(self._slot[r])
        if pos != last:
            moved = int(m[last])
            m[pos] = moved
            self._slot[moved] = pos
            self._member_sorted[tier] = False
        self._member_n[tier] = last

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Every client's fields as arrays of one entry per client (registration order); copies.

        ``class_counts`` is flattened: ``class_counts`` holds the counts back to back and
        ``class_counts_len`` how many belong to each client.
        """
        state: dict[str, Any] = {name: self.column(name).copy() for name in _COLUMNS}
        state["class_counts_len"] = np.fromiter(
            (len(c) for c in self._class_counts), dtype=np.int64, count=self._n
        )
        state["class_counts"] = np.fromiter(
            (v for c in self._class_counts for v in c),
            dtype=np.int64,
            count=int(state["class_counts_len"].sum()),
        )
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
                raise ValueError(
                    f"ClientMap state: {name!r} must be a vector of {n} entries, got shape {a.shape}"
                )
            kinds = "iuf" if name in _FLOAT_FIELDS else "iu"
            if a.dtype.kind not in kinds and a.size:
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
        fresh._n = n
        for name in _COLUMNS:
            fresh.column(name)[:] = arrays[name]
        ends = np.cumsum(lens)
        fresh._class_counts = [
            tuple(int(v) for v in flat[e - k : e]) for k, e in zip(lens.tolist(), ends.tolist())
        ]
        fresh._id_ordered = bool(n < 2 or (np.diff(ids) > 0).all())
        fresh._identity = bool((ids == np.arange(n)).all())
        fresh._busy = dict.fromkeys(np.flatnonzero(arrays["in_flight"] != _NO_TASK).tolist())
        small = np.flatnonzero((ids >= 0) & (ids < max(_TABLE_MIN, 4 * n)))
        fresh._table = np.full(
            max(_TABLE_MIN, int(ids[small].max()) + 1 if small.size else 0), -1, dtype=np.int64
        )
        fresh._table[ids[small]] = small
        fresh._sparse = {int(ids[r]): int(r) for r in np.setdiff1d(np.arange(n), small)}
        for t in range(len(_TIERS)):
            rows = np.flatnonzero(arrays["tier"] == t)
            fresh._members[t] = np.concatenate([rows, np.empty(max(16, rows.size), dtype=np.int64)])
            fresh._member_n[t] = rows.size
            fresh._member_sorted[t] = fresh._id_ordered  # rows ascend: in id order when ids ascend with rows
            fresh._slot[rows] = np.arange(rows.size)
        self.__dict__.update(fresh.__dict__)
