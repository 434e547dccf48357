"""TorchRL replay buffers: commit, checkout into fresh buffers, exact resume."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from tensordict import TensorDict
from torchrl.data import (
    LazyMemmapStorage,
    LazyTensorStorage,
    ReplayBuffer,
    TensorDictPrioritizedReplayBuffer,
    TensorDictReplayBuffer,
    TensorStorage,
)
from torchrl.data.replay_buffers import RandomSampler, SamplerWithoutReplacement

import ckptstore
from ckptstore.errors import PartialPathError, ShapeMismatchError, TargetMismatchError

from tests.conftest import assert_bit_equal, commit_edited, row_count, run_fresh

CAP = 50


def make_storage(kind: str, cap: int = CAP):
    if kind == "lazy":
        return LazyTensorStorage(cap)
    if kind == "memmap":
        return LazyMemmapStorage(cap)
    return TensorStorage(TensorDict({"obs": torch.zeros(cap, 3), "act": torch.zeros(cap, dtype=torch.int64), "next": {"r": torch.zeros(cap, 1)}}, [cap]))


def make_buffer(storage_kind: str, sampler_kind: str, cap: int = CAP):
    storage = make_storage(storage_kind, cap)
    if sampler_kind == "prioritized":
        return TensorDictPrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=storage, batch_size=8, priority_key="td_error")
    sampler = RandomSampler() if sampler_kind == "random" else SamplerWithoutReplacement()
    return TensorDictReplayBuffer(storage=storage, sampler=sampler, batch_size=8)


def chunk(start: int, n: int) -> TensorDict:
    i = torch.arange(start, start + n)
    return TensorDict({"obs": i[:, None].float().expand(n, 3).clone(), "act": i, "next": {"r": i[:, None].float() * 0.5}}, [n])


def fill(rb, sampler_kind: str) -> None:
    for start in (0, 30, 60):  # 90 writes into 50 slots: wraps around
        rb.extend(chunk(start, 30))
    if sampler_kind == "prioritized":
        rb.update_priority(torch.arange(CAP), torch.linspace(0.1, 5.0, CAP))
    torch.manual_seed(1)
    np.random.seed(1)
    rb.sample()  # advances a sampler without replacement


def storage_of(rb) -> TensorDict:
    return rb.storage._storage[: len(rb)]


def samples(rb, k: int = 5, seed: int = 123) -> list[TensorDict]:
    torch.manual_seed(seed)
    np.random.seed(seed)
    return [rb.sample() for _ in range(k)]


@pytest.mark.parametrize("sampler_kind", ["random", "without_replacement", "prioritized"])
@pytest.mark.parametrize("storage_kind", ["lazy", "memmap", "tensor"])
def test_matrix_checkout_into_fresh_buffer(store, storage_kind, sampler_kind):
    rb = make_buffer(storage_kind, sampler_kind)
    fill(rb, sampler_kind)
    assert (len(rb), rb.writer._cursor, rb.writer._write_count) == (CAP, 40, 90)
    store.commit(rb, tag="rb")
    fresh = make_buffer(storage_kind, sampler_kind)
    store.checkout("rb", into=fresh)
    assert (len(fresh), fresh.writer._cursor, fresh.writer._write_count) == (CAP, 40, 90)
    for key in (("obs",), ("act",), ("next", "r")):
        assert_bit_equal(storage_of(fresh)[key], storage_of(rb)[key])
    if sampler_kind == "prioritized":
        idx = torch.arange(CAP)
        assert_bit_equal(fresh.sampler._sum_tree[idx], rb.sampler._sum_tree[idx])
        assert_bit_equal(fresh.sampler._min_tree[idx], rb.sampler._min_tree[idx])
    if sampler_kind == "without_replacement":
        assert_bit_equal(fresh.sampler._sample_list, rb.sampler._sample_list)
    for a, b in zip(samples(rb), samples(fresh)):
        assert_bit_equal(a["act"], b["act"])
        assert_bit_equal(a["obs"], b["obs"])
        if sampler_kind == "prioritized":
            assert_bit_equal(a["priority_weight"], b["priority_weight"])
    rb.extend(chunk(100, 7))
    fresh.extend(chunk(100, 7))
    assert fresh.writer._cursor == rb.writer._cursor == 47
    assert_bit_equal(storage_of(fresh)["act"], storage_of(rb)["act"])


def test_plain_replay_buffer_with_tensor_storage_layout(store):
    rb = ReplayBuffer(storage=LazyTensorStorage(20), batch_size=4)
    rb.extend(torch.arange(30).view(15, 2).float())
    store.commit(rb, tag="plain")
    fresh = ReplayBuffer(storage=LazyTensorStorage(20), batch_size=4)
    store.checkout("plain", into=fresh)
    assert len(fresh) == 15 and fresh.writer._cursor == 15
    assert_bit_equal(fresh.storage._storage[:15], rb.storage._storage[:15])
    torch.manual_seed(0)
    a = rb.sample()
    torch.manual_seed(0)
    assert_bit_equal(fresh.sample(), a)


C01_BUILD = """
import torch, numpy as np
from tensordict import TensorDict
from torchrl.data import TensorDictPrioritizedReplayBuffer, LazyTensorStorage

