"""A deployed client's side of secure aggregation, sans-I/O: the updates it keeps for their
groups and its answer to each stage the server sends (``felix.deploy.client`` moves the bytes).

A training result travels sealed (its metadata only); the client keeps the delta of its last
``SEALED_HELD`` training tasks. When the server opens a group with one of them, the task's member
(:class:`felix.secagg.client.SecAggClient`, the simulator's own) answers the setup with its keys,
the keys with its shares, the forwarded shares with its masked ``[w, w * delta]`` (``w``: the
folded weight the server sent) and the unmask request with its shares of its peers' secrets.
A task's update is masked in one group only: a later setup for a task already masked is refused
(``replay``), so the server never holds two masked vectors of one update; a setup before that
(the last group was abandoned, e.g. with a server that died) starts afresh. What fails the
member's checks raises ``SecAggRefusal`` with its typed reason."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from felix.deploy.secagg_wire import SecAggEnvelope
from felix.secagg import messages as sa
from felix.secagg.client import SecAggClient
from felix.secagg.refusals import Reason, SecAggRefusal

SEALED_HELD = 8  # the updates (of the latest training tasks) a client keeps for their groups


@dataclass(eq=False)
class Sealed:
    """A training update waiting for its group: the delta (dropped once masked) and the member's
    state machine (None until the group's setup)."""

    delta: np.ndarray | None
    member: SecAggClient | None = None


class SealedUpdates:
    """One client's updates waiting for their groups, by task."""

    def __init__(self, held: int = SEALED_HELD) -> None:
        self.held = held
        self.tasks: dict[int, Sealed] = {}

    def seal(self, task_id: int, delta: np.ndarray) -> None:
        self.tasks[task_id] = Sealed(delta)
        while len(self.tasks) > self.held:
            del self.tasks[next(iter(self.tasks))]

    def answer(self, env: SecAggEnvelope) -> sa.Message | None:
        """The member's answer to one stage of the group of ``env.task`` (None: a redelivered
        setup, answered already)."""
        st = self.tasks.get(env.task)
        msg = env.msg
        if st is None:
            raise SecAggRefusal(Reason.NOT_MEMBER, f"task {env.task} has no update waiting for a group")
        if isinstance(msg, sa.Setup):
            lay = None if st.member is None else st.member.layout
            if lay is not None and (lay.group_id, lay.members) == (msg.group_id, msg.members):
                return None
            if st.delta is None:
                raise SecAggRefusal(Reason.REPLAY, f"task {env.task}'s update was masked in another group")
            st.member = SecAggClient(env.member)
            return st.member.on_setup(msg)
        if st.member is None or st.member.client_id != env.member:
            raise SecAggRefusal(
                Reason.WRONG_STAGE, f"a {type(msg).__name__} for a group task {env.task} is not in"
            )
        if isinstance(msg, sa.KeysBroadcast):
            return st.member.on_keys(msg)
        if isinstance(msg, sa.SharesForward):
            st.member.on_shares(msg)
            assert st.delta is not None  # (the member's stage guards it)
            masked = st.member.masked(env.weight, st.delta)
            st.delta = None
            return masked
        assert isinstance(msg, sa.UnmaskRequest)  # secagg_wire admits no other from the server
        answer = st.member.on_unmask(msg)
        del self.tasks[env.task]
        return answer


__all__ = ["SEALED_HELD", "Sealed", "SealedUpdates"]
