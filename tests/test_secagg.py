"""Secure aggregation's protocol objects (felix.secagg): the unmasked sum equals the plaintext
quantised sum bit for bit under random dropouts at every stage, the server never asks for both
secrets of one member, and hostile messages are refused with a typed reason while the group goes
on (or is abandoned, never a wrong sum)."""

from __future__ import annotations

import struct
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from felix.secagg import crypto
from felix.secagg.client import SecAggClient
from felix.secagg.graph import GroupLayout, group_threshold, split_groups
from felix.secagg.messages import (
    Keys,
    Masked,
    Shares,
    Unmask,
    UnmaskRequest,
    decode,
    encode,
)
from felix.secagg.quantize import Quantizer
from felix.secagg.refusals import Reason, SecAggRefusal
from felix.secagg.server import SecAggServer
from felix.secagg.session import STAGES, run_group

Q32 = Quantizer(8.0, 22, 32)


def _updates(members: tuple[int, ...], length: int, seed: int = 0) -> dict[int, tuple[float, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return {m: (float(rng.random()), rng.normal(0, 3, length).astype(np.float32)) for m in members}


def _plain(
    q: Quantizer, updates: dict[int, tuple[float, np.ndarray]], members: tuple[int, ...]
) -> np.ndarray:
    """The plaintext quantised sum, in Python integers (no wrap-around), reduced at the end."""
    total = [0] * (next(iter(updates.values()))[1].size + 1)
    for m in members:
        for i, w in enumerate(q.encode(*updates[m]).tolist()):
            total[i] += w
    return np.array([t % (1 << q.modulus_bits) for t in total], dtype=np.uint64)


def _layout(n: int, k: int | None = None, t: int | None = None, gid: int = 5) -> GroupLayout:
    k = n if k is None else k
    return GroupLayout(gid, tuple(range(10, 10 + n)), k, k // 2 + 1 if t is None else t)


# ---------------------------------------------------------------------- exactness
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(3, 12),
    length=st.integers(1, 40),
    half=st.integers(1, 5),
    bits=st.sampled_from([(22, 32), (10, 16), (30, 40), (40, 64)]),
    stages=st.data(),
)
def test_unmasked_sum_equals_the_plaintext_quantised_sum_under_any_dropouts(
    n: int, length: int, half: int, bits: tuple[int, int], stages: Any
) -> None:
    lay = _layout(n, k=min(2 * half + 1, n))
    q = Quantizer(4.0, bits[0], bits[1])
    drop_at = {
        m: s
        for m in lay.members
        if (s := stages.draw(st.sampled_from([None, None, *STAGES]), label=f"drop {m}")) is not None
    }
    updates = _updates(lay.members, length, seed=n * 1000 + length)
    server, _ = run_group(lay, q, updates, drop_at)
    reported = tuple(m for m in lay.members if drop_at.get(m) in (None, "unmask"))
    if server.result is None:
        assert server.abandoned and server.abandon_reason
        assert drop_at, "a group without dropouts is never abandoned"
        return
    r = server.result
    assert set(r.members) <= set(reported)
    assert np.array_equal(r.total.astype(np.uint64), _plain(q, updates, r.members))
    shared_then_dropped = {m for m in server.shares if drop_at.get(m) == "masked"}
    paired = {m for m in shared_then_dropped if set(lay.neighbours(m)) & set(r.members)}
    assert r.dropouts_recovered == len(paired)  # their masks were in the sum and were removed


def test_a_dropout_at_each_stage_is_recovered_and_the_sum_dequantises() -> None:
    lay = _layout(12, k=7)
    updates = _updates(lay.members, 300)
    drop_at = {10: "keys", 13: "shares", 16: "masked", 19: "unmask"}  # spread round the ring
    server, traffic = run_group(lay, Q32, updates, drop_at)
    r = server.result
    assert r is not None and not server.refusals
    assert r.members == tuple(m for m in lay.members if m not in (10, 13, 16))
    assert r.dropouts_recovered == 1  # member 16: shared its secrets, then sent no masked vector
    assert np.array_equal(r.total.astype(np.uint64), _plain(Q32, updates, r.members))
    step = 2 * Q32.clipping_range / Q32.levels
    assert r.weight_sum == pytest.approx(
        sum(updates[m][0] for m in r.members), abs=len(r.members) / Q32.levels
    )
    want = sum(updates[m][0] * np.clip(updates[m][1], -8, 8).astype(np.float64) for m in r.members)
    assert np.abs(r.weighted_sum - want).max() <= len(r.members) * step
    assert traffic.round_trips == 4 and traffic.up[16] > 0 and traffic.up[10] == 0


def test_too_many_dropouts_abandon_the_group_without_a_sum() -> None:
    lay = _layout(8, k=5, t=3)
    drop_at = {m: "unmask" for m in lay.members[:6]}  # 2 answers left for a threshold of 3
    server, _ = run_group(lay, Q32, _updates(lay.members, 10), drop_at)
    assert server.abandoned and server.result is None
    assert "could not be rebuilt" in (server.abandon_reason or "")


def test_groups_and_thresholds_of_a_cohort() -> None:
    assert [len(g) for g in split_groups(list(range(250)), 100)] == [84, 83, 83]
    assert split_groups([1], 100) == [] and [len(g) for g in split_groups([1, 2, 3], 2)] == [3]
    assert group_threshold(100, 21, 11) == (21, 11)
    k, t = group_threshold(9, 21, 15)
    assert k == 9 and 2 * t > k and t <= k
    lay = _layout(30, k=9)
    for m in lay.members:
        assert len(lay.neighbours(m)) == 8
        assert all(m in lay.neighbours(v) for v in lay.neighbours(m))


# ---------------------------------------------------------------------- the invariant
@settings(max_examples=40, deadline=None)
@given(n=st.integers(3, 14), half=st.integers(1, 4), seed=st.integers(0, 2**16), p=st.floats(0, 0.5))
def test_the_server_never_asks_for_both_secrets_of_one_member(n: int, half: int, seed: int, p: float) -> None:
    lay = _layout(n, k=min(2 * half + 1, n))
    rng = np.random.default_rng(seed)
    drop_at = {m: str(rng.choice(STAGES)) for m in lay.members if rng.random() < p}
    server, _ = run_group(lay, Q32, _updates(lay.members, 4, seed), drop_at)
    seeds_asked = {m for r in server.requests.values() for m in r.seed_of}
    keys_asked = {m for r in server.requests.values() for m in r.key_of}
    assert not seeds_asked & keys_asked  # across all holders, not only within one request
    for holder, req in server.requests.items():
        assert holder not in req.key_of
        assert set(req.seed_of) | set(req.key_of) <= set(lay.holders(holder)) | {
            m for m in lay.members if holder in lay.holders(m)
        }
    if "masked" in drop_at.values() and server.requests:
        assert keys_asked or server.abandoned or not (set(server.shares) - server.masked)


# ---------------------------------------------------------------------- hostile messages
def _tampered(stage_kind: type, victim: int, edit: Any) -> Any:
    def tamper(sender: int, raw: bytes) -> bytes:
        msg = decode(raw)
        if sender == victim and isinstance(msg, stage_kind):
            out = edit(msg)
            return out if isinstance(out, bytes) else encode(out)
        return raw

    return tamper


def _run_hostile(
    tamper: Any, n: int = 9, k: int = 5, q: Quantizer = Q32
) -> tuple[SecAggServer, dict[int, Any]]:
    lay = _layout(n, k=k)
    updates = _updates(lay.members, 50)
    server, _ = run_group(lay, q, updates, tamper=tamper)
    return server, updates


def _reasons(server: SecAggServer) -> set[tuple[int, Reason]]:
    return {(m, r.reason) for m, r in server.refusals}


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        (lambda m: replace(m, mask_pk=bytes(32)), Reason.MALFORMED_KEY),  # small order (zero point)
        (lambda m: replace(m, cipher_pk=m.mask_pk), Reason.DUPLICATE_KEY),
        (lambda m: encode(m)[:-5], Reason.MALFORMED),  # a truncated commitment
    ],
)
def test_a_bad_key_is_refused_and_the_group_goes_on_without_its_sender(edit: Any, reason: Reason) -> None:
    server, updates = _run_hostile(_tampered(Keys, 13, edit))
    assert (13, reason) in _reasons(server)
    r = server.result
    assert r is not None and 13 not in r.members and len(r.members) == 8
    assert np.array_equal(r.total.astype(np.uint64), _plain(Q32, updates, r.members))


