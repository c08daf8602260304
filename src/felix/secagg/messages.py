"""The messages of one SecAgg+ group and their wire encoding.

Each stage is one exchange: the server's ``Setup`` and each client's ``Keys`` (two X25519 public
keys and a commitment to its mask seed); the server's ``KeysBroadcast`` (the neighbours' keys) and
each client's ``Shares`` (one AES-GCM ciphertext per neighbour); the server's ``SharesForward`` and
each client's ``Masked`` vector; the server's ``UnmaskRequest`` and each client's ``Unmask``
answer. ``encode``/``decode`` give the bytes that travel (MQTT payloads, and the simulator's
byte counts); ``decode`` refuses anything malformed with ``SecAggRefusal(MALFORMED)``."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from felix.secagg.refusals import Reason, SecAggRefusal
from felix.secagg.shamir import PRIME, SHARE_BYTES

SERVER = 0xFFFFFFFF  # the sender id of the server's messages
_HEAD = struct.Struct("<2sBBQI")  # magic, version, kind, group id, sender
_MAGIC, _VERSION = b"SA", 1
#: A share's plaintext: sender, recipient, the seed share and the key share.
SHARE_PLAINTEXT = struct.Struct(f"<II{SHARE_BYTES}s{SHARE_BYTES}s")
#: The AES-GCM ciphertext of one share: nonce, plaintext, tag.
SHARE_CIPHERTEXT_BYTES = 12 + SHARE_PLAINTEXT.size + 16


@dataclass(frozen=True)
class Setup:
    """Opens a group: its members in ring order and the parameters every member must use."""

    kind: ClassVar[int] = 1
    group_id: int
    members: tuple[int, ...]
    num_shares: int
    threshold: int
    length: int  # the update's length (the masked vector has one word more: the weight)
    clipping_range: float
    quantization_bits: int
    modulus_bits: int
    sender: int = SERVER


@dataclass(frozen=True)
class Keys:
    kind: ClassVar[int] = 2
    group_id: int
    sender: int
    cipher_pk: bytes  # encrypts the shares sent to this client
    mask_pk: bytes  # agrees the pairwise masks; its private key is Shamir-shared
    seed_commitment: bytes  # SHA-256 of the self-mask seed


@dataclass(frozen=True)
class KeysBroadcast:
    kind: ClassVar[int] = 3
    group_id: int
    keys: dict[int, tuple[bytes, bytes]]  # neighbour -> (cipher_pk, mask_pk)
    sender: int = SERVER


@dataclass(frozen=True)
class Shares:
    kind: ClassVar[int] = 4
    group_id: int
    sender: int
    ciphertexts: dict[int, bytes]  # recipient -> sealed share


@dataclass(frozen=True)
class SharesForward:
    kind: ClassVar[int] = 5
    group_id: int
    ciphertexts: dict[int, bytes]  # sender -> sealed share for this recipient
    sender: int = SERVER


@dataclass(frozen=True)
class Masked:
    kind: ClassVar[int] = 6
    group_id: int
    sender: int
    words: np.ndarray = field(compare=False)  # [w, w * delta] quantised and masked, length + 1
    modulus_bits: int = 32


@dataclass(frozen=True)
class UnmaskRequest:
    """Asks one survivor for its shares of the mask seeds of ``seed_of`` (members whose masked
    vectors arrived) and of the mask keys of ``key_of`` (members that dropped after sharing):
    disjoint, so no one answer holds both secrets of a peer."""

    kind: ClassVar[int] = 7
    group_id: int
    seed_of: tuple[int, ...]
    key_of: tuple[int, ...]
    sender: int = SERVER


@dataclass(frozen=True)
class Unmask:
    kind: ClassVar[int] = 8
    group_id: int
    sender: int
    seed_shares: dict[int, int]
    key_shares: dict[int, int]


Message = Setup | Keys | KeysBroadcast | Shares | SharesForward | Masked | UnmaskRequest | Unmask


def word_bytes(modulus_bits: int) -> int:
    return 4 if modulus_bits <= 32 else 8


def encode(msg: Message) -> bytes:
    """The bytes of ``msg`` on the wire."""
    head = _HEAD.pack(_MAGIC, _VERSION, msg.kind, msg.group_id, msg.sender)
    if isinstance(msg, Setup):
        body = struct.pack(f"<I{len(msg.members)}I", len(msg.members), *msg.members) + struct.pack(
            "<IIIdBB",
            msg.num_shares,
            msg.threshold,
            msg.length,
            msg.clipping_range,
            msg.quantization_bits,
            msg.modulus_bits,
        )
    elif isinstance(msg, Keys):
        body = msg.cipher_pk + msg.mask_pk + msg.seed_commitment
    elif isinstance(msg, KeysBroadcast):
        body = struct.pack("<I", len(msg.keys)) + b"".join(
            struct.pack("<I", m) + c + s for m, (c, s) in sorted(msg.keys.items())
        )
    elif isinstance(msg, Shares | SharesForward):
        body = struct.pack("<I", len(msg.ciphertexts)) + b"".join(
            struct.pack("<IH", m, len(blob)) + blob for m, blob in sorted(msg.ciphertexts.items())
        )
    elif isinstance(msg, Masked):
        dtype = np.dtype("<u4") if msg.modulus_bits <= 32 else np.dtype("<u8")
        body = (
            struct.pack("<BI", msg.modulus_bits, msg.words.size)
            + msg.words.astype(dtype, copy=False).tobytes()
        )
    elif isinstance(msg, UnmaskRequest):
        body = _ids(msg.seed_of) + _ids(msg.key_of)
    else:
        body = _share_map(msg.seed_shares) + _share_map(msg.key_shares)
    return head + body


def _ids(ids: tuple[int, ...]) -> bytes:
    return struct.pack(f"<I{len(ids)}I", len(ids), *ids)


def _share_map(shares: dict[int, int]) -> bytes:
    return struct.pack("<I", len(shares)) + b"".join(
        struct.pack("<I", m) + v.to_bytes(SHARE_BYTES, "big") for m, v in sorted(shares.items())
    )


class _Reader:
    """Reads a payload front to back; any short read or leftover byte is MALFORMED."""

    def __init__(self, raw: bytes) -> None:
        self.raw = memoryview(raw)
        self.at = 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.at + n > len(self.raw):
            raise SecAggRefusal(Reason.MALFORMED, "a payload shorter than its fields")
        out = bytes(self.raw[self.at : self.at + n])
        self.at += n
        return out

    def unpack(self, fmt: str) -> tuple:
        st = struct.Struct(fmt)
        return st.unpack(self.take(st.size))

    def count(self, item_bytes: int) -> int:
        (n,) = self.unpack("<I")
        if n * item_bytes > len(self.raw) - self.at:
            raise SecAggRefusal(Reason.MALFORMED, "a count larger than the payload")
        return n

    def done(self) -> None:
        if self.at != len(self.raw):
            raise SecAggRefusal(Reason.MALFORMED, "trailing bytes after the fields")


def decode(raw: bytes) -> Message:
    """The message in ``raw``; ``SecAggRefusal(MALFORMED)`` for anything that is not exactly one."""
    r = _Reader(raw)
    magic, version, kind, group_id, sender = r.unpack(_HEAD.format)
    if magic != _MAGIC or version != _VERSION:
        raise SecAggRefusal(Reason.MALFORMED, "not a secure-aggregation message of this version")
    msg: Message
    if kind == Setup.kind:
        members = r.unpack(f"<{r.count(4)}I")
        k, t, length, clip, qb, mb = r.unpack("<IIIdBB")
        msg = Setup(group_id, tuple(members), k, t, length, clip, qb, mb, sender)
    elif kind == Keys.kind:
        msg = Keys(group_id, sender, r.take(32), r.take(32), r.take(32))
    elif kind == KeysBroadcast.kind:
        keys = {}
        for _ in range(r.count(68)):
            (m,) = r.unpack("<I")
            keys[m] = (r.take(32), r.take(32))
        msg = KeysBroadcast(group_id, keys, sender)
    elif kind in (Shares.kind, SharesForward.kind):
        blobs = {}
        for _ in range(r.count(6)):
            m, n = r.unpack("<IH")
            if m in blobs:
                raise SecAggRefusal(Reason.MALFORMED, f"two ciphertexts for member {m}")
            blobs[m] = r.take(n)
        msg = (
            Shares(group_id, sender, blobs) if kind == Shares.kind else SharesForward(group_id, blobs, sender)
        )
    elif kind == Masked.kind:
        (mb,) = r.unpack("<B")
        if not 1 <= mb <= 64:
            raise SecAggRefusal(Reason.MALFORMED, f"modulus_bits {mb} outside 1..64")
        wb = word_bytes(mb)
        n = r.count(wb)
        words = np.frombuffer(r.take(n * wb), dtype="<u4" if wb == 4 else "<u8")
        msg = Masked(group_id, sender, words, mb)
    elif kind == UnmaskRequest.kind:
        seed_of = r.unpack(f"<{r.count(4)}I")
        key_of = r.unpack(f"<{r.count(4)}I")
        msg = UnmaskRequest(group_id, tuple(seed_of), tuple(key_of), sender)
    elif kind == Unmask.kind:
        msg = Unmask(group_id, sender, _read_shares(r), _read_shares(r))
    else:
        raise SecAggRefusal(Reason.MALFORMED, f"unknown message kind {kind}")
    r.done()
    return msg


def _read_shares(r: _Reader) -> dict[int, int]:
    out: dict[int, int] = {}
    for _ in range(r.count(4 + SHARE_BYTES)):
        (m,) = r.unpack("<I")
        v = int.from_bytes(r.take(SHARE_BYTES), "big")
        if m in out or v >= PRIME:
            raise SecAggRefusal(Reason.MALFORMED, "a repeated share or one outside the field")
        out[m] = v
    return out


__all__ = [
    "SERVER",
    "SHARE_CIPHERTEXT_BYTES",
    "SHARE_PLAINTEXT",
    "Keys",
    "KeysBroadcast",
    "Masked",
    "Message",
    "Setup",
    "Shares",
    "SharesForward",
    "Unmask",
    "UnmaskRequest",
    "decode",
    "encode",
]
