"""Server checkpoints whose cost does not grow with the run's history, without pickle.

A checkpoint is two files:

- the snapshot ``<path>``: ``Orchestrator.state_dict()`` and the shell's state, replaced
  atomically (write ``<path>.tmp``, fsync, rename). Everything that grows with the population or
  the history is a numpy array there (the ClientMap's columns, closed task ids above the
  watermark, per-update statistics), so writing it is a few array copies, not a Python object
  per client or per update;
- the applied-update log ``<path>.applied.csv``: one line per training update applied, appended
  as aggregations happen and fsynced before each snapshot. The snapshot records how many lines
  (and bytes) it covers; a resumed server truncates the log there, dropping the lines of
  aggregations the snapshot does not hold (they happen again, once, after the resume).

Snapshot format: a safetensors file whose tensors are the state's arrays (``a0``, ``a1``, ...)
plus ``__state__``, a uint8 tensor holding the UTF-8 JSON of everything else, where an array is
``{"$a": "a3"}``. The state is plain data (dicts with string keys, lists, numbers, strings,
booleans, None, numpy arrays): the owners convert their objects in their own ``state_dict`` /
``load_state_dict``; loading a checkpoint never builds a class it names.
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Iterator
from dataclasses import astuple, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import load_file, save

FORMAT = "felix-checkpoint"
VERSION = (
    "3"  # 3: the orchestrator's policies (round, availability, data plan) and the run controller in the state
)
_STATE_KEY = "__state__"
RESUME_TASK_ID_STRIDE = 1 << 32


class CheckpointError(RuntimeError):
    """A state that cannot be saved, or a file that cannot be restored (the message says where)."""


# ---------------------------------------------------------------------- plain-data tree <-> tensors + JSON
def _encode(v: Any, arrays: dict[str, np.ndarray], path: str) -> Any:
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, (float, np.floating)):
        return float(v)
    if isinstance(v, np.ndarray):
        if v.dtype.kind not in "biuf":
            raise CheckpointError(f"cannot checkpoint {path}: array of dtype {v.dtype}")
        key = f"a{len(arrays)}"
        arrays[key] = np.ascontiguousarray(v)
        return {"$a": key}
    if isinstance(v, (list, tuple)):
        return [_encode(x, arrays, f"{path}[{i}]") for i, x in enumerate(v)]
    if isinstance(v, dict):
        out = {}
        for k, x in v.items():
            if not isinstance(k, str) or k.startswith("$"):
                raise CheckpointError(f"cannot checkpoint {path}: key {k!r} is not a plain string")
            out[k] = _encode(x, arrays, f"{path}.{k}")
        return out
    raise CheckpointError(
        f"cannot checkpoint {path}: unsupported type {type(v).__module__}.{type(v).__name__}"
    )


def _decode(v: Any, arrays: dict[str, np.ndarray], path: str) -> Any:
    if isinstance(v, list):
        return [_decode(x, arrays, f"{path}[{i}]") for i, x in enumerate(v)]
    if isinstance(v, dict):
        if "$a" in v:
            try:
                return arrays[v["$a"]]
            except (KeyError, TypeError):
                raise CheckpointError(f"{path}: array {v['$a']!r} missing from the file") from None
        return {k: _decode(x, arrays, f"{path}.{k}") for k, x in v.items()}
    return v


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> int:
    """Write ``state`` (plain data) atomically; returns the file size in bytes."""
    arrays: dict[str, np.ndarray] = {}
    doc = _encode(state, arrays, "state")
    text = json.dumps(doc, separators=(",", ":")).encode("utf-8")
    arrays[_STATE_KEY] = np.frombuffer(text, dtype=np.uint8)
    blob = save(arrays, metadata={"format": FORMAT, "version": VERSION})
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(blob)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, p)
    return len(blob)


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint written by ``save_checkpoint``; arrays come back as numpy arrays."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint {p} not found")
    try:
        with safe_open(str(p), framework="np") as f:
            meta = f.metadata() or {}
        arrays = load_file(str(p))
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {p} is not a readable safetensors file ({exc})") from None
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise CheckpointError(
            f"checkpoint {p}: format {meta.get('format')!r} v{meta.get('version')!r}, "
            f"expected {FORMAT} v{VERSION}"
        )
    raw = arrays.pop(_STATE_KEY, None)
    if raw is None:
        raise CheckpointError(f"checkpoint {p} has no state record")
    try:
        doc = json.loads(raw.tobytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"checkpoint {p}: state record is not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise CheckpointError(f"checkpoint {p}: state record is not a mapping")
    return _decode(doc, arrays, "state")  # type: ignore[no-any-return]


# ---------------------------------------------------------------------- the applied-update log
@dataclass(frozen=True)
class AppliedUpdate:
    """One training update applied by an aggregation (the exactly-once audit trail)."""

    version: int
    task_id: int
    client_id: int
    staleness: int
    weight: float
    time_s: float


APPLIED_FIELDS = [f.name for f in fields(AppliedUpdate)]


class AppliedLog:
    """Append-only log of applied updates: a CSV file (``applied_updates.csv``'s format), or memory
    when there is no file. ``sync()`` makes what was appended durable; ``position`` is what a
    snapshot records and ``truncate`` returns to it."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.count = 0
        self._rows: list[AppliedUpdate] = []  # only without a file
        self._task_ids: set[int] = set()  # to report whether every applied task id is unique
        self.unique = True
        self._f: io.TextIOWrapper | None = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(path, "a+", newline="")  # noqa: SIM115  (kept open: appended to)
            self._f.seek(0, os.SEEK_END)
            if self._f.tell() == 0:
                self._f.write(",".join(APPLIED_FIELDS) + "\n")

    def append(self, row: AppliedUpdate) -> None:
        self.count += 1
        if row.task_id in self._task_ids:
            self.unique = False
        self._task_ids.add(row.task_id)
        if self._f is None:
            self._rows.append(row)
        else:
            self._f.write(",".join(repr(x) if isinstance(x, float) else str(x) for x in astuple(row)) + "\n")

    def sync(self) -> None:
        if self._f is not None:
            self._f.flush()
            os.fsync(self._f.fileno())

    def position(self) -> dict[str, int]:
        if self._f is None:
            return {"count": self.count, "bytes": 0}
        self._f.flush()
        return {"count": self.count, "bytes": self._f.tell()}

    def truncate(self, position: dict[str, Any]) -> None:
        """Drop what was appended after ``position`` (a resumed server's lost future)."""
        if self._f is None:
            if position["count"] != 0:
                raise CheckpointError("the checkpoint has applied updates but there is no log file")
            return
        n, size = int(position["count"]), int(position["bytes"])
        self._f.flush()
        if self._f.seek(0, os.SEEK_END) < size:
            raise CheckpointError(f"applied-update log {self.path} is shorter than its checkpoint says")
        self._f.truncate(size)
        self._f.seek(size)
        self.count = 0
        self._task_ids = set()
        self.unique = True
        for row in self.rows():
            self.count += 1
            self.unique &= row.task_id not in self._task_ids
            self._task_ids.add(row.task_id)
        if self.count != n:
            raise CheckpointError(
                f"applied-update log {self.path} holds {self.count} updates where the checkpoint says {n}"
            )

    def rows(self) -> Iterator[AppliedUpdate]:
        if self._f is None:
            yield from self._rows
            return
        self._f.flush()
        assert self.path is not None
        with open(self.path, newline="") as f:
            for r in csv.DictReader(f):
                yield AppliedUpdate(
                    int(r["version"]),
                    int(r["task_id"]),
                    int(r["client_id"]),
                    int(r["staleness"]),
                    float(r["weight"]),
                    float(r["time_s"]),
                )

    def write_csv(self, out: Path) -> None:
        with open(out, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(APPLIED_FIELDS)
            for row in self.rows():
                w.writerow(astuple(row))

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def applied_log_path(checkpoint: Path) -> Path:
    return checkpoint.with_name(checkpoint.name + ".applied.csv")
