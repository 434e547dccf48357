"""Refs, tags, lineage, reflog, store folders and bad input."""

from __future__ import annotations

import pytest
import torch

import ckptstore
from ckptstore.errors import (
    AmbiguousRefError,
    InvalidArgumentError,
    InvalidNameError,
    NotAStoreError,
    PartialPathError,
    RefNotFoundError,
    TargetMismatchError,
)

from .conftest import assert_bit_equal, commit_edited, row_count


def test_refs_tags_prefixes_and_lineage(store):
    a = store.commit({"x": torch.zeros(3)}, tag="t", message="first", metadata={"step": 1})
    b = store.commit({"x": torch.ones(3)}, tag="t", message="second", metadata={"step": 2})
    assert b.parents == (a.id,) and a.parents == ()
    assert store.resolve("t") == b.id == store.resolve(b.id) == store.resolve(b.id[:8]) == store.resolve(b.id[:8].upper())
    assert store.tags() == {"t": b.id}
    assert [c.id for c in store.log("t")] == [b.id, a.id]
    assert store.log("t")[0].tags == ("t",) and store.log("t")[1].tags == ()
    assert store.info(a.id).metadata == {"step": 1} and store.info(a.id).message == "first"
    assert_bit_equal(store.checkout(a.id)["x"], torch.zeros(3))  # the old commit stays readable
    moves = store.reflog("t")
    assert [(m["old_commit"], m["new_commit"], m["action"]) for m in moves] == [(a.id, b.id, "commit"), (None, a.id, "commit")]


def test_several_tags_move_in_one_commit_and_tag_api(store):
    a = store.commit({"x": torch.zeros(1)}, tag=["step-1", "latest"])
    b = store.commit({"x": torch.ones(1)}, tag=["step-2", "latest"])
    assert b.parents == (a.id,)
    assert store.tags() == {"latest": b.id, "step-1": a.id, "step-2": b.id}
    assert store.tag("best", "step-1") == a.id
    assert store.delete_tag("best") == a.id
    assert "best" not in store.tags()
    assert store.reflog("best")[0]["action"] == "delete"
    with pytest.raises(RefNotFoundError):
        store.delete_tag("best")


def test_ref_errors(store):
    with pytest.raises(RefNotFoundError, match="nope"):
        store.checkout("nope")
    ids = set()
    i = 0
    while True:  # find two commits sharing their first 4 hex digits (a few hundred commits)
        cid = store.commit({"i": i}).id
        i += 1
        if cid[:4] in ids:
            break
        ids.add(cid[:4])
    with pytest.raises(AmbiguousRefError, match="ambiguous"):
        store.resolve(cid[:4])
    with pytest.raises(RefNotFoundError):  # shorter hex is not read as a prefix: too easily a mistyped tag
        store.resolve(cid[:3])
    for bad in ("", " x", "a\nb", 3):
        with pytest.raises(InvalidNameError):
            store.commit({"i": 0}, tag=bad)


def test_partial_errors_list_components(store):
    store.commit({"policy": torch.nn.Linear(2, 2), "opt": {"lr": 0.1}}, tag="t")
    before = row_count(store)
    with pytest.raises(PartialPathError, match="policy, opt"):
        store.checkout("t", partial=["sampler"])
    with pytest.raises(TargetMismatchError, match="no component"):
        store.checkout("t", into={"sampler": torch.nn.Linear(2, 2)})
    assert row_count(store) == before


def test_json_values_and_plain_dicts_round_trip(store):
    state = {"progress": {"step": 10, "frames": 2560, "best": 1.5, "history": [(0, 0.5), (1, 1.0)]}, "tag": "run-a", "net": torch.nn.Linear(2, 1)}
    store.commit(state, tag="p")
    back = store.checkout("p")
    assert back["progress", "history"] == [(0, 0.5), (1, 1.0)]
    assert back["tag"] == "run-a"
    target = {"progress": {}, "tag": None, "net": torch.nn.Linear(2, 1)}
    store.checkout("p", into=target)
    assert target["progress"] == state["progress"] and target["tag"] == "run-a"


def test_bare_values_as_the_whole_commit(store):
    store.commit(torch.arange(5), tag="tensor")
    store.commit(42, tag="int")
    assert_bit_equal(store.checkout("tensor"), torch.arange(5))
    assert store.checkout("int") == 42
    target = torch.zeros(5, dtype=torch.int64)
    assert store.checkout("tensor", into=target) is target
    assert_bit_equal(target, torch.arange(5))


def test_store_folder_checks(tmp_path):
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "file.txt").write_text("hello")
    with pytest.raises(NotAStoreError, match="not a ckptstore store"):
        ckptstore.Store(tmp_path / "junk")
    assert sorted(p.name for p in (tmp_path / "junk").iterdir()) == ["file.txt"]  # untouched
    with pytest.raises(NotAStoreError):
        ckptstore.Store(tmp_path / "missing", create=False)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(NotAStoreError):
        ckptstore.Store(tmp_path / "afile")
    s = ckptstore.Store(tmp_path / "new", shard_bytes=4096, create=True)
    s.close()
    with ckptstore.Store(tmp_path / "new") as again:
        assert again.shard_bytes == 4096  # saved with the store


