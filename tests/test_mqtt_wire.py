"""The deployment's message codec: round trips and every malformed case (no broker needed)."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from felix.core.refusals import Refusal
from felix.core.types import ClientUpdate, TaskKind, Tier
from felix.deploy import wire
from felix.deploy.channels import Address, Channel
from felix.deploy.topics import Topics, check_run_id, sanitize_run_id
from felix.deploy.wire import MessageError

ENV = {"run": "r1", "msg_id": "abcd-1", "sent_at": 1700000000.5}


def _messages() -> list[wire.Message]:
    w = np.linspace(-1, 1, 7, dtype=np.float32)
    return [
        wire.Status(**ENV, session="s1", state="running"),
        wire.Register(
            **ENV, client=3, incarnation="abcd", num_samples=40, tier=Tier.AVL_EVAL, class_counts=(1, 0, 39)
        ),
        wire.State(**ENV, client=3, incarnation="abcd", tier=Tier.UN_AVL),
        wire.Result(
            **ENV,
            client=3,
            incarnation="abcd",
            task=9,
            kind=TaskKind.TRAIN,
            version=2,
            update=ClientUpdate(
                num_samples=40,
                stat_utility=1.5,
                loss=0.25,
                duration=12.0,
                delta=w,
                aux={"beta": np.array(0.5)},
            ),
        ),
        wire.Result(
            **ENV,
            client=3,
            incarnation="abcd",
            task=10,
            kind=TaskKind.EVAL,
            version=2,
            update=ClientUpdate(num_samples=40, stat_utility=1.5, loss=0.25, duration=0.6),
        ),
        wire.Failed(**ENV, client=3, incarnation="abcd", task=11, reason="out of memory"),
        wire.TrainTask(
            **ENV, client=3, task=9, version=2, plan=(0, 4, 2), weights=w, aux={"c": np.ones((2, 2))}
        ),
        wire.EvalTask(**ENV, client=3, task=10, version=2, weights=w),
        wire.Cancel(**ENV, client=3, task=9, reason="round ended"),
    ]


@pytest.mark.parametrize("msg", _messages(), ids=lambda m: m.TYPE.value)
def test_round_trip(msg: wire.Message) -> None:
    data = wire.encode(msg)
    assert data[:4] == wire.MAGIC
    back = wire.decode(data)
    assert type(back) is type(msg)
    _same_fields(msg, back)


def _same_fields(msg: object, back: object) -> None:
    for f in msg.__dataclass_fields__:  # type: ignore[attr-defined]
        a, b = getattr(msg, f), getattr(back, f)
        if isinstance(a, ClientUpdate):  # a result's update travels whole
            _same_fields(a, b)
        elif isinstance(a, np.ndarray):
            assert b.dtype.str in ("<f4", "<f8") and np.array_equal(a, b) and a.shape == b.shape
        elif isinstance(a, dict):
            assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
        else:
            assert a == b, f


def test_arrays_are_little_endian_float32_without_copy() -> None:
    w = np.arange(5, dtype=">f4")  # big-endian input is converted on the way out
    back = wire.decode(wire.encode(wire.EvalTask(**ENV, client=0, task=1, version=0, weights=w)))
    assert back.weights.dtype == np.dtype("<f4") and np.array_equal(back.weights, np.arange(5))
    assert not back.weights.flags.writeable  # a view of the received bytes


def _frame(
    header: dict, payload: bytes = b"", version: int = wire.FORMAT_VERSION, magic: bytes = wire.MAGIC
) -> bytes:
    h = json.dumps(header).encode()
    return struct.pack("<4sHI", magic, version, len(h)) + h + payload


def _state_header(**over: object) -> dict:
    h = {
        "fmt": 1,
        "type": "state",
        "run": "r1",
        "msg": "m-1",
        "sent": 1.0,
        "payload": 0,
        "arrays": [],
        "client": 3,
        "incarnation": "abcd",
        "tier": "AVL_TRAIN",
    }
    h.update(over)
    return h


def _expect(
    data: bytes, code: Refusal, fragment: str = "", max_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES
) -> None:
    with pytest.raises(MessageError) as info:
        wire.decode(data, max_bytes)
    assert info.value.code is code, str(info.value)
    assert fragment in str(info.value)


def test_valid_hand_built_frame_decodes() -> None:
    msg = wire.decode(_frame(_state_header()))
    assert isinstance(msg, wire.State) and msg.tier is Tier.AVL_TRAIN


@pytest.mark.parametrize(
    "data, code, fragment",
    [
        (b"", Refusal.TRUNCATED, "prefix"),
        (b"FLXM\x01", Refusal.TRUNCATED, "prefix"),
        (_frame(_state_header(), magic=b"PK\x03\x04"), Refusal.BAD_MAGIC, "magic"),
        (b"\x80\x04\x95" + b"\x00" * 20, Refusal.BAD_MAGIC, "magic"),  # a pickle stream is refused up front
        (_frame(_state_header(), version=2), Refusal.UNKNOWN_VERSION, "version 2"),
        (struct.pack("<4sHI", wire.MAGIC, 1, 100) + b"{}", Refusal.TRUNCATED, "header of 100 bytes"),
        (
            struct.pack("<4sHI", wire.MAGIC, 1, wire.MAX_HEADER_BYTES + 1),
            Refusal.BAD_HEADER,
            "header length",
        ),
        (struct.pack("<4sHI", wire.MAGIC, 1, 3) + b"{x}", Refusal.BAD_HEADER, "JSON"),
        (struct.pack("<4sHI", wire.MAGIC, 1, 2) + b"\xff\xfe", Refusal.BAD_HEADER, "UTF-8"),
        (_frame([1, 2]), Refusal.BAD_HEADER, "object"),  # type: ignore[arg-type]
        (_frame(_state_header(fmt=2)), Refusal.BAD_HEADER, "fmt"),
        (_frame(_state_header(type="exec")), Refusal.UNKNOWN_TYPE, "exec"),
        (
            _frame({k: v for k, v in _state_header().items() if k != "tier"}),
            Refusal.BAD_HEADER,
            "lacks ['tier']",
        ),
        (_frame(_state_header(extra=1)), Refusal.BAD_HEADER, "unknown fields ['extra']"),
        (_frame(_state_header(client="3")), Refusal.BAD_FIELD, "'client' must be"),
        (_frame(_state_header(client=True)), Refusal.BAD_FIELD, "'client' must be"),
        (_frame(_state_header(client=-1)), Refusal.BAD_FIELD, "'client' must be"),
        (_frame(_state_header(tier="SLEEPY")), Refusal.BAD_FIELD, "'tier'"),
        (_frame(_state_header(sent=None)), Refusal.BAD_FIELD, "'sent'"),
        (_frame(_state_header(msg="")), Refusal.BAD_FIELD, "'msg'"),
        (_frame(_state_header(msg="x" * 300)), Refusal.BAD_FIELD, "'msg'"),
        (_frame(_state_header(payload=8)), Refusal.TRUNCATED, "8-byte payload"),
        (_frame(_state_header(), b"junk"), Refusal.BAD_PAYLOAD, "0-byte payload"),
        (
            _frame(
                _state_header(payload=4, arrays=[{"name": "delta", "dtype": "<f4", "shape": [1]}]), b"\0" * 4
            ),
            Refusal.BAD_HEADER,
            "carries no arrays",
        ),
    ],
)
def test_malformed(data: bytes, code: Refusal, fragment: str) -> None:
    _expect(data, code, fragment)


@pytest.mark.parametrize(
    "over",
    [
        {"msg": "m-\ud800"},  # a lone high surrogate in a string field
        {"run": "\udfff"},  # a lone low surrogate
        {"incarnation": "ab\udc80cd"},
        {"extra\ud800": 1},  # in a key: refused before the unknown-field check names it
        {"arrays": [{"name": "delta\ud83d", "dtype": "<f4", "shape": [1]}]},  # nested
    ],
)
def test_lone_surrogates_are_refused_at_decode(over: dict) -> None:
    data = _frame(_state_header(**over))
    assert b"\\ud8" in data or b"\\udf" in data or b"\\udc" in data  # JSON escapes, valid UTF-8 bytes
    with pytest.raises(MessageError) as info:
        wire.decode(data)
    assert info.value.code is Refusal.BAD_HEADER
    assert "not valid Unicode" in str(info.value)
    str(info.value).encode("utf-8")  # the refusal itself is printable anywhere


def test_proper_surrogate_pairs_are_unicode() -> None:
    msg = wire.decode(_frame(_state_header(msg="m-\U0001f600", incarnation="\u00e9t\u00e9")))
    assert isinstance(msg, wire.State) and msg.msg_id == "m-\U0001f600"


def _result_header(**over: object) -> dict:
    h = {
        "fmt": 1,
        "type": "result",
        "run": "r1",
        "msg": "m-2",
        "sent": 1.0,
        "payload": 8,
        "arrays": [{"name": "delta", "dtype": "<f4", "shape": [2]}],
        "client": 3,
        "incarnation": "abcd",
        "task": 4,
        "kind": "train",
        "version": 0,
        "num_samples": 5,
        "stat_utility": 1.0,
        "loss": 1.0,
        "duration": 1.0,
    }
    h.update(over)
    return h


@pytest.mark.parametrize(
    "over, payload, code, fragment",
    [
        ({"arrays": [{"name": "delta", "dtype": "|O", "shape": [2]}]}, 8, Refusal.BAD_FIELD, "dtype"),
        ({"arrays": [{"name": "delta", "dtype": "<f4", "shape": [-2]}]}, 8, Refusal.BAD_FIELD, "shape"),
        (
            {"arrays": [{"name": "delta", "dtype": "<f4", "shape": [3]}]},
            8,
            Refusal.BAD_PAYLOAD,
            "past the end",
        ),
        (
            {"arrays": [{"name": "delta", "dtype": "<f4", "shape": [1]}]},
            8,
            Refusal.BAD_PAYLOAD,
            "not covered",
        ),
        ({"arrays": [{"name": "delta", "dtype": "<f4"}]}, 8, Refusal.BAD_HEADER, "name, dtype and shape"),
        ({"arrays": [{"name": "delta", "dtype": "<f4", "shape": [1]}] * 2}, 8, Refusal.BAD_HEADER, "twice"),
        (
            {"arrays": [{"name": "weights", "dtype": "<f4", "shape": [2]}]},
            8,
            Refusal.BAD_HEADER,
            "unexpected array",
        ),
        ({"arrays": [], "payload": 0}, 0, Refusal.BAD_HEADER, "must carry a 'delta'"),
        ({"sealed": True}, 8, Refusal.BAD_HEADER, "a sealed train result carries no 'delta'"),
        ({"sealed": True, "kind": "eval", "arrays": [], "payload": 0}, 0, Refusal.BAD_HEADER, "never sealed"),
        ({"sealed": False, "arrays": [], "payload": 0}, 0, Refusal.BAD_FIELD, "'sealed'"),
        ({"kind": "eval"}, 8, Refusal.BAD_HEADER, "eval result carries no arrays"),
        ({"kind": "sleep"}, 8, Refusal.BAD_FIELD, "'kind'"),
        ({"loss": "0.1"}, 8, Refusal.BAD_FIELD, "'loss'"),
    ],
)
def test_malformed_arrays(over: dict, payload: int, code: Refusal, fragment: str) -> None:
    _expect(_frame(_result_header(**over), b"\0" * payload), code, fragment)


def test_a_sealed_train_result_carries_no_delta_and_round_trips() -> None:
    """Secure aggregation: the update travels masked in its group; the result is its metadata."""
    msg = wire.decode(_frame(_result_header(sealed=True, arrays=[], payload=0)))
    assert isinstance(msg, wire.Result) and msg.sealed and msg.update.delta is None
    assert wire.decode(wire.encode(msg)) == msg
    plain = wire.decode(_frame(_result_header(), b"\0" * 8))
    assert isinstance(plain, wire.Result) and not plain.sealed and b"sealed" not in wire.encode(plain)


def test_non_finite_arrays_decode_for_the_orchestrator_to_reject() -> None:
    """A non-finite delta is well-formed on the wire; the orchestrator's validation rejects it with
    its reason. A header number outside its declared range (NaN included) is refused at decode."""
    msg = wire.decode(_frame(_result_header(), np.array([np.inf, 1], "<f4").tobytes()))
    assert isinstance(msg, wire.Result) and np.isinf(msg.update.delta).any()  # type: ignore[arg-type]
    _expect(_frame(_result_header(loss=float("nan")), b"\0" * 8), Refusal.BAD_FIELD, "'loss'")


def test_oversized_is_refused_before_parsing() -> None:
    data = wire.encode(wire.EvalTask(**ENV, client=0, task=1, version=0, weights=np.zeros(1000, np.float32)))
    _expect(data, Refusal.OVERSIZED, f"{len(data)} bytes", max_bytes=len(data) - 1)
    wire.decode(data, max_bytes=len(data))


def test_truncated_anywhere_is_an_error() -> None:
    data = wire.encode(_messages()[3])
    for cut in range(0, len(data) - 1, 7):
        with pytest.raises(MessageError):
            wire.decode(data[:cut])


def test_a_deeply_nested_header_is_an_error_not_a_recursion_error() -> None:
    """JSON nesting thousands deep fits in the header's 64 KiB and blows Python's parser stack."""
    for depth in (30000, 2000):
        inner = "[" * depth + "]" * depth
        hdr = (
            inner.encode()
            if depth > 10000
            else json.dumps({"fmt": wire.FORMAT_VERSION}).replace("}", f', "x": {inner}}}').encode()
        )
        data = wire._PREFIX.pack(wire.MAGIC, wire.FORMAT_VERSION, len(hdr)) + hdr
        with pytest.raises(MessageError) as err:
            wire.decode(data)
        assert err.value.code is Refusal.BAD_HEADER


def test_msg_ids_are_unique_per_sender() -> None:
    ids = wire.MsgIds("inc")
    assert [ids.next() for _ in range(3)] == ["inc-1", "inc-2", "inc-3"]


def test_topics() -> None:
    t = Topics("run-1")
    assert t.task(7) == "felix/run-1/client/7/task"
    assert t.parse_inbound_to_server("felix/run-1/server/result/7") == Address(Channel.RESULT, 7)
    assert t.parse_inbound_to_server("felix/run-1/server/result/x") is None
    assert t.parse_inbound_to_server("felix/other/server/result/7") is None
    with pytest.raises(ValueError, match="run id"):
        check_run_id("a/#")
    assert sanitize_run_id("digits churn/90") == "digits-churn-90"
