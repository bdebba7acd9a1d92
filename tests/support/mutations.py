"""Mutations of protobuf wire bytes, for fuzzing a parser: byte-level (bytes flipped, a cut, a splice
of two messages, bytes inserted, dropped or repeated) and structural, at any depth of a message whose
nested messages its descriptor names (a field duplicated, removed, moved, renumbered, given another
wire type, its length set huge or off by some, a varint set to an extreme or encoded overlong, a string
or packed field's bytes changed, an unknown field added). Structural mutations re-encode the
enclosing lengths, so the change reaches the parser of the message it was made in.

Pure: no I/O; every choice from the ``random.Random`` passed in, so a seed replays a mutant.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from google.protobuf.descriptor import Descriptor

# Doubles a parser must survive in a fixed64 field (timeouts): the non-finite ones, both zeros,
# the extremes, NaNs with a sign and a payload.
DOUBLES = (0.0, -0.0, 1e-3, 5e-4, 0.5, 2.5, 100.0, -1.0, -1e-9, 5e-324, 1e-300, 1e308, -1e308,
           float("inf"), float("-inf"), float("nan"),
           struct.unpack("<d", b"\x01\x00\x00\x00\x00\x00\xf8\xff")[0],  # a negative NaN with a payload
           struct.unpack("<d", b"\x00\x00\x00\x00\x00\x00\xf0\x7f")[0] + 0.0)
# Varint values at the edges of the integer types a field may be read as.
EXTREME_VARINTS = (0, 1, 2, 127, 128, 255, 2**31 - 2, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 1, 2**53,
                   2**63 - 1, 2**63, 2**64 - 1)
# Lengths a length-delimited field may claim beyond the bytes it has.
HUGE_LENGTHS = (2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 5, 2**63, 2**64 - 1)
WIRE_TYPES = range(8)  # 0, 1, 2, 5 valid; 3 and 4 (groups), 6 and 7 invalid


def put_varint(value: int) -> bytes:
    value &= (1 << 64) - 1
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def read_varint(data: bytes, i: int) -> tuple[int, int] | None:
    """The varint at ``data[i:]`` (at most ten bytes) and the index after it; None if it does not end."""
    value = shift = 0
    for k in range(i, min(i + 10, len(data))):
        value |= (data[k] & 0x7F) << shift
        if not data[k] & 0x80:
            return value, k + 1
        shift += 7
    return None


@dataclass
class Field:
    number: int
    wire_type: int
    value: bytes  # varint, fixed64 and fixed32: the encoded value; length-delimited: the bytes after the length
    key: bytes | None = None  # encoded as given instead of (number, wire_type)
    length: bytes | None = None  # length-delimited: this length prefix instead of the true one

    def encode(self) -> bytes:
        key = self.key if self.key is not None else put_varint(self.number << 3 | self.wire_type)
        if self.wire_type != 2:
            return key + self.value
        return key + (self.length if self.length is not None else put_varint(len(self.value))) + self.value


def fields(data: bytes) -> list[Field] | None:
    """``data`` as a message's fields in wire order, or None where it is not one (groups included)."""
    out: list[Field] = []
    i = 0
    while i < len(data):
        key = read_varint(data, i)
        if key is None or key[0] >> 3 == 0:
            return None
        (k, i) = key
        number, wire_type = k >> 3, k & 7
        if wire_type == 0:
            got = read_varint(data, i)
            if got is None:
                return None
            out.append(Field(number, 0, data[i:got[1]]))
            i = got[1]
        elif wire_type in (1, 5):
            size = 8 if wire_type == 1 else 4
            if i + size > len(data):
                return None
            out.append(Field(number, wire_type, data[i:i + size]))
            i += size
        elif wire_type == 2:
            got = read_varint(data, i)
            if got is None or got[1] + got[0] > len(data):
                return None
            out.append(Field(number, 2, data[got[1]:got[1] + got[0]]))
            i = got[1] + got[0]
        else:
            return None
    return out


