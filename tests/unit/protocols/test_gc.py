"""GC: retention, grace period, locking, and the C22 cases."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import ckptstore
from ckptstore.adapters import REGISTRY
from ckptstore.protocols.archive import check_export
from ckptstore.errors import BlobCorruptError, ContainerError, GCLockedError, IntegrityError, InvalidArgumentError, StoreWriteError
from ckptstore.protocols.gc import gc_lock, parse_duration

from tests.conftest import assert_bit_equal, row_count


def layers(changed: int, value: float) -> dict:
    """Five 128x128 layers; layer ``changed`` holds ``value``, the others are fixed."""
    torch.manual_seed(0)
    out = {f"l{i}": torch.randn(128, 128) for i in range(5)}
    out[f"l{changed}"] = torch.full((128, 128), value)
    return out


def blob_ids(store, ref) -> set[int]:
    return {r["blob_id"] for r in store.catalog.rows(
        "SELECT s.blob_id FROM shards s JOIN commit_leaves l ON l.id = s.leaf_id WHERE l.commit_id = ?", (store.resolve(ref),))}


def test_durations_and_bad_arguments(store):
    assert parse_duration("90s") == 90 and parse_duration("15m") == 900 and parse_duration("2d") == 172800 and parse_duration("0") == 0
    before = row_count(store)
    for kwargs in ({"grace": "soon"}, {"keep_within": "-1h"}, {"keep_tags": ["[abc"]}, {"keep_last": -1}):
        with pytest.raises(InvalidArgumentError):
            store.gc(**kwargs)
    assert row_count(store) == before


def test_retention_keep_last_keep_tag_keep_within(store):
    ids = [store.commit({"x": torch.full((4,), float(i))}, tag="latest").id for i in range(5)]
    rel = [store.commit({"y": torch.full((4,), float(i))}, tag="release-1").id for i in range(3)]
    dry = store.gc(grace=0, dry_run=True)
    assert sorted(dry.dropped) == sorted(ids[:4] + rel[:2]) and len(store.log()) == 8  # nothing changed
    report = store.gc(grace=0, keep_last=2, keep_tags=["release-*"])
    assert sorted(report.dropped) == sorted(ids[:3])
    assert {c.id for c in store.log()} == {ids[3], ids[4], *rel}
    assert [c.id for c in store.log("latest")] == [ids[4], ids[3]]  # lineage ends where GC cut it
    store.commit({"z": 1})  # untagged
    assert store.gc(grace=0, keep_within="1h").commits_dropped == 0
    assert store.gc(grace="1h").commits_dropped == 0  # the grace period protects young commits too
    assert store.gc(grace=0).commits_dropped == 1 + 1 + 2  # the untagged one, latest's parent, release's history


def test_two_gcs_at_once(store):
    with gc_lock(store.root), pytest.raises(GCLockedError, match="another GC"):
        store.gc(grace=0)


def test_grace_period_keeps_unreferenced_blobs_and_packs(store):
    store.commit({"a": torch.randn(1000)}, tag="t")
    store.commit({"a": torch.randn(1000)}, tag="t")
    report = store.gc()  # default grace 1 hour: the old commit is young, nothing goes
    assert (report.commits_dropped, report.blobs_deleted, report.packs_deleted) == (0, 0, 0)
    report = store.gc(grace=0)
    # the old commit's blob pack and the pack holding its commit record; the new commit's two
    # small packs are merged into one
    assert (report.commits_dropped, report.blobs_deleted, report.packs_deleted, report.packs_consolidated) == (1, 1, 4, 2)
    assert report.bytes_freed > 4000
    assert store.fsck(deep=True).ok


def test_repack_moves_live_blobs_and_frees_dead_ones(tmp_path):
    s = ckptstore.Store(tmp_path / "s", shard_bytes=4096)
    torch.manual_seed(0)
    base = torch.randn(10 * 1024)  # 10 shards of 4 KiB, one pack
    s.commit({"w": base}, tag="a")
    changed = base.clone()
    changed[: 9 * 1024] += 1  # 9 of 10 shards change
    s.commit({"w": changed}, tag="b")
    s.delete_tag("a")  # the first pack now holds one live blob of ten
    report = s.gc(grace=0)
    # the repacked pack, and the pack of the dropped commit's record; b's two small packs and the
    # delete's record pack are merged with the repacked blob
    assert (report.packs_repacked, report.packs_consolidated, report.packs_deleted, report.blobs_deleted) == (1, 3, 5, 9)
    assert len(list((tmp_path / "s" / "blobs").glob("*/*.pack"))) == 1
    assert_bit_equal(s.checkout("b")["w"], changed)
    assert s.fsck(deep=True).ok
    s.close()


def test_c22a_incomplete_export_copied_into_a_store_is_not_collected_and_import_is_rejected(store, tmp_path):
    store.commit(layers(0, 1.0), tag="t1")
    store.export("t1", tmp_path / "export")
    other = ckptstore.Store(tmp_path / "other", create=True)
    incoming = other.root / "incoming"
    shutil.copytree(tmp_path / "export", incoming)
    (incoming / "ckptstore-export.json").unlink()  # the final marker never arrived
    files = sorted(p.name for p in (incoming / "blobs").iterdir())
    other.gc(grace=0)
    assert sorted(p.name for p in (incoming / "blobs").iterdir()) == files  # GC only touches what the catalog owns
    with pytest.raises(ContainerError, match="not a complete ckptstore export"):
        check_export(incoming, REGISTRY)
    with pytest.raises(ContainerError, match=f"^{incoming} is the store {other.root} or inside it"):
        other.import_from(incoming, tag="t1")  # never read from inside the store (its catalog's locks)
    assert other.tags() == {}
    other.close()


def test_c22b_deleting_a_tag_frees_only_its_unique_shards(store):
    store.commit(layers(4, 1.0), tag="t1")
    store.commit(layers(4, 2.0), tag="t2")
    only_t1 = blob_ids(store, "t1") - blob_ids(store, "t2")
    shared = blob_ids(store, "t1") & blob_ids(store, "t2")
    assert len(only_t1) == 1 and len(shared) == 4  # 80 % shared
    store.delete_tag("t1")
    report = store.gc(grace=0)
    alive = {r["id"] for r in store.catalog.rows("SELECT id FROM blobs")}
    assert report.commits_dropped == 1 and not (only_t1 & alive) and shared <= alive
    assert store.verify("t2").ok
    assert_bit_equal(store.checkout("t2")["l4"], torch.full((128, 128), 2.0))


class GCBetweenLookupAndTransaction(ckptstore.Store):
    """A store whose commit meets a real GC right after looking up known blobs."""

    armed = False

    def _lookup(self, keys):
        known = super()._lookup(keys)
        if self.armed:  # the first lookup of the armed commit: step 3, before its transaction
            self.armed = False
            self.gc(grace=0)
        return known


def test_c22c_gc_between_a_commits_lookup_and_transaction(tmp_path):
    s = GCBetweenLookupAndTransaction(tmp_path / "s")
    s.commit(layers(0, 1.0), tag="t1")
    s.commit(layers(0, 2.0), tag="t2")
    s.delete_tag("t1")  # t1's unique blob is unreferenced; t3 will reuse it
    s.armed = True
    info = s.commit(layers(0, 1.0), tag="t3")  # all dedup hits, then the GC deletes one of them
    assert info.shards_new == 1  # the blob the GC removed was written again
    assert s.verify("t3").ok
    assert_bit_equal(s.checkout("t3")["l0"], torch.full((128, 128), 1.0))
    assert s.fsck(deep=True).ok
    s.close()


def test_c22d_damaged_newest_tag_is_an_explicit_error(store):
    store.commit(layers(4, 1.0), tag="t1")
    store.commit(layers(4, 2.0), tag="latest")
    only_latest = blob_ids(store, "latest") - blob_ids(store, "t1")
    row = store.catalog.rows("SELECT * FROM blobs WHERE id = ?", (only_latest.pop(),))[0]
    pack = store.root / "blobs" / row["pack"][:2] / f"{row['pack']}.pack"
    with open(pack, "r+b") as f:
        f.truncate(row["offset"] + 40 + row["stored_len"] // 2)
    model = torch.nn.Module()
    target = {f"l{i}": torch.zeros(128, 128) for i in range(5)}
    with pytest.raises(IntegrityError, match="leaf l4") as err:
        store.checkout("latest", into=target)
    assert "truncated" in str(err.value)
    assert all(bool((t == 0).all()) for t in target.values())  # nothing overwritten
    report = store.fsck()
    assert not report.ok and report.damaged_tags == ["latest"]
    assert_bit_equal(store.checkout("t1")["l4"], torch.full((128, 128), 1.0))  # falling back is explicit
    del model


def test_fsck_orphans_are_reported_not_errors(store):
    store.commit({"x": torch.ones(3)}, tag="t")
    orphan = store.root / "blobs" / "ab" / ("ab" + "0" * 30 + ".pack")
    orphan.parent.mkdir(exist_ok=True)
    orphan.write_bytes(b"CKPK" + b"\0" * 12)
    (store.root / "tmp" / "stale.pack.tmp").write_bytes(b"x")
    report = store.fsck(deep=True)
    assert report.ok and report.orphan_packs == [orphan.stem] and report.tmp_files == 1
    os.utime(orphan, (0, 0))
    os.utime(store.root / "tmp" / "stale.pack.tmp", (0, 0))
    gc = store.gc()  # older than the grace period, and no commit holds them
    assert (gc.orphans_removed, gc.tmp_removed) == (1, 1)
    assert store.fsck().orphan_packs == []


def test_deleted_pack_and_bad_header(store):
    store.commit({"a": torch.randn(1000), "b": torch.randn(1000)}, tag="t")
    rows = {r["path"]: r for r in store.catalog.rows(
        "SELECT l.path, b.* FROM leaves l JOIN shards s ON s.leaf_id = l.id JOIN blobs b ON b.id = s.blob_id WHERE l.commit_id = ?",
        (store.resolve("t"),))}
    pack = store.root / "blobs" / rows["a"]["pack"][:2] / f"{rows['a']['pack']}.pack"
    raw = bytearray(pack.read_bytes())
    raw[rows["a"]["offset"] + 5] = 7  # codec byte of a's blob header
    pack.write_bytes(bytes(raw))
    with pytest.raises(BlobCorruptError, match="codec 7"):
        store.checkout("t", partial=["a"])
    raw[rows["a"]["offset"] + 5] = 0
    raw[rows["a"]["offset"] + 8] ^= 1  # raw length field
    pack.write_bytes(bytes(raw))
    with pytest.raises(BlobCorruptError, match="does not match the catalog") as err:
        store.checkout("t", partial=["a"])
    want = rows["a"]["raw_len"]
    assert f"raw length {want ^ 1} in the pack, {want} in the catalog" in str(err.value)  # names the field that differs
    assert "codec" not in str(err.value) and "hash" not in str(err.value)
    raw[rows["a"]["offset"] + 8] ^= 1
    raw[rows["a"]["offset"] + 30] ^= 1  # a digest byte
    pack.write_bytes(bytes(raw))
    with pytest.raises(BlobCorruptError, match="hash .* in the pack, .* in the catalog"):
        store.checkout("t", partial=["a"])
    pack.unlink()
    with pytest.raises(ckptstore.errors.BlobMissingError, match="missing"):
        store.checkout("t")
    report = store.fsck()
    assert not report.ok and report.damaged_tags == ["t"] and len(report.missing_blobs) == 2


def test_dry_run_reports_exactly_what_the_real_run_does(tmp_path):
    s = ckptstore.Store(tmp_path / "s", shard_bytes=4096)
    torch.manual_seed(0)
    base = torch.randn(10 * 1024)
    for i in range(4):  # commits to drop, a half-dead pack to repack, whole packs to delete
        changed = base.clone()
        changed[: (9 - i) * 1024] += i + 1
        s.commit({"w": changed, "k": i}, tag=["latest", f"t{i}"])
    for i in range(3):
        s.delete_tag(f"t{i}")
    (s.root / "tmp" / "stale.pack.tmp").write_bytes(b"x" * 100)
    fields = ("commits_dropped", "blobs_deleted", "blob_bytes", "packs_repacked", "packs_deleted",
              "orphans_removed", "tmp_removed", "bytes_freed", "bytes_pending")
    first = None
    for grace in (0, "1h"):
        dry = s.gc(grace=grace, dry_run=True)
        real = s.gc(grace=grace)
        assert {f: getattr(dry, f) for f in fields} == {f: getattr(real, f) for f in fields}, grace
        assert sorted(dry.dropped) == sorted(real.dropped)
        first = first if grace == "1h" else real
    assert real.commits_dropped == 0 and dry.bytes_freed == 0  # the second pair (grace 1h) had nothing left
    assert first.commits_dropped == 3 and first.packs_repacked >= 1 and first.packs_deleted >= 3 and first.tmp_removed == 1
    s.close()


def test_dry_run_matches_with_a_grace_period_pending(tmp_path):
    s = ckptstore.Store(tmp_path / "s", shard_bytes=4096)
    for i in range(3):
        s.commit({"w": torch.randn(4096)}, tag="latest")
    fields = ("commits_dropped", "blobs_deleted", "packs_repacked", "packs_deleted", "bytes_freed", "bytes_pending")
    s.catalog.conn.execute("UPDATE commits SET created_at = created_at - 7200")  # as if two hours old
    s.catalog.conn.execute("UPDATE blobs SET created_at = created_at - 7200")
    s.catalog.conn.execute("UPDATE packs SET created_at = created_at - 7200")
    dry, real = s.gc(grace="1h", dry_run=True), s.gc(grace="1h")
    assert {f: getattr(dry, f) for f in fields} == {f: getattr(real, f) for f in fields}
    assert real.commits_dropped == 2 and real.bytes_pending > 0
    s.close()


def test_an_async_commit_rewrites_a_freed_blob_from_one_read_of_live_memory(tmp_path, monkeypatch):
    """Found by a breaker: another Store's GC frees the blob an unchanged tensor's kept hash
    names, so the background commit writes it again from the live tensor. It hashed the live
    bytes, then wrote them again from live memory: a training write in between was stored
    under the old hash (a corrupt blob that later commits then reused). Here the write lands
    exactly there, inside the pack writer's append."""
    from ckptstore.objects import packs

    s = ckptstore.Store(tmp_path / "s", shard_bytes=4096)
    live = torch.randn(1024)  # one 4096-byte shard
    s.commit({"w": live}, tag="a")
    other = ckptstore.Store(tmp_path / "s")
    other.delete_tag("a")
    assert other.gc(grace=0).blobs_deleted >= 1
    expected = live.clone()
    append = packs.PackWriter.append

    def append_while_training(self, raw, digest=None):
        if len(raw) == 4096:
            live.add_(1.0)  # the training loop writes while the commit writes the shard
        return append(self, raw, digest)

    monkeypatch.setattr(packs.PackWriter, "append", append_while_training)
    info = s.commit_async({"w": live}, tag="b").result()
    monkeypatch.setattr(packs.PackWriter, "append", append)
    assert info.shards_new == 1
    assert_bit_equal(ckptstore.Store(tmp_path / "s").checkout("b")["w"], expected)  # the state at the call
    assert s.fsck(deep=True).ok

    # changed after the call, before the background commit found the blob freed and read the
    # tensor: a clear error (the content at the call is gone), and the next commit rehashes
    s.commit({"w": live}, tag="b")  # kept hashes of the tensor as it is now
    other.delete_tag("b")
    other.gc(grace=0)
    finish = packs.PackWriter.finish

    def finish_while_training(self):
        monkeypatch.setattr(packs.PackWriter, "finish", finish)
        live.add_(1.0)
        return finish(self)

    monkeypatch.setattr(packs.PackWriter, "finish", finish_while_training)
    with pytest.raises(StoreWriteError, match="freed by a GC"):
        s.commit_async({"w": live}, tag="c").result()
    assert "c" not in s.tags()
    s.commit_async({"w": live}, tag="c").result()
    assert_bit_equal(ckptstore.Store(tmp_path / "s").checkout("c")["w"], live)
    assert s.fsck(deep=True).ok
