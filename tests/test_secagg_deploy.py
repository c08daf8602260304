"""Secure aggregation in the deployment, without a broker: the secagg envelope, the server
protocol's checks of sealed results and secagg messages, and the group driver
(felix.deploy.secagg_groups) with in-process members on a fake clock: dropouts at every stage
tolerated up to the threshold and abandoned below it, hostile messages refused with their typed
reason, and the same group giving the same unmasked sum as the simulator's in-process session."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from test_deploy_protocol import RUN, N, _result

from felix.core.refusals import Refusal
from felix.deploy import secagg_wire
from felix.deploy.channels import Address, Channel
from felix.deploy.protocol import ProtocolLimits, Refused, SecAggIn, ServerProtocol
from felix.deploy.secagg_groups import NetworkGroups
from felix.deploy.secagg_wire import SecAggEnvelope
from felix.secagg import messages as sa
from felix.secagg.client import SecAggClient
from felix.secagg.graph import GroupLayout
from felix.secagg.quantize import Quantizer
from felix.secagg.refusals import Reason, SecAggRefusal
from felix.secagg.session import STAGES, run_group

Q = Quantizer(8.0, 22, 32)
LENGTH = 40
BIG = (5 << 32) + 3  # a task id of a resumed server's later life: beyond the protocol's 32-bit ids


# ---------------------------------------------------------------------- the envelope
def _keys(member: int = 7, gid: int = 3) -> sa.Keys:
    return sa.Keys(gid, member, b"\x09" * 32, b"\x0a" * 32, b"\x0b" * 32)


def test_envelope_round_trips_and_refuses_what_is_not_exactly_one() -> None:
    env = SecAggEnvelope(RUN, 2, 7, BIG, 0.0, _keys())
    raw = secagg_wire.encode(env)
    assert secagg_wire.is_secagg(raw) and secagg_wire.decode(raw, from_server=False) == env
    setup = SecAggEnvelope(RUN, 2, 7, BIG, 0.25, sa.Setup(3, (7, 8), 2, 2, 5, 8.0, 22, 32))
    assert secagg_wire.decode(secagg_wire.encode(setup), from_server=True) == setup
    bad: list[tuple[bytes, bool, Reason]] = [
        (raw[:9], False, Reason.MALFORMED),  # cut in the run id
        (raw[:-1], False, Reason.MALFORMED),  # cut in the message
        (raw + b"\0", False, Reason.MALFORMED),  # trailing byte
        (b"FLXM" + raw[4:], False, Reason.MALFORMED),  # a wire-format magic
        (
            secagg_wire.encode(SecAggEnvelope(RUN, 2, 7, BIG, 0.5, _keys())),
            False,
            Reason.MALFORMED,
        ),  # a client's weight
        (secagg_wire.encode(SecAggEnvelope(RUN, 2, 7, BIG, float("nan"), setup.msg)), True, Reason.MALFORMED),
        (secagg_wire.encode(SecAggEnvelope(RUN, 2, 8, BIG, 0.0, _keys(member=7))), False, Reason.NOT_MEMBER),
        (raw, True, Reason.WRONG_STAGE),  # a client's message posing as the server's
        (
            secagg_wire.encode(replace(setup, weight=0.0)),
            False,
            Reason.WRONG_STAGE,
        ),  # the server's as a client's
    ]
    for payload, from_server, reason in bad:
        with pytest.raises(SecAggRefusal) as exc:
            secagg_wire.decode(payload, from_server)
        assert exc.value.reason is reason, (payload[:24], exc.value)


# ---------------------------------------------------------------------- the server protocol
class _Orch:
    def __init__(self) -> None:
        self.plans: dict[int, tuple[int, ...]] = {}

    def is_registered(self, cid: int) -> bool:
        return True

    def held_task(self, cid: int) -> int | None:
        return None

    def late_task(self, cid: int) -> int | None:
        return None


def _protocol(sealed: bool) -> ServerProtocol:
    limits = ProtocolLimits(4, 3, [30] * 4, 1 << 16, {}, sealed_length=N if sealed else None)
    return ServerProtocol(RUN, "sess", limits, _Orch())


def test_sealed_results_stand_for_a_zero_delta_and_a_result_in_the_clear_is_refused() -> None:
    on, off = _protocol(True), _protocol(False)
    res = Address(Channel.RESULT, 1)
    got = on.receive(res, _result(delta=None, sealed=True), 1.0)
    assert not isinstance(got, Refused), got
    ((event, _),) = got.events  # type: ignore[union-attr]
    delta = event.update.delta  # type: ignore[attr-defined]
    assert delta.shape == (N,) and not delta.any() and not delta.flags.writeable
    clear = on.receive(res, _result(msg_id="inc-3"), 1.0)
    assert isinstance(clear, Refused) and clear.kind is Refusal.SECAGG
    assert clear.reason == "secagg: a training result that carries its update in the clear"
    sealed_off = off.receive(res, _result(delta=None, sealed=True), 1.0)
    assert (
        isinstance(sealed_off, Refused)
        and sealed_off.reason == "secagg: secure aggregation is off in this run"
    )
    assert on.stats.refused_by_kind == {"secagg": 1} and on.stats.rejected_by_reason == {clear.reason: 1}


@pytest.mark.parametrize(
    ("env", "topic_client", "kind", "reason"),
    [
        (
            SecAggEnvelope("other", 1, 7, BIG, 0.0, _keys()),
            1,
            Refusal.OTHER_RUN,
            "transport: message for run 'other'",
        ),
        (
            SecAggEnvelope(RUN, 2, 7, BIG, 0.0, _keys()),
            1,
            Refusal.SENDER_MISMATCH,
            "transport: sender mismatch",
        ),
        (
            SecAggEnvelope(RUN, 9, 7, BIG, 0.0, _keys()),
            9,
            Refusal.OUTSIDE_POPULATION,
            "transport: client id 9",
        ),
        (None, 1, Refusal.SECAGG, "secagg: malformed"),
    ],
)
def test_secagg_envelopes_are_checked_before_any_group_sees_them(
    env: SecAggEnvelope | None, topic_client: int, kind: Refusal, reason: str
) -> None:
    p = _protocol(True)
    payload = b"FLXS\x01\x02r1" + b"\0" * 5 if env is None else secagg_wire.encode(env)
    got = p.receive(Address(Channel.SECAGG, topic_client), payload, 1.0)
    assert isinstance(got, Refused) and got.kind is kind and got.reason.startswith(reason), got
    ok = p.receive(
        Address(Channel.SECAGG, 1), secagg_wire.encode(SecAggEnvelope(RUN, 1, 7, BIG, 0.0, _keys())), 1.0
    )
    assert isinstance(ok, SecAggIn) and ok.client == 1 and ok.env.member == 7 and ok.env.task == BIG
    off = _protocol(False).receive(Address(Channel.SECAGG, 1), payload, 1.0)
    assert isinstance(off, Refused) and off.reason == "secagg: secure aggregation is off in this run"


# ---------------------------------------------------------------------- the group driver
Tamper = Callable[[int, sa.Message], sa.Message | None]


class Harness:
    """A group driver whose members answer in process: ``send`` queues the server's envelopes,
    ``pump`` (the server loop's turn) advances a fake clock and lets the members answer, each
    answer going back through the driver's checks. ``drop_at[m]``: the stage from which member m
    is silent (as ``felix.secagg.session``)."""

    def __init__(
        self,
        members: dict[int, int],
        updates: dict[int, tuple[float, np.ndarray]],
        stage_s: float = 30.0,
        grace_s: float = 0.5,
    ) -> None:
        self.client_of = members
        self.updates = updates
        self.now = 0.0
        self.outbox: list[tuple[int, bytes]] = []
        self.sent: list[bytes] = []  # every payload the server received
        self.drop_at: dict[int, str] = {}
        self.tamper: Tamper | None = None
        self.extra: list[tuple[int, bytes]] = []  # payloads injected at the next pump
        self.agents: dict[int, SecAggClient] = {}  # task -> its member's state machine
        self.groups = NetworkGroups(RUN, self._send, self._pump, stage_s, grace_s, clock=lambda: self.now)

    def run(self, layout: GroupLayout) -> Any:
        weights = {m: self.updates[m][0] for m in layout.members}
        return self.groups.run_group(layout, Q, weights, LENGTH, self.client_of)

    def _send(self, cid: int, payload: bytes) -> None:
        self.outbox.append((cid, payload))

    def deliver(self, cid: int, raw: bytes) -> None:
        self.sent.append(raw)
        try:
            env = secagg_wire.decode(raw, from_server=False)
            self.groups.receive(cid, env, hashlib.blake2b(raw, digest_size=16).digest(), len(raw))
        except SecAggRefusal:
            pass

    def _pump(self, seconds: float) -> None:
        self.now += seconds
        out, self.outbox = self.outbox, []
        for cid, payload in out:
            env = secagg_wire.decode(payload, from_server=True)
            assert env.client == cid == self.client_of[env.task]
            stage = {sa.Setup: "keys", sa.KeysBroadcast: "shares", sa.SharesForward: "masked"}.get(
                type(env.msg), "unmask"
            )
            task = env.task
            if task in self.drop_at and STAGES.index(self.drop_at[task]) <= STAGES.index(stage):
                continue
            if isinstance(env.msg, sa.Setup):
                self.agents[task] = SecAggClient(env.member)
            reply = self._answer(self.agents[task], env)
            if self.tamper is not None:
                reply = self.tamper(task, reply)
            if reply is not None:
                self.deliver(cid, secagg_wire.encode(SecAggEnvelope(RUN, cid, env.member, task, 0.0, reply)))
        extra, self.extra = self.extra, []
        for cid, raw in extra:
            self.deliver(cid, raw)

    def _answer(self, agent: SecAggClient, env: SecAggEnvelope) -> sa.Message:
        msg = env.msg
        if isinstance(msg, sa.Setup):
            return agent.on_setup(msg)
        if isinstance(msg, sa.KeysBroadcast):
            return agent.on_keys(msg)
        if isinstance(msg, sa.SharesForward):
            agent.on_shares(msg)
            return agent.masked(env.weight, self.updates[env.task][1])
        assert isinstance(msg, sa.UnmaskRequest)
        return agent.on_unmask(msg)


def _group(
    n: int = 6, seed: int = 0, base: int = 100
) -> tuple[GroupLayout, dict[int, int], dict[int, tuple[float, np.ndarray]]]:
    rng = np.random.default_rng(seed)
    members = tuple(range(base, base + n))  # task ids
    client_of = {m: i % 4 for i, m in enumerate(members)}  # two tasks of one client in a group too
    updates = {
        m: (float(rng.uniform(0.2, 1.0)), rng.normal(0, 2, LENGTH).astype(np.float32)) for m in members
    }
    return GroupLayout(11, members, n, n // 2 + 1), client_of, updates


def _plain(updates: dict[int, tuple[float, np.ndarray]], members: tuple[int, ...]) -> np.ndarray:
    total = np.zeros(LENGTH + 1, np.uint32)
    for m in members:
        total += Q.encode(*updates[m])
    return total


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("dropped", [1, 2, 3])
def test_dropouts_at_each_stage_tolerated_to_the_threshold_and_the_same_sum_as_the_simulator(
    stage: str, dropped: int
) -> None:
    layout, client_of, updates = _group()  # 6 members, threshold 4
    h = Harness(client_of, updates)
    h.drop_at = {m: stage for m in layout.members[:dropped]}
    server, traffic = h.run(layout)
    sim, _ = run_group(layout, Q, updates, h.drop_at)  # the simulator's shell, same group and dropouts
    in_sum = [m for m in layout.members if m not in h.drop_at or stage == "unmask"]
    if 6 - dropped < layout.threshold:
        assert server.abandoned and sim.abandoned and server.result is None
        # a stage whose answers never suffice waits out its deadline (30 s), then the group ends
        assert 30.0 <= h.now <= 30.0 + 4 * 0.05 + 1e-9
        return
    assert server.result is not None and sim.result is not None
    assert server.result.members == tuple(sorted(in_sum)) == sim.result.members
    np.testing.assert_array_equal(server.result.total, _plain(updates, server.result.members))
    np.testing.assert_array_equal(server.result.total, sim.result.total)
    assert server.result.dropouts_recovered == (dropped if stage == "masked" else 0)
    assert traffic.round_trips == 4 and all(traffic.up[m] > 0 for m in in_sum)
    # the stage that misses members ends a grace (0.5 s) after its answers sufficed, not at its
    # deadline (30 s): a silent member cannot stall the server; each stage's answers take one pump
    assert 0.5 <= h.now <= 0.5 + 4 * 0.05 + 1e-9
    # what the server received holds no member's update: no masked vector decodes near one
    for raw in h.sent:
        env = secagg_wire.decode(raw, from_server=False)
        msg = env.msg
        if isinstance(msg, sa.Masked):
            mine = Q.encode(*updates[env.task]).astype(np.int64)
            assert np.abs(msg.words.astype(np.int64) - mine).max() > 1 << 20


def test_hostile_members_are_refused_with_their_reason_and_the_group_goes_on() -> None:
    layout, client_of, updates = _group(seed=1, base=BIG)  # task ids past 32 bits: members 0-5 on the wire
    h = Harness(client_of, updates)
    m0, m1, m2 = layout.members[:3]
    kept: dict[str, bytes] = {}

    def env(m: int, reply: sa.Message, client: int | None = None) -> bytes:
        c = client_of[m] if client is None else client
        return secagg_wire.encode(SecAggEnvelope(RUN, c, reply.sender, m, 0.0, reply))

    def tamper(m: int, reply: sa.Message) -> sa.Message | None:
        raw = env(m, reply)
        if isinstance(reply, sa.Shares) and m == m0:
            kept["shares"] = raw
            h.extra.append((client_of[m], raw))  # a verbatim redelivery: a duplicate
            forged = sa.Shares(
                reply.group_id, reply.sender, {k: v[::-1] for k, v in reply.ciphertexts.items()}
            )
            h.extra.append((client_of[m], env(m, forged)))  # other shares: a replay
            other = 3 if client_of[m] != 3 else 2  # speaking for a task of another client
            h.extra.append((other, env(m, reply, other)))
        if isinstance(reply, sa.Masked) and m == m1:
            return sa.Masked(reply.group_id, reply.sender, reply.words[:-1])  # the wrong length: m1 drops
        if isinstance(reply, sa.Unmask) and m == m2:
            extra = {**reply.seed_shares, 1: 5}  # member 1 is m1, whose seed was not asked for
            return sa.Unmask(reply.group_id, reply.sender, extra, reply.key_shares)
        return reply

    h.tamper = tamper
    server, _ = h.run(layout)
    reasons = [exc.reason for _, exc in h.groups.refusals]
    assert reasons == [Reason.REPLAY, Reason.NOT_MEMBER, Reason.WRONG_LENGTH, Reason.UNREQUESTED], reasons
    assert h.groups.duplicates == 1
    assert server.result is not None and m1 not in server.result.members
    np.testing.assert_array_equal(server.result.total, _plain(updates, server.result.members))
    # the group is closed: a late message is refused as of no open group
    h.deliver(client_of[m0], kept["shares"])
    assert h.groups.refusals[-1][1].reason is Reason.WRONG_GROUP


def test_the_server_never_asks_one_member_for_both_secrets_of_a_peer() -> None:
    layout, client_of, updates = _group(n=8, seed=2)
    h = Harness(client_of, updates)
    h.drop_at = {layout.members[0]: "masked", layout.members[5]: "masked"}
    requests: list[sa.UnmaskRequest] = []
    send = h.groups.send

    def watch(cid: int, raw: bytes) -> None:
        msg = secagg_wire.decode(raw, from_server=True).msg
        if isinstance(msg, sa.UnmaskRequest):
            requests.append(msg)
        send(cid, raw)

    h.groups.send = watch
    server, _ = h.run(layout)
    assert server.result is not None and len(requests) == 6
    asked_keys = {p for r in requests for p in r.key_of}
    assert asked_keys == {0, 5}  # the members of ring positions 0 and 5, as the wire numbers them
    for r in requests:
        assert not set(r.seed_of) & set(r.key_of)
    assert layout.members[0] not in server.result.members and layout.members[5] not in server.result.members


# ---------------------------------------------------------------------- the client's member
def test_a_client_masks_a_tasks_update_in_one_group_only() -> None:
    from felix.deploy.secagg_member import SealedUpdates

    rng = np.random.default_rng(3)
    sealed = SealedUpdates(held=2)
    for task in (BIG, BIG + 1, BIG + 2):  # the oldest is let go past ``held``
        sealed.seal(task, rng.normal(0, 1, LENGTH).astype(np.float32))
    assert list(sealed.tasks) == [BIG + 1, BIG + 2]

    def env(msg: sa.Message, task: int = BIG + 1, member: int = 0) -> SecAggEnvelope:
        return SecAggEnvelope(RUN, 1, member, task, 0.5, msg)

    setup = sa.Setup(9, (0, 1), 2, 2, LENGTH, 8.0, 22, 32)
    with pytest.raises(SecAggRefusal) as gone:
        sealed.answer(env(setup, task=BIG))
    assert gone.value.reason is Reason.NOT_MEMBER
    with pytest.raises(SecAggRefusal) as early:
        sealed.answer(env(sa.KeysBroadcast(9, {})))
    assert early.value.reason is Reason.WRONG_STAGE
    first = sealed.answer(env(setup))
    assert isinstance(first, sa.Keys) and sealed.answer(env(setup)) is None  # a redelivery
    again = sealed.answer(env(sa.Setup(10, (0, 1), 2, 2, LENGTH, 8.0, 22, 32)))  # a new group before masking
    assert isinstance(again, sa.Keys) and again.group_id == 10 and again.mask_pk != first.mask_pk
    peer = SecAggClient(1)  # the other member of group 10
    keys = peer.on_setup(sa.Setup(10, (0, 1), 2, 2, LENGTH, 8.0, 22, 32))
    shares = sealed.answer(env(sa.KeysBroadcast(10, {1: (keys.cipher_pk, keys.mask_pk)})))
    assert isinstance(shares, sa.Shares)
    peer.on_keys(sa.KeysBroadcast(10, {0: (again.cipher_pk, again.mask_pk)}))
    masked = sealed.answer(env(sa.SharesForward(10, {})))
    assert isinstance(masked, sa.Masked) and sealed.tasks[BIG + 1].delta is None
    with pytest.raises(SecAggRefusal) as twice:  # masked once: no other group gets this update
        sealed.answer(env(sa.Setup(11, (0, 1), 2, 2, LENGTH, 8.0, 22, 32)))
    assert twice.value.reason is Reason.REPLAY
    answer = sealed.answer(env(sa.UnmaskRequest(10, (0,), ())))
    assert isinstance(answer, sa.Unmask) and BIG + 1 not in sealed.tasks
