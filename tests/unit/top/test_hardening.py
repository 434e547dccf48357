"""The store's trust guarantees, one class of failure per test (issue: trustworthy under every topology).

Each test failed before its fix: a second Store corrupting the catalog through
Python file descriptors, bytes committed unsynced into a renamed pack, wrong
data from an edited catalog, a catalog whose loss lost everything, store
creation races, readers failing beside a GC, hostile locations and shapes, and
stores that could not be read when they could not be written.
"""

from __future__ import annotations

import builtins
import io
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import ckptstore
from ckptstore.objects import packs as packs_mod
from ckptstore.errors import (
    BlobCorruptError,
    CatalogCorruptError,
    IntegrityError,
    InvalidNameError,
    NotAStoreError,
    StoreWriteError,
)
from ckptstore.objects.packs import PackReader, PackWriter, pack_path

from tests.conftest import ROOT, assert_bit_equal, run_fresh

CATALOG_FILES = ("catalog.sqlite", "catalog.sqlite-wal", "catalog.sqlite-shm", "catalog.sqlite-journal")


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(128, 32, generator=g),
        "shared": torch.arange(1024, dtype=torch.float32),  # the same in every step: deduplicated
        "nested": {"b": torch.full((16,), step, dtype=torch.int64), "flag": step % 2 == 0},
    }


def assert_state(td, step: int) -> None:
    want = state(step)
    assert_bit_equal(td["w"], want["w"])
    assert_bit_equal(td["shared"], want["shared"])
    assert_bit_equal(td["nested", "b"], want["nested"]["b"])


# --- 1. nothing but SQLite opens the catalog files ----------------------------------------


@contextmanager
def catalog_opens():
    """Record every Python-level open of a catalog file (os.open, open, io.open)."""
    seen: list[str] = []
    real_os_open, real_open = os.open, builtins.open

    def note(path) -> None:
        if isinstance(path, (str, os.PathLike)) and os.path.basename(os.fspath(path)) in CATALOG_FILES:
            seen.append(os.fspath(path))

    def os_open(path, *a, **k):
        note(path)
        return real_os_open(path, *a, **k)

    def open_(file, *a, **k):
        note(file)
        return real_open(file, *a, **k)

    os.open, builtins.open, io.open = os_open, open_, open_
    try:
        yield seen
    finally:
        os.open, builtins.open, io.open = real_os_open, real_open, real_open


def test_no_operation_opens_the_catalog_outside_sqlite(tmp_path):
    """Closing any descriptor of catalog.sqlite drops this process's POSIX locks on it,
    SQLite's for other connections included (invariant 6): every operation, with two
    Stores open on one path in one process, leaves the catalog files to SQLite."""
    path = tmp_path / "s"
    with catalog_opens() as seen:
        a = ckptstore.Store(path)
        b = ckptstore.Store(path)  # a second Store in the same process, as an evaluator would open
        a.commit(state(1), tag="t1")
        b.commit(state(2), tag=["t2", "latest"])
        a.commit_async(state(3), tag="t3").result()
        assert_state(b.checkout("t1"), 1)
        b.checkout("t2", partial=["nested"])
        a.tag("x", "t1")
        b.delete_tag("x")
        assert a.fsck(deep=True).ok and b.verify("latest").ok
        a.export("t1", tmp_path / "t1.zip")
        b.import_from(tmp_path / "t1.zip", tag="back")
        a.gc(grace=0)
        b.du(), a.show("t2"), b.diff("t1", "t2"), a.log("latest"), b.reflog()
        with pytest.raises(ckptstore.errors.ContainerError):
            a.import_from(path / "catalog.sqlite")  # an import of the catalog itself is refused unread
        a.close()
        b.close()
        with pytest.raises(ckptstore.errors.InvalidArgumentError, match="nothing to recover"):
            ckptstore.Store.recover(path)
        ckptstore.Store.recover(path, force=True)
    assert seen == []
    with ckptstore.Store(path) as s:
        assert s.fsck(deep=True).ok
        assert_state(s.checkout("back"), 1)


# --- 2. every byte a commit depends on is durable; packs never change after rename -----------


def test_a_pack_is_never_written_after_its_rename(tmp_path):
    w = PackWriter(tmp_path)
    first = w.append(memoryview(b"a" * 100))
    w.finish()
    size = pack_path(tmp_path, first.pack).stat().st_size
    second = w.append(memoryview(b"b" * 100))  # a retry after a GC freed a reused blob
    w.finish()
    w.close()
    assert second.pack != first.pack
    assert pack_path(tmp_path, first.pack).stat().st_size == size
    assert sorted(p.name for p in (tmp_path / "tmp").iterdir()) == []