def build():
    return TensorDictPrioritizedReplayBuffer(alpha=0.6, beta=0.4, storage=LazyTensorStorage(100), batch_size=12, priority_key="td_error")

def original():
    rb = build()
    rb.extend(TensorDict({"a": torch.arange(48, dtype=torch.float32).view(24, 2)}, [24]))
    rb.update_priority(torch.arange(24), torch.tensor([0.1 * (i + 1) for i in range(24)], dtype=torch.float32))
    return rb
"""


def test_c01_prioritized_buffer_into_never_written_buffer_fresh_process(tmp_path):
    ns: dict = {}
    exec(C01_BUILD, ns)
    with ckptstore.Store(tmp_path / "s") as s:
        s.commit(ns["original"](), tag="per")
    run_fresh(
        C01_BUILD
        + """
import sys, ckptstore
store = ckptstore.Store(sys.argv[1], create=False)
rb, fresh = original(), build()
store.checkout("per", into=fresh)
assert len(fresh) == 24
idx = torch.arange(100)
for tree in ("_sum_tree", "_min_tree"):
    a, b = getattr(rb.sampler, tree)[idx], getattr(fresh.sampler, tree)[idx]
    assert a.dtype == b.dtype and a.numpy().tobytes() == b.numpy().tobytes(), tree
assert bool((fresh.sampler._sum_tree[idx][24:] == 0).all())
assert bool((fresh.sampler._min_tree[idx][24:] == torch.finfo(torch.float32).max).all())
assert fresh.sampler._sum_tree.query(0, 100) == rb.sampler._sum_tree.query(0, 100)
assert float(fresh.sampler._max_priority[0]) == float(rb.sampler._max_priority[0])
for label, buf in (("orig", rb), ("restored", fresh)):
    torch.manual_seed(0); np.random.seed(0)
    out = [buf.sample() for _ in range(5)]
    globals()[label] = out
for x, y in zip(orig, restored):
    assert torch.equal(x["index"], y["index"]) and x["priority_weight"].numpy().tobytes() == y["priority_weight"].numpy().tobytes()
print("ok")
""",
        str(tmp_path / "s"),
    )


C03_BUILD = """
import torch
from tensordict import TensorDict
from torchrl.data import TensorDictReplayBuffer, LazyTensorStorage

def build():
    return TensorDictReplayBuffer(storage=LazyTensorStorage(10), batch_size=2)

def rows(start, n):
    step = torch.arange(start, start + n)
    return TensorDict({"step": step, "obs": step[:, None].float().expand(n, 3).clone()}, [n])

def original():
    rb, start = build(), 0
    for n in (7, 7, 7, 4):
        rb.extend(rows(start, n)); start += n
    return rb
"""


def test_c03_writer_cursor_and_write_count_after_wraparound_fresh_process(tmp_path):
    ns: dict = {}
    exec(C03_BUILD, ns)
    rb = ns["original"]()
    assert (rb.writer._cursor, len(rb), rb.writer._write_count) == (5, 10, 25)
    assert rb.storage._storage["step"].tolist() == [20, 21, 22, 23, 24, 15, 16, 17, 18, 19]
    with ckptstore.Store(tmp_path / "s") as s:
        s.commit(rb, tag="w")
    run_fresh(
        C03_BUILD
        + """
import sys, ckptstore
store = ckptstore.Store(sys.argv[1], create=False)
rb, fresh = original(), build()
store.checkout("w", into=fresh)
assert (fresh.writer._cursor, len(fresh), fresh.writer._write_count) == (5, 10, 25)
assert torch.equal(fresh.storage._storage["step"], rb.storage._storage["step"])
for buf in (rb, fresh):
    buf.extend(rows(25, 3))
