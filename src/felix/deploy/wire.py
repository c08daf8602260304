"""The deployment's message format: a typed, versioned header and raw little-endian tensors.

Nothing that can execute code crosses the wire (DESIGN.md principle 6): no pickle, only a JSON
header and raw arrays whose dtype and shape the header declares. Layout of one MQTT payload::

    offset  size  field
    0       4     magic b"FLXM"
    4       2     format version, uint16 little-endian (this module writes and reads FORMAT_VERSION)
    6       4     header length H, uint32 little-endian (at most MAX_HEADER_BYTES)
    10      H     header: a UTF-8 JSON object (fields below)
    10+H    P     payload: the arrays of the header's "arrays" list, concatenated, little-endian

A TRAIN or EVAL task may instead name its arrays by content address (an optional ``model``
field: ``{"sha256", "size", "url"}``): its header keeps the manifest and ``payload`` (= ``size``),
no payload follows, and the receiver fetches the ``size`` bytes the SHA-256 names from ``url``
(``felix.deploy.model_fetch``) and decodes the message again with them (``decode(...,
model_body=...)``), which refuses bytes of another hash or size (``model_hash``).

Every header holds ``fmt`` (= the prefix's version), ``type``, ``run`` (run id), ``msg`` (message
id, unique per sender: the receiver's replay/duplicate check keys on it), ``sent`` (sender's Unix
time), ``payload`` (P, so a cut message is caught) and ``arrays`` (``[{"name", "dtype", "shape"}]``,
dtype one of ``<f4 <f8 <i8``). The type-specific fields are listed in ``_SCHEMAS`` and in
docs/deployment.md; unknown or missing fields, and fields of the wrong JSON type, are errors.

``decode`` checks everything before building a message and raises ``MessageError`` with a
machine-readable ``code`` (a :class:`felix.core.refusals.Refusal`, counted by kind) and a detail
that says what was wrong. Arrays are read-only views of the received bytes (no copy).

One file of about 760 lines on purpose: every message kind's fields, limits and checks sit beside
the one header parser that enforces them, so a kind's declaration and its validation cannot drift.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar

import numpy as np

from felix.core.refusals import Refusal
from felix.core.types import ClientUpdate, TaskKind, Tier
from felix.core.validation import (
    MAX_ID,
    MAX_SAMPLES,
    MAX_TIME,
    MAX_UNIX_TIME,
    REPORTED_RANGES,
    AuxSpec,
    aux_problem,
)

MAGIC = b"FLXM"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<4sHI")
PREFIX_BYTES = _PREFIX.size
MAX_HEADER_BYTES = 64 * 1024
# Checked on the raw bytes before the header is parsed (a heavy header must cost a count, not a
# parse): opening brackets bound both the nesting depth and the number of lists and objects. A
# header holds one object, the arrays list, two per array (its object and its shape) and one list
# of counts or a plan; 64 arrays is more than any message carries.
MAX_HEADER_BRACKETS = 2 * 64 + 8
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
MAX_STR = 256
MAX_LIST = 65536
MAX_URL = 2048
_SHA256 = re.compile(r"[0-9a-f]{64}")
# What JSON turns into a surrogate (valid UTF-8 bytes encode none): the header's strings need the
# walk of _check_unicode only when its raw bytes hold one of these escapes.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")
_URL = re.compile(r"https?://[!-~]+")  # printable ASCII, no spaces: nothing a request line can be split by
DTYPES: dict[str, np.dtype[Any]] = {"<f4": np.dtype("<f4"), "<f8": np.dtype("<f8"), "<i8": np.dtype("<i8")}


class MsgType(str, Enum):
    STATUS = "status"  # server -> all (retained): which server session is up, or that the run is over
    REGISTER = "register"  # client -> server
    STATE = "state"  # client -> server: TierTrack tier change
    RESULT = "result"  # client -> server: a train update or an eval utility
    FAILED = "failed"  # client -> server: the client cannot complete a task
    TRAIN = "train"  # server -> client
    EVAL = "eval"  # server -> client
    CANCEL = "cancel"  # server -> client


class MessageError(ValueError):
    """An inbound message that cannot be decoded; ``code`` says which check failed (one of the
    wire format's kinds of :class:`felix.core.refusals.Refusal`)."""

    def __init__(self, code: Refusal, detail: str) -> None:
        super().__init__(f"{code.value}: {detail}")
        self.code = code
        self.detail = detail


# ---------------------------------------------------------------------- messages
@dataclass(frozen=True, kw_only=True)
class Envelope:
    """Fields every message carries. ``msg_id`` is unique per sender (``<incarnation>-<seq>``)."""

    run: str
    msg_id: str
    sent_at: float

    TYPE: ClassVar[MsgType]


@dataclass(frozen=True, kw_only=True)
class Status(Envelope):
    TYPE: ClassVar[MsgType] = MsgType.STATUS
    session: str
    state: str  # "running" or "finished"


@dataclass(frozen=True, kw_only=True)
class Register(Envelope):
    TYPE: ClassVar[MsgType] = MsgType.REGISTER
    client: int
    incarnation: str  # random per client process start: a new one means the client lost its tasks
    num_samples: int
    tier: Tier
    class_counts: tuple[int, ...] = ()


@dataclass(frozen=True, kw_only=True)
class State(Envelope):
    TYPE: ClassVar[MsgType] = MsgType.STATE
    client: int
    incarnation: str
    tier: Tier


@dataclass(frozen=True, kw_only=True)
class Result(Envelope):
    TYPE: ClassVar[MsgType] = MsgType.RESULT
    client: int
    incarnation: str
    task: int
    kind: TaskKind
    version: int  # the model version the client worked on
    # The orchestrator's own record of a result, sent and received as it is (no copy field by
    # field): its counts are header fields, its delta, aux and data span arrays (the span, "span",
    # only on streams, so results without it are the bytes they always were). An eval result
    # carries no arrays.
    update: ClientUpdate = field(repr=False)
    # Secure aggregation: a train result without its delta, which travels masked in a group
    # (``felix.deploy.secagg_wire``); the header's optional ``"sealed": true``.
    sealed: bool = False


@dataclass(frozen=True, kw_only=True)
class Failed(Envelope):
    TYPE: ClassVar[MsgType] = MsgType.FAILED
    client: int
    incarnation: str
    task: int
    reason: str


@dataclass(frozen=True, kw_only=True)
class ModelRef:
    """Where a task's arrays are fetched from: the SHA-256 (hex) of their bytes (the payload the
    message would otherwise carry), how many there are, and the URL that serves them."""

    sha256: str
    size: int
    url: str


@dataclass(frozen=True, kw_only=True)
class TrainTask(Envelope):
    TYPE: ClassVar[MsgType] = MsgType.TRAIN
    client: int
    task: int
    version: int
    plan: tuple[int, ...] = ()
    weights: np.ndarray = field(repr=False)
    aux: dict[str, np.ndarray] = field(default_factory=dict, repr=False)
    # Set: the arrays are fetched by hash (decoded without them, ``weights`` is empty and ``aux`` too).
    model: ModelRef | None = None


@dataclass(frozen=True, kw_only=True)
class EvalTask(Envelope):
    TYPE: ClassVar[MsgType] = MsgType.EVAL
    client: int
    task: int
    version: int
    weights: np.ndarray = field(repr=False)
    model: ModelRef | None = None  # as TrainTask's


@dataclass(frozen=True, kw_only=True)
class Cancel(Envelope):
    TYPE: ClassVar[MsgType] = MsgType.CANCEL
    client: int
    task: int
    reason: str


Message = Status | Register | State | Result | Failed | TrainTask | EvalTask | Cancel
CLASSES: dict[MsgType, type] = {
    c.TYPE: c for c in (Status, Register, State, Result, Failed, TrainTask, EvalTask, Cancel)
}


# ---------------------------------------------------------------------- field checks
Check = Callable[[str, Any], Any]


def _bad(name: str, want: str, got: Any) -> MessageError:
    return MessageError(
        Refusal.BAD_FIELD, f"field {name!r} must be {want}, got {type(got).__name__} {_short(got)}"
    )


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


def _int(name: str, v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise _bad(name, "an integer", v)
    return v


def _ranged_int(hi: int) -> Check:
    def check(name: str, v: Any) -> int:
        if not (0 <= _int(name, v) <= hi):
            raise _bad(name, f"an integer from 0 to {hi}", v)
        return v

    return check


# Ids and versions, and sample counts: each number a client reports has a declared range
# (``felix.core.validation``), checked here before anything computes with it.
_nonneg = _ranged_int(MAX_ID)
_client_id = _nonneg
_samples = _ranged_int(MAX_SAMPLES)


def _float(name: str, v: Any) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise _bad(name, "a number", v)
    return float(v)


def _ranged_float(lo: float, hi: float) -> Check:
    """A number within [lo, hi] (NaN and the infinities are outside every range)."""

    def check(name: str, v: Any) -> float:
        f = _float(name, v)
        if not (lo <= f <= hi):
            raise _bad(name, f"a number from {lo:g} to {hi:g}", v)
        return f

    return check


_time = _ranged_float(0.0, MAX_UNIX_TIME)  # "sent": the sender's Unix time


def _str(name: str, v: Any) -> str:
    if not isinstance(v, str) or not v or len(v) > MAX_STR:
        raise _bad(name, f"a non-empty string of at most {MAX_STR} characters", v)
    return v


_TIERS = dict(Tier.__members__)  # ``Tier.__members__`` builds a new mapping proxy at each access


def _tier(name: str, v: Any) -> Tier:
    tier = _TIERS.get(v) if isinstance(v, str) else None
    if tier is None:
        raise _bad(name, f"one of {sorted(_TIERS)}", v)
    return tier


def _kind(name: str, v: Any) -> TaskKind:
    try:
        return TaskKind(v)
    except ValueError:
        raise _bad(name, "'train' or 'eval'", v) from None


def _state(name: str, v: Any) -> str:
    if v not in ("running", "finished"):
        raise _bad(name, "'running' or 'finished'", v)
    return v


def _int_list(name: str, v: Any) -> tuple[int, ...]:
    if not isinstance(v, list) or len(v) > MAX_LIST:
        raise _bad(name, f"a list of at most {MAX_LIST} integers", v)
    for x in v:
        if not isinstance(x, int) or isinstance(x, bool) or not (0 <= x <= MAX_SAMPLES):
            raise _bad(name, f"a list of integers from 0 to {MAX_SAMPLES}", v)
    return tuple(v)


def is_model_url(url: Any) -> bool:
    """An http(s) URL of at most ``MAX_URL`` printable ASCII characters (no file:, no spaces)."""
    return isinstance(url, str) and len(url) <= MAX_URL and _URL.fullmatch(url) is not None


def _true(name: str, v: Any) -> bool:
    if v is not True:
        raise _bad(name, "true (or left out)", v)
    return v


def _model_ref(name: str, v: Any) -> ModelRef:
    if not isinstance(v, dict) or v.keys() != {"sha256", "size", "url"}:
        raise _bad(name, "an object with sha256, size and url", v)
    sha, size, url = v["sha256"], v["size"], v["url"]
    if not isinstance(sha, str) or not _SHA256.fullmatch(sha):
        raise _bad(f"{name}.sha256", "64 lowercase hex digits", sha)
    if not is_model_url(url):
        raise _bad(f"{name}.url", f"an http(s) URL of at most {MAX_URL} printable characters", url)
    return ModelRef(sha256=sha, size=_nonneg(f"{name}.size", size), url=url)


_COMMON: dict[str, Check] = {"run": _str, "msg": _str, "sent": _time}
_SCHEMAS: dict[MsgType, dict[str, Check]] = {
    MsgType.STATUS: {"session": _str, "state": _state},
    MsgType.REGISTER: {
        "client": _client_id,
        "incarnation": _str,
        "num_samples": _samples,
        "tier": _tier,
        "class_counts": _int_list,
    },
    MsgType.STATE: {"client": _client_id, "incarnation": _str, "tier": _tier},
    MsgType.RESULT: {
        "client": _client_id,
        "incarnation": _str,
        "task": _nonneg,
        "kind": _kind,
        "version": _nonneg,
        "num_samples": _samples,
        **{k: _ranged_float(lo, hi) for k, (lo, hi) in REPORTED_RANGES.items()},
    },
    MsgType.FAILED: {"client": _client_id, "incarnation": _str, "task": _nonneg, "reason": _str},
    MsgType.TRAIN: {"client": _client_id, "task": _nonneg, "version": _nonneg, "plan": _int_list},
    MsgType.EVAL: {"client": _client_id, "task": _nonneg, "version": _nonneg},
    MsgType.CANCEL: {"client": _client_id, "task": _nonneg, "reason": _str},
}
# Fields a header of the type may carry or leave out.
_OPTIONAL: dict[MsgType, dict[str, Check]] = {
    MsgType.TRAIN: {"model": _model_ref},
    MsgType.EVAL: {"model": _model_ref},
    MsgType.RESULT: {"sealed": _true},
}
_UPDATE_FIELDS = ("num_samples", *REPORTED_RANGES)  # a result's header fields that are its update's
_ENVELOPE_KEYS = {"fmt", "type", "payload", "arrays"}
# Per type, built once: every field's check, and the exact key set a header must have.
_FULL_SCHEMAS: dict[MsgType, dict[str, Check]] = {t: {**_COMMON, **f} for t, f in _SCHEMAS.items()}
_EXPECTED: dict[MsgType, frozenset[str]] = {
    t: frozenset(f) | _ENVELOPE_KEYS for t, f in _FULL_SCHEMAS.items()
}
_TYPES: dict[str, MsgType] = {t.value: t for t in MsgType}


# ---------------------------------------------------------------------- encode
def _header_fields(msg: Message) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in _SCHEMAS[msg.TYPE]:
        v = (
            getattr(msg.update, key)
            if isinstance(msg, Result) and key in _UPDATE_FIELDS
            else getattr(msg, key)
        )
        if isinstance(v, Enum):
            v = v.name if isinstance(v, Tier) else v.value
        elif isinstance(v, tuple):
            v = list(v)
        out[key] = v
    if isinstance(msg, Result) and msg.sealed:
        out["sealed"] = True
    ref = getattr(msg, "model", None)
    if ref is not None:
        out["model"] = {"sha256": ref.sha256, "size": ref.size, "url": ref.url}
    return out


def _arrays_of(msg: Message) -> list[tuple[str, np.ndarray]]:
    if isinstance(msg, Result):
        upd = msg.update
        arrays = [] if upd.delta is None else [("delta", upd.delta)]
        if upd.data_span is not None:
            arrays.append(("span", np.asarray(upd.data_span, dtype=np.float64)))
        return arrays + [(f"aux/{k}", v) for k, v in sorted(upd.aux.items())]
    if isinstance(msg, TrainTask):
        return [("weights", msg.weights)] + [(f"aux/{k}", v) for k, v in sorted(msg.aux.items())]
    if isinstance(msg, EvalTask):
        return [("weights", msg.weights)]
    return []


def _le(a: np.ndarray) -> np.ndarray:
    arr = np.asarray(a)
    want: np.dtype[Any]
    if arr.dtype.kind == "f":
        want = np.dtype("<f4") if arr.dtype.itemsize <= 4 else np.dtype("<f8")
    elif arr.dtype.kind in "iub":
        want = np.dtype("<i8")
    else:
        raise TypeError(f"cannot send an array of dtype {arr.dtype}")
    return np.asarray(arr, dtype=want, order="C")  # (ascontiguousarray would make a 0-d array 1-d)


def encode(msg: Message) -> bytes:
    """Serialize a message: prefix, JSON header, raw little-endian arrays."""
    arrays = [(name, _le(a)) for name, a in _arrays_of(msg)]
    manifest = [{"name": n, "dtype": a.dtype.str, "shape": list(a.shape)} for n, a in arrays]
    payload_len = sum(a.nbytes for _, a in arrays)
    header = {
        "fmt": FORMAT_VERSION,
        "type": msg.TYPE.value,
        "run": msg.run,
        "msg": msg.msg_id,
        "sent": msg.sent_at,
        "payload": payload_len,
        "arrays": manifest,
        **_header_fields(msg),
    }
    hbytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    if len(hbytes) > MAX_HEADER_BYTES:
        raise ValueError(f"header of {len(hbytes)} bytes exceeds {MAX_HEADER_BYTES}")
    parts = [_PREFIX.pack(MAGIC, FORMAT_VERSION, len(hbytes)), hbytes]
    if getattr(msg, "model", None) is None:  # else the arrays are fetched by hash
        parts += [a.tobytes() for _, a in arrays]
    return b"".join(parts)


def model_body(weights: np.ndarray, aux: dict[str, np.ndarray] | None = None) -> bytes:
    """The bytes a task with these arrays carries as its payload: what its ``model`` hash names."""
    arrays = [weights] + [v for _, v in sorted((aux or {}).items())]
    return b"".join(_le(a).tobytes() for a in arrays)


def model_ref(body: bytes, url_base: str) -> ModelRef:
    """The reference to ``body`` served under ``url_base`` (``<url_base>/<sha256>``)."""
    sha = hashlib.sha256(body).hexdigest()
    return ModelRef(sha256=sha, size=len(body), url=f"{url_base.rstrip('/')}/{sha}")


# ---------------------------------------------------------------------- decode
def _check_unicode(header: dict[str, Any]) -> None:
    """Every string of the header (keys and values, at any depth) must be proper Unicode.

    The bytes are valid UTF-8 by then, but JSON's ``\\ud800`` escapes still produce lone
    surrogates, which no UTF-8 encoder accepts: caught here, they are a refusal like any other bad
    header instead of an internal error wherever the string is next encoded (a log line, a topic,
    the checkpoint). Iterative, so a deeply nested header cannot exhaust the stack.
    """
    stack: list[Any] = [header]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise MessageError(
                    Refusal.BAD_HEADER,
                    f"header string {node[:40]!a} is not valid Unicode "
                    f"(lone surrogate at character {exc.start})",
                ) from None


def header_limit(num_classes: int) -> int:
    """The largest header a client of a run with ``num_classes`` classes needs: 8 KiB of fields
    and array manifests, and a class count (up to 13 digits and a comma) per class."""
    return min(MAX_HEADER_BYTES, 8192 + 16 * num_classes)


def decode(
    data: bytes,
    max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    aux_spec: AuxSpec | None = None,
    max_header_bytes: int = MAX_HEADER_BYTES,
    model_body: bytes | None = None,
) -> Message:
    """Parse and validate one message; raises ``MessageError`` with the failed check's code.

    ``aux_spec``: the aux entries a result may carry (what the objective and aggregator in use
    declare, ``felix.core.validation``); any other key, shape or dtype is ``bad_aux``. The server
    passes it; ``None`` skips the check (a client reading the server's tasks).
    ``max_header_bytes``: the header's size limit (the server's is ``header_limit`` of its run),
    checked with its bracket count before the header is parsed.
    ``model_body``: for a task that names its arrays by hash, the bytes fetched for it (checked
    against the hash and size; without them the task is returned with empty arrays and its
    ``model`` reference, for the receiver to fetch).

    The two halves, :func:`parse` (every check of the bytes and the header) and :func:`build`
    (the arrays, as views of ``data``, and the message), may run in different processes.
    """
    return build(parse(data, max_bytes, max_header_bytes, model_body), data, aux_spec, model_body)


@dataclass(frozen=True, slots=True)
class Parsed:
    """A message's checked header: its type, field values and the layout of its arrays (name,
    dtype, shape, byte offset in the payload; None: a task whose model is not fetched yet)."""

    mtype: MsgType
    values: dict[str, Any]
    layout: tuple[tuple[str, str, tuple[int, ...], int], ...] | None

    def __reduce__(self) -> tuple[type[Parsed], tuple[Any, ...]]:
        # Rebuilt by its constructor: half the unpickling time of the dataclass's generic
        # ``__setstate__``, which the server's loop pays for every message the decode worker parsed.
        return Parsed, (self.mtype, self.values, self.layout)


def parse(
    data: bytes,
    max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    max_header_bytes: int = MAX_HEADER_BYTES,
    model_body: bytes | None = None,
) -> Parsed:
    """Every check of :func:`decode` that needs no array: the bytes' sizes, the header, its
    fields and the arrays' layout against the payload (plain values: it pickles cheaply)."""
    if len(data) > max_bytes:
        raise MessageError(
            Refusal.OVERSIZED, f"message of {len(data)} bytes exceeds the limit of {max_bytes}"
        )
    if len(data) < PREFIX_BYTES:
        raise MessageError(
            Refusal.TRUNCATED, f"{len(data)} bytes, shorter than the {PREFIX_BYTES}-byte prefix"
        )
    magic, version, hlen = _PREFIX.unpack_from(data, 0)
    if magic != MAGIC:
        raise MessageError(Refusal.BAD_MAGIC, f"magic {magic!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise MessageError(
            Refusal.UNKNOWN_VERSION, f"format version {version}, this end speaks {FORMAT_VERSION}"
        )
    if hlen > max_header_bytes:
        raise MessageError(Refusal.BAD_HEADER, f"header length {hlen} exceeds {max_header_bytes}")
    if PREFIX_BYTES + hlen > len(data):
        raise MessageError(
            Refusal.TRUNCATED, f"header of {hlen} bytes but only {len(data) - PREFIX_BYTES} follow"
        )
    raw = data[PREFIX_BYTES : PREFIX_BYTES + hlen]
    brackets = raw.count(b"[") + raw.count(b"{")
    if brackets > MAX_HEADER_BRACKETS:
        raise MessageError(
            Refusal.BAD_HEADER,
            f"header opens {brackets} lists or objects, more than {MAX_HEADER_BRACKETS} (nesting or bulk)",
        )
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MessageError(Refusal.BAD_HEADER, f"header is not UTF-8 JSON ({exc})") from None
    except RecursionError:  # thousands of nested brackets fit in the header's 64 KiB
        raise MessageError(Refusal.BAD_HEADER, "header nests too deeply") from None
    if not isinstance(header, dict):
        raise MessageError(Refusal.BAD_HEADER, f"header must be a JSON object, got {type(header).__name__}")
    if _SURROGATE_ESCAPE.search(raw) is not None:  # only a \\uD800-\\uDFFF escape makes a lone surrogate
        _check_unicode(header)
    if header.get("fmt") != FORMAT_VERSION:
        raise MessageError(Refusal.BAD_HEADER, f"header fmt {header.get('fmt')!r} disagrees with the prefix")
    t = header.get("type")
    mtype = _TYPES.get(t) if isinstance(t, str) else None
    if mtype is None:
        raise MessageError(Refusal.UNKNOWN_TYPE, f"message type {_short(t)}")
    schema = _FULL_SCHEMAS[mtype]
    optional = _OPTIONAL.get(mtype, {})
    keys = header.keys() - optional.keys()
    if keys != _EXPECTED[mtype]:
        expected = _EXPECTED[mtype]
        missing = expected - set(header)
        if missing:
            raise MessageError(Refusal.BAD_HEADER, f"{mtype.value} header lacks {sorted(missing)}")
        extra = keys - expected
        raise MessageError(Refusal.BAD_HEADER, f"{mtype.value} header has unknown fields {sorted(extra)}")
    values = {k: check(k, header[k]) for k, check in schema.items()}
    values.update({k: check(k, header[k]) for k, check in optional.items() if k in header})
    body = memoryview(data)[PREFIX_BYTES + hlen :]
    declared = _nonneg("payload", header["payload"])
    ref: ModelRef | None = values.get("model")
    if ref is not None:
        body = _fetched_body(ref, declared, len(body), max_bytes, model_body)
        if model_body is None:
            return Parsed(mtype, values, None)
    if declared != len(body):
        code = Refusal.TRUNCATED if len(body) < declared else Refusal.BAD_PAYLOAD
        raise MessageError(code, f"header declares a {declared}-byte payload, {len(body)} bytes follow")
    return Parsed(mtype, values, _layout(header["arrays"], len(body)))


def build(
    parsed: Parsed, data: bytes, aux_spec: AuxSpec | None = None, model_body: bytes | None = None
) -> Message:
    """The message ``parsed`` describes, its arrays read-only views of ``data``'s payload (of
    ``model_body`` for a task fetched by hash); ``aux_spec`` as for :func:`decode`."""
    values = dict(parsed.values)  # _build consumes its copy
    if parsed.layout is None:
        return _build(parsed.mtype, values, {"weights": _NO_ARRAY})
    if model_body is not None:
        body = memoryview(model_body)
    else:
        body = memoryview(data)[PREFIX_BYTES + _PREFIX.unpack_from(data, 0)[2] :]
    arrays = {
        name: np.frombuffer(body, dtype=DTYPES[dt], count=math.prod(shape), offset=off).reshape(shape)
        for name, dt, shape, off in parsed.layout
    }
    msg = _build(parsed.mtype, values, arrays)
    if aux_spec is not None and isinstance(msg, Result):
        problem = aux_problem(msg.update.aux, aux_spec)
        if problem is not None:
            raise MessageError(Refusal.BAD_AUX, problem)
    return msg


_NO_ARRAY = np.empty(0, np.float32)
_NO_ARRAY.flags.writeable = False


def _fetched_body(
    ref: ModelRef, declared: int, inline: int, max_bytes: int, fetched: bytes | None
) -> memoryview:
    """The payload of a task that names its arrays by hash: ``fetched``, once it is the bytes the
    hash names (an empty view while it is not fetched yet)."""
    if inline:
        raise MessageError(Refusal.BAD_PAYLOAD, f"a task fetched by hash carries {inline} payload bytes")
    if declared != ref.size:
        raise MessageError(
            Refusal.BAD_HEADER, f"header declares a {declared}-byte payload, its model {ref.size}"
        )
    if ref.size > max_bytes:
        raise MessageError(Refusal.OVERSIZED, f"model of {ref.size} bytes exceeds the limit of {max_bytes}")
    if fetched is None:
        return memoryview(b"")
    check_model(ref, fetched)
    return memoryview(fetched)


def check_model(ref: ModelRef, body: bytes) -> None:
    """Raise ``MessageError`` (``model_hash``) unless ``body`` is the bytes ``ref`` names."""
    if len(body) != ref.size:
        raise MessageError(Refusal.MODEL_HASH, f"model of {len(body)} bytes, its task names {ref.size}")
    got = hashlib.sha256(body).hexdigest()
    if got != ref.sha256:
        raise MessageError(
            Refusal.MODEL_HASH, f"model bytes hash to {got[:16]}..., its task names {ref.sha256[:16]}..."
        )


def _layout(manifest: Any, size: int) -> tuple[tuple[str, str, tuple[int, ...], int], ...]:
    """The arrays' (name, dtype, shape, offset), checked to cover the ``size`` payload bytes exactly."""
    if not isinstance(manifest, list):
        raise _bad("arrays", "a list", manifest)
    out: dict[str, tuple[str, str, tuple[int, ...], int]] = {}
    offset = 0
    for i, spec in enumerate(manifest):
        if not isinstance(spec, dict) or set(spec) != {"name", "dtype", "shape"}:
            raise MessageError(
                Refusal.BAD_HEADER, f"arrays[{i}] must be an object with name, dtype and shape"
            )
        name = _str(f"arrays[{i}].name", spec["name"])
        if name in out:
            raise MessageError(Refusal.BAD_HEADER, f"array {name!r} appears twice")
        dtype = DTYPES.get(spec["dtype"]) if isinstance(spec["dtype"], str) else None
        if dtype is None:
            raise _bad(f"arrays[{i}].dtype", f"one of {sorted(DTYPES)}", spec["dtype"])
        shape = spec["shape"]
        if (
            not isinstance(shape, list)
            or len(shape) > 8
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        ):
            raise _bad(f"arrays[{i}].shape", "a list of at most 8 non-negative integers", shape)
        n = math.prod(shape) * dtype.itemsize
        if offset + n > size:
            raise MessageError(Refusal.BAD_PAYLOAD, f"array {name!r} runs past the end of the payload")
        out[name] = (name, spec["dtype"], tuple(shape), offset)
        offset += n
    if offset != size:
        raise MessageError(Refusal.BAD_PAYLOAD, f"{size - offset} payload bytes are not covered by any array")
    return tuple(out.values())


def _split_aux(
    arrays: dict[str, np.ndarray], main: str | None, mtype: MsgType
) -> tuple[np.ndarray | None, dict]:
    aux: dict[str, np.ndarray] = {}
    main_arr = None
    for name, arr in arrays.items():
        if name == main:
            main_arr = arr
        elif name.startswith("aux/") and len(name) > 4 and mtype in (MsgType.TRAIN, MsgType.RESULT):
            aux[name[4:]] = arr
        else:
            raise MessageError(Refusal.BAD_HEADER, f"unexpected array {name!r} in a {mtype.value} message")
    return main_arr, aux


def _span(arr: np.ndarray | None) -> tuple[float, float] | None:
    """A result's data span: two float64 arrival times (the orchestrator checks their order)."""
    if arr is None:
        return None
    if arr.shape != (2,) or arr.dtype.kind != "f" or arr.dtype.itemsize != 8:
        raise MessageError(
            Refusal.BAD_HEADER, f"array 'span' must be 2 float64 times, not {arr.shape}/{arr.dtype}"
        )
    first, last = float(arr[0]), float(arr[1])
    if not (abs(first) <= MAX_TIME and abs(last) <= MAX_TIME):
        raise _bad("span", f"two times within +-{MAX_TIME:g}", [first, last])
    return first, last


def _build(mtype: MsgType, v: dict[str, Any], arrays: dict[str, np.ndarray]) -> Message:
    env = {"run": v.pop("run"), "msg_id": v.pop("msg"), "sent_at": v.pop("sent")}
    if mtype is MsgType.RESULT:
        span = arrays.pop("span", None)
        delta, aux = _split_aux(arrays, "delta", mtype)
        sealed = v.get("sealed", False)
        if v["kind"] is TaskKind.TRAIN and (delta is None) != sealed:
            raise MessageError(
                Refusal.BAD_HEADER,
                "a sealed train result carries no 'delta' array"
                if sealed
                else "a train result must carry a 'delta' array",
            )
        if sealed and v["kind"] is TaskKind.EVAL:
            raise MessageError(Refusal.BAD_HEADER, "an eval result is never sealed")
        if v["kind"] is TaskKind.EVAL and (delta is not None or aux or span is not None):
            raise MessageError(Refusal.BAD_HEADER, "an eval result carries no arrays")
        counts = {k: v.pop(k) for k in _UPDATE_FIELDS}
        update = ClientUpdate(**counts, delta=delta, aux=aux, data_span=_span(span))
        return Result(**env, **v, update=update)
    if mtype in (MsgType.TRAIN, MsgType.EVAL):
        weights, aux = _split_aux(arrays, "weights", mtype)
        if weights is None:
            raise MessageError(Refusal.BAD_HEADER, f"a {mtype.value} task must carry a 'weights' array")
        if mtype is MsgType.TRAIN:
            return TrainTask(**env, **v, weights=weights, aux=aux)
        return EvalTask(**env, **v, weights=weights)
    if arrays:
        raise MessageError(Refusal.BAD_HEADER, f"a {mtype.value} message carries no arrays")
    return CLASSES[mtype](**env, **v)  # type: ignore[no-any-return]


class MsgIds:
    """Message ids of one sender: ``<incarnation>-<sequence>``, unique for the sender's lifetime."""

    def __init__(self, incarnation: str) -> None:
        self.incarnation = incarnation
        self._seq = 0

    def next(self) -> str:
        self._seq += 1
        return f"{self.incarnation}-{self._seq}"
