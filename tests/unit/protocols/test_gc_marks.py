"""One reader of the GC marks, one rule for a mark that cannot be read (docs/design.md, "GC on
object storage: two phases, no lock", item 5): it withholds every pack it may name, and
deletes none. On a bucket (the moto server) with real damaged ``gc/*.json`` objects: the
commit's check, push and the GC read them alike (:func:`ckptstore.objects.bucketformat.read_gc_marks`);
in a folder the marks are the packs' ``retired_at`` (:func:`ckptstore.home.local.retired_marks`),
read by the same rule."""

from __future__ import annotations

import json
import sqlite3
import time
import uuid

import pytest
import torch

import ckptstore
from ckptstore.backends import open_backend
from ckptstore.objects.bucketformat import RemoteIndex, read_gc_marks
from ckptstore.home.local import retired_marks
from ckptstore.objects.packindex import pack_key

#: Damaged marks, as bytes: each cannot be read, so each may name any pack.
DAMAGED = {
    "not-json": b'{"packs": ["0123',
    "a-list": b'["0123456789abcdef0123456789abcdef"]',
    "no-commits": b'{"at": 1, "packs": ["0123456789abcdef0123456789abcdef"]}',
    "packs-a-string": b'{"at": 1, "commits": [], "packs": "0123456789abcdef0123456789abcdef"}',
    "a-pack-not-a-string": b'{"at": 1, "commits": [], "packs": [7]}',
}


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(200_000, generator=g), "step": torch.tensor([seed])}


def _same(a: dict, b: dict) -> None:
    for k in a:
        assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k


def _mark_key() -> str:
    return f"gc/{time.time_ns():020d}-{uuid.uuid4().hex}.json"


@pytest.fixture
def url(s3_server) -> str:
    return f"s3://ckpt/m-{uuid.uuid4().hex[:12]}"


def test_each_damaged_mark_withholds_every_pack_for_each_reader(url):
    s = ckptstore.Store(url)
    s.commit(_state(1), tag="t")
    b = open_backend(url)
    packs = sorted(o.key.rsplit("/", 1)[1][:-5] for o in b.list("blobs") if o.key.endswith(".pack"))
    assert packs
    good = _mark_key()
    b.put_new(good, json.dumps({"at": 1, "commits": [], "objects": [], "packs": ["f" * 32]}).encode())
    marks = read_gc_marks(b)
    assert [k for _, k, _ in marks.marks] == [good] and marks.packs == {"f" * 32} and not marks.unreadable
    assert not marks.withholds_all and "f" * 32 in marks and not any(p in marks for p in packs)
    index = RemoteIndex(b).refresh()
    assert all(index.reusable(k) is not None for k in index.blobs)  # push reuses them all
    for name, raw in DAMAGED.items():
        key = _mark_key()
        b.put_new(key, raw)
        for marks in (read_gc_marks(b), s.home.marked_packs(), index.read_marks()):
            (got, at, names), = marks.unreadable
            assert got == key and at == b.head(key).mtime and names is None, name
            assert marks.withholds_all and all(p in marks for p in packs + ["e" * 32]), name
            # It may name any pack made no later than itself; one made after it (a rewrite), none.
            assert marks.withholds("e" * 32, at) and not marks.withholds("e" * 32, at + 1), name
            assert [k for _, k, _ in marks.marks] == [good], name  # the readable mark still counts for the sweep
        assert index.all_marked and all(index.reusable(k) is None for k in index.blobs), name
        b.delete(key)
    assert not read_gc_marks(b).withholds_all
    b.close()
    s.close()


def test_a_commit_and_a_push_reuse_nothing_beside_a_damaged_mark_and_gc_removes_it(tmp_path, url):
    state = _state(2)
    s = ckptstore.Store(url)
    first = s.commit(state, tag="a")
    assert first.shards_new == first.shards_total > 1
    b = open_backend(url)
    key = _mark_key()
    b.put_new(key, DAMAGED["not-json"])
    again = s.commit(state, tag="b")  # every blob is in a pack the damaged mark may name: written again
    assert again.shards_new == again.shards_total == first.shards_total
    _same(state, s.checkout("b"))
    # A push from a folder: the remote holds every blob, yet none is reused while the mark stands.
    local = ckptstore.Store(tmp_path / "local", create=True)
    local.commit(state, tag="p")
    report = local.push(url, "p")
    assert report.blobs_copied == first.shards_total
    b.delete(key)
    local.commit({**state, "step": torch.tensor([3])}, tag="p")
    assert local.push(url, "p").blobs_copied == 1  # the mark gone: the others are reused
    # The GC deletes the damaged mark and no pack a live commit needs.
    b.put_new(key, DAMAGED["a-list"])
    report = s.gc(grace=0)
    assert b.head(key) is None and not list(b.list("gc"))
    for tag in ("a", "b"):
        _same(state, s.checkout(tag))
    assert s.fsck(deep=True).ok
    b.close()
    local.close()
    s.close()