def encode(message: list[Field]) -> bytes:
    return b"".join(f.encode() for f in message)


def nested(descriptor: Descriptor) -> dict[int, Descriptor]:
    """The fields of ``descriptor`` that hold messages, by number."""
    return {f.number: f.message_type for f in descriptor.fields if f.message_type is not None}


class Mutator:
    """Mutants of messages of one type (``descriptor``); ``corpus``: messages to splice with."""

    def __init__(self, rng: random.Random, descriptor: Descriptor) -> None:
        self.rng = rng
        self.descriptor = descriptor

    def mutate(self, data: bytes, corpus: Sequence[bytes] = ()) -> bytes:
        """One to three mutations of ``data`` stacked, structural ones about twice as often."""
        rng = self.rng
        for _ in range(rng.choice((1, 1, 1, 2, 2, 3))):
            if rng.random() < 0.65:
                data = self.structural(data, self.descriptor)
            else:
                data = self.bytewise(data, corpus)
        return data

    # -- bytes ------------------------------------------------------------------------------------

    def bytewise(self, data: bytes, corpus: Sequence[bytes] = ()) -> bytes:
        rng = self.rng
        op = rng.randrange(7)
        if not data:
            return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 8)))
        if op == 0:  # bytes flipped
            out = bytearray(data)
            for _ in range(rng.randint(1, 4)):
                out[rng.randrange(len(out))] = rng.randrange(256)
            return bytes(out)
        if op == 1:  # one bit
            out = bytearray(data)
            out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
            return bytes(out)
        if op == 2:  # cut
            return data[:rng.randrange(len(data))]
        if op == 3 and corpus:  # a splice: one message's start, another's end
            other = rng.choice(corpus)
            return data[:rng.randrange(len(data) + 1)] + other[rng.randrange(len(other) + 1):]
        if op == 4:  # bytes inserted
            at = rng.randrange(len(data) + 1)
            return data[:at] + bytes(rng.randrange(256) for _ in range(rng.randint(1, 16))) + data[at:]
        if op == 5:  # a range dropped
            at = rng.randrange(len(data))
            return data[:at] + data[at + rng.randint(1, 32):]
        at = rng.randrange(len(data))  # a range repeated
        piece = data[at:at + rng.randint(1, 64)]
        return data[:at] + piece + data[at:]

    # -- structure ----------------------------------------------------------------------------------

    def structural(self, data: bytes, descriptor: Descriptor) -> bytes:
        """One structural mutation somewhere in ``data`` (a ``descriptor`` message), the enclosing
        messages re-encoded with their new lengths. Where: every kind of field present (a field number
        of a message type, at any depth) as likely as any other, then one of its instances; so the
        descriptor of a frame is reached as often as its thirty entries. Bytes that are not a message
        get a byte mutation."""
        rng = self.rng
        root = fields(data)
        if not root:
            return self.bytewise(data) if root is None else encode(self._added([]))
        sites: list[tuple[list, list[Field], int, tuple[str, int]]] = []

        def walk(message: list[Field], desc: Descriptor, path: list) -> None:
            inner = nested(desc)
            for i, f in enumerate(message):
                sites.append((path, message, i, (desc.full_name, f.number)))
                child = fields(f.value) if f.wire_type == 2 and f.number in inner else None
                if child:
                    walk(child, inner[f.number], [*path, (message, i, child)])

        walk(root, descriptor, [])
        kind = rng.choice(sorted({site[3] for site in sites}))
        path, message, i, _ = rng.choice([site for site in sites if site[3] == kind])
        self.at_level(message, i)
        for parent, j, child in reversed(path):
            parent[j] = Field(parent[j].number, 2, encode(child))
        return encode(root)

    def _added(self, message: list[Field], near: int = 0) -> list[Field]:
        """An unknown field (or a known one, where it does not belong) put into ``message`` near ``near``."""
        rng = self.rng
        number = rng.choice((rng.randint(1, 20), rng.randint(21, 2**29 - 1)))
        wire_type = rng.choice((0, 1, 2, 5))
        value = {0: put_varint(rng.choice(EXTREME_VARINTS)), 1: struct.pack("<d", rng.choice(DOUBLES)),
                 2: bytes(rng.randrange(256) for _ in range(rng.randrange(8))), 5: bytes(4)}[wire_type]
        message.insert(min(len(message), near + rng.randint(0, 1)), Field(number, wire_type, value))
        return message

    def at_level(self, message: list[Field], i: int) -> None:
        """One mutation of ``message``'s field ``i`` (or a field added beside it)."""
        rng = self.rng
        op = rng.randrange(10)
        if op == 9:
            self._added(message, i)
            return
        f = message[i]
        if op == 0:  # duplicated
            message.insert(rng.randrange(len(message) + 1), Field(f.number, f.wire_type, f.value))
        elif op == 1:  # removed
            del message[i]
        elif op == 2:  # moved
            moved = message.pop(i)
            message.insert(rng.randrange(len(message) + 1), moved)
        elif op == 3:  # renumbered: a neighbour, any small number, the largest, or numbers no key may hold
            number = rng.choice((f.number + 1, max(1, f.number - 1), rng.randint(1, 20), 2**29 - 1, 0, 2**29,
                                 19000))
            f.key = put_varint(number << 3 | f.wire_type)
        elif op == 4:  # another wire type, the value's bytes as they were
            wire_type = rng.choice([w for w in WIRE_TYPES if w != f.wire_type])
            value = put_varint(len(f.value)) + f.value if f.wire_type == 2 else f.value
            message[i] = _Raw(put_varint(f.number << 3 | wire_type) + value)
        elif op == 5 and f.wire_type == 2:  # a length beyond the bytes there are
            f.length = _varint_bytes(rng.choice((len(f.value) + 1, len(f.value) + rng.randint(2, 100),
                                                 *HUGE_LENGTHS)), rng)
        elif op == 6 and f.wire_type == 2 and f.value:  # the bytes of a string, bytes or packed field
            f.value = self.bytewise(f.value)
        elif op == 6 and f.wire_type == 2:
            f.value = bytes(rng.randrange(256) for _ in range(rng.randint(1, 300)))
        elif f.wire_type == 0:  # an extreme value, or the same value overlong
            value = read_varint(f.value, 0)
            if rng.random() < 0.3 and value is not None:
                f.value = _overlong(value[0], rng)
            else:
                f.value = _varint_bytes(rng.choice(EXTREME_VARINTS), rng)
        elif f.wire_type == 1:
            f.value = (struct.pack("<d", rng.choice(DOUBLES)) if rng.random() < 0.7
                       else bytes(rng.randrange(256) for _ in range(8)))
        elif f.wire_type == 2:  # emptied, or cut
            f.value = f.value[:rng.randrange(len(f.value) + 1)]
        else:
            f.value = bytes(rng.randrange(256) for _ in range(len(f.value)))


class _Raw(Field):
    """A field written as given, bytes for bytes."""

    def __init__(self, raw: bytes) -> None:
        super().__init__(0, -1, raw)

    def encode(self) -> bytes:
        return self.value


def _overlong(value: int, rng: random.Random) -> bytes:
    """``value`` as a varint padded with continuation bytes up to ten bytes (still the same value)."""
    short = bytearray(put_varint(value))
    pad = rng.randint(1, max(1, 10 - len(short)))
    if len(short) + pad > 10:
        return bytes(short)
    short[-1] |= 0x80
    return bytes(short) + b"\x80" * (pad - 1) + b"\x00"


def _varint_bytes(value: int, rng: random.Random) -> bytes:
    """``value`` as a varint; now and then malformed instead: eleven bytes, or a tenth byte past 64 bits."""
    roll = rng.random()
    if roll < 0.05:
        return b"\xff" * 10 + b"\x01"
    if roll < 0.1:
        return b"\xff" * 9 + bytes([rng.randint(2, 0x7F)])
    return put_varint(value)