def test_a_blob_freed_by_gc_during_a_commit_goes_to_a_new_durable_pack(tmp_path, monkeypatch):
    path = tmp_path / "s"
    s = ckptstore.Store(path)
    old = torch.randn(1000)
    s.commit({"old": old}, tag="t")
    s.delete_tag("t")  # its blob is unreferenced now: a GC may free it at any moment
    lookup = ckptstore.Store._lookup

    def lookup_then_gc(self, keys):  # the GC of another Store runs between the lookup and the transaction
        found = lookup(self, keys)
        if not ran:
            ran.append(True)
            with ckptstore.Store(path) as other:
                other.gc(grace=0)
        return found

    ran: list[bool] = []

    monkeypatch.setattr(ckptstore.Store, "_lookup", lookup_then_gc)
    new = torch.randn(1000)
    info = s.commit({"old": old, "new": new}, tag="t2")
    monkeypatch.undo()
    shards = {r.path: r.shards[0] for r in s.manifest("t2")}
    assert shards["old"].pack != shards["new"].pack  # rewritten into a second pack, not appended to the renamed one
    assert info.shards_new == 2
    assert_bit_equal(s.checkout("t2")["old"], old)
    assert s.fsck(deep=True).ok
    s.close()


# --- 3. a damaged catalog never yields wrong data -----------------------------------------------


def test_edited_catalog_rows_are_detected_and_never_returned(store):
    store.commit({"a": torch.zeros(1000), "b": torch.ones(1000)}, tag="t")
    cid = store.resolve("t")
    with store.catalog.write():  # swap the two leaves' shard rows, keeping every byte count
        run = store.catalog.conn.execute
        run("PRAGMA defer_foreign_keys = ON")
        ids = {p: i for i, p in run("SELECT id, path FROM leaves WHERE commit_id = ?", (cid,))}
        run("UPDATE shards SET leaf_id = -1 WHERE leaf_id = ?", (ids["a"],))
        run("UPDATE shards SET leaf_id = ? WHERE leaf_id = ?", (ids["a"], ids["b"]))
        run("UPDATE shards SET leaf_id = ? WHERE leaf_id = -1", (ids["b"],))
        run("UPDATE leaves SET dtype = 'int32' WHERE id = ?", (ids["a"],))
    td = store.checkout("t")  # the manifest comes from the verified commit record
    assert_bit_equal(td["a"], torch.zeros(1000))
    assert_bit_equal(td["b"], torch.ones(1000))
    report = store.fsck()
    assert report.damaged_commits == [cid] and any("disagree with its record" in p for p in report.problems)
    assert not store.verify("t").ok


def test_an_edited_commit_record_is_an_integrity_error_naming_the_commit(store):
    store.commit({"a": torch.zeros(10, dtype=torch.float32)}, tag="t")
    cid = store.resolve("t")
    with store.catalog.write():  # change the dtype inside the record: same byte count, other values
        store.catalog.conn.execute("UPDATE commits SET record = replace(record, '\"float32\"', '\"int32\"') WHERE id = ?", (cid,))
    store._records.clear()
    for call in (lambda: store.checkout("t"), lambda: store.checkout("t", partial=["a"]), lambda: store.export("t", store.root.parent / "e.zip")):
        with pytest.raises(IntegrityError, match=f"commit {cid}.*does not hash"):
            call()
    assert not store.verify("t").ok and cid in store.fsck().damaged_commits


# --- 4. losing the catalog loses nothing -----------------------------------------------------------


def build_history(path: Path) -> dict[str, int]:
    """20 commits, 5 tags, retention and a repack behind it; returns {tag: step}."""
    s = ckptstore.Store(path, shard_bytes=1024)
    for step in range(20):
        s.commit(state(step), tag=[f"t{step % 5}", "latest"], metadata={"step": step})
    s.delete_tag("t4")
    s.tag("t4", "t1")
    s.commit(state(100), tag="gone")
    s.delete_tag("gone")
    report = s.gc(grace=0, keep_last=2)
    assert report.packs_repacked >= 1 and report.commits_dropped > 0
    tags = {t: s.info(t).metadata.get("step") for t in s.tags()}
    s.close()
    return tags


def check_tags(path: Path, tags: dict[str, int]) -> None:
    with ckptstore.Store(path, create=False) as s:
        assert {t: s.info(t).metadata.get("step") for t in s.tags()} == tags
        for t, step in tags.items():
            assert_state(s.checkout(t), step)
        assert s.fsck(deep=True).ok


