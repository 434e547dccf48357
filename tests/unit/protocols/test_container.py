"""Export and import: tampered, truncated and malicious containers (C24, C25, C08)."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import sys
import uuid
import zipfile
from pathlib import Path

import pytest
import torch

import ckptstore
from ckptstore.protocols.archive import MANIFEST
from ckptstore.errors import BlobCorruptError, ContainerError

from tests.conftest import assert_bit_equal, row_count


@pytest.fixture
def exported(store, tmp_path):
    torch.manual_seed(0)
    data = {"w": torch.randn(1000, 1000), "b": torch.zeros(1000)}
    store.commit(data, tag="t")
    store.export("t", tmp_path / "dir")
    store.export("t", tmp_path / "t.zip")
    target = ckptstore.Store(tmp_path / "target", create=True)
    yield data, tmp_path / "dir", tmp_path / "t.zip", target
    target.close()


def manifest(folder: Path) -> dict:
    return json.loads((folder / MANIFEST).read_text())


def leaf(doc: dict, path: str) -> dict:
    return next(r for r in doc["leaves"] if r["path"] == path)


def rewrite_zip(src: Path, dst: Path, replace: dict[str, bytes]) -> None:
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, replace.get(info.filename, zin.read(info.filename)))


def test_round_trip_through_both_forms(exported):
    data, folder, archive, target = exported
    for src, tag in ((folder, "d"), (archive, "z")):
        target.import_from(src, tag=tag)
        back = target.checkout(tag)
        assert_bit_equal(back["w"], data["w"])
        assert_bit_equal(back["b"], data["b"])


def test_export_refuses_existing_destination(store, exported, tmp_path):
    with pytest.raises(ContainerError, match="already exists"):
        store.export("t", tmp_path / "dir")


def expect_rejected(target, src, *patterns):
    before = row_count(target)
    with pytest.raises(ContainerError) as err:
        target.import_from(src, tag="x")
    for p in patterns:
        assert p in str(err.value), (p, str(err.value))
    assert row_count(target) == before
    assert list((target.root / "tmp").iterdir()) == []  # nothing left behind
    return err.value


def test_c25_flipped_byte_in_a_shard(exported):
    _, folder, _, target = exported
    addr = leaf(manifest(folder), "w")["shards"][2]
    f = folder / "blobs" / addr
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    f.write_bytes(bytes(raw))
    expect_rejected(target, folder, "leaf 'w' shard 2", addr, "hash mismatch")


def test_c25_truncated_shard(exported):
    _, folder, _, target = exported
    addr = leaf(manifest(folder), "w")["shards"][0]
    f = folder / "blobs" / addr
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    expect_rejected(target, folder, "leaf 'w' shard 0", addr)


def test_c25_shape_edited(exported):
    _, folder, _, target = exported
    doc = manifest(folder)
    leaf(doc, "w")["shape"] = [2000, 1000]
    (folder / MANIFEST).write_text(json.dumps(doc))
    expect_rejected(target, folder, "leaf 'w'", "[2000, 1000]")


def test_c25_record_pointed_at_another_leafs_shard(exported):
    _, folder, _, target = exported
    doc = manifest(folder)
    leaf(doc, "b")["shards"] = [leaf(doc, "w")["shards"][0]]
    (folder / MANIFEST).write_text(json.dumps(doc))
    expect_rejected(target, folder, "leaf 'b'", "should hold 4000 bytes")


def test_c25_zip_without_central_directory(exported, tmp_path):
    _, _, archive, target = exported
    cut = tmp_path / "cut.zip"
    cut.write_bytes(archive.read_bytes()[:-100])
    expect_rejected(target, cut, "probably truncated or corrupt")


def test_c25_duplicate_key_in_manifest(exported):
    _, folder, _, target = exported
    text = (folder / MANIFEST).read_text()
    (folder / MANIFEST).write_text(text.replace('"version": 1,', '"version": 1, "version": 1,', 1))
    expect_rejected(target, folder, "duplicate key")


def test_c08_missing_shard_file_names_the_leaf(store, tmp_path):
    store.commit({"x": torch.arange(4.0), "empty": torch.zeros(0, 3)}, tag="z")
    store.export("z", tmp_path / "d")
    addr = leaf(manifest(tmp_path / "d"), "x")["shards"][0]
    (tmp_path / "d" / "blobs" / addr).unlink()
    with ckptstore.Store(tmp_path / "other", create=True) as other:
        expect_rejected(other, tmp_path / "d", "leaf 'x'", "missing")


def test_incomplete_export_without_manifest_is_rejected(exported):
    _, folder, _, target = exported
    (folder / MANIFEST).unlink()
    expect_rejected(target, folder, "not a complete ckptstore export")


class _Pwn:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_c24_malicious_payloads_never_run_code(exported, tmp_path):
    _, folder, archive, target = exported
    marker = f"/tmp/ckpt_pwn_{uuid.uuid4().hex}"
    payload = pickle.dumps(_Pwn(marker))
    doc = manifest(folder)
    w0 = leaf(doc, "w")["shards"][0]
    pt = tmp_path / "evil.pt"
    torch.save({"x": _Pwn(marker)} if False else {"x": torch.zeros(2)}, pt)  # a real .pt file in place of a shard
    cases = []

    def variant(name: str, files: dict[str, bytes] | None = None, edit=None):
        d = tmp_path / name
        shutil.copytree(folder, d)
        for rel, content in (files or {}).items():
            (d / rel).write_bytes(content)
        if edit is not None:
            m = manifest(d)
            edit(m)
            (d / MANIFEST).write_text(json.dumps(m))
        cases.append(d)

    variant("pickle_blob", {f"blobs/{w0}": payload})
    variant("pt_blob", {f"blobs/{w0}": pt.read_bytes()})
    variant("pickle_meta", edit=lambda m: m["commit"].__setitem__("metadata", payload.decode("latin-1")))
    variant("os_system", edit=lambda m: m["components"][0].__setitem__("adapter", "os.system"))
    variant("popen", edit=lambda m: m["components"][0].__setitem__("adapter", "subprocess.Popen"))
    variant("traversal", edit=lambda m: leaf(m, "w").__setitem__("path", "../../outside.bin"))
    variant("absolute", edit=lambda m: leaf(m, "w").__setitem__("path", "/etc/outside.bin"))
    zipped = tmp_path / "evil.zip"
    rewrite_zip(archive, zipped, {f"blobs/{w0}": payload})
    cases.append(zipped)
    traversal_zip = tmp_path / "slip.zip"
    rewrite_zip(archive, traversal_zip, {})
    with zipfile.ZipFile(traversal_zip, "a") as z:
        z.writestr("../../outside.bin", b"x")
    target.import_from(traversal_zip, tag="slip")  # stray entries are never extracted or used
    assert not (tmp_path.parent / "outside.bin").exists()

    modules_before = set(sys.modules)
    listing_before = sorted(os.listdir(tmp_path.parent))
    messages = [str(expect_rejected(target, case)) for case in cases]
    assert not os.path.exists(marker)
    assert {m for m in set(sys.modules) - modules_before if not m.startswith("ckptstore")} == set()
    assert sorted(os.listdir(tmp_path.parent)) == listing_before
    assert "bad header" in messages[0] and "bad header" in messages[1] and "bad header" in messages[7]
    assert "metadata" in messages[2]
    assert "os.system" in messages[3] and "subprocess.Popen" in messages[4]
    # ".." is a key like any other (paths never name files), so that manifest only fails its commit id
    assert "does not match its id" in messages[5] and "/etc/outside.bin" in messages[6]


def test_corrupt_blob_in_store_names_leaf_blob_commit_and_spares_other_leaves(store):
    torch.manual_seed(0)
    data = {"w": torch.randn(1000, 1000), "b": torch.zeros(1000)}
    info = store.commit(data, tag="t")
    loc = store.manifest(info.id, ["w"])[0].shards[1]
    pack = store.root / "blobs" / loc.pack[:2] / f"{loc.pack}.pack"
    raw = bytearray(pack.read_bytes())
    raw[loc.offset + 100] ^= 0xFF
    os.chmod(pack, 0o644)
    pack.write_bytes(bytes(raw))
    with pytest.raises(BlobCorruptError) as err:
        store.checkout("t")
    assert "leaf w" in str(err.value) and loc.address in str(err.value) and info.id in str(err.value)
    assert_bit_equal(store.checkout("t", partial=["b"])["b"], data["b"])
    target = torch.zeros(1000, 1000)
    with pytest.raises(BlobCorruptError):
        store.checkout("t", into={"w": target}, partial=["w"])
    assert bool((target == 0).all())  # read and verified before anything is written


def test_import_keeps_provenance_and_is_idempotent(store, tmp_path):
    first = store.commit({"w": torch.arange(10.0)}, tag="t", message="first", metadata={"step": 1})
    second = store.commit({"w": torch.arange(10.0) + 1}, tag="t", message="second", metadata={"step": 2})
    store.export("t", tmp_path / "t.zip")
    other = ckptstore.Store(tmp_path / "other", create=True)
    with pytest.warns(UserWarning, match="no tag: the next `ckptstore gc` drops it"):
        info = other.import_from(tmp_path / "t.zip")
    assert (info.id, info.parents, info.created_at, info.message, info.metadata) == (
        second.id, (first.id,), second.created_at, "second", {"step": 2})
    before = {t: other.catalog.rows(f"SELECT COUNT(*) FROM {t}")[0][0] for t in ("commits", "blobs", "leaves")}
    again = other.import_from(tmp_path / "t.zip", tag="back")  # the same archive again: nothing new, the tag moves
    assert again.id == second.id and again.shards_new == 0 and other.tags() == {"back": second.id}
    assert {t: other.catalog.rows(f"SELECT COUNT(*) FROM {t}")[0][0] for t in ("commits", "blobs", "leaves")} == before
    assert [c.id for c in other.log("back")] == [second.id]  # the parent is not here: lineage ends
    assert_bit_equal(other.checkout("back")["w"], torch.arange(10.0) + 1)
    assert other.fsck(deep=True).ok
    other.close()