def test_gc_sweeps_nothing_on_a_damaged_marks_account(url):
    """A pack no commit needs, named by a mark that is damaged (one of its packs is not a
    string): the sweep does not go by it, though its other name reads. The run marks the
    pack anew and deletes the damaged mark; the run a grace period later sweeps the pack."""
    s = ckptstore.Store(url)
    s.commit(_state(4), tag="t")
    b = open_backend(url)
    writer = s.pack_writer()  # a pack whose writer died before its commit: no record uses it
    writer.append(memoryview(b"orphan" * 100))
    writer.finish()
    (pid, _), = writer.pack_ids
    key = _mark_key()
    b.put_new(key, json.dumps({"at": 1, "commits": [], "objects": [], "packs": [pid, 7]}).encode())
    time.sleep(2.2)  # both older than the grace period (1 s, whole seconds on the server)
    report = s.gc(grace=1.0)
    assert report.packs_deleted == 0 and b.head(pack_key(pid)) is not None and b.head(key) is None
    marks = read_gc_marks(b)
    assert marks.packs == {pid} and not marks.unreadable  # this run's own mark
    time.sleep(2.2)
    report = s.gc(grace=1.0)
    assert report.packs_deleted == 1 and b.head(pack_key(pid)) is None and not list(b.list("gc"))
    _same(_state(4), s.checkout("t"))
    b.close()
    s.close()


def _retire(root, pid: str, value) -> None:
    """Write ``value`` into pack ``pid``'s ``retired_at`` with SQLite (a damaged row)."""
    conn = sqlite3.connect(root / "catalog.sqlite")
    with conn:
        conn.execute("UPDATE packs SET retired_at = ? WHERE id = ?", (value, pid))
    conn.close()


def _packs(s) -> list[tuple]:
    return s.catalog.rows("SELECT id, retired_at FROM packs ORDER BY id", raw=True)


def test_a_folders_marks_follow_the_same_rule(tmp_path):
    """``retired_at`` that is not a number: a mark that cannot be read. It withholds its pack
    (the rows name it) and deletes nothing: a live pack stays, a dead one is marked anew and
    swept by that readable mark."""
    root = tmp_path / "store"
    s = ckptstore.Store(root, create=True)
    keep, drop = _state(5), _state(6)
    holding = lambda: {p for (p,) in s.catalog.rows("SELECT DISTINCT pack FROM blobs", raw=True)}
    s.commit(keep, tag="keep")
    live, = holding()
    s.commit(drop, tag="drop")
    dead = sorted(holding() - {live})
    assert len(dead) == 1
    s.close()
    _retire(root, live, "damaged")
    _retire(root, dead[0], "damaged")
    s = ckptstore.Store(root)
    marks = retired_marks(_packs(s))
    assert [k for k, _, _ in marks.unreadable] == sorted([live, dead[0]]) and not marks.marks
    assert live in marks and dead[0] in marks and "e" * 32 not in marks and not marks.withholds_all
    assert marks.oldest() == {}  # the sweep goes by none of them
    s.delete_tag("drop")
    report = s.gc(grace=0, small_pack_bytes=0)  # (no consolidation: the packs stay as they are)
    assert report.packs_deleted >= 1 and live in [p for p, _ in _packs(s)] and dead[0] not in [p for p, _ in _packs(s)]
    assert not (root / "blobs" / dead[0][:2] / f"{dead[0]}.pack").exists()
    _same(keep, s.checkout("keep"))
    marks = retired_marks(_packs(s))
    assert live in marks and [k for k, _, _ in marks.unreadable] == [live]  # a live pack: no GC marks it, it stays withheld
    report = s.gc(grace=0, small_pack_bytes=0)
    assert report.packs_deleted == 0 and live in [p for p, _ in _packs(s)]
    _same(keep, s.checkout("keep"))
    assert s.fsck(deep=True).ok
    # A readable mark: the same question, the same answer.
    assert retired_marks([("a" * 32, 12.5), ("b" * 32, None)]).oldest() == {"a" * 32: 12.5}
    s.close()
