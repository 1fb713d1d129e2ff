"""Reading the index of a TensorFlow tensor bundle (what the ``SaveV2`` op writes).

A bundle ``{prefix}`` is a data file ``{prefix}.data-00000-of-00001`` holding the raw
bytes of its tensors one after another, and an index ``{prefix}.index``: a table (the
LevelDB SSTable layout, uncompressed) from tensor name to a ``BundleEntryProto`` giving
the tensor's offset, size and masked crc32c in the data file. :func:`read_index` returns
those entries, each block of the index checked against its own crc32c;
:func:`index_bytes` writes such an index for data that is already on disk (a restore
has a parameter server read a binary shard file as a bundle's data file, and TensorFlow's
reader check each tensor's bytes against the crc32c the index records).

TensorFlow's ``BundleWriter`` writes each file under a temporary name first
(``{file}.tempstate{digits}``) and renames it once complete; a task that dies while
writing leaves those. :func:`file_name_ends` matches every name a bundle's files take.
"""

from __future__ import annotations

import dataclasses
import re
import struct

from de_store.errors import FormatError
from de_store.formats._crc32c import crc32c

#: The last 8 bytes of a table file.
_TABLE_MAGIC = 0xDB4775248B80FB57
_FOOTER_BYTES = 48
_MASK_DELTA = 0xA282EAD8


@dataclasses.dataclass(frozen=True)
class BundleEntry:
    """One tensor of a bundle: its byte range in the data file and that range's crc32c."""

    offset: int
    size: int
    crc32c: int


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """A tensor for :func:`index_bytes` to record: its dtype (a TensorFlow ``DataType``
    enum value), shape and byte range in the data file, with that range's crc32c."""

    dtype: int
    shape: tuple[int, ...]
    offset: int
    size: int
    crc32c: int


#: What TensorFlow adds to a bundle's prefix: its (single-shard) data file, its index (a
#: TF checkpoint is such a bundle: ``binding`` and ``convert`` find one by its index).
DATA_SUFFIX = ".data-00000-of-00001"
INDEX_SUFFIX = ".index"
#: What ``BundleWriter`` adds, with a random number, to a file's name while it writes it.
TEMP_INFIX = ".tempstate"


def data_path(prefix: str) -> str:
    """The data file of the single-shard bundle ``prefix``."""
    return prefix + DATA_SUFFIX


def index_path(prefix: str) -> str:
    return prefix + INDEX_SUFFIX


def file_name_ends() -> str:
    """A regular expression for what each file of a bundle adds to its prefix: the data
    file or the index, complete or under the name it has while ``BundleWriter`` writes it."""
    files = f"{re.escape(DATA_SUFFIX)}|{re.escape(INDEX_SUFFIX)}"
    return rf"({files})({re.escape(TEMP_INFIX)}\d+)?"


def unmask(masked: int) -> int:
    """The crc32c a table or bundle stores masked (rotated right 15 bits, plus a delta)."""
    rotated = (masked - _MASK_DELTA) & 0xFFFFFFFF
    return ((rotated >> 17) | (rotated << 15)) & 0xFFFFFFFF


def mask(crc: int) -> int:
    """The masked form of ``crc`` that tables and bundles store (see :func:`unmask`)."""
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def index_bytes(entries: dict[str, TensorEntry]) -> bytes:
    """The index of a single-shard, little-endian bundle holding ``entries`` by name:
    what ``BundleWriter`` would write for them, for a data file already written.

    One data block holds the header and the entries in name order, each a restart point
    (no key prefix shared), then an empty metaindex block, the index block and the footer.
    """
    from tensorflow.core.protobuf import tensor_bundle_pb2

    header = tensor_bundle_pb2.BundleHeaderProto(num_shards=1)
    header.version.producer = 1
    records = [(b"", header.SerializeToString())]
    for name in sorted(entries, key=str.encode):
        e = entries[name]
        proto = tensor_bundle_pb2.BundleEntryProto(
            dtype=e.dtype, offset=e.offset, size=e.size, crc32c=mask(e.crc32c)
        )
        for dim in e.shape:
            proto.shape.dim.add(size=dim)
        records.append((name.encode(), proto.SerializeToString()))
    data = _block_bytes(records)
    metaindex = _block_bytes([])
    index = _block_bytes([(records[-1][0], _handle(0, len(data) - 5))])
    footer = _handle(len(data), len(metaindex) - 5)
    footer += _handle(len(data) + len(metaindex), len(index) - 5)
    footer = footer.ljust(_FOOTER_BYTES - 8, b"\0") + struct.pack("<Q", _TABLE_MAGIC)
    return data + metaindex + index + footer