def test_one_store_class_on_its_local_home_and_object_storage_options_refused_for_a_folder(tmp_path):
    from ckptstore.localhome import LocalHome

    with ckptstore.Store(tmp_path / "s", create=True) as s:
        assert type(s) is ckptstore.Store and type(s.home) is LocalHome and s.location == str(tmp_path / "s")
        assert not hasattr(s, "backend")  # a folder's objects are files, not a backend
    for option in ({"cache": tmp_path / "c"}, {"backend": object()}):
        with pytest.raises(InvalidArgumentError, match="for a store on object storage"):
            ckptstore.Store(tmp_path / "s", **option)
    assert not (tmp_path / "c").exists()


def test_custom_adapter_registration_and_versions(store):
    class Counter:
        def __init__(self, n=0):
            self.n = n

    @ckptstore.register_adapter
    class CounterAdapter(ckptstore.Adapter):
        name = "tests.counter"
        version = 1
        types = (Counter,)

        def to_state(self, obj):
            return {"n": obj.n}

        def from_state(self, obj, state):
            obj.n = state.json("n")
            return obj

    try:
        store.commit({"c": Counter(5)}, tag="c")
        c = Counter()
        store.checkout("c", into={"c": c})
        assert c.n == 5

        @ckptstore.register_adapter(replace=True)
        class CounterV2(CounterAdapter):
            version = 2
            migrations = {1: lambda flat, meta: {"n": flat["n"] * 10}}

        store.checkout("c", into={"c": c})
        assert c.n == 50  # migrated v1 -> v2

        @ckptstore.register_adapter(replace=True)
        class CounterOld(CounterAdapter):
            version = 1

        commit_edited(store, {"c": Counter(1)}, "c", version={"c": 9})
        with pytest.raises(ckptstore.errors.AdapterVersionError, match="version 9.*version 1"):
            store.checkout("c", into={"c": c})
    finally:
        from ckptstore.adapters import REGISTRY

        del REGISTRY.by_name["tests.counter"]
        del REGISTRY.by_type[Counter]


def test_commit_async_snapshots_then_commits_in_the_background(store):
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(100), batch_size=4)
    rb.extend(TensorDict({"obs": torch.arange(300.0).view(100, 3)}, [100]))
    net = torch.nn.Linear(3, 2)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    progress = {"step": 1, "hist": [1, 2]}
    first = store.commit_async({"rb": rb, "net": net, "progress": progress}, tag="latest")
    with torch.no_grad():  # training goes on while the commit runs
        net.weight.add_(1.0)
        rb.storage._storage["obs"].mul_(0)
    progress["hist"].append(3)
    info = first.result()
    back = store.checkout(info.id)
    assert_bit_equal(back["net", "weight"], before["weight"])
    assert_bit_equal(back["rb", "storage", "data", "obs"], torch.arange(300.0).view(100, 3))
    assert back["progress", "hist"] == [1, 2]
    second = store.commit_async({"rb": rb, "net": net, "progress": progress}, tag="latest")
    assert second.result().parents == (info.id,)  # in call order
    assert_bit_equal(store.checkout("latest")["rb", "storage", "data", "obs"], torch.zeros(100, 3))
    bad = store.commit_async({"net": net}, tag=" bad")
    with pytest.raises(InvalidNameError):
        bad.result()
    with pytest.raises(ckptstore.errors.UnsupportedTypeError):
        store.commit_async({"x": object()})


def test_tag_names_that_would_hide_a_commit_id_are_refused(store):
    cid = store.commit({"x": torch.ones(1)}, tag="t").id
    for name in (cid[:12], "DEADBEEF", "0" * 32, "x" * 256):
        with pytest.raises(ckptstore.errors.InvalidNameError):
            store.tag(name, "t")
    assert store.resolve(cid[:12]) == cid and store.tag("beefy", "t") == cid  # not all hex: fine


def test_gc_dry_run_on_a_store_that_cannot_be_written(tmp_path):
    import os
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("a read-only bind mount needs root")
    with ckptstore.Store(tmp_path / "src" / "s", create=True) as s:
        s.commit({"x": torch.ones(1)}, tag="t")
        s.commit({"x": torch.zeros(1)}, tag="t")
    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["mount", "--bind", str(tmp_path / "src"), str(ro)], capture_output=True).returncode:
        pytest.skip("cannot bind-mount here")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], check=True)
        with ckptstore.Store(ro / "s", create=False) as s:
            assert s.gc(grace=0, dry_run=True).commits_dropped == 1
            with pytest.raises(ckptstore.errors.StoreWriteError, match="read-only"):
                s.gc(grace=0)
    finally:
        subprocess.run(["umount", "-l", str(ro)], check=False)


def test_blobs_folder_fsynced_once_per_store_and_process(tmp_path, monkeypatch):
    """The first pack a process renames into a blobs/<xx> folder it has not seen made
    durable creates all 256 folders and fsyncs blobs/ once; every later pack needs only
    its own folder fsynced. Empty folders change nothing for fsck."""
    from pathlib import Path

    import ckptstore.packs as packs

    synced: list[str] = []
    real = packs.fsync_dir
    monkeypatch.setattr(packs, "fsync_dir", lambda path: (synced.append(Path(path).name), real(path)))
    store = ckptstore.Store(tmp_path / "s")
    for i in range(40):  # 80 packs: the blobs and the record of each commit
        store.commit({"x": torch.full((4,), float(i))}, tag="a")
    blobs = tmp_path / "s" / "blobs"
    assert sorted(p.name for p in blobs.iterdir()) == [f"{i:02x}" for i in range(256)]
    assert sum(1 for _ in blobs.glob("*/*.pack")) == 80
    assert synced == ["blobs"]
    report = store.fsck()
    assert report.ok and report.orphan_packs == []
