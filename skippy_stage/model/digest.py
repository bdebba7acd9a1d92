"""A logit row's digest: how a recorded schedule names the exact logits a sample was drawn from.

Exactness here means bit-identical logits (max |diff| == 0.0), so a digest of the float32 bytes
decides it as well as the n_vocab floats would, in 8 bytes instead of ~200 KB a row: the final
stage reports one per sample when a step asks (``BatchEntry.digest_logits``) and ``replay``
computes the same on the unsplit model's row.
"""

from __future__ import annotations

import hashlib

import numpy as np

DIGEST_BYTES = 8


def logit_digest(row: np.ndarray) -> int:
    """The first 8 bytes of BLAKE2b over ``row``'s float32 values, as a little-endian integer."""
    values = np.ascontiguousarray(row, dtype=np.float32)
    return int.from_bytes(hashlib.blake2b(memoryview(values).cast("B"), digest_size=DIGEST_BYTES).digest(), "little")


def digest_hex(digest: int) -> str:
    """A digest as a schedule writes it (16 hex digits)."""
    return f"{digest:0{2 * DIGEST_BYTES}x}"
