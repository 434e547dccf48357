"""Dedup never spreads damage (issue 41, finding 3; invariant 14): a blob known to be bad (a
read that failed verification, fsck) is never reused; the next commit of its bytes writes a
good copy, which the index then points at, so every commit that referenced the address reads
again; ``fsck --repair`` points the index at a good copy already in a pack.

Damage is made behind ckptstore's back (a byte flipped in the pack file at the blob's payload,
a truncated pack) or as the race of issue 41 finding 1 makes it (the real pack writer storing
other bytes under a shard's address). Every count is exact: shards, bytes, marks.
"""

from __future__ import annotations

import os
import sqlite3
import time
import uuid
from contextlib import closing
from pathlib import Path

import pytest
import torch

import ckptstore
from ckptstore.errors import BlobCorruptError, StoreWriteError
from ckptstore.layout import address, digest
from ckptstore.objects.packs import BLOB_HEADER, CODEC_RAW, pack_path

from tests.conftest import assert_bit_equal, run_fresh
from tests.unit.top.test_hardening import read_only_view

SHARD = 4096  # bytes: a float32 tensor of 4096 values is 4 shards


def _tensor(seed: int, n: int = 4096) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g)


def _key(t: torch.Tensor, shard: int) -> tuple[bytes, int]:
    """The address of shard ``shard`` of contiguous tensor ``t``."""
    b = t.contiguous().view(torch.uint8).numpy().tobytes()[shard * SHARD : (shard + 1) * SHARD]
    return digest(b), len(b)


def _row(root: Path, key: tuple[bytes, int]) -> tuple[int, str, int, int, int]:
    """``(blob id, pack, offset, stored_len, codec)`` of the catalog's row of ``key`` (a connection of its own: closed, it leaves no WAL behind)."""
    with closing(sqlite3.connect(root / "catalog.sqlite")) as c:
        return c.execute("SELECT id, pack, offset, stored_len, codec FROM blobs WHERE hash = ? AND raw_len = ?", key).fetchone()


def _marks(root: Path) -> list[tuple[int, str, int]]:
    with closing(sqlite3.connect(root / "catalog.sqlite")) as c:
        return c.execute("SELECT blob_id, pack, offset FROM bad_blobs ORDER BY blob_id").fetchall()


def _flip(root: Path, key: tuple[bytes, int], at: int = 7) -> None:
    """Flip one byte of the blob's payload in its pack file."""
    _, pack, offset, stored_len, _ = _row(root, key)
    path = pack_path(root, pack)
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(offset + BLOB_HEADER.size + at % stored_len)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x5A]))