assert fresh.writer._write_count == rb.writer._write_count == 28
assert fresh.storage._storage["step"].tolist() == rb.storage._storage["step"].tolist() == [20, 21, 22, 23, 24, 25, 26, 27, 18, 19]
assert torch.equal(fresh.storage._storage["obs"], rb.storage._storage["obs"])
print("ok")
""",
        str(tmp_path / "s"),
    )


def test_c03_variant_writer_record_without_write_count_uses_documented_default(store):
    ns: dict = {}
    exec(C03_BUILD, ns)
    commit_edited(store, ns["original"](), "old", version={"writer": 1}, drop=("writer/write_count",))  # a version-1 writer record (cursor only)
    fresh = ns["build"]()
    store.checkout("old", into=fresh)
    assert fresh.writer._cursor == 5
    assert fresh.writer._write_count == 10  # default: the restored storage's length


def test_c05a_never_written_buffer(store):
    def build():
        return TensorDictReplayBuffer(storage=LazyTensorStorage(100), batch_size=100)

    store.commit(build(), tag="empty")
    fresh = build()
    store.checkout("empty", into=fresh)
    assert len(fresh) == 0 and not fresh.storage.initialized
    fresh.extend(TensorDict({"obs": torch.ones(5, 3)}, [5]))
    assert len(fresh) == 5 and fresh.writer._cursor == 5
    assert torch.equal(fresh.storage._storage["obs"][:5], torch.ones(5, 3))


def test_c05b_partly_filled_memmap_storage_commits_only_written_rows(store, tmp_path):
    cap = 1_000_000
    rb = TensorDictReplayBuffer(storage=LazyMemmapStorage(cap, scratch_dir=tmp_path / "a"), batch_size=4)
    g = torch.Generator().manual_seed(0)
    data = TensorDict(
        {"pixels": torch.randint(0, 256, (24, 3, 64, 64), dtype=torch.uint8, generator=g), "next": {"reward": torch.randn(24, 1, generator=g)}}, [24]
    )
    rb.extend(data)
    info = store.commit(rb, tag="partial")
    assert info.logical_bytes == 24 * 3 * 64 * 64 + 24 * 4 + 24 * 8  # pixels + reward + the buffer's "index" key
    assert info.new_bytes < 2_000_000 and info.stored_bytes < 2_000_000
    fresh = TensorDictReplayBuffer(storage=LazyMemmapStorage(cap, scratch_dir=tmp_path / "b"), batch_size=4)
    store.checkout("partial", into=fresh)
    assert (len(fresh), fresh.writer._cursor, fresh.storage.max_size) == (24, 24, cap)
    assert_bit_equal(fresh.storage._storage["pixels"][:24].clone(), data["pixels"])
    index = fresh.extend(data[:1])
    assert index.tolist() == [24]


def test_exact_resume_by_restoring_the_rng_component(store):
    rb = make_buffer("lazy", "prioritized")
    fill(rb, "prioritized")
    store.commit({"rb": rb, "rng": ckptstore.RNGState()}, tag="r")
    reference = [rb.sample() for _ in range(4)]
    torch.manual_seed(999)
    np.random.seed(999)  # scramble; the rng component must bring the streams back
    fresh = make_buffer("lazy", "prioritized")
    store.checkout("r", into={"rb": fresh, "rng": ckptstore.RNGState()})
    for a, b in zip(reference, [fresh.sample() for _ in range(4)]):
        assert_bit_equal(a["index"], b["index"])
        assert_bit_equal(a["obs"], b["obs"])
        assert_bit_equal(a["priority_weight"], b["priority_weight"])


def test_capacity_mismatch_is_refused_before_touching_the_target(store):
    rb = make_buffer("lazy", "prioritized")
    fill(rb, "prioritized")
    store.commit(rb, tag="rb")
    before = row_count(store)
    wrong = make_buffer("lazy", "prioritized", cap=60)
    with pytest.raises(TargetMismatchError, match="capacity"):
        store.checkout("rb", into=wrong)
    assert len(wrong) == 0 and not wrong.storage.initialized and wrong.writer._cursor == 0
    assert row_count(store) == before


def test_layout_and_key_mismatch_are_refused(store):
    rb = make_buffer("lazy", "random")
    fill(rb, "random")
    store.commit(rb, tag="rb")
    plain = ReplayBuffer(storage=LazyTensorStorage(CAP), batch_size=4)
    plain.extend(torch.zeros(3, 2))
    with pytest.raises(TargetMismatchError, match="layout"):
        store.checkout("rb", into=plain)
    other = TensorDictReplayBuffer(storage=LazyTensorStorage(CAP), batch_size=4)
    other.extend(TensorDict({"obs": torch.zeros(2, 3), "act": torch.zeros(2, dtype=torch.int64), "extra": torch.zeros(2)}, [2]))
    with pytest.raises(TargetMismatchError, match=r"keys differ; not in the commit: \['extra'\]"):
        store.checkout("rb", into=other)
    wrong_shape = TensorDictReplayBuffer(storage=LazyTensorStorage(CAP), batch_size=4)
    wrong_shape.extend(TensorDict({"obs": torch.zeros(2, 4), "act": torch.zeros(2, dtype=torch.int64), "next": {"r": torch.zeros(2, 1)}, "index": torch.zeros(2, dtype=torch.int64)}, [2]))
    with pytest.raises(ShapeMismatchError, match="obs"):
        store.checkout("rb", into=wrong_shape)
    with pytest.raises(TargetMismatchError, match="sampler"):
        store.checkout("rb", into=make_buffer("lazy", "prioritized"))


def test_dedup_accounting_exact(store):
    cap = 10_000
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(cap), batch_size=32)
    g = torch.Generator().manual_seed(0)
    rb.extend(TensorDict({"obs": torch.randn(cap, 64, generator=g), "reward": torch.randn(cap, 1, generator=g)}, [cap]))
    first = store.commit(rb, tag="a")
    keys = {"obs": 256, "reward": 4, "index": 8}  # bytes per row; the buffer adds "index"
    assert first.logical_bytes == cap * sum(keys.values())
    again = store.commit(rb, tag="a")
    assert (again.shards_new, again.new_bytes, again.stored_bytes) == (0, 0, 0)
    assert again.parents == (first.id,)
    rb.extend(TensorDict({"obs": torch.randn(100, 64, generator=g), "reward": torch.randn(100, 1, generator=g)}, [100]))  # 1 %
    third = store.commit(rb, tag="a")
    # default shards: 256 KiB and at most 4096 rows, so "obs" (256 B rows) has 1024 rows per shard
    # and "reward" and "index" 4096. Rows 0..99 changed: the first shard of "obs" and of "reward"
    # are new; "index" holds the slot numbers 0..99 again, so its shard is reused
    assert third.new_bytes == 1024 * 256 + 4096 * 4 == 278_528
    assert third.shards_new == 2 and third.shards_total == 10 + 3 + 3


def test_partial_checkout_reads_only_selected_blobs(store):
    rb = make_buffer("lazy", "prioritized")
    fill(rb, "prioritized")
    policy = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Linear(8, 2))
    store.commit({"rb": rb, "policy": policy}, tag="latest")
    policy_leaves = len(policy.state_dict())
    before = store.io.blobs_read
    state = store.checkout("latest", partial=["rb/sampler"])
    assert store.io.blobs_read - before == 4  # sum tree, min tree, max-priority value and index
    assert set(state.keys()) == {"rb"} and set(state["rb"].keys()) == {"sampler"}
    policy2 = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Linear(8, 2))
    before = store.io.blobs_read
    store.checkout("latest", into={"policy": policy2}, partial=["policy"])
    assert store.io.blobs_read - before == policy_leaves  # no replay-buffer blob
    for a, b in zip(policy.parameters(), policy2.parameters()):
        assert_bit_equal(a, b)
    before = store.io.blobs_read
    store.checkout("latest", into={"policy": policy2})  # into alone also limits what is read
    assert store.io.blobs_read - before == policy_leaves
    with pytest.raises(PartialPathError, match="components: rb/storage, rb/writer, rb/sampler, policy"):
        store.checkout("latest", partial=["rb/nothing"])


def test_unchanged_storage_is_not_rehashed_and_changes_always_are(tmp_path, monkeypatch):
    import ckptstore.protocols.commit as store_module

    store = ckptstore.Store(tmp_path / "store", shard_bytes=4096, create=True)  # obs: 63 shards, index: 2

    hashed = []
    real = store_module.digest
    def counting(data):  # shards are memoryviews; the commit record is bytes
        if isinstance(data, memoryview):
            hashed.append(len(data))
        return real(data)

    monkeypatch.setattr(store_module, "digest", counting)
    monkeypatch.setattr(ckptstore.layout, "digest", counting)  # the reuse sample's hashes
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(1000), batch_size=4)
    rb.extend(TensorDict({"obs": torch.randn(1000, 64)}, [1000]))
    store.commit(rb, tag="a")
    storage_bytes = 1000 * 64 * 4 + 1000 * 8
    assert sum(hashed) == storage_bytes
    hashed.clear()
    store.commit(rb, tag="a")  # nothing changed: the storage's hashes are reused, one sampled shard per leaf checked
    assert len(hashed) == 2 and sum(hashed) <= 2 * 4096
    hashed.clear()
    obs = rb.storage._storage["obs"]
    obs[3] += 1  # an in-place torch op bumps the tensor's version counter
    info = store.commit(rb, tag="a")
    assert len(hashed) == 63 + 1 and 1000 * 64 * 4 < sum(hashed) <= 1000 * 64 * 4 + 4096 and info.shards_new == 1  # obs, and the index's sample
    assert_bit_equal(store.checkout("a")["storage", "data", "obs"], obs)
    hashed.clear()
    rb.extend(TensorDict({"obs": torch.randn(5, 64)}, [5]))  # a write through TorchRL bumps the storage revision
    info = store.commit(rb, tag="a")
    # the storage's write log names rows 0-4: shard 0 of obs and of the index is rehashed, plus one
    # sampled reused shard of each (obs: 4096 bytes, the index's other shard: 3904)
    assert sorted(hashed) == [3904, 4096, 4096, 4096] and info.shards_new == 1  # the index rows hold the same values
    assert_bit_equal(store.checkout("a")["storage", "data", "obs"], obs)
    hashed.clear()
    rb.update_(TensorDict({"obs": torch.zeros(1000, 64)}, [1000]))  # a write the log does not see: whole columns again
    store.commit(rb, tag="a")
    assert sum(hashed) == storage_bytes
    fresh = TensorDictReplayBuffer(storage=LazyTensorStorage(1000), batch_size=4)
    store.checkout("a", into=fresh)  # restoring bumps the target's revision too
    hashed.clear()
    store.commit(fresh, tag="b")
    assert sum(hashed) == storage_bytes
    no_reuse = ckptstore.Store(store.root, reuse_hashes=False)
    hashed.clear()
    no_reuse.commit(rb, tag="c")
    no_reuse.commit(rb, tag="c")
    assert sum(hashed) == 2 * storage_bytes
    no_reuse.close()


def test_changed_storage_looks_up_only_changed_shards(tmp_path, monkeypatch):
    from ckptstore.home.base import Home

    store = ckptstore.Store(tmp_path / "store", shard_bytes=4096)
    looked_up = []
    real = Home.lookup  # (the commit's dedup and its index step both ask the home)
    monkeypatch.setattr(Home, "lookup", lambda self, keys: looked_up.extend(keys) or real(self, keys))
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(1000), batch_size=4)
    rb.extend(TensorDict({"obs": torch.randn(1000, 64)}, [1000]))  # obs: 63 shards of 16 rows
    store.commit(rb, tag="a")
    rb.storage._storage["obs"][3] += 1
    looked_up.clear()
    info = store.commit(rb, tag="a")
    # obs is rehashed; its 62 unchanged shards take their blob ids from the last commit, the changed one is
    # looked up, then looked up again once written; the index column's hashes come from the cache.
    assert info.shards_new == 1 and len(looked_up) == 2 and looked_up[0] == looked_up[1]
    assert_bit_equal(store.checkout("a")["storage", "data", "obs"], rb.storage._storage["obs"])
    store.close()


def test_cached_blob_ids_freed_and_reused_by_gc_are_rewritten(tmp_path):
    """A blob id cached from the last commit may be freed by a GC in another process and
    taken by a new blob; the next commit must not point at that blob."""
    root = tmp_path / "store"
    store = ckptstore.Store(root, shard_bytes=4096)
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(100), batch_size=4)
    rb.extend(TensorDict({"obs": torch.randn(100, 64)}, [100]))
    store.commit(rb, tag="a")
    other = ckptstore.Store(root)
    other.delete_tag("a")
    other.gc(grace=0)  # every blob freed: SQLite gives the next blobs the same ids
    other.commit({"x": torch.randn(100 * 64 + 100 * 2)}, tag="other")
    other.close()
    info = store.commit(rb, tag="a")  # unchanged: its blob ids come from the digest cache
    assert info.shards_new == info.shards_total
    assert_bit_equal(store.checkout("a")["storage", "data", "obs"], rb.storage._storage["obs"])
    assert store.fsck(deep=True).ok
    store.close()


def test_restore_warns_for_each_hyperparameter_it_overrides(store):
    """A sampler built with alpha=0.9 gets the committed 0.7: a HyperparameterOverrideWarning
    names alpha and both values; a target built with the committed values gets none."""
    from torchrl.data.replay_buffers import PrioritizedSampler

    from ckptstore.errors import HyperparameterOverrideWarning

    rb = make_buffer("lazy", "prioritized")
    fill(rb, "prioritized")
    cid = store.commit({"rb": rb}).id
    other = TensorDictPrioritizedReplayBuffer(alpha=0.9, beta=0.5, storage=LazyTensorStorage(CAP), batch_size=8, priority_key="td_error")
    with pytest.warns(HyperparameterOverrideWarning) as caught:
        store.checkout(cid, into={"rb": other})
    assert [str(w.message) for w in caught if w.category is HyperparameterOverrideWarning] == [
        "rb/sampler/alpha: the restore sets alpha to the committed 0.7; the target was built with 0.9"]
    assert other.sampler._alpha == 0.7
    sampler = PrioritizedSampler(CAP, alpha=0.7, beta=0.1, eps=1e-3)
    wo = SamplerWithoutReplacement(shuffle=False)
    with pytest.warns(HyperparameterOverrideWarning) as caught:
        store.checkout(store.commit({"s": rb.sampler, "w": SamplerWithoutReplacement()}).id, into={"s": sampler, "w": wo})
    assert sorted(str(w.message).split(":")[0] for w in caught if w.category is HyperparameterOverrideWarning) == ["s/beta", "s/eps", "w/shuffle"]
    same = make_buffer("lazy", "prioritized")
    with warnings.catch_warnings():
        warnings.simplefilter("error", HyperparameterOverrideWarning)
        store.checkout(cid, into={"rb": same})


@pytest.mark.parametrize("fresh_process", [False, True])
def test_resume_into_a_scratch_dir_that_holds_the_memmap_files(tmp_path, fresh_process):
    """The documented resume (build the buffer as in training, check out into it) into a
    LazyMemmapStorage(scratch_dir=...) whose folder still holds the interrupted run's
    memmap files: they are reused and hold exactly the committed rows."""
    scratch = tmp_path / "scratch"
    rb = TensorDictReplayBuffer(storage=LazyMemmapStorage(CAP, scratch_dir=scratch), batch_size=8)
    fill(rb, "random")
    with ckptstore.Store(tmp_path / "s") as s:
        s.commit({"rb": rb}, tag="t")
    expected = storage_of(rb).clone()
    rb.extend(chunk(500, 10))  # the run went on after its last commit: the files now differ
    assert (scratch / "obs.memmap").exists()
    if fresh_process:
        run_fresh(f"""
