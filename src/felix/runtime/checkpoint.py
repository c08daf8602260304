"""Server checkpoints: the orchestrator's whole state, and the shell's, in one file, without pickle.

Coupling, on purpose and in one place: the sans-I/O orchestrator has no snapshot API, so
``snapshot_orchestrator`` reads *every instance attribute* of the ``Orchestrator`` (except ``cfg``
and ``oracle``, which are rebuilt from the config) and, recursively, of the objects it owns (the
ClientMap, the stats, the train/eval selectors and the aggregator with their internal state:
Oort's exploration factor and pacer, TierSelect's bookkeeping...). ``restore_orchestrator`` writes
them back onto an orchestrator freshly built from the same config. A new attribute of a plain
type (numbers, strings, containers, numpy arrays, felix dataclasses and enums, numpy Generators)
is covered with no change here; one of another type makes ``snapshot`` fail loudly with its path,
at the first checkpoint, rather than resume wrongly.

File format (one file, replaced atomically: write ``<path>.tmp``, fsync, rename): a safetensors
file whose tensors are the state's arrays (``a0``, ``a1``, ...) plus ``__state__``, a uint8 tensor
holding the UTF-8 JSON of everything else. Types JSON cannot say are tagged: ``{"$t": [...]}`` a
tuple, ``{"$s": [...]}`` a set, ``{"$d": [[k, v], ...]}`` a dict (keys keep their type),
``{"$a": "a3"}`` an array, ``{"$f": "nan"}`` a non-finite float, ``{"$e": "module:Enum", "v": ...}``,
``{"$dc": "module:Class", "f": {...}}`` a dataclass, ``{"$o": "module:Class", "f": {...}}`` an
object restored in place, ``{"$rng": {...}}`` a numpy Generator. Classes are looked up only in
``felix.*`` modules and must be dataclasses, enums or named tuples: loading a checkpoint never
runs code it names.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import math
import os
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import load_file, save

from felix.core.orchestrator import Orchestrator

FORMAT = "felix-checkpoint"
VERSION = "1"
_SKIP = frozenset({"cfg", "oracle"})  # rebuilt from the config, never checkpointed
_STATE_KEY = "__state__"


class CheckpointError(RuntimeError):
    """A state that cannot be saved, or a file that cannot be restored (the message says where)."""


def _qualname(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _resolve(name: Any, path: str) -> type:
    if not isinstance(name, str) or ":" not in name:
        raise CheckpointError(f"{path}: bad class reference {name!r}")
    module, qual = name.split(":", 1)
    if module != "felix" and not module.startswith("felix."):
        raise CheckpointError(f"{path}: refusing class {name} outside the felix package")
    try:
        obj: Any = importlib.import_module(module)
        for part in qual.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        raise CheckpointError(f"{path}: class {name} no longer exists") from None
    if not isinstance(obj, type):
        raise CheckpointError(f"{path}: {name} is not a class")
    return obj


def _is_namedtuple(v: Any) -> bool:
    return isinstance(v, tuple) and hasattr(type(v), "_fields")


class _Encoder:
    def __init__(self) -> None:
        self.arrays: dict[str, np.ndarray] = {}

    def array(self, a: np.ndarray, path: str) -> dict[str, str]:
        if a.dtype.kind not in "biuf":
            raise CheckpointError(f"{path}: cannot checkpoint an array of dtype {a.dtype}")
        key = f"a{len(self.arrays)}"
        self.arrays[key] = np.asarray(a, order="C")
        return {"$a": key}

    def enc(self, v: Any, path: str) -> Any:
        if isinstance(v, Enum):  # first: str- and int-valued enums are also str / int
            return {"$e": _qualname(type(v)), "v": self.enc(v.value, path)}
        if v is None or isinstance(v, (bool, str)):
            return v
        if isinstance(v, (int, np.integer)):
            return int(v)
        if isinstance(v, (float, np.floating)):
            f = float(v)
            return f if math.isfinite(f) else {"$f": repr(f)}
        if isinstance(v, np.ndarray):
            return self.array(v, path)
        if isinstance(v, np.random.Generator):
            return {"$rng": self.enc(v.bit_generator.state, f"{path}.rng")}
        if _is_namedtuple(v):
            return {"$dc": _qualname(type(v)), "f": {k: self.enc(x, f"{path}.{k}") for k, x in v._asdict().items()}}
        if isinstance(v, tuple):
            return {"$t": [self.enc(x, f"{path}[{i}]") for i, x in enumerate(v)]}
        if isinstance(v, list):
            return [self.enc(x, f"{path}[{i}]") for i, x in enumerate(v)]
        if isinstance(v, (set, frozenset)):
            items = [self.enc(x, f"{path}{{}}") for x in v]
            try:
                items.sort()
            except TypeError:
                pass
            return {"$s": items}
        if isinstance(v, dict):
            return {"$d": [[self.enc(k, f"{path}.key"), self.enc(x, f"{path}[{k!r}]")] for k, x in v.items()]}
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            fields = {f.name: self.enc(getattr(v, f.name), f"{path}.{f.name}") for f in dataclasses.fields(v)}
            return {"$dc": _qualname(type(v)), "f": fields}
        if type(v).__module__.startswith("felix.") and hasattr(v, "__dict__"):
            return self.obj(v, path)
        raise CheckpointError(f"cannot checkpoint {path}: unsupported type {type(v).__module__}.{type(v).__name__}")

    def obj(self, v: Any, path: str, skip: frozenset[str] = frozenset()) -> dict[str, Any]:
        attrs = {k: self.enc(x, f"{path}.{k}") for k, x in vars(v).items() if k not in skip}
        return {"$o": _qualname(type(v)), "f": attrs}


class _Decoder:
    def __init__(self, arrays: dict[str, np.ndarray]) -> None:
        self.arrays = arrays

    def dec(self, v: Any, path: str, current: Any = None) -> Any:
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, list):
            return [self.dec(x, f"{path}[{i}]") for i, x in enumerate(v)]
        if not isinstance(v, dict) or len(v) not in (1, 2):
            raise CheckpointError(f"{path}: malformed value {str(v)[:60]}")
        if "$a" in v:
            try:
                return np.array(self.arrays[v["$a"]], copy=True)
            except KeyError:
                raise CheckpointError(f"{path}: array {v['$a']!r} missing from the file") from None
        if "$f" in v:
            return float(v["$f"])
        if "$t" in v:
            return tuple(self.dec(x, f"{path}[{i}]") for i, x in enumerate(v["$t"]))
        if "$s" in v:
            return {self.dec(x, f"{path}{{}}") for x in v["$s"]}
        if "$d" in v:
            return {self.dec(k, f"{path}.key"): self.dec(x, f"{path}[{k!r}]") for k, x in v["$d"]}
        if "$rng" in v:
            gen = current if isinstance(current, np.random.Generator) else np.random.default_rng()
            gen.bit_generator.state = self.dec(v["$rng"], f"{path}.rng")
            return gen
        if "$e" in v:
            cls = _resolve(v["$e"], path)
            if not issubclass(cls, Enum):
                raise CheckpointError(f"{path}: {v['$e']} is not an enum")
            return cls(self.dec(v["v"], path))
        if "$dc" in v:
            cls = _resolve(v["$dc"], path)
            fields = {k: self.dec(x, f"{path}.{k}") for k, x in v["f"].items()}
            if issubclass(cls, tuple) and hasattr(cls, "_fields"):
                return cls(**fields)
            if not dataclasses.is_dataclass(cls):
                raise CheckpointError(f"{path}: {v['$dc']} is not a dataclass")
            names = {f.name for f in dataclasses.fields(cls)}
            if set(fields) != names:
                raise CheckpointError(f"{path}: {v['$dc']} fields changed since the checkpoint "
                                      f"(saved {sorted(fields)}, now {sorted(names)})")
            inst = cls.__new__(cls)
            for k, x in fields.items():
                object.__setattr__(inst, k, x)  # frozen and slotted dataclasses alike; no __post_init__
            return inst
        if "$o" in v:
            if current is None or _qualname(type(current)) != v["$o"]:
                got = "nothing" if current is None else _qualname(type(current))
                raise CheckpointError(f"{path}: the checkpoint holds a {v['$o']}, the config builds {got}")
            self.into(current, v, path)
            return current
        raise CheckpointError(f"{path}: unknown tag in {str(v)[:60]}")

    def into(self, target: Any, v: dict[str, Any], path: str) -> None:
        """Restore an ``$o`` value onto an existing object, recursing into owned objects."""
        for k, x in v["f"].items():
            cur = getattr(target, k, None)
            setattr(target, k, self.dec(x, f"{path}.{k}", cur))


# ---------------------------------------------------------------------- orchestrator
def snapshot_orchestrator(orch: Orchestrator, enc: _Encoder) -> dict[str, Any]:
    return enc.obj(orch, "orchestrator", _SKIP)


def restore_orchestrator(orch: Orchestrator, state: dict[str, Any], dec: _Decoder) -> None:
    if state.get("$o") != _qualname(type(orch)):
        raise CheckpointError(f"checkpoint holds {state.get('$o')!r}, not an orchestrator")
    dec.into(orch, state, "orchestrator")
    orch._theta.flags.writeable = False  # the orchestrator hands its weights out read-only


def buffered_task_ids(orch: Orchestrator) -> list[int]:
    """Task ids of the updates waiting in the aggregation buffer, in buffer order.

    The shell needs them to log which tasks each aggregation applied (``AggregationReport``
    names the clients, not the tasks); reading ``_buffer`` is part of this module's coupling.
    """
    return [b.task_id for b in orch._buffer]


RESUME_TASK_ID_STRIDE = 1 << 32


def reserve_task_ids(orch: Orchestrator, life: int) -> None:
    """Number the tasks of a resumed server's ``life`` from ``life * 2**32 + 1``.

    Tasks dispatched between the last checkpoint and a crash are unknown to the restored state,
    but their clients may still answer; a fresh id range keeps such a late result from matching
    a task of the new life. Writes ``_next_task``, part of this module's coupling.
    """
    orch._next_task = max(orch._next_task, life * RESUME_TASK_ID_STRIDE + 1)


# ---------------------------------------------------------------------- files
def save_checkpoint(path: str | Path, orch: Orchestrator, shell_state: dict[str, Any]) -> int:
    """Write orchestrator + shell state atomically; returns the file size in bytes."""
    enc = _Encoder()
    doc = {"orchestrator": snapshot_orchestrator(orch, enc), "shell": enc.enc(shell_state, "shell")}
    text = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode("utf-8")
    tensors = dict(enc.arrays)
    tensors[_STATE_KEY] = np.frombuffer(text, dtype=np.uint8)
    blob = save(tensors, metadata={"format": FORMAT, "version": VERSION})
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(blob)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, p)
    return len(blob)


def load_checkpoint(path: str | Path) -> tuple[dict[str, Any], _Decoder]:
    """Read a checkpoint; returns the raw document and a decoder bound to its arrays."""
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
        raise CheckpointError(f"checkpoint {p}: format {meta.get('format')!r} v{meta.get('version')!r}, "
                              f"expected {FORMAT} v{VERSION}")
    raw = arrays.pop(_STATE_KEY, None)
    if raw is None:
        raise CheckpointError(f"checkpoint {p} has no state record")
    try:
        doc = json.loads(raw.tobytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"checkpoint {p}: state record is not JSON ({exc})") from None
    if not isinstance(doc, dict) or "orchestrator" not in doc or "shell" not in doc:
        raise CheckpointError(f"checkpoint {p}: state record lacks orchestrator or shell state")
    return doc, _Decoder(arrays)


def restore(path: str | Path, orch: Orchestrator) -> dict[str, Any]:
    """Restore ``orch`` in place from ``path``; returns the shell's state."""
    doc, dec = load_checkpoint(path)
    restore_orchestrator(orch, doc["orchestrator"], dec)
    shell = dec.dec(doc["shell"], "shell")
    if not isinstance(shell, dict):
        raise CheckpointError(f"checkpoint {path}: shell state is not a mapping")
    return shell
