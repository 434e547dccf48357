"""Pack indexes (``blobs/<xx>/<id>.idx``): built from real packs, read back through both
backends, and every damaged or hostile index refused."""

from __future__ import annotations

import random
import struct
import uuid

import pytest

from ckptstore.backends import open_backend
from ckptstore.errors import BlobCorruptError
from ckptstore.layout import digest
from ckptstore.objects.packindex import INDEX_ENTRY, INDEX_HEADER, decode_index, encode_index, index_key, pack_key, scan_pack
from ckptstore.objects.packs import BLOB_HEADER, PackWriter, pack_path, scan


@pytest.fixture
def pack(tmp_path):
    """A real pack written by PackWriter: blobs raw and compressed, an empty one, a record."""
    blobs = [random.Random(0).randbytes(70_000), bytes(50_000), b"", b"x" * 10]
    with PackWriter(tmp_path, level=3) as w:
        locs = [w.append(memoryview(b)) for b in blobs]
        w.append_record(1, b'["commit record"]')
        w.finish()
        (pack_id, size), = w.pack_ids
    raw = pack_path(tmp_path, pack_id).read_bytes()
    assert len(raw) == size
    entries, problem = scan(pack_path(tmp_path, pack_id), pack_id)
    assert problem is None and len(entries) == 5
    assert [e.loc for e in entries[:4]] == locs and [e.loc.codec for e in entries[:2]] == [0, 1]
    return pack_id, raw, entries, blobs


def test_index_round_trip(pack):
    pack_id, raw, entries, _ = pack
    idx = encode_index(entries)
    assert len(idx) == INDEX_HEADER.size + 5 * INDEX_ENTRY.size + 16
    assert decode_index(idx, pack_id, len(raw)) == entries
    assert scan_pack(raw, pack_id) == entries  # rebuilt from the pack's bytes alone
    assert decode_index(encode_index([]), "e" * 32, 16) == []


@pytest.mark.parametrize("where", ["local", "s3"])
def test_index_and_pack_through_a_backend(pack, where, tmp_path, request):
    """Upload a pack and its index, read the index back, fetch every blob by range and rehash it."""
    pack_id, raw, entries, blobs = pack
    if where == "s3":
        request.getfixturevalue("s3_server")
        backend = open_backend(f"s3://ckpt/idx-{uuid.uuid4().hex[:8]}")
    else:
        backend = open_backend(tmp_path / "remote", create=True)
    assert backend.put_new(pack_key(pack_id), raw) and backend.put_new(index_key(pack_id), encode_index(entries))
    got = decode_index(backend.get(index_key(pack_id)), pack_id, backend.head(pack_key(pack_id)).size)
    raw_blobs = [e for e in got if e.kind == 0 and e.loc.codec == 0]
    ranges = [(e.loc.offset + BLOB_HEADER.size, e.loc.offset + BLOB_HEADER.size + e.loc.stored_len) for e in raw_blobs]
    for e, payload in zip(raw_blobs, backend.get_ranges(pack_key(pack_id), ranges)):
        assert digest(payload) == e.loc.digest and bytes(payload) in blobs


def _rehash(body: bytes) -> bytes:
    return body + digest(body)


def test_damaged_indexes_are_refused(pack):
    pack_id, raw, entries, _ = pack
    idx = encode_index(entries)
    body = idx[:-16]
    entry0 = INDEX_HEADER.size

    def with_entry_field(i: int, fmt: str, at: int, value) -> bytes:
        b = bytearray(body)
        struct.pack_into(fmt, b, entry0 + i * INDEX_ENTRY.size + at, value)
        return _rehash(bytes(b))

    cases = {
        "shorter than a header": idx[:20],
        "trailer hash mismatch": idx[:-1] + bytes([idx[-1] ^ 1]),
        "not a pack index": _rehash(b"CKIY" + body[4:]),
        "do not fit": _rehash(body[:8] + struct.pack("<Q", 6) + body[16:]),
        "where the previous one ends": with_entry_field(2, "<Q", 40, entries[2].loc.offset + 1),
        "bad entry header": with_entry_field(1, "<B", 5, 7),  # codec 7
        "inconsistent entry header": with_entry_field(0, "<Q", 16, entries[0].loc.stored_len + 1),  # raw blob: stored != raw
    }
    for match, bad in cases.items():
        with pytest.raises(BlobCorruptError, match=match):
            decode_index(bad, pack_id, len(raw))
    with pytest.raises(BlobCorruptError, match=f"the pack has {len(raw) + 1} bytes"):
        decode_index(idx, pack_id, len(raw) + 1)


def test_damaged_packs_are_refused_by_the_scan(pack):
    pack_id, raw, _, _ = pack
    with pytest.raises(BlobCorruptError, match="bad pack header"):
        scan_pack(b"CKPX" + raw[4:], pack_id)
    with pytest.raises(BlobCorruptError, match="past the pack"):
        scan_pack(raw[:-1], pack_id)
    with pytest.raises(BlobCorruptError, match="truncated entry header"):
        scan_pack(raw + b"\0" * 10, pack_id)
    with pytest.raises(BlobCorruptError, match="bad entry header at offset 16"):
        scan_pack(raw[:16] + b"JUNK" + raw[20:], pack_id)
