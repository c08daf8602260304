"""The server's side of one SecAgg+ group, sans-I/O: ``setup`` opens the group, ``receive``
takes each client's message of the current stage (refusing anything hostile with a typed reason:
that client counts as dropped at this stage), and ``advance`` closes the stage when the shell
decides (every expected answer in; the answers in ``sufficient`` and a grace passed; or its deadline
passed), returning the next stage's messages.

Stages and survivor sets (Bonawitz et al.'s U1..U4): keys (U1), shares (U2), masked vectors (U3),
unmask answers. A member whose secrets fewer than ``threshold`` live holders could rebuild is
dropped from the group; when fewer than ``threshold`` members remain, or a needed secret cannot
be rebuilt, the group is abandoned (``abandoned``, ``abandon_reason``), never a wrong sum.

Unmasking: the masked vectors are summed as they arrive (uint words wrap mod 2^32 or 2^64); at the
end, each survivor's self mask PRG(b) is rebuilt and subtracted, and for each member that dropped
after sharing, its mask key is rebuilt and its pairwise masks with surviving neighbours removed.
Every survivor is asked for seed shares of surviving peers and key shares of dropped peers only,
once, so no answer holds both secrets of one peer."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from felix.secagg import crypto, shamir
from felix.secagg.client import info
from felix.secagg.graph import GroupLayout
from felix.secagg.messages import (
    SHARE_CIPHERTEXT_BYTES,
    Keys,
    KeysBroadcast,
    Masked,
    Message,
    Setup,
    Shares,
    SharesForward,
    Unmask,
    UnmaskRequest,
)
from felix.secagg.quantize import Quantizer
from felix.secagg.refusals import Reason, SecAggRefusal

_MESSAGE_OF_STAGE = {"keys": Keys, "shares": Shares, "masked": Masked, "unmask": Unmask}


@dataclass(frozen=True)
class GroupResult:
    """A finished group: who is in the sum, the reduced integer sum of their ``[w, w * delta]``,
    and its dequantised parts (sum of weights, sum of weighted deltas)."""

    members: tuple[int, ...]
    total: np.ndarray
    weight_sum: float
    weighted_sum: np.ndarray
    dropouts_recovered: int  # members that shared their secrets, then dropped: their masks removed


class SecAggServer:
    """One group's aggregation. ``refusals`` lists ``(client, SecAggRefusal)`` for every message
    refused; ``requests`` keeps every unmask request sent (the invariant's evidence)."""

    def __init__(self, layout: GroupLayout, quantizer: Quantizer, length: int) -> None:
        self.layout = layout
        self.q = quantizer
        self.length = length
        self.stage = "setup"
        self.abandon_reason: str | None = None
        self.result: GroupResult | None = None
        self.refusals: list[tuple[int, SecAggRefusal]] = []
        self.requests: dict[int, UnmaskRequest] = {}
        self.keys: dict[int, Keys] = {}
        self.shares: dict[int, Shares] = {}
        self.masked: set[int] = set()
        self.answers: dict[int, Unmask] = {}
        self._sent_keys: dict[int, set[int]] = {}  # member -> neighbours whose keys it was sent
        self._used_keys: set[bytes] = set()
        self._acc = np.zeros(length + 1, dtype=quantizer.dtype)

    @property
    def abandoned(self) -> bool:
        return self.stage == "abandoned"

    @property
    def done(self) -> bool:
        return self.stage in ("done", "abandoned")

    # ------------------------------------------------------------------ stages
    def setup(self) -> dict[int, Setup]:
        lay, q = self.layout, self.q
        self.stage = "keys"
        msg = Setup(
            lay.group_id,
            lay.members,
            lay.num_shares,
            lay.threshold,
            self.length,
            q.clipping_range,
            q.quantization_bits,
            q.modulus_bits,
        )
        return {m: msg for m in lay.members}

    def waits_on(self, member: int) -> bool:
        """Whether the current stage still waits on ``member`` (``expected`` for one member)."""
        if self.stage == "keys":
            return member in self.layout.position and member not in self.keys
        if self.stage == "shares":
            return member in self._sent_keys and member not in self.shares
        if self.stage == "masked":
            return member in self.shares and member not in self.masked
        if self.stage == "unmask":
            return member in self.requests and member not in self.answers
        return False

    def expected(self) -> set[int]:
        """Who the current stage still waits on (the shell may advance once this is empty)."""
        if self.stage == "keys":
            return set(self.layout.members) - set(self.keys)
        if self.stage == "shares":
            return set(self._sent_keys) - set(self.shares)
        if self.stage == "masked":
            return set(self.shares) - self.masked
        if self.stage == "unmask":
            return set(self.requests) - set(self.answers)
        return set()

    def sufficient(self) -> bool:
        """Whether the answers in suffice for the group to finish if the stage closed now without
        the members it still waits on: at least ``threshold`` members go on, and every secret the
        next stages need has ``threshold`` live holders (at the unmask stage: ``threshold`` shares
        of every needed secret are in). The shell may then close the stage early, after a grace."""
        lay, t = self.layout, self.layout.threshold
        if self.stage == "keys":
            return len(self._prune(set(self.keys))) >= t
        if self.stage == "shares":
            return len(self._prune(set(self.shares))) >= t
        if self.stage == "masked":
            u3 = set(self.masked)
            dropped = {p for p in set(self.shares) - u3 if set(lay.neighbours(p)) & u3}
            return len(u3) >= t and all(len(set(lay.holders(m)) & u3) >= t for m in u3 | dropped)
        if self.stage == "unmask":
            seeds = Counter(m for a in self.answers.values() for m in a.seed_shares)
            keys = Counter(p for a in self.answers.values() for p in a.key_shares)
            return all(seeds[m] >= t for m in self.masked) and all(
                keys[p] >= t for p in self.requests_key_of()
            )
        return False

    def receive(self, msg: Message) -> None:
        """Take one client's message; ``SecAggRefusal`` (also kept in ``refusals``) if hostile."""
        try:
            self._receive(msg)
        except SecAggRefusal as exc:
            self.refusals.append((msg.sender, exc))
            raise

    def advance(self) -> dict[int, Message]:
        """Close the current stage; the next stage's messages (none once done or abandoned)."""
        step = {"keys": self._after_keys, "shares": self._after_shares, "masked": self._after_masked}
        if self.stage in step:
            return step[self.stage]()
        if self.stage == "unmask":
            self._finish()
        return {}

    # ------------------------------------------------------------------ receiving
    def _receive(self, msg: Message) -> None:
        lay = self.layout
        if msg.group_id != lay.group_id:
            raise SecAggRefusal(Reason.WRONG_GROUP, f"a message for group {msg.group_id}, not {lay.group_id}")
        if msg.sender not in lay.position:
            raise SecAggRefusal(Reason.NOT_MEMBER, f"client {msg.sender} is not in group {lay.group_id}")
        want = _MESSAGE_OF_STAGE.get(self.stage)
        if want is None or not isinstance(msg, want):
            seen = any(msg.sender in d for d in (self.keys, self.shares, self.masked, self.answers))
            reason = Reason.REPLAY if seen else Reason.WRONG_STAGE
            raise SecAggRefusal(reason, f"a {type(msg).__name__} at stage {self.stage}")
        if not self.waits_on(msg.sender):
            done: dict[str, Any] = {
                "keys": self.keys,
                "shares": self.shares,
                "masked": self.masked,
                "unmask": self.answers,
            }
            if msg.sender in done[self.stage]:
                raise SecAggRefusal(Reason.REPLAY, f"a second {type(msg).__name__} from {msg.sender}")
            raise SecAggRefusal(Reason.WRONG_STAGE, f"client {msg.sender} dropped out of this group earlier")
        if isinstance(msg, Keys):
            self._on_keys(msg)
        elif isinstance(msg, Shares):
            self._on_shares(msg)
        elif isinstance(msg, Masked):
            self._on_masked(msg)
        else:
            assert isinstance(msg, Unmask)
            self._on_unmask(msg)

    def _on_keys(self, msg: Keys) -> None:
        crypto.check_public_key(msg.cipher_pk)
        crypto.check_public_key(msg.mask_pk)
        if len(msg.seed_commitment) != 32:
            raise SecAggRefusal(Reason.MALFORMED, "a seed commitment must be 32 bytes")
        if msg.cipher_pk == msg.mask_pk or {msg.cipher_pk, msg.mask_pk} & self._used_keys:
            raise SecAggRefusal(Reason.DUPLICATE_KEY, f"client {msg.sender} reuses a public key")
        self._used_keys |= {msg.cipher_pk, msg.mask_pk}
        self.keys[msg.sender] = msg

    def _on_shares(self, msg: Shares) -> None:
        want = self._sent_keys[msg.sender]
        if set(msg.ciphertexts) != want:
            raise SecAggRefusal(
                Reason.MISSING_SHARE, f"shares for {sorted(msg.ciphertexts)}, expected {sorted(want)}"
            )
        if any(len(b) != SHARE_CIPHERTEXT_BYTES for b in msg.ciphertexts.values()):
            raise SecAggRefusal(
                Reason.MALFORMED, f"a share ciphertext must be {SHARE_CIPHERTEXT_BYTES} bytes"
            )
        self.shares[msg.sender] = msg

    def _on_masked(self, msg: Masked) -> None:
        words = msg.words
        if msg.modulus_bits != self.q.modulus_bits:
            raise SecAggRefusal(
                Reason.OUT_OF_RANGE, f"modulus_bits {msg.modulus_bits}, not {self.q.modulus_bits}"
            )
        if words.ndim != 1 or words.size != self.length + 1:
            raise SecAggRefusal(Reason.WRONG_LENGTH, f"{words.size} words, expected {self.length + 1}")
        if words.dtype.kind != "u" or words.dtype.itemsize != np.dtype(self.q.dtype).itemsize:
            raise SecAggRefusal(
                Reason.OUT_OF_RANGE, f"words of type {words.dtype}, not {np.dtype(self.q.dtype)}"
            )
        if self.q.modulus_bits not in (32, 64) and int(words.max(initial=0)) > self.q.mask:
            raise SecAggRefusal(Reason.OUT_OF_RANGE, f"a word at or above 2^{self.q.modulus_bits}")
        self._acc += words.astype(self.q.dtype, copy=False)
        self.masked.add(msg.sender)

    def _on_unmask(self, msg: Unmask) -> None:
        req = self.requests[msg.sender]
        extra = (set(msg.seed_shares) - set(req.seed_of)) | (set(msg.key_shares) - set(req.key_of))
        if extra:
            raise SecAggRefusal(Reason.UNREQUESTED, f"shares for {sorted(extra)}, which were not asked for")
        if any(not 0 <= v < shamir.PRIME for v in (*msg.seed_shares.values(), *msg.key_shares.values())):
            raise SecAggRefusal(Reason.MALFORMED, "a share outside the field")
        self.answers[msg.sender] = msg

    # ------------------------------------------------------------------ closing stages
    def _prune(self, alive: set[int]) -> set[int]:
        """Drop members whose secrets fewer than ``threshold`` holders in ``alive`` hold."""
        t = self.layout.threshold
        while True:
            weak = {m for m in alive if len(set(self.layout.holders(m)) & alive) < t}
            if not weak:
                return alive
            alive -= weak

    def _abandon(self, why: str) -> dict[int, Message]:
        self.stage = "abandoned"
        self.abandon_reason = why
        self._acc = np.zeros(0, dtype=self.q.dtype)
        return {}

    def _after_keys(self) -> dict[int, Message]:
        alive = self._prune(set(self.keys))
        if len(alive) < self.layout.threshold:
            return self._abandon(f"{len(alive)} members sent keys, threshold {self.layout.threshold}")
        out: dict[int, Message] = {}
        for m in sorted(alive):
            peers = set(self.layout.neighbours(m)) & alive
            self._sent_keys[m] = peers
            out[m] = KeysBroadcast(
                self.layout.group_id,
                {p: (self.keys[p].cipher_pk, self.keys[p].mask_pk) for p in sorted(peers)},
            )
        self.stage = "shares"
        return out

    def _after_shares(self) -> dict[int, Message]:
        alive = self._prune(set(self.shares))
        if len(alive) < self.layout.threshold:
            return self._abandon(f"{len(alive)} members sent shares, threshold {self.layout.threshold}")
        self.shares = {m: s for m, s in self.shares.items() if m in alive}
        out: dict[int, Message] = {}
        for m in sorted(alive):
            blobs = {p: self.shares[p].ciphertexts[m] for p in self.layout.neighbours(m) if p in alive}
            out[m] = SharesForward(self.layout.group_id, blobs)
        self.stage = "masked"
        return out

    def _after_masked(self) -> dict[int, Message]:
        lay = self.layout
        u2, u3 = set(self.shares), set(self.masked)
        if len(u3) < lay.threshold:
            return self._abandon(f"{len(u3)} masked vectors, threshold {lay.threshold}")
        dropped = {p for p in u2 - u3 if set(lay.neighbours(p)) & u3}  # their pairwise masks are in the sum
        for m in u3 | dropped:
            if len(set(lay.holders(m)) & u3) < lay.threshold:
                return self._abandon(f"member {m}'s secrets have fewer than {lay.threshold} live holders")
        out: dict[int, Message] = {}
        for h in sorted(u3):
            mine = set(lay.holders(h))  # h holds shares of m iff m holds h's: the relation is symmetric
            seed_of = tuple(sorted(mine & u3))
            key_of = tuple(sorted(mine & dropped))
            req = UnmaskRequest(lay.group_id, seed_of, key_of)
            self.requests[h] = req
            out[h] = req
        self.stage = "unmask"
        return out

    def _finish(self) -> None:
        lay, q = self.layout, self.q
        u2, u3 = set(self.shares), set(self.masked)
        total = self._acc
        gid = lay.group_id
        for m in sorted(u3):
            points = {
                lay.position[h]: a.seed_shares[m] for h, a in self.answers.items() if m in a.seed_shares
            }
            commitment = self.keys[m].seed_commitment
            got = shamir.combine(points, lay.threshold, partial(_commits_to, commitment))
            if got is None:
                self._abandon(f"the mask seed of member {m} could not be rebuilt")
                return
            self._note_bad(got[1], m)
            total -= crypto.prg_words(got[0], total.size, q.dtype)
        for p in sorted(self.requests_key_of()):
            points = {lay.position[h]: a.key_shares[p] for h, a in self.answers.items() if p in a.key_shares}
            mask_pk = self.keys[p].mask_pk
            got = shamir.combine(points, lay.threshold, partial(_is_key_of, mask_pk))
            if got is None:
                self._abandon(f"the mask key of member {p} could not be rebuilt")
                return
            self._note_bad(got[1], p)
            sk = crypto.private_from_bytes(got[0])
            for u in lay.neighbours(p):
                if u not in u3:
                    continue
                pad = crypto.prg_words(
                    crypto.agree(sk, self.keys[u].mask_pk, info(b"mask", gid)), total.size, q.dtype
                )
                # u added +pad when its position is below p's, else -pad: undo it
                if lay.position[u] < lay.position[p]:
                    total -= pad
                else:
                    total += pad
        total = q.reduce(total)
        members = tuple(sorted(u3))
        wsum, xsum = q.decode_sum(total, len(members))
        self.result = GroupResult(members, total, wsum, xsum, len((u2 - u3) & self.requests_key_of()))
        self._acc = np.zeros(0, dtype=q.dtype)
        self.stage = "done"

    def requests_key_of(self) -> set[int]:
        """The members whose mask keys were asked for (dropped after sharing)."""
        return {p for r in self.requests.values() for p in r.key_of}

    def _note_bad(self, points: set[int], peer: int) -> None:
        by_point = {x: m for m, x in self.layout.position.items()}
        for x in points:
            self.refusals.append(
                (by_point[x], SecAggRefusal(Reason.BAD_SHARE, f"a wrong share of member {peer}"))
            )


def _commits_to(commitment: bytes, seed: bytes) -> bool:
    return crypto.commit(seed) == commitment


def _is_key_of(public: bytes, private: bytes) -> bool:
    return crypto.public_of(private) == public


__all__ = ["GroupResult", "SecAggServer"]
