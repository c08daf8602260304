"""The client side of the wire protocol, sans-I/O: hostile messages from the server get a typed
drop, counted by kind; good ones come back decoded."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from felix.core.refusals import Refusal
from felix.deploy import wire
from felix.deploy.channels import Channel
from felix.deploy.client_protocol import ClientProtocol, Dropped

RUN = "r1"


def _train(client: int = 3, run: str = RUN) -> wire.TrainTask:
    return wire.TrainTask(
        run=run, msg_id="s-1", sent_at=1.0, client=client, task=7, version=2, weights=np.zeros(4, np.float32)
    )


def _status() -> wire.Status:
    return wire.Status(run=RUN, msg_id="s-2", sent_at=1.0, session="abc", state="running")


def test_a_task_for_this_client_comes_back_decoded() -> None:
    p = ClientProtocol(RUN, 1 << 16)
    got = p.receive(3, Channel.TASK, wire.encode(_train()))
    assert isinstance(got, wire.TrainTask) and (got.task, got.version) == (7, 2)
    status = p.receive(3, Channel.STATUS, wire.encode(_status()))
    assert isinstance(status, wire.Status) and status.session == "abc"
    assert p.dropped_by_kind == {}


@pytest.mark.parametrize(
    ("channel", "payload", "kind"),
    [
        (Channel.TASK, b"JUNK" + bytes(40), Refusal.BAD_MAGIC),
        (Channel.TASK, b"", Refusal.TRUNCATED),
        (Channel.TASK, wire.encode(_train())[:-3], Refusal.TRUNCATED),
        (Channel.TASK, wire.encode(_train(run="other")), Refusal.OTHER_RUN),
        (Channel.STATUS, wire.encode(_train()), Refusal.TYPE_ON_TOPIC),  # a task on the status channel
        (Channel.TASK, wire.encode(_status()), Refusal.TYPE_ON_TOPIC),
        (Channel.TASK, wire.encode(_train(client=4)), Refusal.WRONG_ADDRESSEE),
        (
            Channel.TASK,
            wire.encode(dataclasses.replace(_train(), weights=np.zeros(1 << 15))),
            Refusal.OVERSIZED,
        ),
    ],
)
def test_hostile_messages_are_dropped_by_kind(channel: Channel, payload: bytes, kind: Refusal) -> None:
    p = ClientProtocol(RUN, 1 << 16)
    got = p.receive(3, channel, payload)
    assert isinstance(got, Dropped) and got.kind is kind, got
    assert p.dropped_by_kind == {kind.value: 1}