def test_a_key_copied_from_another_member_is_refused() -> None:
    lay = _layout(4)
    server = SecAggServer(lay, Q32, 3)
    clients = {m: SecAggClient(m) for m in lay.members}
    keys = {m: clients[m].on_setup(s) for m, s in server.setup().items()}
    server.receive(keys[10])
    with pytest.raises(SecAggRefusal) as err:
        server.receive(replace(keys[10], sender=11))
    assert err.value.reason is Reason.DUPLICATE_KEY
    with pytest.raises(SecAggRefusal) as err:
        server.receive(keys[10])  # a replay of an accepted message
    assert err.value.reason is Reason.REPLAY
    with pytest.raises(SecAggRefusal) as err:
        server.receive(replace(keys[12], group_id=99))
    assert err.value.reason is Reason.WRONG_GROUP
    with pytest.raises(SecAggRefusal) as err:
        server.receive(replace(keys[12], sender=77))
    assert err.value.reason is Reason.NOT_MEMBER


def _flip_one_ciphertext(msg: Shares) -> Shares:
    first = min(msg.ciphertexts)
    blob = bytearray(msg.ciphertexts[first])
    blob[20] ^= 1
    return replace(msg, ciphertexts={**msg.ciphertexts, first: bytes(blob)})


def test_a_share_that_does_not_decrypt_is_refused_by_its_recipient_and_the_sum_stays_exact() -> None:
    lay = _layout(9, k=5)
    updates = _updates(lay.members, 50)
    server, _ = run_group(lay, Q32, updates, tamper=_tampered(Shares, 14, _flip_one_ciphertext))
    r = server.result
    assert r is not None and len(r.members) == 9  # the recipient still pairs; others rebuild 14's seed
    assert np.array_equal(r.total.astype(np.uint64), _plain(Q32, updates, r.members))