def _block_bytes(records: list[tuple[bytes, bytes]]) -> bytes:
    """A table block of ``records`` (each its own restart point) with its trailer."""
    body, restarts = bytearray(), []
    for key, value in records:
        restarts.append(len(body))
        body += _to_varint(0) + _to_varint(len(key)) + _to_varint(len(value)) + key + value
    restarts = restarts or [0]
    body += struct.pack(f"<{len(restarts)}I", *restarts) + struct.pack("<I", len(restarts))
    body += b"\0"  # type: no compression
    return bytes(body) + struct.pack("<I", mask(crc32c(body)))


def _handle(offset: int, size: int) -> bytes:
    return _to_varint(offset) + _to_varint(size)


def _to_varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def read_index(data: bytes, where: str) -> dict[str, BundleEntry]:
    """The entries of the bundle index ``data`` (the file ``where``), by tensor name."""
    from tensorflow.core.protobuf import tensor_bundle_pb2

    if len(data) < _FOOTER_BYTES or struct.unpack("<Q", data[-8:])[0] != _TABLE_MAGIC:
        raise FormatError(
            f"{where}: not a TensorFlow bundle index: expected a table footer ending in "
            f"{_TABLE_MAGIC:#x} in its last {_FOOTER_BYTES} bytes, found {len(data)} bytes "
            "without it"
        )
    footer = data[-_FOOTER_BYTES:]
    _, pos = _varint(footer, 0)  # the metaindex block: unused
    _, pos = _varint(footer, pos)
    index_offset, pos = _varint(footer, pos)
    index_size, _ = _varint(footer, pos)
    entries = {}
    for _, handle in _block(data, index_offset, index_size, where):
        offset, pos = _varint(handle, 0)
        size, _ = _varint(handle, pos)
        for name, value in _block(data, offset, size, where):
            if not name:  # the bundle's header
                continue
            proto = tensor_bundle_pb2.BundleEntryProto.FromString(value)
            if proto.shard_id != 0 or proto.slices:
                raise FormatError(f"{where}: tensor {name!r} is sliced or in another shard")
            entries[name.decode()] = BundleEntry(proto.offset, proto.size, unmask(proto.crc32c))
    return entries


def _block(data: bytes, offset: int, size: int, where: str) -> list[tuple[bytes, bytes]]:
    """The ``(key, value)`` entries of the table block at ``offset``, checked."""
    if offset + size + 5 > len(data):
        raise FormatError(
            f"{where}: the block at byte {offset} ({size} bytes and its 5-byte trailer) "
            f"runs past the end of the file ({len(data)} bytes)"
        )
    contents, kind = data[offset : offset + size], data[offset + size]
    (stored,) = struct.unpack("<I", data[offset + size + 1 : offset + size + 5])
    found = crc32c(data[offset : offset + size + 1])
    if unmask(stored) != found:
        raise FormatError(
            f"{where}: block at byte {offset} fails its crc32c: recorded "
            f"{unmask(stored):#010x}, computed {found:#010x}"
        )
    if kind != 0:
        raise FormatError(
            f"{where}: block at byte {offset} is compressed (type {kind}), expected type 0"
        )
    (restarts,) = struct.unpack("<I", contents[-4:])
    end = len(contents) - 4 - 4 * restarts
    entries, key, pos = [], b"", 0
    while pos < end:
        shared, pos = _varint(contents, pos)
        unshared, pos = _varint(contents, pos)
        length, pos = _varint(contents, pos)
        key = key[:shared] + contents[pos : pos + unshared]
        pos += unshared
        entries.append((key, contents[pos : pos + length]))
        pos += length
    return entries


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return result, pos
