"""Secure aggregation's groups over the deployment's link: the server's side of each SecAgg+ group
(:class:`felix.secagg.server.SecAggServer`, the simulator's own state machine) driven with real
clients and wall-clock deadlines.

The aggregator's sum mechanism (``felix.secagg.aggregate.SecureSum``, the same object the
simulator uses) forms the groups from the aggregation's reporters and calls :meth:`run_group` for
each; the aggregation waits until its groups have unmasked or been abandoned, so a new model
version is made whole or not at all, exactly as in the simulator. While a group runs, the server
loop's ``pump`` takes inbound messages: the secure-aggregation ones come back here through the
server protocol (:meth:`receive`), every other one waits, unhandled and unacknowledged, until the
aggregation is over. Each stage lasts until every member it waits on has answered, or
``grace_s`` wall seconds after the answers in first sufficed for the group to finish (the protocol
object's ``sufficient``: enough holders of every needed secret, at least the threshold), or
``stage_s`` wall seconds, whichever comes first; a member that has not answered by then has
dropped at that stage, and the protocol object decides whether the group goes on or is abandoned.
So one silent (or hostile) member costs a stage the grace, not the deadline, while an honest
member slower than the grace counts as dropped; only a group that cannot finish waits out the
deadline, and a group takes at most four of them, never a hang. Both come from the config's
``secure_aggregation.stage_timeout_s`` and ``stage_grace_s``, the simulator's own rule
(``felix.secagg.latency``), in wall seconds.

Checks on each client message, beyond the protocol's envelope checks: the group is open, the
member is one of the group's tasks and belongs to the sending client (so no login speaks for
another's task), and then the state machine's own (stage, replay, sizes, keys, ranges, requested
peers), each refusal with its typed reason (``felix.secagg.refusals``). A verbatim redelivery
(QoS 1 is at least once) is a duplicate, not a replay."""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from felix.deploy import secagg_wire
from felix.secagg.graph import GroupLayout
from felix.secagg.messages import Message
from felix.secagg.quantize import Quantizer
from felix.secagg.refusals import Reason, SecAggRefusal
from felix.secagg.server import SecAggServer
from felix.secagg.session import STAGES, Traffic


@dataclass
class _Open:
    server: SecAggServer
    task_of: Mapping[int, int]  # member id in the group -> task
    client_of: Mapping[int, int]  # task -> client
    weights: Mapping[int, float]  # task -> folded weight
    traffic: Traffic  # by task
    seen: set[bytes] = field(default_factory=set)  # digests of the accepted payloads


class NetworkGroups:
    """Runs groups with real members for run ``run_id``. ``send(client, payload)`` publishes to a
    client's task channel; ``pump(seconds)`` lets the server loop take inbound messages for up to
    that long; ``stage_s`` and ``grace_s`` are a stage's deadline and its grace once the answers
    suffice (wall seconds); ``clock`` is monotonic wall seconds."""

    def __init__(
        self,
        run_id: str,
        send: Callable[[int, bytes], None],
        pump: Callable[[float], None],
        stage_s: float,
        grace_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not stage_s > 0:
            raise ValueError(f"secure aggregation's stage deadline must be positive, not {stage_s}")
        if not grace_s >= 0:
            raise ValueError(f"secure aggregation's stage grace must be >= 0, not {grace_s}")
        self.run_id = run_id
        self.send = send
        self.pump = pump
        self.stage_s = stage_s
        self.grace_s = grace_s
        self.clock = clock
        self.open: dict[int, _Open] = {}
        self.refusals: list[tuple[int, SecAggRefusal]] = []  # (client, refusal), for the log and tests
        self.duplicates = 0

    def run_group(
        self,
        layout: GroupLayout,
        quantizer: Quantizer,
        weights: Mapping[int, float],
        length: int,
        client_of: Mapping[int, int],
    ) -> tuple[SecAggServer, Traffic]:
        """Run one group to its end (``felix.secagg.aggregate.RemoteGroups``). ``layout``'s
        members are task ids; on the wire they are numbered 0 to n - 1 in ring order, the group
        has a random id, and the result names the tasks again."""
        task_of = dict(enumerate(layout.members))
        # A fresh random group id on the wire: a resumed server (or an aggregation tried again)
        # forms groups with the same number, and a client must tell a new group from a redelivery.
        gid = secrets.randbits(63)
        local = GroupLayout(gid, tuple(task_of), layout.num_shares, layout.threshold)
        server = SecAggServer(local, quantizer, length)
        tasks = layout.members
        g = _Open(server, task_of, client_of, weights, Traffic({t: 0 for t in tasks}, {t: 0 for t in tasks}))
        self.open[gid] = g
        try:
            out: dict[int, Message] = dict(server.setup())
            for _ in STAGES:
                g.traffic.round_trips += 1
                for m, msg in out.items():
                    self._send(g, m, msg)
                self._wait(server)
                out = dict(server.advance())
                if server.done:
                    break
        finally:
            del self.open[gid]
        if server.result is not None:
            members = tuple(sorted(task_of[m] for m in server.result.members))
            server.result = dataclasses.replace(server.result, members=members)
        return server, g.traffic

    def _wait(self, server: SecAggServer) -> None:
        """Take the stage's answers until none is awaited, the grace after they first sufficed, or
        the deadline."""
        now = self.clock()
        deadline = now + self.stage_s
        while server.expected():
            if server.sufficient():
                deadline = min(deadline, now + self.grace_s)
            if now >= deadline:
                return
            self.pump(min(deadline - now, 0.05))
            now = self.clock()

    def _send(self, g: _Open, member: int, msg: Message) -> None:
        task = g.task_of[member]
        env = secagg_wire.SecAggEnvelope(self.run_id, g.client_of[task], member, task, g.weights[task], msg)
        payload = secagg_wire.encode(env)
        g.traffic.down[task] += len(payload)
        self.send(env.client, payload)

    def receive(self, client: int, env: secagg_wire.SecAggEnvelope, digest: bytes, size: int) -> bool:
        """Take one client's message (its envelope checked by the server protocol): True if new,
        False for a verbatim redelivery; ``SecAggRefusal`` (kept in ``refusals``) if refused."""
        try:
            return self._receive(client, env, digest, size)
        except SecAggRefusal as exc:
            self.refusals.append((client, exc))
            raise

    def _receive(self, client: int, env: secagg_wire.SecAggEnvelope, digest: bytes, size: int) -> bool:
        g = self.open.get(env.msg.group_id)
        if g is None:
            raise SecAggRefusal(Reason.WRONG_GROUP, f"group {env.msg.group_id} is not open")
        if g.task_of.get(env.member) != env.task or g.client_of.get(env.task) != client:
            raise SecAggRefusal(
                Reason.NOT_MEMBER,
                f"member {env.member} (task {env.task}) of group {env.msg.group_id} is not client {client}'s",
            )
        if digest in g.seen:
            self.duplicates += 1
            return False
        g.traffic.up[env.task] += size
        g.server.receive(env.msg)
        g.seen.add(digest)
        return True


__all__ = ["NetworkGroups"]
