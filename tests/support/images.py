"""Small images for the multimodal tests, written without an imaging library: PNG is a zlib
stream of filtered scanlines in three chunks, and a seed fixes every pixel."""

from __future__ import annotations

import base64
import struct
import zlib

import numpy as np


def png(width: int, height: int, seed: int) -> bytes:
    """An RGB PNG of seeded random pixels (smooth enough to look like something, not that it matters)."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, size=(max(1, height // 8), max(1, width // 8), 3))
    pixels = np.kron(coarse, np.ones((8, 8, 1)))[:height, :width].astype(np.uint8)
    pixels = np.pad(pixels, ((0, height - pixels.shape[0]), (0, width - pixels.shape[1]), (0, 0)), mode="edge")
    raw = b"".join(b"\x00" + pixels[y].tobytes() for y in range(height))  # filter 0 on every row

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def data_url(image: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(image).decode()}"
