"""Export and import hardening: sizes checked before reading, unbuildable shapes,
nested leaf paths, importing the store's own files, stale staging folders,
unwritable destinations, and TorchRL buffers filled under inference mode."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
import time
import uuid
import zipfile
from pathlib import Path

import pytest
import torch

import ckptstore
from ckptstore.protocols import archive as container
from ckptstore.protocols.archive import MANIFEST, STAGING_LOCK, STAGING_MARK
from ckptstore.errors import ContainerError
from ckptstore.core.shards import check_shape

from tests.conftest import assert_bit_equal, row_count

HUGE = 10**15  # bytes: a shard no machine can hold


@pytest.fixture
def exported(store, tmp_path):
    store.commit({"a": torch.arange(3.0), "b": torch.zeros(1000), "c": {"d": torch.ones(2)}, "e": torch.zeros(0, 3)}, tag="t")
    store.export("t", tmp_path / "dir")
    target = ckptstore.Store(tmp_path / "target", create=True)
    yield tmp_path / "dir", target
    target.close()


def manifest(folder: Path) -> dict:
    return json.loads((folder / MANIFEST).read_text())


def leaf(doc: dict, path: str) -> dict:
    return next(r for r in doc["leaves"] if r["path"] == path)


def expect_rejected(target, src, *parts) -> str:
    before = row_count(target)
    with pytest.raises(ContainerError) as err:
        target.import_from(src, tag="x")
    for p in parts:
        assert p in str(err.value), (p, str(err.value))
    assert row_count(target) == before
    return str(err.value)


def huge_shard(folder: Path) -> str:
    """Leaf 'b' declares one shard of 10**15 bytes; its blob file holds 100 bytes."""
    doc = manifest(folder)
    addr = f"{'ab' * 16}-{HUGE}"
    r = leaf(doc, "b")
    r.update(shape=[HUGE // 4], nbytes=HUGE, shard_bytes=HUGE, shards=[addr])
    (folder / MANIFEST).write_text(json.dumps(doc))
    (folder / "blobs" / addr).write_bytes(b"\0" * 100)
    return addr


def zip_folder(folder: Path, dest: Path) -> None:
    with zipfile.ZipFile(dest, "w", compression=zipfile.ZIP_STORED) as zf:
        for f in sorted(folder.rglob("*")):
            if f.is_file():
                zf.write(f, f.relative_to(folder).as_posix())


def declare_compressed_size(archive: Path, name: str, size: int) -> None:
    """Rewrite the ZIP central directory so that entry ``name`` claims ``size``
    compressed bytes (a ZIP64 extra field); its data and local header are unchanged."""
    raw = archive.read_bytes()
    eocd = raw.rindex(b"PK\x05\x06")
    cd_size, cd_offset = struct.unpack_from("<II", raw, eocd + 12)
    cd, out, pos = raw[cd_offset : cd_offset + cd_size], b"", 0
    while pos < len(cd):
        n, m, k = struct.unpack_from("<HHH", cd, pos + 28)
        rec = bytearray(cd[pos : pos + 46 + n + m + k])
        if rec[46 : 46 + n].decode() == name:
            struct.pack_into("<I", rec, 20, 0xFFFFFFFF)  # compressed size: see the ZIP64 extra field
            extra = struct.pack("<HHQ", 1, 8, size)
            rec = rec[: 46 + n] + extra + rec[46 + n :]
            struct.pack_into("<H", rec, 30, m + len(extra))
        out += bytes(rec)
        pos += 46 + n + m + k
    tail = bytearray(raw[eocd:])
    struct.pack_into("<I", tail, 12, len(out))
    archive.write_bytes(raw[:cd_offset] + out + bytes(tail))


# --- 1: sizes are checked before anything is allocated -----------------------------------


def test_folder_shard_declared_huge_is_refused_before_reading(exported):
    folder, target = exported
    addr = huge_shard(folder)
    expect_rejected(
        target, folder, "leaf 'b' shard 0", f"blob {addr} declares {HUGE} raw bytes", "which its 100-byte entry cannot hold even compressed",
    )


def test_source_reads_no_more_than_the_entry_holds(exported):
    folder, _ = exported
    addr = huge_shard(folder)
    source = container._Source(folder)
    try:
        assert source.read(f"blobs/{addr}", HUGE) == b"\0" * 100  # used to allocate 10**15 bytes first
        with pytest.raises(ContainerError, match=rf"entry blobs/{addr} is 100 bytes, larger than its declared 99 bytes"):
            source.read(f"blobs/{addr}", 99)
    finally:
        source.close()


def test_zip_shard_declared_huge_is_refused_before_reading(exported, tmp_path):
    folder, target = exported
    addr = huge_shard(folder)
    zip_folder(folder, tmp_path / "huge.zip")
    expect_rejected(
        target, tmp_path / "huge.zip", "leaf 'b' shard 0", f"blob {addr} declares {HUGE} raw bytes", "which its 100-byte entry cannot hold",
    )


def test_zip_directory_claiming_more_bytes_than_the_archive_is_refused(exported, tmp_path):
    folder, target = exported
    addr = huge_shard(folder)
    archive = tmp_path / "lying.zip"
    zip_folder(folder, archive)
    declare_compressed_size(archive, f"blobs/{addr}", HUGE)
    with zipfile.ZipFile(archive) as zf:
        assert zf.getinfo(f"blobs/{addr}").compress_size == HUGE  # the crafted directory is readable
    size = archive.stat().st_size
    expect_rejected(target, archive, str(archive), "directory declares", f"more than the archive's {size} bytes")


# --- 2: shapes torch cannot build, leaves that are also folders ------------------------------


def test_check_shape():
    for shape in ([], [3, 4], (0, 2**62), torch.Size([2, 0, 5]), [2**63 - 1]):
        assert check_shape(shape, torch.uint8 if shape == [2**63 - 1] else torch.float32) is None
    cases = [
        ([0, 2**70], torch.float32, "shape [0, 1180591620717411303424] is too large"),
        ([2**62, 4], torch.float32, "shape [4611686018427387904, 4] of 4-byte elements is too large"),
        ([0, 2**63 - 1, 2**63 - 1], torch.float32, "is too large"),
        ([2], torch.complex128, None),
        ([-1], torch.float32, "shape [-1]: dimension -1 is not a non-negative int"),
        ([True], torch.float32, "shape [True]: dimension True is not a non-negative int"),
        ([2.0], torch.float32, "shape [2.0]: dimension 2.0 is not a non-negative int"),
        ("12", torch.float32, "shape '12' is not a list of ints"),
        ([1] * 65, torch.float32, "shape has 65 dimensions, more than 64"),
        ([2], "float32", "'float32' is not a torch dtype"),
    ]
    for shape, dtype, message in cases:
        if message is None:
            check_shape(shape, dtype)
            continue
        with pytest.raises(ValueError) as err:
            check_shape(shape, dtype)
        assert message in str(err.value), (shape, str(err.value))


def test_import_refuses_a_zero_element_shape_torch_cannot_build(exported):
    folder, target = exported
    doc = manifest(folder)
    leaf(doc, "e")["shape"] = [0, 2**70]  # zero bytes, so the byte count matches: only torch can tell
    (folder / MANIFEST).write_text(json.dumps(doc))
    expect_rejected(target, folder, "leaf 'e'", "[0, 1180591620717411303424]", "too large")


def test_import_refuses_a_leaf_that_is_also_a_folder(exported):
    folder, target = exported
    doc = manifest(folder)
    leaf(doc, "c/d")["path"] = "a/d"  # leaves 'a' and 'a/d': no TensorDict or dict holds both
    (folder / MANIFEST).write_text(json.dumps(doc))
    expect_rejected(target, folder, "leaves 'a' and 'a/d'", "'a' cannot be both a leaf and a folder of leaves")


# --- 3: never open the store's own files ---------------------------------------------------


def test_import_from_inside_the_store_is_refused_before_opening(store, tmp_path, monkeypatch):
    store.commit({"x": torch.arange(4.0)}, tag="t")
    store.export("t", tmp_path / "store.zip")  # beside the store, its name starting like the store's
    link = tmp_path / "link.sqlite"
    link.symlink_to(store.root / "catalog.sqlite")
    opened = []
    real_source = container._Source
    monkeypatch.setattr(container, "_Source", lambda path: opened.append(path) or real_source(path))
    before = row_count(store)
    for src in ("catalog.sqlite", "catalog.sqlite-wal", "catalog.sqlite-shm", "", "blobs", "tmp/x.zip", "blobs/../catalog.sqlite"):
        with pytest.raises(ContainerError) as err:
            store.import_from(store.root / src, tag="x")
        assert f"{store.root / src} is the store {store.root} or inside it" in str(err.value)
    with pytest.raises(ContainerError, match="is the store .* or inside it"):
        store.import_from(link, tag="x")
    assert opened == [] and row_count(store) == before
    info = store.import_from(tmp_path / "store.zip", tag="ok")
    assert opened == [tmp_path / "store.zip"]
    assert_bit_equal(store.checkout(info.id)["x"], torch.arange(4.0))


# --- 4: staging folders of killed exports ------------------------------------------------


def hold_lock(folder: Path) -> subprocess.Popen:
    """A live process holding the lock of staging folder ``folder``."""
    code = f"""
        import fcntl, os, sys, time
        os.makedirs({str(folder)!r})
        fd = os.open(os.path.join({str(folder)!r}, {STAGING_LOCK!r}), os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX)
        print("locked", flush=True)
        time.sleep(600)
    """
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "locked\n"
    return proc


def stalled_export(store_path: Path, dest: Path) -> subprocess.Popen:
    """A real export that stops for good once its staging folder exists."""
    code = f"""
        import time
        import ckptstore
        from ckptstore.objects.packs import PackReader
        def stall(self, *args, **kwargs):
            print("staged", flush=True)
            time.sleep(600)
        PackReader.stored = stall
        ckptstore.Store({str(store_path)!r}).export("t", {str(dest)!r})
    """
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline() == "staged\n"
    return proc


def test_stale_staging_folders_are_removed_live_ones_kept(store, tmp_path):
    store.commit({"x": torch.arange(1000.0)}, tag="t")
    out = tmp_path / "out"
    out.mkdir()
    exporter = stalled_export(store.root, out / "dead.zip")
    holder = None
    try:
        (killed,) = out.glob(f".dead.zip{STAGING_MARK}*")
        assert (killed / STAGING_LOCK).is_file()
        store.export("t", out / "first.zip")  # the exporter is alive: its staging folder stays
        assert killed.is_dir()
        os.kill(exporter.pid, signal.SIGKILL)
        assert exporter.wait() == -signal.SIGKILL
        assert killed.is_dir()  # nothing removes it by itself

        unheld = out / f".old.zip{STAGING_MARK}abc123"  # lock file, no holder: its exporter died
        (unheld / "old.zip").mkdir(parents=True)
        (unheld / STAGING_LOCK).touch()
        old_lockless = out / f".older{STAGING_MARK}def456"  # no lock file, two hours old
        old_lockless.mkdir()
        os.utime(old_lockless, (time.time() - 7200,) * 2)
        young_lockless = out / f".young{STAGING_MARK}ghi789"  # no lock file yet: being made
        young_lockless.mkdir()
        live = out / f".live{STAGING_MARK}jkl012"
        holder = hold_lock(live)
        (out / ".keep").mkdir()  # not a staging folder
        (out / f".x{STAGING_MARK}").mkdir()  # no random part: not a staging folder

        store.export("t", out / "second")
        assert sorted(p.name for p in out.iterdir()) == sorted(
            ["first.zip", "second", ".keep", f".x{STAGING_MARK}", young_lockless.name, live.name]
        )
        assert (live / STAGING_LOCK).is_file()
        with ckptstore.Store(tmp_path / "other", create=True) as other:
            assert_bit_equal(other.checkout(other.import_from(out / "second").id)["x"], torch.arange(1000.0))
            assert_bit_equal(other.checkout(other.import_from(out / "first.zip").id)["x"], torch.arange(1000.0))
    finally:
        for proc in (exporter, holder):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


def test_export_staging_is_marked_locked_and_removed(store, tmp_path, monkeypatch):
    store.commit({"x": torch.arange(10.0)}, tag="t")
    seen = []
    real_fsync = container._fsync

    def spy(path):
        (staging,) = tmp_path.glob(f".e.zip{STAGING_MARK}*")
        fd = os.open(staging / STAGING_LOCK, os.O_RDONLY)
        try:
            with pytest.raises(BlockingIOError):  # held by this export (flock: per open file)
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
        seen.append(sorted(p.name for p in staging.iterdir()))
        real_fsync(path)

    monkeypatch.setattr(container, "_fsync", spy)
    store.export("t", tmp_path / "e.zip")
    assert seen == [["e.zip", STAGING_LOCK]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.zip", "store"]


# --- 5: destinations that cannot be written -----------------------------------------------


def test_export_refuses_a_missing_parent_folder(store, tmp_path):
    store.commit({"x": torch.arange(4.0)}, tag="t")
    for dest in (tmp_path / "nope" / "x.zip", tmp_path / "nope" / "deeper" / "dir"):
        with pytest.raises(ContainerError) as err:
            store.export("t", dest)
        assert str(err.value) == f"cannot export to {dest}: folder {dest.parent} does not exist"
    assert not (tmp_path / "nope").exists()


def test_export_under_a_file_names_the_destination(store, tmp_path):
    store.commit({"x": torch.arange(4.0)}, tag="t")
    (tmp_path / "afile").write_text("x")
    for dest in (tmp_path / "afile" / "x.zip", tmp_path / "afile" / "dir"):
        with pytest.raises(ContainerError) as err:
            store.export("t", dest)
        assert str(err.value) == f"cannot export to {dest}: {tmp_path / 'afile'} is not a folder"


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc: a folder no one can create files in")
def test_export_to_an_unwritable_folder_names_the_destination(store):
    store.commit({"x": torch.arange(4.0)}, tag="t")
    for dest in (Path(f"/proc/ckptstore-{uuid.uuid4().hex}.zip"), Path(f"/proc/ckptstore-{uuid.uuid4().hex}")):
        with pytest.raises(ContainerError) as err:
            store.export("t", dest)
        assert str(err.value).startswith(f"cannot write the export {dest}: ")
        assert ".ckptstore-export-" not in str(err.value) and "tmp" not in str(err.value)


def test_zip_export_refuses_an_existing_empty_folder(store, tmp_path):
    store.commit({"x": torch.arange(4.0)}, tag="t")
    (tmp_path / "e.zip").mkdir()
    with pytest.raises(ContainerError, match=rf"^{tmp_path / 'e.zip'} already exists$"):
        store.export("t", tmp_path / "e.zip")
    (tmp_path / "empty").mkdir()  # an empty folder is still a fine destination for a folder export
    assert store.export("t", tmp_path / "empty") == tmp_path / "empty"
    assert (tmp_path / "empty" / MANIFEST).is_file()


# --- 6: TorchRL buffers filled under inference mode ------------------------------------------


@pytest.mark.parametrize("reuse_hashes", [True, False])
def test_replay_buffer_filled_under_inference_mode(tmp_path, reuse_hashes):
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, ReplayBuffer

    torch.manual_seed(0)
    with torch.inference_mode():
        rb = ReplayBuffer(storage=LazyTensorStorage(100))
        rb.extend(TensorDict({"obs": torch.randn(30, 4), "reward": torch.randn(30, 1), "done": torch.rand(30) > 0.5}, batch_size=[30]))
    data = rb.storage._storage
    assert all(data[k].is_inference() for k in ("obs", "reward", "done"))
    adapter = ckptstore.adapters.REGISTRY.named("torchrl.storage.tensor", "")
    assert adapter.fingerprints(rb.storage) == {}  # no version counter: always hashed

    with ckptstore.Store(tmp_path / "s", reuse_hashes=reuse_hashes) as s:
        first = s.commit(rb, tag="rb")
        assert first.shards_new == first.shards_total == 3 and first.new_bytes == 30 * (16 + 4 + 1)
        second = s.commit(rb, tag="rb")  # hashed again, every shard already stored
        assert (second.shards_total, second.shards_new, second.new_bytes) == (3, 0, 0)
        fresh = ReplayBuffer(storage=LazyTensorStorage(100))
        s.checkout("rb", into=fresh)
    assert len(fresh) == 30
    for key in ("obs", "reward", "done"):
        assert_bit_equal(fresh.storage._storage[key][:30], data[key][:30])

    normal = ReplayBuffer(storage=LazyTensorStorage(100))  # outside inference mode tokens are still made
    normal.extend(TensorDict({"obs": torch.randn(5, 4)}, batch_size=[5]))
    assert set(adapter.fingerprints(normal.storage)) == {"data/obs"}
