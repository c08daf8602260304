"""A client's side of one SecAgg+ group, sans-I/O: each ``on_*`` method takes the server's
message of a stage and returns the client's answer (or raises ``SecAggRefusal`` with a typed
reason, after which the client takes no further part). No clock, socket or torch: the shell moves
the bytes and decides when a stage has timed out.

The client masks ``[w, w * delta]`` (quantised, ``felix.secagg.quantize``) with its self mask
``PRG(b)`` and, for each neighbour v whose shares the server forwarded, ``+-PRG(k_uv)`` (plus when
its ring position is below v's), with ``k_uv`` agreed over X25519 and HKDF. It Shamir-shares ``b``
and its mask private key among its neighbours and itself, and later reveals, for each peer, at
most one of the two: never both, never its own key, and only once."""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from felix.secagg import crypto, shamir
from felix.secagg.graph import GroupLayout
from felix.secagg.messages import (
    SHARE_CIPHERTEXT_BYTES,
    SHARE_PLAINTEXT,
    Keys,
    KeysBroadcast,
    Masked,
    Setup,
    Shares,
    SharesForward,
    Unmask,
    UnmaskRequest,
)
from felix.secagg.quantize import Quantizer
from felix.secagg.refusals import Reason, SecAggRefusal


def share_aad(group_id: int, sender: int, recipient: int) -> bytes:
    """The associated data binding a sealed share to its group, sender and recipient (a share
    replayed into another group or to another member does not authenticate)."""
    return struct.pack("<QII", group_id, sender, recipient)


def info(purpose: bytes, group_id: int) -> bytes:
    """HKDF's ``info``: the key's purpose and group, so keys of two purposes or groups differ."""
    return b"felix-secagg/" + purpose + struct.pack("<Q", group_id)


@dataclass
class _Peer:
    cipher_pk: bytes
    mask_pk: bytes
    seed_share: int | None = None
    key_share: int | None = None