def test_shares_missing_a_neighbour_are_refused_and_their_sender_is_recovered_as_a_dropout() -> None:
    def drop_one(msg: Shares) -> Shares:
        return replace(
            msg, ciphertexts={k: v for k, v in msg.ciphertexts.items() if k != min(msg.ciphertexts)}
        )

    server, updates = _run_hostile(_tampered(Shares, 14, drop_one))
    assert (14, Reason.MISSING_SHARE) in _reasons(server)
    r = server.result
    assert r is not None and 14 not in r.members
    assert np.array_equal(r.total.astype(np.uint64), _plain(Q32, updates, r.members))


@pytest.mark.parametrize(
    ("q", "edit", "reason"),
    [
        (Q32, lambda m: replace(m, words=m.words[:-1]), Reason.WRONG_LENGTH),
        (Q32, lambda m: replace(m, words=np.concatenate([m.words, m.words[:1]])), Reason.WRONG_LENGTH),
        (
            Quantizer(4.0, 10, 16),
            lambda m: replace(m, words=m.words | np.uint32(1 << 20)),
            Reason.OUT_OF_RANGE,
        ),
        (Q32, lambda m: replace(m, words=m.words.astype(np.uint64), modulus_bits=40), Reason.OUT_OF_RANGE),
    ],
)
def test_a_bad_masked_vector_is_refused_and_its_sender_is_unmasked_as_a_dropout(
    q: Quantizer, edit: Any, reason: Reason
) -> None:
    server, updates = _run_hostile(_tampered(Masked, 12, edit), q=q)
    assert (12, reason) in _reasons(server)
    r = server.result
    assert r is not None and 12 not in r.members and r.dropouts_recovered == 1
    assert np.array_equal(r.total.astype(np.uint64), _plain(q, updates, r.members))


