"""Pack indexes: the ``blobs/<xx>/<id>.idx`` object written beside each pack on object
storage (docs/design.md, "Object storage"), so that the blobs and records of a pack are
known without reading it.

Format (all integers little-endian)::

    header   16 bytes  b"CKIX", u16 format version (1), u16 0, u64 entry count
    entries  48 bytes each: the entry's 40-byte header exactly as in the pack
             (see :mod:`ckptstore.objects.packs`), then u64 its offset in the pack
    trailer  16 bytes  XXH3-128 of everything before it

An index is derived data: the pack is self-describing (its entries follow each other
from the 16-byte pack header), so :func:`scan_pack` rebuilds the index from the pack's
bytes. :func:`decode_index` checks everything before returning: the trailer hash, the
count against the size, each header's magic, version and codec, and that the entries
tile the pack from its header to its end without gaps (the pack's size, when given,
must be where the last entry ends). Blobs are still checked against their own header
and rehashed when read.
"""

from __future__ import annotations

import struct

from ..core.errors import BlobCorruptError
from ..core.layout import digest
from .packs import BLOB_HEADER, BLOB_MAGIC, CODEC_RAW, CODECS, FORMAT_VERSION, PACK_HEADER, PACK_MAGIC, RECORD_MAGIC, BlobLoc, Entry

INDEX_MAGIC = b"CKIX"
INDEX_VERSION = 1
INDEX_HEADER = struct.Struct("<4sHHQ")
INDEX_ENTRY = struct.Struct("<40sQ")
TRAILER = 16


def pack_key(pack_id: str) -> str:
    """The object key of pack ``pack_id`` (the local store's own path under its folder)."""
    return f"blobs/{pack_id[:2]}/{pack_id}.pack"


def index_key(pack_id: str) -> str:
    """The object key of pack ``pack_id``'s index."""
    return f"blobs/{pack_id[:2]}/{pack_id}.idx"


def encode_index(entries: list[Entry]) -> bytes:
    """The index of a pack whose entries are ``entries`` (in pack order, as :func:`ckptstore.objects.packs.scan` gives them)."""
    parts = [INDEX_HEADER.pack(INDEX_MAGIC, INDEX_VERSION, 0, len(entries))]
    for e in entries:
        loc = e.loc
        header = BLOB_HEADER.pack(e.magic, FORMAT_VERSION, loc.codec, e.kind, loc.raw_len, loc.stored_len, loc.digest)
        parts.append(INDEX_ENTRY.pack(header, loc.offset))
    body = b"".join(parts)
    return body + digest(body)


def _entry(header: bytes, pack_id: str, offset: int, where: str) -> Entry:
    magic, version, codec, kind, raw_len, stored_len, dig = BLOB_HEADER.unpack(header)
    if magic not in (BLOB_MAGIC, RECORD_MAGIC) or version != FORMAT_VERSION or codec not in CODECS:
        raise BlobCorruptError(f"{where}: bad entry header at offset {offset} (magic {magic!r}, version {version}, codec {codec})")
    if (magic == BLOB_MAGIC) != (kind == 0) or (codec == CODEC_RAW and stored_len != raw_len) or stored_len > raw_len:
        raise BlobCorruptError(f"{where}: inconsistent entry header at offset {offset} (kind {kind}, codec {codec}, lengths {raw_len}/{stored_len})")
    return Entry(BlobLoc(dig, raw_len, pack_id, offset, stored_len, codec), kind, magic)


def decode_index(data: bytes, pack_id: str, pack_size: int | None = None, where: str = "") -> list[Entry]:
    """The entries of pack ``pack_id`` from its index bytes, after checking them (see the module docstring).

    Args:
        data: the index object's bytes.
        pack_id: the pack it indexes.
        pack_size: the pack object's size in bytes, if known (from ``head`` or ``list``).
        where: names the index in error messages.

    Raises:
        BlobCorruptError: naming what is wrong.
    """
    data = bytes(data)
    where = where or f"index of pack {pack_id}"
    if len(data) < INDEX_HEADER.size + TRAILER:
        raise BlobCorruptError(f"{where}: {len(data)} bytes, shorter than a header and trailer")
    if digest(data[:-TRAILER]) != data[-TRAILER:]:
        raise BlobCorruptError(f"{where}: trailer hash mismatch (the index is damaged)")
    magic, version, _, count = INDEX_HEADER.unpack_from(data)
    if magic != INDEX_MAGIC or version != INDEX_VERSION:
        raise BlobCorruptError(f"{where}: not a pack index of format {INDEX_VERSION} (magic {magic!r}, version {version})")
    if len(data) != INDEX_HEADER.size + count * INDEX_ENTRY.size + TRAILER:
        raise BlobCorruptError(f"{where}: {count} entries do not fit its {len(data)} bytes")
    entries = []
    expect = PACK_HEADER.size
    for i in range(count):
        header, offset = INDEX_ENTRY.unpack_from(data, INDEX_HEADER.size + i * INDEX_ENTRY.size)
        if offset != expect:
            raise BlobCorruptError(f"{where}: entry {i} at offset {offset}, where the previous one ends at {expect}")
        e = _entry(header, pack_id, offset, where)
        entries.append(e)
        expect = offset + BLOB_HEADER.size + e.loc.stored_len
    if pack_size is not None and expect != pack_size:
        raise BlobCorruptError(f"{where}: its entries end at byte {expect}, the pack has {pack_size} bytes")
    return entries


def scan_pack(data, pack_id: str, where: str = "") -> list[Entry]:
    """The entries of a whole pack held in memory (``data``: bytes-like), walked from its header.

    Raises:
        BlobCorruptError: a bad pack header, a bad or truncated entry header, or an entry past the end.
    """
    view = memoryview(data).cast("B")
    where = where or f"pack {pack_id}"
    if len(view) < PACK_HEADER.size or PACK_HEADER.unpack_from(view)[:2] != (PACK_MAGIC, FORMAT_VERSION):
        raise BlobCorruptError(f"{where}: bad pack header")
    entries = []
    offset = PACK_HEADER.size
    while offset < len(view):
        if offset + BLOB_HEADER.size > len(view):
            raise BlobCorruptError(f"{where}: truncated entry header at offset {offset}")
        e = _entry(bytes(view[offset : offset + BLOB_HEADER.size]), pack_id, offset, where)
        end = offset + BLOB_HEADER.size + e.loc.stored_len
        if end > len(view):
            raise BlobCorruptError(f"{where}: the entry at offset {offset} ends at byte {end}, past the pack's {len(view)} bytes")
        entries.append(e)
        offset = end
    return entries