class SecAggClient:
    """One member of one group (a client in two groups holds two of these)."""

    def __init__(self, client_id: int) -> None:
        self.client_id = client_id
        self.stage = "setup"
        self.layout: GroupLayout | None = None
        self.quantizer: Quantizer | None = None
        self.length = 0
        self._cipher_sk, self._cipher_pk = crypto.new_keypair()
        self._mask_sk, self._mask_pk = crypto.new_keypair()
        self._seed = crypto.random_bytes(32)
        self.peers: dict[int, _Peer] = {}
        self.paired: tuple[int, ...] = ()  # neighbours whose shares were forwarded: masks with them
        self.refusals: list[SecAggRefusal] = []  # peers' shares that did not decrypt

    # ------------------------------------------------------------------ stages
    def on_setup(self, msg: Setup) -> Keys:
        if self.stage != "setup":
            raise SecAggRefusal(Reason.REPLAY, f"a second setup at stage {self.stage}")
        if self.client_id not in msg.members:
            raise SecAggRefusal(Reason.NOT_MEMBER, f"client {self.client_id} is not in group {msg.group_id}")
        self.layout = GroupLayout(msg.group_id, msg.members, msg.num_shares, msg.threshold)
        if 2 * self.layout.threshold <= min(self.layout.num_shares, len(msg.members)):
            raise SecAggRefusal(Reason.TOO_FEW, "a threshold of half the holders or less")
        self.quantizer = Quantizer(msg.clipping_range, msg.quantization_bits, msg.modulus_bits)
        self.length = msg.length
        self.stage = "keys"
        return Keys(msg.group_id, self.client_id, self._cipher_pk, self._mask_pk, crypto.commit(self._seed))

    def on_keys(self, msg: KeysBroadcast) -> Shares:
        lay = self._expect("keys", self._gid(), msg.group_id)
        neighbours = set(lay.neighbours(self.client_id))
        seen = {self._cipher_pk, self._mask_pk}
        for m, (c, s) in msg.keys.items():
            if m not in neighbours:
                raise SecAggRefusal(Reason.NOT_MEMBER, f"keys of {m}, not a neighbour")
            crypto.check_public_key(c)
            crypto.check_public_key(s)
            if c in seen or s in seen or c == s:
                raise SecAggRefusal(Reason.DUPLICATE_KEY, f"member {m} reuses a public key")
            seen |= {c, s}
            self.peers[m] = _Peer(c, s)
        holders = [self.client_id, *sorted(self.peers)]
        if len(holders) < lay.threshold:
            raise SecAggRefusal(Reason.TOO_FEW, f"{len(holders)} holders < threshold {lay.threshold}")
        xs = [lay.position[h] for h in holders]
        seeds = shamir.split(self._seed, lay.threshold, xs)
        keys = shamir.split(crypto.private_bytes(self._mask_sk), lay.threshold, xs)
        me = lay.position[self.client_id]
        self._own = (seeds[me], keys[me])
        out = {}
        for m in holders[1:]:
            x = lay.position[m]
            plain = SHARE_PLAINTEXT.pack(
                self.client_id, m, shamir.to_bytes(seeds[x]), shamir.to_bytes(keys[x])
            )
            key = crypto.agree(self._cipher_sk, self.peers[m].cipher_pk, info(b"share", lay.group_id))
            out[m] = crypto.seal(key, plain, share_aad(lay.group_id, self.client_id, m))
        self.stage = "shares"
        return Shares(lay.group_id, self.client_id, out)

    def on_shares(self, msg: SharesForward) -> None:
        """Keep the shares the server forwarded; a share that does not decrypt is recorded in
        ``refusals`` (this client then cannot help rebuild that peer's secrets, but still pairs with
        it, as the server expects)."""
        lay = self._expect("shares", self._gid(), msg.group_id)
        for m, blob in msg.ciphertexts.items():
            if m not in self.peers:
                raise SecAggRefusal(Reason.NOT_MEMBER, f"a share from {m}, not a neighbour with keys")
        for m, blob in msg.ciphertexts.items():
            try:
                if len(blob) != SHARE_CIPHERTEXT_BYTES:
                    raise SecAggRefusal(Reason.BAD_SHARE, f"a share of {len(blob)} bytes")
                key = crypto.agree(self._cipher_sk, self.peers[m].cipher_pk, info(b"share", lay.group_id))
                plain = crypto.open_sealed(key, blob, share_aad(lay.group_id, m, self.client_id))
                sender, recipient, seed_raw, key_raw = SHARE_PLAINTEXT.unpack(plain)
                if (sender, recipient) != (m, self.client_id):
                    raise SecAggRefusal(Reason.BAD_SHARE, "a share addressed to someone else")
                self.peers[m].seed_share = shamir.from_bytes(seed_raw)
                self.peers[m].key_share = shamir.from_bytes(key_raw)
            except (SecAggRefusal, ValueError) as exc:
                reason = exc if isinstance(exc, SecAggRefusal) else SecAggRefusal(Reason.BAD_SHARE, str(exc))
                self.refusals.append(reason)
        self.paired = tuple(sorted(msg.ciphertexts))
        self.stage = "masked"

    def masked(self, weight: float, delta: np.ndarray) -> Masked:
        """The masked ``[weight, weight * delta]`` (``weight`` in [0, 1]: the aggregation weight
        over ``max_weight``)."""
        lay = self._expect("masked", self._gid(), self._gid())
        q = self.quantizer
        assert q is not None
        if delta.size != self.length:
            raise SecAggRefusal(
                Reason.WRONG_LENGTH, f"an update of {delta.size} values, the group expects {self.length}"
            )
        words = q.encode(weight, delta)
        words += crypto.prg_words(self._seed, words.size, q.dtype)
        me = lay.position[self.client_id]
        for m in self.paired:
            k = crypto.agree(self._mask_sk, self.peers[m].mask_pk, info(b"mask", lay.group_id))
            pad = crypto.prg_words(k, words.size, q.dtype)
            if me < lay.position[m]:
                words += pad
            else:
                words -= pad
        self.stage = "unmask"
        return Masked(lay.group_id, self.client_id, q.reduce(words), q.modulus_bits)

    def on_unmask(self, msg: UnmaskRequest) -> Unmask:
        lay = self._expect("unmask", self._gid(), msg.group_id)
        both = set(msg.seed_of) & set(msg.key_of)
        if both:
            raise SecAggRefusal(Reason.BOTH_SECRETS, f"asked for the seed and the key of {sorted(both)}")
        if self.client_id in msg.key_of:
            raise SecAggRefusal(Reason.BOTH_SECRETS, "asked for its own mask key")
        known = set(self.peers) | {self.client_id}
        stray = (set(msg.seed_of) | set(msg.key_of)) - known
        if stray:
            raise SecAggRefusal(Reason.NOT_MEMBER, f"asked about {sorted(stray)}, not neighbours")
        seeds = {m: self._seed_share(m) for m in msg.seed_of}
        keys = {m: self.peers[m].key_share for m in msg.key_of}
        self.stage = "done"  # one answer only: a second request is a replay
        return Unmask(
            lay.group_id,
            self.client_id,
            {m: v for m, v in seeds.items() if v is not None},
            {m: v for m, v in keys.items() if v is not None},
        )

    # ------------------------------------------------------------------ helpers
    def _seed_share(self, m: int) -> int | None:
        return self._own[0] if m == self.client_id else self.peers[m].seed_share

    def _gid(self) -> int:
        return -1 if self.layout is None else self.layout.group_id

    def _expect(self, stage: str, group_id: int, got: int) -> GroupLayout:
        if self.stage != stage:
            reason = Reason.REPLAY if _order(self.stage) > _order(stage) else Reason.WRONG_STAGE
            raise SecAggRefusal(reason, f"a {stage} message at stage {self.stage}")
        if group_id != got:
            raise SecAggRefusal(Reason.WRONG_GROUP, f"a message for group {got}, not {group_id}")
        assert self.layout is not None
        return self.layout


_STAGES = ("setup", "keys", "shares", "masked", "unmask", "done")


def _order(stage: str) -> int:
    return _STAGES.index(stage)


__all__ = ["SecAggClient", "info", "share_aad"]
