"""The cryptographic primitives of SecAgg+, all from the ``cryptography`` package: X25519 key
agreement, HKDF-SHA256 key derivation, AES-256-GCM for the shares, SHA-256 commitments and
AES-256-CTR as the pseudo-random generator that expands a 32-byte seed into a mask.

The mask PRG writes AES-CTR's keystream straight into a numpy array, so expanding a seed into
537k words costs one OpenSSL call (about a millisecond) and no Python loop."""

from __future__ import annotations

import os

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

from felix.secagg.refusals import Reason, SecAggRefusal

KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
_ZERO_IV = bytes(16)


def random_bytes(n: int) -> bytes:
    """Fresh randomness from the operating system (seeds, nonces)."""
    return os.urandom(n)


def new_keypair() -> tuple[X25519PrivateKey, bytes]:
    """An X25519 key pair: the private key object and the raw 32-byte public key."""
    sk = X25519PrivateKey.generate()
    return sk, sk.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def private_bytes(sk: X25519PrivateKey) -> bytes:
    """The raw 32 bytes of a private key (what is Shamir-shared)."""
    return sk.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())


def private_from_bytes(raw: bytes) -> X25519PrivateKey:
    return X25519PrivateKey.from_private_bytes(raw)


def public_of(raw_private: bytes) -> bytes:
    """The raw public key of a raw private key (to check a reconstructed key)."""
    pk = private_from_bytes(raw_private).public_key()
    return pk.public_bytes(Encoding.Raw, PublicFormat.Raw)


_PROBE = X25519PrivateKey.generate()


def check_public_key(raw: bytes) -> None:
    """Refuse a public key of the wrong length or of small order (its shared secret is all zero,
    which the library refuses): ``SecAggRefusal(MALFORMED_KEY)``."""
    if not isinstance(raw, bytes) or len(raw) != KEY_BYTES:
        raise SecAggRefusal(Reason.MALFORMED_KEY, f"a public key must be {KEY_BYTES} bytes")
    try:
        _PROBE.exchange(X25519PublicKey.from_public_bytes(raw))
    except ValueError:
        raise SecAggRefusal(Reason.MALFORMED_KEY, "a public key of small order") from None


def agree(sk: X25519PrivateKey, peer_public: bytes, info: bytes) -> bytes:
    """A 32-byte key both ends derive: HKDF-SHA256 of the X25519 shared secret, bound to ``info``
    (purpose and group)."""
    try:
        shared = sk.exchange(X25519PublicKey.from_public_bytes(peer_public))
    except ValueError:
        raise SecAggRefusal(Reason.MALFORMED_KEY, "key agreement failed (small-order key)") from None
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=info).derive(shared)


def seal(key: bytes, plaintext: bytes, aad: bytes) -> bytes:
    """AES-256-GCM under a fresh random nonce: nonce || ciphertext || tag."""
    nonce = random_bytes(NONCE_BYTES)
    return nonce + AESGCM(key).encrypt(nonce, plaintext, aad)


def open_sealed(key: bytes, blob: bytes, aad: bytes) -> bytes:
    """The plaintext of :func:`seal`; ``SecAggRefusal(BAD_SHARE)`` if it does not authenticate."""
    if len(blob) < NONCE_BYTES + TAG_BYTES:
        raise SecAggRefusal(Reason.BAD_SHARE, "ciphertext too short")
    try:
        return AESGCM(key).decrypt(blob[:NONCE_BYTES], blob[NONCE_BYTES:], aad)
    except InvalidTag:
        raise SecAggRefusal(Reason.BAD_SHARE, "a share that does not authenticate") from None


def commit(secret: bytes) -> bytes:
    """SHA-256 commitment to a 32-byte uniformly random secret (binding; hiding as the secret has
    256 bits of entropy), so that the server can check a reconstructed mask seed."""
    h = hashes.Hash(hashes.SHA256())
    h.update(secret)
    return h.finalize()


def prg_words(seed: bytes, n: int, dtype: type[np.unsignedinteger]) -> np.ndarray:
    """``n`` pseudo-random words of ``dtype`` (uint32 or uint64) expanded from a 32-byte seed by
    AES-256-CTR (the keystream of a zero message)."""
    size = np.dtype(dtype).itemsize * n
    enc = Cipher(algorithms.AES(seed), modes.CTR(_ZERO_IV)).encryptor()
    buf = bytearray(size + 15)  # update_into wants room for one block more than the input
    enc.update_into(bytes(size), buf)
    return np.frombuffer(buf, dtype=dtype, count=n)


__all__ = [
    "KEY_BYTES",
    "agree",
    "check_public_key",
    "commit",
    "new_keypair",
    "open_sealed",
    "prg_words",
    "private_bytes",
    "private_from_bytes",
    "public_of",
    "random_bytes",
    "seal",
]
