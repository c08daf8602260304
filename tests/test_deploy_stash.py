"""The stash a deployed server holds messages in while a secure-aggregation group runs: bounded
by bytes and count, read from the inbox past what it cannot hold, in arrival order."""

from __future__ import annotations

from felix.deploy.channels import Address, Channel
from felix.deploy.inbox import Inbox
from felix.deploy.stash import Stash
from felix.deploy.transport import Ack, Connected, Delivery


def _msg(n: int, channel: Channel = Channel.STATE, size: int = 10) -> Delivery:
    return Delivery(Address(channel, 1), bytes([n]) * size, Ack(n, 1, 1), "t")


def _secagg(item: object) -> bool:
    return isinstance(item, Delivery) and item.address is not None and item.address.channel is Channel.SECAGG


def test_a_full_stash_lets_the_groups_messages_past_and_keeps_the_rest_queued_in_order() -> None:
    stash = Stash(max_bytes=1000, max_messages=3)
    inbox = Inbox(1 << 20, 100)
    items = [_msg(0), _msg(1), _msg(2, Channel.SECAGG), _msg(3), _msg(4), _msg(5, Channel.SECAGG), _msg(6)]
    inbox.put_many(items)
    fits = stash.fits()
    got = [item for _, item in inbox.get_batch(0.0, 64, lambda i: _secagg(i) or fits(i))]
    # three messages fit; the group's pass; 4 does not fit, and 6, behind it, waits with it
    assert got == [items[i] for i in (0, 1, 2, 3, 5)]
    for item in got:
        if not _secagg(item):
            stash.push(item)
    assert (len(stash), stash.messages, stash.bytes, stash.peak_messages) == (3, 3, 30, 3)
    notice = Connected(2, True)
    inbox.put(notice)  # a notice behind the message that did not fit stays behind it
    inbox.put_many([_msg(7, Channel.SECAGG)])
    fits = stash.fits()
    assert [i for _, i in inbox.get_batch(0.0, 64, lambda i: _secagg(i) or fits(i))] == [
        _msg(7, Channel.SECAGG)
    ]
    assert stash.full_reads == 2  # both reads left messages queued
    assert stash.pop() == items[0] and (stash.messages, stash.bytes) == (2, 20)
    assert [i for _, i in inbox.get_batch(0.0, 64)] == [items[4], items[6], notice]  # in arrival order


def test_one_message_larger_than_the_bytes_bound_fits_an_empty_stash_only() -> None:
    stash = Stash(max_bytes=50, max_messages=10)
    big = _msg(1, size=80)
    fits = stash.fits()
    assert fits(big) and not fits(_msg(2))  # the big one was counted by this read
    stash.push(big)
    assert not stash.fits()(_msg(3, size=1))