def test_an_unmask_answer_for_a_peer_not_asked_for_is_refused() -> None:
    def add_stranger(msg: Unmask) -> Unmask:
        return replace(msg, key_shares={**msg.key_shares, 17: 12345})

    server, updates = _run_hostile(_tampered(Unmask, 11, add_stranger))
    assert (11, Reason.UNREQUESTED) in _reasons(server)
    r = server.result
    assert r is not None and np.array_equal(r.total.astype(np.uint64), _plain(Q32, updates, r.members))


def test_a_wrong_seed_share_is_outvoted_and_its_sender_named() -> None:
    def corrupt(msg: Unmask) -> Unmask:
        return replace(msg, seed_shares={k: (v + 1) for k, v in msg.seed_shares.items()})

    server, updates = _run_hostile(_tampered(Unmask, 10, corrupt), n=9, k=9)  # 9 holders, threshold 5
    assert (10, Reason.BAD_SHARE) in _reasons(server)
    r = server.result
    assert r is not None and len(r.members) == 9
    assert np.array_equal(r.total.astype(np.uint64), _plain(Q32, updates, r.members))


def test_a_client_refuses_a_request_for_both_secrets_a_second_request_and_its_own_key() -> None:
    lay = _layout(3)
    server = SecAggServer(lay, Q32, 2)
    clients = {m: SecAggClient(m) for m in lay.members}
    for m, s in server.setup().items():
        server.receive(clients[m].on_setup(s))
    for m, b in server.advance().items():
        server.receive(clients[m].on_keys(b))  # type: ignore[arg-type]
    for m, f in server.advance().items():
        clients[m].on_shares(f)  # type: ignore[arg-type]
    c = clients[10]
    c.masked(0.5, np.zeros(2, dtype=np.float32))
    for req, reason in (
        (UnmaskRequest(5, (11,), (11,)), Reason.BOTH_SECRETS),
        (UnmaskRequest(5, (11,), (10,)), Reason.BOTH_SECRETS),
        (UnmaskRequest(5, (99,), ()), Reason.NOT_MEMBER),
        (UnmaskRequest(6, (11,), ()), Reason.WRONG_GROUP),
    ):
        with pytest.raises(SecAggRefusal) as err:
            c.on_unmask(req)
        assert err.value.reason is reason
    c.on_unmask(UnmaskRequest(5, (10, 11), (12,)))
    with pytest.raises(SecAggRefusal) as err:
        c.on_unmask(UnmaskRequest(5, (10,), ()))
    assert err.value.reason is Reason.REPLAY


def test_a_client_refuses_relayed_keys_that_are_malformed_or_reused() -> None:
    lay = _layout(3)
    server = SecAggServer(lay, Q32, 2)
    clients = {m: SecAggClient(m) for m in lay.members}
    for m, s in server.setup().items():
        server.receive(clients[m].on_setup(s))
    out = server.advance()
    bcast = out[10]
    assert bcast.keys  # type: ignore[union-attr]
    evil = {11: (bytes(32), bcast.keys[11][1])}  # type: ignore[union-attr]
    with pytest.raises(SecAggRefusal) as err:
        clients[10].on_keys(replace(bcast, keys=evil))  # type: ignore[arg-type]
    assert err.value.reason is Reason.MALFORMED_KEY
    fresh = SecAggClient(10)
    fresh.on_setup(server.setup()[10])
    reused = {11: bcast.keys[11], 12: bcast.keys[11]}  # type: ignore[union-attr]
    with pytest.raises(SecAggRefusal) as err:
        fresh.on_keys(replace(bcast, keys=reused))  # type: ignore[arg-type]
    assert err.value.reason is Reason.DUPLICATE_KEY
    with pytest.raises(SecAggRefusal) as err:
        SecAggClient(10).on_keys(bcast)  # type: ignore[arg-type]
    assert err.value.reason is Reason.WRONG_STAGE


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"XX" + bytes(20),
        encode(UnmaskRequest(1, (2,), (3,)))[:-1],
        encode(UnmaskRequest(1, (2,), ()))[:2] + bytes([9]) + bytes(12),
    ],
)
def test_garbage_does_not_decode(raw: bytes) -> None:
    with pytest.raises(SecAggRefusal) as err:
        decode(raw)
    assert err.value.reason is Reason.MALFORMED


