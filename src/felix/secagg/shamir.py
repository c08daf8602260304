"""Shamir's t-of-n secret sharing of 32-byte secrets over the prime field GF(2^521 - 1).

The ``cryptography`` package has no secret sharing, and this scheme is exact polynomial arithmetic
over Python's integers rather than a cipher: a random polynomial of degree t - 1 (coefficients from
the operating system's CSPRNG) whose constant term is the secret, one evaluation per holder at
x = 1, 2, ..., and Lagrange interpolation at 0 from any t of them. The Mersenne prime exceeds
2^256, so a secret is one field element and a share is 66 bytes."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from itertools import combinations

PRIME = 2**521 - 1
SHARE_BYTES = 66  # ceil(521 / 8)
#: Subsets tried when shares disagree (a few wrong shares among a few extra ones).
MAX_TRIES = 256


def split(secret: bytes, threshold: int, xs: Sequence[int]) -> dict[int, int]:
    """Shares of ``secret`` for the holders at points ``xs`` (distinct, 1 <= x < PRIME): any
    ``threshold`` of them rebuild it, fewer reveal nothing."""
    if not 1 <= threshold <= len(xs):
        raise ValueError(f"threshold {threshold} must lie in 1..{len(xs)}")
    coeffs = [int.from_bytes(secret, "big")] + [secrets.randbelow(PRIME) for _ in range(threshold - 1)]
    out: dict[int, int] = {}
    for x in xs:
        acc = 0
        for c in reversed(coeffs):  # Horner
            acc = (acc * x + c) % PRIME
        out[x] = acc
    return out


def interpolate(points: Mapping[int, int], at: int = 0) -> int:
    """The value at ``at`` of the polynomial through ``points`` (x -> y), by Lagrange."""
    coeffs = _lagrange(tuple(sorted(points)), at)
    return sum(points[x] * c for x, c in zip(sorted(points), coeffs)) % PRIME


@lru_cache(maxsize=4096)
def _lagrange(xs: tuple[int, ...], at: int) -> tuple[int, ...]:
    """The Lagrange basis at ``at`` for the points ``xs``: the same holders answer for many peers,
    so a reconstruction of a group's secrets computes each basis once."""
    out = []
    for xi in xs:
        num, den = 1, 1
        for xj in xs:
            if xj != xi:
                num = num * (at - xj) % PRIME
                den = den * (xi - xj) % PRIME
        out.append(num * pow(den, -1, PRIME) % PRIME)
    return tuple(out)


def combine(
    points: Mapping[int, int], threshold: int, check: Callable[[bytes], bool]
) -> tuple[bytes, set[int]] | None:
    """Rebuild a 32-byte secret from ``points`` (at least ``threshold``), tolerating wrong shares.

    ``check(secret)`` recognises the right secret (its commitment or its public key). The first
    ``threshold`` points are tried; if their secret fails the check, further subsets are tried
    (at most ``MAX_TRIES``), and the points that disagree with the right polynomial are returned
    beside the secret: their holders sent wrong shares. None when no subset passes."""
    xs = sorted(points)
    for tried, subset in enumerate(combinations(xs, threshold)):
        if tried >= MAX_TRIES:
            return None
        sub = {x: points[x] for x in subset}
        value = interpolate(sub)
        if value >= 2**256 or not check(secret := value.to_bytes(32, "big")):
            continue
        if tried == 0:
            return secret, set()
        return secret, {x for x in xs if x not in sub and interpolate(sub, x) != points[x]}
    return None


def to_bytes(value: int) -> bytes:
    return value.to_bytes(SHARE_BYTES, "big")


def from_bytes(raw: bytes) -> int:
    """A share's field element; ``ValueError`` for the wrong length or a value outside the field."""
    if len(raw) != SHARE_BYTES:
        raise ValueError(f"a share must be {SHARE_BYTES} bytes")
    value = int.from_bytes(raw, "big")
    if value >= PRIME:
        raise ValueError("a share outside the field")
    return value


__all__ = ["PRIME", "SHARE_BYTES", "combine", "from_bytes", "interpolate", "split", "to_bytes"]