def _truncate(root: Path, key: tuple[bytes, int]) -> None:
    """Cut the blob's pack file in the middle of the blob's payload (it must be the pack's last entry)."""
    _, pack, offset, stored_len, _ = _row(root, key)
    path = pack_path(root, pack)
    assert path.stat().st_size == offset + BLOB_HEADER.size + stored_len, "the blob is not the pack's last entry"
    os.chmod(path, 0o644)
    os.truncate(path, offset + BLOB_HEADER.size + stored_len // 2)


class _RacyWriter:
    """The real pack writer, except that the blob of address ``victim`` is stored with the bytes
    ``other`` (raw): a commit whose shard another thread changed between its hash and its write
    (issue 41, finding 1)."""

    def __init__(self, real, victim: tuple[bytes, int], other: bytes):
        self._real, self._victim, self._other = real, victim, other

    def __getattr__(self, name):
        return getattr(self._real, name)

    def __enter__(self):
        self._real.__enter__()
        return self

    def __exit__(self, *exc):
        return self._real.__exit__(*exc)

    def append(self, raw, digest=None):
        if (digest, len(raw)) == self._victim:
            return self._real.append_encoded(digest, len(raw), CODEC_RAW, self._other)
        return self._real.append(raw, digest)


def _racy_commit(root: Path, t: torch.Tensor, tag: str, shard: int) -> tuple[bytes, int]:
    """Commit ``t`` with shard ``shard`` stored under its address but with other bytes; returns that address."""
    victim = _key(t, shard)
    other = bytes(b ^ 0xFF for b in t.contiguous().view(torch.uint8).numpy().tobytes()[shard * SHARD : (shard + 1) * SHARD])
    with ckptstore.Store(root, create=True, shard_bytes=SHARD, compression_level=0) as s:
        real = s.pack_writer
        s.pack_writer = lambda: _RacyWriter(real(), victim, other)
        info = s.commit({"w": t}, tag=tag)
    assert (info.shards_new, info.new_bytes) == (4, 4 * SHARD)
    return victim


def _damage(root: Path, how: str, t: torch.Tensor, tag: str, shard: int) -> tuple[bytes, int]:
    """Commit ``t`` as ``tag`` and damage shard ``shard``'s blob ``how``; returns its address."""
    if how == "race":
        return _racy_commit(root, t, tag, shard)
    with ckptstore.Store(root, create=True, shard_bytes=SHARD, compression_level=0) as s:
        info = s.commit({"w": t}, tag=tag)
    assert (info.shards_new, info.new_bytes) == (4, 4 * SHARD)
    key = _key(t, shard)
    (_flip if how == "flip" else _truncate)(root, key)
    return key


@pytest.mark.parametrize("how", ["flip", "race", "truncate"])
def test_a_failed_read_marks_the_blob_and_the_next_commit_writes_a_good_copy(tmp_path, how):
    root = tmp_path / "s"
    t = _tensor(1)
    shard = 3 if how == "truncate" else 2  # a truncated pack: its last entry
    key = _damage(root, how, t, "a", shard)
    blob_id = _row(root, key)[0]
    # (a) checkout names the shard and its blob; the copy is marked bad
    with ckptstore.Store(root) as s:
        with pytest.raises(BlobCorruptError, match=f"leaf w, shard {shard}, blob {address(*key)}"):
            s.checkout("a")
    marks = _marks(root)
    assert [m[0] for m in marks] == [blob_id]
    # (b) a new commit of the same content, from a fresh Store, writes exactly that shard again
    with ckptstore.Store(root) as s:
        info = s.commit({"w": t.clone()}, tag="b")
        assert (info.shards_total, info.shards_new, info.new_bytes) == (4, 1, SHARD)
        assert_bit_equal(s.checkout("b")["w"], t)
        # (c) the old commit reads again: the address's row points at the good copy
        assert_bit_equal(s.checkout("a")["w"], t)
        rep = s.fsck(deep=True)
        assert rep.ok, rep.problems
        assert rep.blobs_checked == 4 and rep.marked_bad == 0
    assert _marks(root) == []
    assert _row(root, key)[0] == blob_id  # the same row (every commit's shard rows name it), a new place
    assert _row(root, key)[1:3] != marks[0][1:3]
    with ckptstore.Store(root) as s:  # and nothing more to write
        info = s.commit({"w": t.clone()}, tag="c")
        assert (info.shards_new, info.new_bytes) == (0, 0)


def test_fresh_process_commit_writes_the_good_copy(tmp_path):
    root = tmp_path / "s"
    t = _tensor(2)
    key = _damage(root, "race", t, "a", 1)
    with ckptstore.Store(root) as s:
        with pytest.raises(BlobCorruptError, match=f"shard 1, blob {address(*key)}"):
            s.checkout("a")
    assert len(_marks(root)) == 1
    torch.save(t, tmp_path / "t.pt")
    out = run_fresh(f"""
        import torch, ckptstore
        t = torch.load({str(tmp_path / 't.pt')!r})
        with ckptstore.Store({str(root)!r}) as s:
            info = s.commit({{"w": t}}, tag="b")
            print(info.shards_new, info.new_bytes)
            assert torch.equal(s.checkout("a")["w"].view(torch.uint8), t.view(torch.uint8))
    """)
    assert out.stdout.split() == ["1", str(SHARD)]
    assert _marks(root) == []
    with ckptstore.Store(root) as s:
        assert s.fsck(deep=True).ok
        assert_bit_equal(s.checkout("a")["w"], t)


def test_fsck_marks_what_it_finds_and_the_next_commit_replaces_it(tmp_path):
    """Without any checkout: fsck --deep finds the bad copy and marks it."""
    root = tmp_path / "s"
    t = _tensor(3)
    key = _damage(root, "flip", t, "a", 0)
    with ckptstore.Store(root) as s:
        rep = s.fsck(deep=True)
        assert not rep.ok and rep.corrupt_blobs == [address(*key)] and rep.damaged_tags == ["a"]
        assert rep.marked_bad == 1
        again = s.fsck(deep=True)  # marked once
        assert again.corrupt_blobs == [address(*key)] and again.marked_bad == 0
    with ckptstore.Store(root) as s:
        info = s.commit({"w": t.clone(), "v": _tensor(4)}, tag="b")
        assert (info.shards_total, info.shards_new, info.new_bytes) == (8, 5, 5 * SHARD)
        assert s.fsck(deep=True).ok
        assert_bit_equal(s.checkout("a")["w"], t)


def test_the_all_zero_shard(tmp_path):
    """The most exposed address: fresh buffer rows and zero-initialised state share it."""
    root = tmp_path / "s"
    zeros = torch.zeros(4096)
    half = torch.cat([_tensor(5, 2048), torch.zeros(2048)])  # shards 2 and 3 are the all-zero shard
    with ckptstore.Store(root, create=True, shard_bytes=SHARD) as s:  # (compressed: zeros pay)
        first = s.commit({"z": zeros, "h": half}, tag="a")
        assert (first.shards_total, first.shards_new) == (8, 3)
        s.commit({"m": torch.zeros(2048)}, tag="m")  # 2 shards, both the zero shard
    key = _key(zeros, 0)
    assert _row(root, key)[4] != CODEC_RAW  # stored compressed
    _flip(root, key, at=3)
    with ckptstore.Store(root) as s:
        with pytest.raises(BlobCorruptError, match=address(*key)):
            s.checkout("m")
    assert len(_marks(root)) == 1
    with ckptstore.Store(root) as s:  # a quiet commit of zeros: one new copy, of the zero shard only
        info = s.commit({"q": torch.zeros(8192)}, tag="q")
        assert (info.shards_total, info.shards_new, info.new_bytes) == (8, 1, SHARD)
        for tag, want in (("a", {"z": zeros, "h": half}), ("m", {"m": torch.zeros(2048)}), ("q", {"q": torch.zeros(8192)})):
            got = s.checkout(tag)
            for k, v in want.items():
                assert_bit_equal(got[k], v)
        assert s.fsck(deep=True).ok
    assert _marks(root) == []


def test_a_store_that_keeps_its_digest_cache_writes_the_copy_too(tmp_path):
    """The same Store commits, fails to read, commits again: the ids its digest cache offers
    (``prior``) are checked against the marks in the index step, and the component the
    commit would share (unchanged) is written again instead."""
    root = tmp_path / "s"
    t = _tensor(6)
    with ckptstore.Store(root, create=True, shard_bytes=SHARD, compression_level=0) as s:
        s.commit({"w": t}, tag="a")
        key = _key(t, 1)
        _flip(root, key)
        with pytest.raises(BlobCorruptError, match=f"shard 1, blob {address(*key)}"):
            s.checkout("a")
        info = s.commit({"w": t}, tag="b")  # the same tensor object, unchanged: the cache's hashes and ids
        assert (info.shards_total, info.shards_new, info.new_bytes) == (4, 1, SHARD)
        assert _marks(root) == []
        assert_bit_equal(s.checkout("a")["w"], t)
        info = s.commit({"w": t}, tag="c")
        assert (info.shards_new, info.new_bytes) == (0, 0)
        assert s.fsck(deep=True).ok


def test_fsck_repair_points_the_index_at_a_good_copy_in_a_pack(tmp_path):
    """Another good copy of the address already in a pack the catalog knows (here: one
    written by a second commit of the same bytes that lost the race to index them) replaces
    the bad one on ``fsck --repair``, with no new commit."""
    root = tmp_path / "s"
    t = _tensor(7)
    with ckptstore.Store(root, create=True, shard_bytes=SHARD, compression_level=0) as s:
        s.commit({"w": t}, tag="a")
        key = _key(t, 2)
        # a commit that wrote the same bytes before the first one indexed them: its copy is
        # in its pack, the row names the first copy (INSERT OR IGNORE)
        with s.pack_writer() as w:
            spare = w.append(memoryview(t.contiguous().view(torch.uint8).numpy().tobytes()[2 * SHARD : 3 * SHARD]), key[0])
            w.append(memoryview(_tensor(8).view(torch.uint8).numpy().tobytes()[:SHARD]))
            w.finish()
            with s.catalog.write():
                s.catalog.conn.executemany("INSERT INTO packs (id, size, created_at) VALUES (?, ?, ?)", [(p, n, 0.0) for p, n in w.pack_ids])
    _flip(root, key)
    bad_place = _row(root, key)[1:3]
    with ckptstore.Store(root) as s:
        rep = s.fsck(repair=True)
        assert rep.ok, rep.problems
        assert rep.replaced_blobs == [address(*key)] and rep.corrupt_blobs == [] and rep.marked_bad == 1
        assert _row(root, key)[1:3] == (spare.pack, spare.offset) != bad_place
        assert _marks(root) == []
        assert_bit_equal(s.checkout("a")["w"], t)
        assert s.fsck(deep=True).ok
        info = s.commit({"w": t.clone()}, tag="b")
        assert (info.shards_new, info.new_bytes) == (0, 0)


def test_fsck_repair_without_a_good_copy_marks_and_says_so(tmp_path):
    root = tmp_path / "s"
    t = _tensor(9)
    key = _damage(root, "flip", t, "a", 3)
    with ckptstore.Store(root) as s:
        rep = s.fsck(repair=True)
        assert not rep.ok and rep.replaced_blobs == [] and rep.corrupt_blobs == [address(*key)] and rep.marked_bad == 1
        assert rep.damaged_tags == ["a"]
    assert len(_marks(root)) == 1


def test_gc_keeps_the_good_copy_and_frees_the_bad_one(tmp_path):
    """After the good copy replaced the bad one, GC (grace 0) keeps every commit readable."""
    root = tmp_path / "s"
    t = _tensor(10)
    key = _damage(root, "flip", t, "a", 1)
    with ckptstore.Store(root) as s:
        with pytest.raises(BlobCorruptError):
            s.checkout("a")
        s.commit({"w": t.clone()}, tag="b")
        bad = _row(root, key)
        rep = s.gc(grace=0)
        assert (rep.packs_consolidated, rep.packs_deleted, rep.blobs_deleted) == (4, 4, 0)
        assert s.fsck(deep=True).ok
        for tag in ("a", "b"):
            assert_bit_equal(s.checkout(tag)["w"], t)
        assert _row(root, key)[0] == bad[0] and _row(root, key)[1] != bad[1]  # the good copy, moved by the repack


def test_gc_drops_the_mark_with_the_blob(tmp_path):
    """A marked blob that no kept commit needs any more: GC deletes its row, and its mark with it."""
    root = tmp_path / "s"
    t = _tensor(13)
    key = _damage(root, "flip", t, "a", 0)
    with ckptstore.Store(root) as s:
        with pytest.raises(BlobCorruptError):
            s.checkout("a")
        assert len(_marks(root)) == 1
        s.commit({"v": _tensor(14)}, tag="other")
        s.delete_tag("a")
        rep = s.gc(grace=0)
        assert rep.commits_dropped == 1 and rep.blobs_deleted == 4
        assert _marks(root) == [] and _row(root, key) is None
        assert s.fsck(deep=True).ok


def test_a_read_only_store_is_never_written(tmp_path):
    """A store that cannot be written here (a read-only bind mount) reports the bad blob and
    marks nothing; ``fsck --repair`` is refused; no file changes."""
    src = tmp_path / "src"
    root = src / "s"
    t = _tensor(11)
    key = _damage(root, "flip", t, "a", 2)
    before = {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in root.rglob("*") if p.is_file()}
    with read_only_view(src, tmp_path / "ro") as ro, ckptstore.Store(ro / "s", create=False) as s:
        assert not s.catalog.writable
        with pytest.raises(BlobCorruptError, match=address(*key)):
            s.checkout("a")
        rep = s.fsck(deep=True)
        assert rep.corrupt_blobs == [address(*key)] and rep.marked_bad == 0
        with pytest.raises(StoreWriteError, match="read-only"):
            s.fsck(repair=True)
    after = {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in root.rglob("*") if p.is_file()}
    assert after == before
    assert _marks(root) == []


def test_migration_adds_the_table_and_an_old_read_only_store_reads(tmp_path):
    """Schema 4 -> 5 adds ``bad_blobs``; a schema-4 store that cannot be written reads as if it had it (no marks)."""
    src = tmp_path / "src"
    root = src / "s"
    t = _tensor(12)
    with ckptstore.Store(root, create=True, shard_bytes=SHARD) as s:
        s.commit({"w": t}, tag="a")
        s.catalog.conn.executescript("DROP TABLE bad_blobs; DELETE FROM migrations WHERE version >= 5; PRAGMA user_version = 4;")
    with read_only_view(src, tmp_path / "ro") as ro, ckptstore.Store(ro / "s", create=False) as s:
        assert not s.catalog.writable and s.catalog.user_version == 4
        assert_bit_equal(s.checkout("a")["w"], t)
        assert s.fsck(deep=True).ok
    with ckptstore.Store(root) as s:
        assert s.catalog.migrated_from == 4 and s.catalog.user_version == 5
        assert s.catalog.rows("SELECT COUNT(*) FROM bad_blobs", raw=True) == [(0,)]
        assert s.catalog.rows("SELECT description FROM migrations WHERE version = 5", raw=True)[0][0].startswith("blobs known to be bad")
        assert_bit_equal(s.checkout("a")["w"], t)
        key = _key(t, 0)
    assert (root / "catalog.sqlite.v4.bak").exists()
    _flip(root, key)  # and it works on the migrated store
    with ckptstore.Store(root) as s:
        with pytest.raises(BlobCorruptError):
            s.checkout("a")
        assert s.commit({"w": t.clone()}, tag="b").new_bytes == SHARD
        assert_bit_equal(s.checkout("a")["w"], t)


# --- object storage: the cache marks, a new copy (a newer pack) is preferred ---------------------------


@pytest.fixture
def url(s3_server) -> str:
    return f"s3://ckpt/t-{uuid.uuid4().hex[:12]}"


def _bucket_flip(url: str, loc) -> None:
    """Flip one payload byte of the blob at ``loc`` in its pack object, behind ckptstore's back."""
    from ckptstore.backends import open_backend
    from ckptstore.objects.packindex import pack_key

    from tests.unit.home.test_bucket_store import _raw_put

    with open_backend(url) as b:
        data = bytearray(b.get(pack_key(loc.pack)))
    data[loc.offset + BLOB_HEADER.size + 7] ^= 0x5A
    _raw_put(url, pack_key(loc.pack), bytes(data))


def test_bucket_a_failed_read_marks_and_the_next_commit_replaces(tmp_path, url):
    t = _tensor(21)
    key = _key(t, 2)
    cache = lambda name: tmp_path / f"cache-{name}"  # noqa: E731 (one cache folder per machine)
    with ckptstore.Store(url, cache=cache("writer"), shard_bytes=SHARD, compression_level=0) as s:
        info = s.commit({"w": t}, tag="a")
        assert (info.shards_new, info.new_bytes) == (4, 4 * SHARD)
        loc = s.locate([key])[key]
    _bucket_flip(url, loc)
    time.sleep(1.1)  # (object times are whole seconds: the good copy's pack is then strictly the newer)
    with ckptstore.Store(url, cache=cache("reader")) as s:  # a machine that never saw the store
        with pytest.raises(BlobCorruptError, match=f"leaf w, shard 2, blob {address(*key)}"):
            s.checkout("a")
        assert s.catalog.rows("SELECT COUNT(*) FROM bad_blobs", raw=True) == [(1,)]
        info = s.commit({"w": t.clone()}, tag="b")  # the same machine: a good copy, in a new pack
        assert (info.shards_total, info.shards_new, info.new_bytes) == (4, 1, SHARD)
        assert s.catalog.rows("SELECT COUNT(*) FROM bad_blobs", raw=True) == [(0,)]
        assert_bit_equal(s.checkout("a")["w"], t)
        assert_bit_equal(s.checkout("b")["w"], t)
    # Another machine's cache, and a new one, first read the copy the tag's pack hint names (the bad
    # one): that read fails and marks it; the cache, brought up to date, finds the newer copy.
    with ckptstore.Store(url, cache=cache("fresh")) as s:
        with pytest.raises(BlobCorruptError, match=f"shard 2, blob {address(*key)}"):
            s.checkout("a")
        assert_bit_equal(s.checkout("a")["w"], t)
        assert s.catalog.rows("SELECT COUNT(*) FROM bad_blobs", raw=True) == [(0,)]
    # The writer's cache has read every pack (the newer one too) and points at the bad copy:
    # its failed reads mark it, and fsck --repair points it at the good copy the bucket holds.
    with ckptstore.Store(url, cache=cache("writer")) as s:
        s.refresh_index()
        for _ in range(2):
            with pytest.raises(BlobCorruptError, match=f"shard 2, blob {address(*key)}"):
                s.checkout("a")
        assert s.catalog.rows("SELECT COUNT(*) FROM bad_blobs", raw=True) == [(1,)]
        rep = s.fsck(repair=True)
        assert rep.ok and rep.replaced_blobs == [address(*key)] and rep.blobs_checked == 4, rep
        assert s.catalog.rows("SELECT COUNT(*) FROM bad_blobs", raw=True) == [(0,)]
        assert_bit_equal(s.checkout("a")["w"], t)
    with ckptstore.Store(url, cache=cache("deep")) as s:
        rep = s.fsck(deep=True)
        assert rep.ok, rep.problems
        assert rep.blobs_checked == 4


def test_bucket_repair_finds_an_older_good_copy(tmp_path, url):
    """A newer pack holds a bad copy of an address an older pack holds intact (a rank's
    detached writer that stored other bytes under it): a new cache takes the newer, bad
    copy, its read fails and marks it; ``fsck --repair`` finds the older intact copy and
    points the cache at it."""
    from ckptstore.store import pack_writer_at

    t = _tensor(22)
    key = _key(t, 1)
    with ckptstore.Store(url, cache=tmp_path / "c-writer", shard_bytes=SHARD, compression_level=0) as s:
        assert s.commit({"w": t}, tag="a").new_bytes == 4 * SHARD
    time.sleep(1.1)  # (whole-second object times: the bad copy's pack is the newer)
    w = pack_writer_at(url, 0, 1 << 20)
    try:
        w.append_encoded(key[0], key[1], CODEC_RAW, bytes(SHARD))  # zeros under shard 1's address
        w.finish()
    finally:
        w.close()
    with ckptstore.Store(url, cache=tmp_path / "c-new") as s:
        s.refresh_index()
        for _ in range(2):  # (the cache has read every pack: no other copy to move to)
            with pytest.raises(BlobCorruptError, match=f"shard 1, blob {address(*key)}"):
                s.checkout("a")
        rep = s.fsck(repair=True)
        assert rep.ok and rep.replaced_blobs == [address(*key)] and rep.marked_bad == 0, rep
        assert s.catalog.rows("SELECT COUNT(*) FROM bad_blobs", raw=True) == [(0,)]
        assert_bit_equal(s.checkout("a")["w"], t)
        info = s.commit({"w": t.clone()}, tag="b")
        assert (info.shards_new, info.new_bytes) == (0, 0)
