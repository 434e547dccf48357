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

from tests.conftest import assert_bit_equal, commit_edited, row_count


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
    from ckptstore.home.local import LocalHome

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

    import ckptstore.objects.packs as packs

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


# --- checkout reads runs of blobs (issue 22, item 8) ---------------------------------------


def _count_preadv(monkeypatch) -> list[int]:
    import os

    calls: list[int] = []
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, offset: (calls.append(len(bufs)), real(fd, bufs, offset))[1])
    return calls


def _flip(store: ckptstore.Store, loc, at: int) -> None:
    import os

    pack = store.root / "blobs" / loc.pack[:2] / f"{loc.pack}.pack"
    raw = bytearray(pack.read_bytes())
    raw[loc.offset + at] ^= 0xFF
    os.chmod(pack, 0o644)
    pack.write_bytes(bytes(raw))


def test_checkout_reads_back_to_back_blobs_in_one_call_and_only_what_is_named(store, monkeypatch):
    """The shards of a checkout that lie back to back in a pack are read with one
    ``preadv`` (headers and payloads, straight into the tensors), each still rehashed;
    a partial checkout reads only the named leaves' blobs, counted exactly."""
    import ckptstore.protocols.checkout as checkout
    from ckptstore.objects.packs import BLOB_HEADER

    g = torch.Generator().manual_seed(3)
    a = torch.rand(512, 1024, generator=g)  # 8 shards
    b = torch.rand(512, 1024, generator=g, dtype=torch.float64)  # 16 shards
    store.commit({"a": a}, tag="t")
    store.commit({"a": a, "b": b}, tag="t")  # b's blobs in a second pack
    calls = _count_preadv(monkeypatch)
    out = store.checkout("t")
    assert_bit_equal(out["a"], a)
    assert_bit_equal(out["b"], b)
    assert (store.io.blobs_read, store.io.bytes_read) == (24, 24 * (BLOB_HEADER.size + (256 << 10)))
    assert sorted(calls) == [16, 32]  # one call per pack: 8 and 16 headers and payloads
    calls.clear()
    part = store.checkout("t", partial=["a"])
    assert list(part.keys()) == ["a"]
    assert_bit_equal(part["a"], a)
    assert (store.io.blobs_read, calls) == (24 + 8, [16])  # none of b's
    monkeypatch.setattr(checkout, "_RUN_BYTES", 3 << 18)  # three shards a run
    calls.clear()
    assert_bit_equal(store.checkout("t", partial=["a"], verify=False)["a"], a)
    assert calls == [6, 6, 4]


def test_run_reader_refuses_what_is_not_a_verified_run(store):
    """:meth:`PackReader.read_run` reads only raw blobs back to back, and reports a bad
    header or hash by returning False with nothing counted (the caller then reads blob by
    blob, which names the error)."""
    g = torch.Generator().manual_seed(4)
    w = torch.rand(4, 65536, generator=g)  # 4 shards
    info = store.commit({"w": w}, tag="t")
    order = sorted(range(4), key=lambda i: store.manifest(info.id)[0].shards[i].offset)  # the pool may write them in any order
    locs = [store.manifest(info.id)[0].shards[i] for i in order]
    size = sum(loc.span[1] - loc.span[0] for loc in locs)
    reader = store.pack_reader()
    try:
        bufs = [memoryview(bytearray(loc.raw_len)) for loc in locs]
        assert reader.read_run(locs, bufs) and (reader.blobs_read, reader.bytes_read) == (4, size)
        assert [bytes(buf) for buf in bufs] == [w[i].numpy().tobytes() for i in order]
        assert not reader.read_run([locs[0], locs[2]], [bufs[0], bufs[2]])  # not back to back
        assert not reader.read_run(locs[:2], [bufs[0], bufs[1][:-1]])  # a destination of the wrong size
        _flip(store, locs[2], 40 + 1000)  # payload of the third blob
        assert not reader.read_run(locs, bufs)
        assert reader.read_run(locs, bufs, verify=False)  # its header still matches
        _flip(store, locs[1], 20)  # a header's stored length
        assert not reader.read_run(locs, bufs, verify=False)
        assert (reader.blobs_read, reader.bytes_read) == (8, 2 * size)
    finally:
        reader.close()


@pytest.mark.parametrize("where", ["payload", "header"])
def test_bad_blob_in_a_run_raises_and_leaves_the_module_and_optimizer_unchanged(store, where):
    """A damaged blob in the middle of a run: checkout(into=) raises IntegrityError naming
    the leaf, blob and commit, and the target module and optimizer keep every bit."""
    from ckptstore.errors import BlobCorruptError, IntegrityError

    def make(seed: int):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 8))
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randn(4, 1024)).sum().backward()
        optim.step()
        return model, optim

    model, optim = make(0)
    info = store.commit({"model": model, "optim": optim}, tag="t")
    leaf = next(r for r in store.manifest(info.id) if r.path == "model/0.weight")
    assert len(leaf.shards) == 16
    _flip(store, leaf.shards[7], 40 + 5000 if where == "payload" else 8)
    target, topt = make(1)
    params = list(target.parameters())
    before = {k: v.clone() for k, v in target.state_dict().items()}
    moments = [{k: v.clone() for k, v in topt.state[p].items()} for p in params]
    with pytest.raises(IntegrityError) as err:
        store.checkout("t", into={"model": target, "optim": topt})
    assert isinstance(err.value, BlobCorruptError)
    assert "leaf model/0.weight, shard 7" in str(err.value) and leaf.shards[7].address in str(err.value) and info.id in str(err.value)
    for k, v in target.state_dict().items():
        assert_bit_equal(v, before[k])
    for p, saved in zip(params, moments):
        assert sorted(topt.state[p]) == sorted(saved)
        for k, v in topt.state[p].items():
            assert_bit_equal(v, saved[k])
    whole = store.checkout("t", partial=["optim"], into={"model": target, "optim": topt})  # the optimizer's blobs are whole
    assert whole["optim"] is topt
    for p, q in zip(model.parameters(), params):
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert_bit_equal(optim.state[p][k], topt.state[q][k])
