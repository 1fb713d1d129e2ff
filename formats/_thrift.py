"""The Thrift compact protocol, as far as Parquet's footer and page headers need it.

The encoders build a struct from ``(field id, compact type, encoded value)`` triples (the
plain Parquet writer's footer and page headers); the decoders read a struct back as a
dict of its fields, its lists skipped (a page header, read to find its page's body).
"""

from __future__ import annotations

from typing import Any

# Compact protocol type ids.
TRUE, FALSE, BYTE, I16, I32, I64, DOUBLE, BINARY, LIST, STRUCT = (
    1, 2, 3, 4, 5, 6, 7, 8, 9, 12
)  # fmt: skip


class ThriftError(Exception):
    """Bytes that end before their struct does, or hold a type this reader does not read."""


_ONE_BYTE = [bytes([n]) for n in range(0x80)]


def varint(n: int) -> bytes:
    if n < 0x80:
        return _ONE_BYTE[n]
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def zigzag(n: int) -> bytes:
    """An i16/i32/i64 value: zigzag varint."""
    return varint((n << 1) ^ (n >> 63))


def binary(data: bytes) -> bytes:
    return varint(len(data)) + data


def list_(element_type: int, items: list[bytes]) -> bytes:
    size = len(items)
    head = bytes([size << 4 | element_type]) if size < 15 else bytes([0xF0 | element_type])
    return head + (varint(size) if size >= 15 else b"") + b"".join(items)


def struct(*fields: tuple[int, int, bytes] | None, start: int = 0) -> bytes:
    """A struct of ``(field id, compact type, encoded value)`` in rising id order.

    ``start``: the id of the field encoded before these (the rest of a struct whose first
    fields were encoded apart).
    """
    out = bytearray()
    last = start
    for field in fields:
        if field is None:
            continue
        field_id, type_id, value = field
        delta = field_id - last
        if 0 < delta <= 15:
            out.append(delta << 4 | type_id)
        else:
            out.append(type_id)
            out += zigzag(field_id)
        out += value
        last = field_id
    out.append(0)
    return bytes(out)


def read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf):
            raise ThriftError("truncated")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def read_value(buf: memoryview, pos: int, type_id: int) -> tuple[Any, int]:
    """One Thrift compact value (structs as dicts, lists skipped to ``None``)."""
    if type_id in (TRUE, FALSE):
        return type_id == TRUE, pos
    if type_id == BYTE:
        return buf[pos], pos + 1
    if type_id in (I16, I32, I64):
        raw, pos = read_varint(buf, pos)
        return (raw >> 1) ^ -(raw & 1), pos
    if type_id == DOUBLE:
        return None, pos + 8
    if type_id == BINARY:
        size, pos = read_varint(buf, pos)
        return None, pos + size
    if type_id == STRUCT:
        return read_struct(buf, pos)
    if type_id == LIST:
        head = buf[pos]
        pos += 1
        size, element = head >> 4, head & 0x0F
        if size == 15:
            size, pos = read_varint(buf, pos)
        for _ in range(size):
            _, pos = read_value(buf, pos, element)
        return None, pos
    raise ThriftError(f"type {type_id}")


def read_struct(buf: memoryview, pos: int) -> tuple[dict[int, Any], int]:
    fields: dict[int, Any] = {}
    last = 0
    while True:
        if pos >= len(buf):
            raise ThriftError("truncated")
        head = buf[pos]
        pos += 1
        if head == 0:
            return fields, pos
        delta, type_id = head >> 4, head & 0x0F
        if delta:
            last += delta
        else:
            raw, pos = read_varint(buf, pos)
            last = (raw >> 1) ^ -(raw & 1)
        fields[last], pos = read_value(buf, pos, type_id)
