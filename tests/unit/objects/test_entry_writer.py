"""The one pack-entry writer (:class:`ckptstore.objects.packs.EntryWriter`) and its two sinks: pack
files (:class:`~ckptstore.objects.packs.PackWriter`) and uploads to object storage
(:class:`~ckptstore.objects.bucketformat.BucketPackWriter`, on the moto server). The same entries
make the same bytes through either sink, and those bytes are the stored format, assembled
here by hand from docs/design.md's layout (so a change of either sink that changes a byte fails)."""

from __future__ import annotations

import os
import random
import struct
import uuid
from concurrent.futures import ThreadPoolExecutor

import xxhash
import zstandard

from ckptstore.backends import open_backend
from ckptstore.objects.bucketformat import BucketPackWriter
from ckptstore.objects.packindex import decode_index, index_key, pack_key, scan_pack
from ckptstore.objects.packs import CODEC_RAW, CODEC_ZSTD, RECORD_MAGIC, PackWriter, pack_path, scan

PACK_BYTES = 150_000


def _blobs(seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [
        rng.randbytes(10),  # too small to compress
        bytes(rng.randrange(4) for _ in range(5000)),  # compresses (2 bits of 8)
        rng.randbytes(70_000),  # does not
        bytes(100_000),  # compresses to nothing: one pack holds it past the others
        b"",
        rng.randbytes(90_000),  # rolls over
    ]


def _expected(blobs: list[bytes], record: bytes) -> list[bytes]:
    """The packs the design's layout gives: 16-byte header, then 40-byte entry headers and
    payloads, a new pack once one holding an entry would pass PACK_BYTES."""
    packs, cur = [], None
    for magic, kind, raw in [(b"CKBL", 0, b) for b in blobs] + [(b"CKRC", 1, record)]:
        codec, payload = CODEC_RAW, raw
        if magic == b"CKBL" and len(raw) >= 64:
            packed = zstandard.ZstdCompressor(level=3).compress(raw)
            probe = min(32 << 10, max(4096, len(raw) // 32))
            pays = not (len(raw) > 2 * probe and len(zstandard.ZstdCompressor(level=3).compress(raw[:probe])) > 0.75 * probe)
            if pays and len(packed) <= 0.75 * len(raw):
                codec, payload = CODEC_ZSTD, packed
        entry = struct.pack("<4sBBHQQ16s", magic, 1, codec, kind, len(raw), len(payload), xxhash.xxh3_128_digest(raw)) + payload
        if cur is None or (len(cur) > 16 and len(cur) + len(entry) > PACK_BYTES):
            cur = bytearray(struct.pack("<4sHHQ", b"CKPK", 1, 0, 0))
            packs.append(cur)
        cur += entry
    return [bytes(p) for p in packs]


def _where(locs, ids) -> list[tuple]:
    """Each location with its pack's ordinal in place of the pack id (random per writer)."""
    order = [pid for pid, _ in ids]
    return [(order.index(loc.pack), loc.offset, loc.stored_len, loc.codec, loc.digest) for loc in locs]


def _write(writer, blobs: list[bytes], record: bytes) -> list:
    locs = [writer.append(memoryview(bytearray(b))) for b in blobs]  # a writable buffer: staged (copied) first
    locs.append(writer.append_record(1, record))
    writer.finish()
    return locs


def test_both_sinks_write_the_designs_bytes(tmp_path, s3_server):
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    blobs, record = _blobs(seed), b'{"commit": "x"}'
    want = _expected(blobs, record)
    assert len(want) == 2  # the rollover is exercised

    root = tmp_path / "store"
    for sub in ("tmp", "blobs"):
        (root / sub).mkdir(parents=True)
    with PackWriter(root, level=3, pack_bytes=PACK_BYTES) as fw:
        flocs = _write(fw, blobs, record)
        fids = fw.pack_ids
    files = [pack_path(root, pid).read_bytes() for pid, _ in fids]
    assert files == want
    assert [size for _, size in fids] == [len(p) for p in want]
    assert not os.listdir(root / "tmp")  # every pack renamed into blobs/

    backend = open_backend(f"s3://ckpt/w-{uuid.uuid4().hex[:12]}")
    with ThreadPoolExecutor(2) as pool, BucketPackWriter(backend, 3, PACK_BYTES, pool) as bw:
        blocs = _write(bw, blobs, record)
        bids = bw.pack_ids
        assert bw.objects_uploaded == 4 and bw.bytes_uploaded == sum(len(p) for p in want) + sum(
            len(backend.get(index_key(pid))) for pid, _ in bids)
    uploaded = [backend.get(pack_key(pid)) for pid, _ in bids]
    assert uploaded == want
    # Same locations but for the pack ids; each .idx lists what walking its pack finds.
    assert _where(flocs, fids) == _where(blocs, bids)
    for (pid, size), data in zip(bids, uploaded):
        walked = scan_pack(data, pid, "test")
        assert decode_index(backend.get(index_key(pid)), pid, size, "test") == walked
    for (pid, _), (bpid, _) in zip(fids, bids):
        entries, problem = scan(pack_path(root, pid), pid)
        assert problem is None
        assert [(e.loc.offset, e.loc.stored_len, e.loc.digest, e.magic, e.kind) for e in entries] == [
            (e.loc.offset, e.loc.stored_len, e.loc.digest, e.magic, e.kind) for e in scan_pack(backend.get(pack_key(bpid)), bpid, "test")]
    assert [e.magic for e in scan(pack_path(root, fids[-1][0]), fids[-1][0])[0]][-1] == RECORD_MAGIC
    backend.close()


def test_a_writer_closed_before_finish_leaves_nothing(tmp_path, s3_server):
    """The file sink removes its temporary packs; the upload sink never uploads its open pack."""
    root = tmp_path / "store"
    for sub in ("tmp", "blobs"):
        (root / sub).mkdir(parents=True)
    with PackWriter(root, pack_bytes=PACK_BYTES) as fw:
        fw.append(memoryview(b"x" * 1000))
        assert len(os.listdir(root / "tmp")) == 1
    assert os.listdir(root / "tmp") == [] and fw.pack_ids == []
    backend = open_backend(f"s3://ckpt/w-{uuid.uuid4().hex[:12]}")
    with ThreadPoolExecutor(1) as pool, BucketPackWriter(backend, 3, PACK_BYTES, pool) as bw:
        bw.append(memoryview(b"x" * 1000))
    assert bw.pack_ids == [] and bw.objects_uploaded == 0 and list(backend.list("blobs")) == []
    backend.close()