def test_recover_rebuilds_a_deleted_catalog_from_the_packs(tmp_path):
    path = tmp_path / "s"
    tags = build_history(path)
    assert tags == {"latest": 19, "t0": 15, "t1": 16, "t2": 17, "t3": 18, "t4": 16}
    with ckptstore.Store(path) as s:
        lineage = [c.metadata["step"] for c in s.log("latest")]
        reflog = [(r["tag"], r["new_commit"]) for r in s.reflog() if r["tag"] == "t4"][:1]
    for name in CATALOG_FILES:
        (path / name).unlink(missing_ok=True)
    with pytest.raises(CatalogCorruptError, match="recover"):
        ckptstore.Store(path)
    report = ckptstore.Store.recover(path)
    assert report.tags.keys() == tags.keys() and report.incomplete_commits == [] and report.bad_records == 0
    check_tags(path, tags)
    with ckptstore.Store(path) as s:  # lineage survives, and the store goes on
        assert [c.metadata["step"] for c in s.log("latest")] == lineage == [19, 18, 17, 16, 15, 14]
        assert [(r["tag"], r["new_commit"]) for r in s.reflog("t4")][:1] == reflog  # each tag's last move
        s.commit(state(20), tag="latest")
        assert s.log("latest")[1].metadata["step"] == 19


