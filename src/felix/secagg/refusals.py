"""Typed reasons for refusing a secure-aggregation message. Every message from a client (and,
on a client, every message relayed by the server) is hostile until validated: a refused message
names one of these reasons, the sender is treated as dropped for that stage, and the group goes on
while enough members remain (else it is abandoned, never a crash or a wrong sum)."""

from __future__ import annotations

from enum import Enum


class Reason(str, Enum):
    """Why a message was refused."""

    WRONG_GROUP = "wrong_group"  # addressed to another group
    NOT_MEMBER = "not_member"  # the sender (or a named peer) is not in the group
    WRONG_STAGE = "wrong_stage"  # a message for a stage that is not the current one
    REPLAY = "replay"  # a second message of the same stage from the same sender
    MALFORMED = "malformed"  # does not decode, or fields of the wrong size
    MALFORMED_KEY = "malformed_key"  # a public key of the wrong length or of small order
    DUPLICATE_KEY = "duplicate_key"  # a public key that another member (or the other key) already uses
    MISSING_SHARE = "missing_share"  # a share message without one ciphertext for every neighbour
    BAD_SHARE = "bad_share"  # a share that does not decrypt, or is inconsistent with the others
    WRONG_LENGTH = "wrong_length"  # a masked vector of the wrong length
    OUT_OF_RANGE = "out_of_range"  # a masked vector with entries outside Z_(2^modulus_bits)
    UNREQUESTED = "unrequested"  # an unmask answer for a peer the request did not name
    BOTH_SECRETS = "both_secrets"  # a request for the mask seed and the secret key of one peer
    TOO_FEW = "too_few"  # fewer than threshold members remain: the group is abandoned


class SecAggRefusal(ValueError):
    """A refused message: ``reason`` is typed, the text says what was wrong in one line."""

    def __init__(self, reason: Reason, detail: str) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail


__all__ = ["Reason", "SecAggRefusal"]
