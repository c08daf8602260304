"""What a secure aggregation group's exchanges take in virtual time: the simulator's cost of the
protocol's round trips, from the section's link model (``secure_aggregation.link``) and the bytes
each member's messages really have (:class:`felix.secagg.session.StageTraffic`).

A group's exchanges run one after another. In each, the server sends every member its message and
waits for the answers, so an exchange lasts as long as its slowest answering member's round trip
(``rtt_s`` + bytes down / ``down_mbps`` + bytes up / ``up_mbps``). When a member it waits on
stays silent, the server cannot tell a dropped member from a slow one: it waits ``stage_grace_s``
past the answers once they suffice for the group to finish (the rule of a deployment's
``felix.deploy.secagg_groups``; the members share one link here, so the answers arrive together
and the grace runs from the slowest), or ``stage_timeout_s`` when they never suffice (the group
is abandoned at that stage), whichever comes first. Members the server itself knows to be gone (``gone``: their training tasks were
cancelled or ran out of time, the orchestrator's own decision) are not waited on. In the masked
vector exchange, each member's ``excused`` bytes (its plaintext update's size) are not charged: a
run without secure aggregation sends the update too, as part of its task; only the protocol's
excess is. The groups of one aggregation run side by side, so the aggregation waits for its
slowest group."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import NamedTuple

from felix.secagg.config import LinkCfg
from felix.secagg.session import StageTraffic


def round_trip_s(link: LinkCfg, down_bytes: int, up_bytes: int) -> float:
    """One member's exchange: latency and both transfers over its link."""
    return link.rtt_s + 8 * down_bytes / (link.down_mbps * 1e6) + 8 * up_bytes / (link.up_mbps * 1e6)


class GroupTime(NamedTuple):
    """A group's virtual seconds, and how many of its exchanges waited out the deadline."""

    seconds: float
    deadlines: int


def group_seconds(
    stages: Iterable[StageTraffic],
    link: LinkCfg,
    timeout_s: float,
    gone: Collection[int] = (),
    excused: Mapping[int, int] | None = None,
    grace_s: float = 0.0,
) -> GroupTime:
    """The virtual seconds of one group's exchanges, in order (see the module docstring)."""
    excused = excused or {}
    total, deadlines = 0.0, 0
    for ex in stages:
        spare = excused if ex.stage == "masked" else {}
        slowest = max(
            (round_trip_s(link, ex.down[m], max(up - spare.get(m, 0), 0)) for m, up in ex.up.items()),
            default=0.0,
        )
        if any(m not in gone for m in ex.silent):
            if ex.sufficient and slowest + grace_s < timeout_s:
                slowest += grace_s
            else:
                slowest = max(slowest, timeout_s)
                deadlines += 1
        total += slowest
    return GroupTime(total, deadlines)


__all__ = ["GroupTime", "group_seconds", "round_trip_s"]
