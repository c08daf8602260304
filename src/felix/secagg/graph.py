"""The layout of one SecAgg+ group: its members in order, each member's neighbours on a
k-regular ring (Bell et al.'s sparse graph, as a symmetric circulant), and the threshold a group
of this size uses. Pure functions of the member list, so the server and every client derive the
same graph from the ``Setup`` message."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class GroupLayout:
    """``members`` in ring order; ``num_shares`` share holders per member (itself included: the
    member and ``(num_shares - 1) / 2`` neighbours on each side, or everyone when
    ``num_shares >= len(members)``); ``threshold`` of them rebuild a member's secrets."""

    group_id: int
    members: tuple[int, ...]
    num_shares: int
    threshold: int

    def __post_init__(self) -> None:
        n = len(self.members)
        if len(set(self.members)) != n or n < 2:
            raise ValueError("a group needs at least two distinct members")
        if not 1 <= self.threshold <= min(self.num_shares, n):
            raise ValueError(f"threshold {self.threshold} must lie in 1..{min(self.num_shares, n)}")

    @cached_property
    def _cache(self) -> dict[int, tuple[int, ...]]:
        return {}

    @cached_property
    def position(self) -> dict[int, int]:
        """Each member's Shamir point (its ring position + 1)."""
        return {m: i + 1 for i, m in enumerate(self.members)}

    def neighbours(self, member: int) -> tuple[int, ...]:
        """The other share holders of ``member`` (symmetric: v is u's neighbour iff u is v's).
        Computed per member on demand: a client needs only its own, in a group of any size."""
        got = self._cache.get(member)
        if got is None:
            n, i = len(self.members), self.position[member] - 1
            if self.num_shares >= n:
                got = self.members[:i] + self.members[i + 1 :]
            else:
                half = (self.num_shares - 1) // 2
                offs = sorted({(i + d) % n for d in range(-half, half + 1)} - {i})
                got = tuple(self.members[j] for j in offs)
            self._cache[member] = got
        return got

    def holders(self, member: int) -> tuple[int, ...]:
        """Who holds shares of ``member``'s secrets: its neighbours and itself (symmetric too: h
        holds m's shares iff m holds h's)."""
        return (member, *self.neighbours(member))


def group_threshold(size: int, num_shares: int, threshold: int) -> tuple[int, int]:
    """``(num_shares, threshold)`` for a group of ``size`` members: the configured ones, scaled
    down in proportion for a group smaller than ``num_shares`` (the last group of a cohort), never
    below a strict majority of the holders (so no one holder set rebuilds both secrets of a peer)."""
    k = min(num_shares, size)
    if k < num_shares:
        t = max(k // 2 + 1, -(-threshold * k // num_shares))
    else:
        t = threshold
    return k, min(t, k)


def split_groups(clients: list[int], group_size: int) -> list[list[int]]:
    """A cohort cut into ceil(n / group_size) groups of near-equal size, never one of a single
    client (a cohort of one forms no group; a tiny group_size may then give a group one larger)."""
    n = len(clients)
    if n < 2:
        return []
    count = min(-(-n // group_size), n // 2)
    base, extra = divmod(n, count)
    out, start = [], 0
    for g in range(count):
        size = base + (1 if g < extra else 0)
        out.append(clients[start : start + size])
        start += size
    return out


__all__ = ["GroupLayout", "group_threshold", "split_groups"]