import torch, ckptstore
from torchrl.data import LazyMemmapStorage, TensorDictReplayBuffer
rb = TensorDictReplayBuffer(storage=LazyMemmapStorage({CAP}, scratch_dir={str(scratch)!r}), batch_size=8)
with ckptstore.Store({str(tmp_path / "s")!r}) as s:
    s.checkout("t", into={{"rb": rb}})
assert len(rb) == {CAP} and rb.writer._cursor == {90 % CAP}
import numpy as np
data = rb.storage._storage[:{CAP}]
np.savez({str(tmp_path / "got.npz")!r}, obs=data["obs"].numpy(), act=data["act"].numpy(), r=data["next", "r"].numpy())
""")
        with np.load(tmp_path / "got.npz", allow_pickle=False) as z:
            got = TensorDict({"obs": torch.from_numpy(z["obs"]), "act": torch.from_numpy(z["act"]), "next": {"r": torch.from_numpy(z["r"])}}, [CAP])
    else:
        rb2 = TensorDictReplayBuffer(storage=LazyMemmapStorage(CAP, scratch_dir=scratch), batch_size=8)
        with ckptstore.Store(tmp_path / "s") as s:
            s.checkout("t", into={"rb": rb2})
        assert rb2.storage.existsok is False  # the target's own setting, put back
        got = storage_of(rb2)
    assert_bit_equal(got["obs"], expected["obs"])
    assert_bit_equal(got["act"], expected["act"])
    assert_bit_equal(got["next", "r"], expected["next", "r"])