def test_recover_replaces_a_catalog_sqlite_cannot_read(tmp_path):
    path = tmp_path / "s"
    tags = build_history(path)
    (path / "catalog.sqlite").write_bytes(b"\0" * 8192)  # bit rot beyond SQLite's repair
    with pytest.raises(CatalogCorruptError, match="recover"):
        ckptstore.Store(path)
    proc = subprocess.run([sys.executable, "-m", "ckptstore.cli", "recover", "--store", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "recovered" in proc.stdout and "moved to" in proc.stdout
    check_tags(path, tags)


# --- 5. creating a store: concurrent and killed creators ------------------------------------------


CREATE = """
import sys, time, ckptstore, torch
path = sys.argv[1]
print("ready", flush=True)
sys.stdin.readline()
s = ckptstore.Store(path)
s.commit({"x": torch.arange(int(sys.argv[2]))}, tag="t" + sys.argv[2])
print("done", flush=True)
"""


def test_three_processes_create_one_store_at_once(tmp_path):
    path = tmp_path / "s"
    procs = [
        subprocess.Popen([sys.executable, "-c", CREATE, str(path), str(n)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for n in (5, 6, 7)
    ]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    for p in procs:  # as close to simultaneous as three processes get
        p.stdin.write("go\n")
        p.stdin.flush()
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0 and out.strip() == "done"
    with ckptstore.Store(path, create=False) as s:
        assert sorted(s.tags()) == ["t5", "t6", "t7"]
        assert s.checkout("t6")["x"].tolist() == list(range(6))


def test_sigkill_while_creating_a_store_never_bricks_it(tmp_path):
    """One process creates store after store; SIGKILL lands at a random instant, often
    inside creation (catalog file made, WAL switch, schema transaction)."""
    code = textwrap.dedent("""
        import sys, ckptstore
        base = sys.argv[1]
        ckptstore.Store(f"{base}/warm", create=True).close()  # imports done: the kill lands in creations
        print("ready", flush=True)
        i = 0
        while True:
            ckptstore.Store(f"{base}/s{i}", create=True).close()
            i += 1
    """)
    rng = random.Random(int(os.environ.get("CKPT_SEED", "9")))
    for trial in range(4):
        base = tmp_path / f"trial{trial}"
        base.mkdir()
        p = subprocess.Popen([sys.executable, "-c", code, str(base)], stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.05, 0.4))
        p.send_signal(signal.SIGKILL)
        p.wait()
        made = sorted(base.iterdir())
        assert made, "no store was started"
        for path in made:  # every store, the one killed mid-creation included, opens and commits
            with ckptstore.Store(path) as s:
                s.commit({"x": torch.ones(2)}, tag="t")
                assert s.fsck().ok


def test_an_empty_catalog_in_an_empty_store_folder_is_initialised(tmp_path):
    path = tmp_path / "s"
    (path / "blobs").mkdir(parents=True)
    (path / "catalog.sqlite").write_bytes(b"")  # killed right after the file was made
    with ckptstore.Store(path) as s:
        s.commit({"x": torch.ones(2)}, tag="t")
        assert s.tags().keys() == {"t"}


# --- 6. readers beside a GC with a short grace --------------------------------------------------------


def test_a_reader_finds_blobs_a_gc_repacked_and_unlinked_meanwhile(tmp_path):
    path = tmp_path / "s"
    s = ckptstore.Store(path, shard_bytes=1024)
    keep = torch.randn(256)
    s.commit({"keep": keep, "drop": torch.randn(10 * 256)}, tag="old")
    s.commit({"keep": keep}, tag="new")
    leaves = s.manifest("new")  # the reader has looked its blobs up ...
    with ckptstore.Store(path) as gc_store:  # ... when a GC with grace 0 repacks and unlinks their pack
        s.delete_tag("old")
        report = gc_store.gc(grace=0)
    assert report.packs_repacked == 1 and not pack_path(path, leaves[0].shards[0].pack).exists()
    reader = PackReader(path, locate=s.relocate)
    assert_bit_equal(torch.frombuffer(reader.read(leaves[0].shards[0], "test"), dtype=torch.float32), keep)
    reader.close()
    assert_bit_equal(s.checkout("new")["keep"], keep)
    s.export("new", tmp_path / "new.zip")  # export reads through the same relocation
    s.close()


def test_a_pack_unlinked_between_create_and_lock_is_not_written(tmp_path, monkeypatch):
    """A GC may remove a brand-new tmp pack before its writer locks it: the writer
    notices (the file has no link) and takes a new name."""
    real = packs_mod.fcntl.flock
    removed = []

    def flock_after_gc(fd, op):
        if not removed:
            path = next((tmp_path / "tmp").iterdir())
            path.unlink()  # what a GC with grace 0 does to an unlocked tmp file
            removed.append(path.name)
        return real(fd, op)

    monkeypatch.setattr(packs_mod.fcntl, "flock", flock_after_gc)
    w = PackWriter(tmp_path)
    loc = w.append(memoryview(b"x" * 64))
    w.finish()
    w.close()
    monkeypatch.undo()
    assert removed and loc.pack != removed[0].split(".")[0]
    assert pack_path(tmp_path, loc.pack).exists()


# --- 7. hostile or damaged input is validated before allocating or committing ------------------------


def test_hostile_blob_locations_raise_blob_corrupt_errors(store):
    store.commit({"a": torch.randn(100)}, tag="t")
    for column, value in (("offset", -5), ("stored_len", 1 << 60), ("offset", 1 << 50), ("codec", 9)):
        with store.catalog.write():
            original = store.catalog.rows(f"SELECT {column} FROM blobs")[0][0]
            store.catalog.conn.execute(f"UPDATE blobs SET {column} = ?", (value,))
        with pytest.raises(BlobCorruptError):
            store.checkout("t")
        with store.catalog.write():
            store.catalog.conn.execute(f"UPDATE blobs SET {column} = ?", (original,))
    assert store.fsck(deep=True).ok


def test_a_commit_that_could_not_be_checked_out_is_refused(store):
    from ckptstore.adapters.base import Captured

    a = Captured("a", "tensor", 1, {}, {"a": torch.ones(2)})
    ab = Captured("a/b", "tensor", 1, {}, {"a/b": torch.ones(2)})
    with pytest.raises(InvalidNameError, match="cannot be both a leaf and a folder"):
        store.commit_components([a, ab], tag="bad")
    assert store.tags() == {} and store.log() == []


def test_a_record_with_an_impossible_shape_is_refused_at_checkout(store):
    store.commit({"e": torch.zeros(0, 3)}, tag="t")
    cid = store.resolve("t")
    text = store.catalog.rows("SELECT record FROM commits")[0][0].replace("[0,3]", f"[0,{2**70}]")
    bad = ckptstore.objects.records.commit_id(text)
    with store.catalog.write():  # a record that hashes correctly but describes an impossible tensor
        store.catalog.conn.execute("PRAGMA defer_foreign_keys = ON")
        store.catalog.conn.execute("UPDATE commits SET id = ?, record = ? WHERE id = ?", (bad, text, cid))
        for table in ("components", "leaves"):
            store.catalog.conn.execute(f"UPDATE {table} SET commit_id = ? WHERE commit_id = ?", (bad, cid))
        store.catalog.conn.execute("UPDATE tags SET commit_id = ?", (bad,))
    with pytest.raises(IntegrityError, match="too large"):
        store.checkout("t")


def test_a_tag_naming_a_missing_commit_is_an_integrity_error(store):
    store.commit({"a": torch.ones(2)}, tag="t")
    store.catalog.conn.execute("PRAGMA foreign_keys = OFF")
    with store.catalog.write():
        store.catalog.conn.execute("UPDATE tags SET commit_id = ?", ("0" * 32,))
    for call in (store.show, store.verify, store.checkout, store.info):
        with pytest.raises(IntegrityError, match="tag 't' points to commit 0000"):
            call("t")
    assert not store.fsck().ok


# --- 8. a store that cannot be written can still be read ------------------------------------------------


@contextmanager
def read_only_view(src: Path, where: Path):
    if os.geteuid() != 0:
        pytest.skip("a read-only bind mount needs root")
    where.mkdir()
    if subprocess.run(["mount", "--bind", str(src), str(where)], capture_output=True).returncode != 0:
        pytest.skip("cannot bind-mount here")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(where)], check=True, capture_output=True)
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_read_only_store_reads_everything_and_refuses_commits(tmp_path):
    src = tmp_path / "src"
    with ckptstore.Store(src / "s") as s:
        s.commit(state(1), tag="t1")
        s.commit(state(2), tag="t2")
    with read_only_view(src, tmp_path / "ro") as ro:
        s = ckptstore.Store(ro / "s", create=False)
        assert not s.catalog.writable
        assert_state(s.checkout("t2"), 2)
        assert s.checkout("t1", partial=["nested"])["nested", "b"].tolist() == [1] * 16
        assert sorted(s.tags()) == ["t1", "t2"] and len(s.log()) == 2 and s.show("t1")["leaves"]
        assert s.verify("t1").ok and s.fsck(deep=True).ok
        s.export("t1", tmp_path / "t1.zip")
        with pytest.raises(StoreWriteError, match="read-only"):
            s.commit(state(3), tag="t3")
        with pytest.raises(StoreWriteError, match="read-only"):
            s.tag("x", "t1")
        s.close()
        proc = subprocess.run([sys.executable, "-m", "ckptstore.cli", "tags", "--store", str(ro / "s")], capture_output=True, text=True)
        assert proc.returncode == 0 and "t2" in proc.stdout
    assert ckptstore.Store(tmp_path / "t1imp").import_from(tmp_path / "t1.zip", tag="t1").metadata == {}


def test_reading_a_missing_store_never_creates_it(tmp_path):
    with pytest.raises(NotAStoreError):
        ckptstore.Store(tmp_path / "typo", create=False)
    s = ckptstore.Store(tmp_path / "runs" / "sotre")  # a mistyped path: reads fail, nothing is made
    for read in (lambda: s.checkout("latest"), s.tags, s.log, lambda: s.gc(grace=0), s.fsck):
        with pytest.raises(NotAStoreError, match="does not exist; a first commit creates a store there"):
            read()
    assert not (tmp_path / "runs").exists()
    s.commit({"x": torch.ones(1)}, tag="latest")  # the first commit creates it
    assert ckptstore.Store(tmp_path / "runs" / "sotre", create=False).tags().keys() == {"latest"}


def test_a_fresh_process_recovers_and_reads_as_a_reader_would(tmp_path):
    path = tmp_path / "s"
    tags = build_history(path)
    for name in CATALOG_FILES:
        (path / name).unlink(missing_ok=True)
    run_fresh(
        """
        import sys, ckptstore
        ckptstore.Store.recover(sys.argv[1])
        s = ckptstore.Store(sys.argv[1], create=False)
        print(sorted(s.tags()))
        """,
        str(path),
    )
    check_tags(path, tags)
    assert ROOT.exists()


def test_import_torchrl_from_the_store_itself_is_refused_unread(store):
    store.commit({"a": torch.ones(2)}, tag="t")
    with catalog_opens() as seen, pytest.raises(ckptstore.errors.ContainerError, match="inside it"):
        store.import_torchrl(store.root / "catalog.sqlite")
    assert seen == [] and store.fsck().ok


def test_tag_moves_after_a_recovery_win_over_older_records(tmp_path):
    """Moves made after a recovery must order after every record found by it: a second
    recovery (or a GC keeping each tag's newest record) then sees the latest move."""
    path = tmp_path / "s"
    with ckptstore.Store(path) as s:
        for step in range(5):
            s.commit(state(step), tag="t", metadata={"step": step})
    for round_ in range(2):
        for name in CATALOG_FILES:
            (path / name).unlink(missing_ok=True)
        ckptstore.Store.recover(path)
        with ckptstore.Store(path) as s:
            s.commit(state(10 + round_), tag="t", metadata={"step": 10 + round_})
            s.gc(grace=0, keep_last=1)
    for name in CATALOG_FILES:
        (path / name).unlink(missing_ok=True)
    assert ckptstore.Store.recover(path).tags.keys() == {"t"}
    check_tags(path, {"t": 11})