def test_every_message_survives_its_wire_encoding() -> None:
    lay = _layout(5, k=3)
    server = SecAggServer(lay, Q32, 6)
    clients = {m: SecAggClient(m) for m in lay.members}
    seen: list[Any] = []

    def through(msg: Any) -> Any:
        back = decode(encode(msg))
        if isinstance(msg, Masked):
            assert np.array_equal(back.words, msg.words) and back.modulus_bits == msg.modulus_bits
        else:
            assert back == msg
        seen.append(type(msg))
        return back

    for m, s in server.setup().items():
        server.receive(through(clients[m].on_setup(through(s))))
    for m, b in server.advance().items():
        server.receive(through(clients[m].on_keys(through(b))))
    for m, f in server.advance().items():
        clients[m].on_shares(through(f))
        server.receive(through(clients[m].masked(0.25, np.linspace(-1, 1, 6))))
    for m, req in server.advance().items():
        server.receive(through(clients[m].on_unmask(through(req))))
    server.advance()
    assert server.result is not None and len(set(seen)) == 8
    assert struct.calcsize("<2sBBQI") == 16


def test_the_prg_is_aes_ctr_and_differs_per_seed() -> None:
    a = crypto.prg_words(b"a" * 32, 1000, np.uint32)
    assert np.array_equal(a, crypto.prg_words(b"a" * 32, 1000, np.uint32))
    assert not np.array_equal(a, crypto.prg_words(b"b" * 32, 1000, np.uint32))
    assert np.array_equal(a[:10], crypto.prg_words(b"a" * 32, 10, np.uint32))


def test_a_replayed_share_message_is_refused_in_its_stage_and_after() -> None:
    lay = _layout(4)
    server = SecAggServer(lay, Q32, 3)
    clients = {m: SecAggClient(m) for m in lay.members}
    for m, s in server.setup().items():
        server.receive(clients[m].on_setup(s))
    shares = {m: clients[m].on_keys(b) for m, b in server.advance().items()}  # type: ignore[arg-type]
    server.receive(shares[10])
    for later in (False, True):
        with pytest.raises(SecAggRefusal) as err:
            server.receive(shares[10])
        assert err.value.reason is Reason.REPLAY
        if not later:
            for m in (11, 12, 13):
                server.receive(shares[m])
            server.advance()  # into the masked stage: the replay is still a replay
    assert [r.reason for _, r in server.refusals] == [Reason.REPLAY, Reason.REPLAY]


def test_a_share_ciphertext_of_the_wrong_size_is_refused_by_the_server() -> None:
    def truncate(msg: Shares) -> Shares:
        first = min(msg.ciphertexts)
        return replace(msg, ciphertexts={**msg.ciphertexts, first: msg.ciphertexts[first][:-1]})

    server, updates = _run_hostile(_tampered(Shares, 15, truncate))
    assert (15, Reason.MALFORMED) in _reasons(server)
    r = server.result
    assert r is not None and 15 not in r.members
    assert np.array_equal(r.total.astype(np.uint64), _plain(Q32, updates, r.members))
