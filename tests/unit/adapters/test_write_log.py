"""Row-level change tracking of TorchRL storages (``ckptstore.adapters.torchrl.WriteLog``):
a commit hashes only the shards holding rows written since the last commit, and any write
the log does not see makes the next commit hash whole columns, never commit stale rows."""

from __future__ import annotations

import copy
import pickle
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from tensordict import TensorDict
from torchrl.data import LazyMemmapStorage, LazyTensorStorage, TensorDictReplayBuffer, TensorStorage

import ckptstore
from ckptstore.adapters.torchrl import WriteLog

from tests.conftest import assert_bit_equal

CAPACITY, DIM = 200, 16  # obs rows of 64 bytes: 16 rows per 1 KiB shard, 13 shards


def rows(k: int, seed: int) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    return TensorDict({"obs": torch.randn(k, DIM, generator=g), "reward": torch.randn(k, 1, generator=g)}, [k])


def logged(rb) -> WriteLog:
    log = WriteLog.of(rb.storage)
    assert log is not None
    return log


def test_the_log_names_exactly_the_rows_written_through_torchrl():
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(CAPACITY))
    rb.extend(rows(190, 0))
    log = logged(rb)
    seq = log.token_seq(rb.storage)
    rb.extend(rows(20, 1))  # wraps: rows 190-199 and 0-9
    assert log.rows_since(seq).tolist() == list(range(10)) + list(range(190, 200))
    seq = log.token_seq(rb.storage)
    rb[torch.tensor([50, 7])] = rows(2, 2)  # ReplayBuffer.__setitem__
    rb.storage.set(range(100, 103), rows(3, 3))
    rb.storage.set(np.array([120]), rows(1, 4), set_cursor=False)
    mask = torch.zeros(CAPACITY, dtype=torch.bool)
    mask[[150, 151]] = True
    rb.storage.set(mask, rows(2, 5), set_cursor=False)
    rb.storage.set(slice(160, 162), rows(2, 6))
    assert log.rows_since(seq).tolist() == [7, 50, 100, 101, 102, 120, 150, 151, 160, 161]
    assert log.token_seq(rb.storage) == log.seq  # nothing unseen: no gap


@pytest.mark.parametrize(
    "unseen",
    [
        lambda rb: rb.update_(rows(CAPACITY, 9)),  # bumps the revision without set (the buffer is full)
        lambda rb: rb.set_at_("reward", torch.ones(1, 1), [4]),
        lambda rb: rb.storage._storage["obs"][3].add_(1),  # an in-place op on a view of a column
        lambda rb: rb.storage._storage.set("extra", torch.zeros(CAPACITY)),  # a new column
        lambda rb: rb.storage._storage.set("reward", torch.zeros(CAPACITY, 1)),  # a column replaced
        lambda rb: rb.empty(),
    ],
    ids=["update_", "set_at_", "in-place view", "new column", "replaced column", "empty"],
)
def test_a_write_the_log_does_not_see_makes_it_forget(unseen):
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(CAPACITY))
    rb.extend(rows(CAPACITY, 0))
    log = logged(rb)
    seq = log.token_seq(rb.storage)
    unseen(rb)
    rb.extend(rows(3, 1))  # a logged write after the unseen one does not hide it
    log.token_seq(rb.storage)  # what the next commit does first
    assert log.rows_since(seq) is None


def test_copies_have_no_log_and_write_only_to_themselves():
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(CAPACITY))
    rb.extend(rows(10, 0))
    log = logged(rb)
    before = rb.storage._storage["obs"][:10].clone()
    for twin in (pickle.loads(pickle.dumps(rb.storage)), copy.deepcopy(rb.storage), copy.copy(rb.storage)):
        assert "set" not in vars(twin) and "__getstate__" not in vars(twin)
        twin.set(slice(10, 12), rows(2, 1))  # a shallow copy shares the columns, not the length
        assert len(twin) == 12 and len(rb.storage) == 10
        assert_bit_equal(twin._storage["obs"][10:12], rows(2, 1)["obs"])
        mine = WriteLog.of(twin)  # a commit of the copy installs its own
        assert mine is not log and WriteLog.of(twin) is mine
        assert_bit_equal(rb.storage._storage["obs"][:10], before)
    with pytest.raises(RuntimeError):  # the storage's own error comes through the log unchanged
        rb.storage.set(slice(0, 3), TensorDict({"obs": torch.zeros(3, DIM + 1), "reward": torch.zeros(3, 1)}, [3]))
    assert log.rows_since(log.seq - 1) is None  # and the failed write made the log forget


@pytest.mark.parametrize("through", ["torch views", "numpy views"])
def test_columns_that_share_memory_are_never_row_tracked(tmp_path, through):
    base = torch.randn(CAPACITY + 1, DIM)
    if through == "torch views":
        obs, next_obs = base[:-1], base[1:]
    else:  # each torch.from_numpy view has a storage of its own, overlapping the other's
        array = base.numpy()
        obs, next_obs = torch.from_numpy(array[:-1]), torch.from_numpy(array[1:])
    storage = TensorStorage(TensorDict({"obs": obs, "next_obs": next_obs}, [CAPACITY]), max_size=CAPACITY)
    rb = TensorDictReplayBuffer(storage=storage)
    store = ckptstore.Store(tmp_path / "s", shard_bytes=1024)
    store.commit(rb, tag="a")
    log = logged(rb)
    seq = log.seq
    rb.storage.set(slice(15, 16), TensorDict({"obs": torch.ones(1, DIM), "next_obs": torch.ones(1, DIM)}, [1]), set_cursor=False)
    # obs row 16 changed too (it is next_obs row 15), in obs's next shard (16 rows each)
    assert log.token_seq(rb.storage) > seq and log.rows_since(seq) is None
    info = store.commit(rb, tag="a")
    got = store.checkout(info.id, partial=["storage/data"])
    assert_bit_equal(got["storage", "data", "obs"], base[:-1])
    assert_bit_equal(got["storage", "data", "next_obs"], base[1:])


def test_a_replaced_column_with_the_old_ones_address_and_version_is_rehashed(tmp_path):
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(CAPACITY))
    rb.extend(rows(CAPACITY, 0))
    store = ckptstore.Store(tmp_path / "s", shard_bytes=1024)
    store.commit(rb, tag="a")
    td = rb.storage._storage
    old = td["obs"]
    new = old.clone()
    new[7] = 5.0
    while new._version < old._version:
        torch.autograd.graph.increment_version(new)
    td.set("obs", new)  # replaced, not written: neither TorchRL's revision nor the old column's version moves
    del old
    info = store.commit(rb, tag="a")
    assert info.shards_new == 1  # the shard holding row 7: the column's storage identity is part of its token
    assert_bit_equal(store.checkout(info.id, partial=["storage/data/obs"])["storage", "data", "obs"], new)


def test_a_failed_checkout_into_a_live_buffer_leaves_no_stale_fingerprint(tmp_path):
    from ckptstore.objects.packs import BLOB_HEADER, pack_path

    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(CAPACITY))
    rb.extend(rows(CAPACITY, 0))
    # One worker: the blobs land in the pack in shard order, so the checkout below (in pack
    # order) reads shard 1 before the damaged last one; with threads, 3 commits in 30 put it after.
    store = ckptstore.Store(tmp_path / "s", shard_bytes=1024, compression_level=0, workers=1)
    a = store.commit(rb, tag="a")
    rb.storage.set([20, CAPACITY - 1], rows(2, 1), set_cursor=False)  # obs shards 1 and 12 differ from commit a
    store.commit(rb, tag="b")
    rec = next(r for r in store.manifest(a.id) if r.path == "storage/data/obs")
    loc = store.locate([rec.keys[-1]])[rec.keys[-1]]
    path = pack_path(store.root, loc.pack)
    path.chmod(0o644)
    data = bytearray(path.read_bytes())
    data[loc.offset + BLOB_HEADER.size] ^= 0xFF  # commit a's last obs shard is damaged
    path.write_bytes(bytes(data))
    with pytest.raises(ckptstore.errors.BlobCorruptError):
        store.checkout("a", into=rb)  # reads the other shards into the live columns first
    expected = rb.storage._storage["obs"][:CAPACITY].clone()
    assert_bit_equal(expected[20], rows(CAPACITY, 0)["obs"][20])  # commit a's row is back
    info = store.commit(rb, tag="c")
    assert_bit_equal(store.checkout(info.id, partial=["storage/data/obs"])["storage", "data", "obs"], expected)


def test_an_async_commit_after_a_gc_that_freed_the_last_commits_blobs(tmp_path):
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(CAPACITY))
    rb.extend(rows(CAPACITY, 0))
    store = ckptstore.Store(tmp_path / "s", shard_bytes=1024)
    store.commit(rb, tag="ckpt")
    store.delete_tag("ckpt")  # an old checkpoint deleted ...
    store.gc(keep_last=1, grace=0)  # ... and its blobs freed: the hashes kept from that commit go too
    rb.extend(rows(20, 1))
    future = store.commit_async(rb, tag="ckpt")
    expected = rb.storage._storage["obs"].clone()
    rb.extend(rows(CAPACITY, 2))  # training writes on after the call
    info = future.result()
    assert_bit_equal(store.checkout(info.id, partial=["storage/data/obs"])["storage", "data", "obs"], expected)


def test_a_first_logged_write_under_inference_mode_does_not_break_the_log():
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(CAPACITY))
    rb.extend(rows(CAPACITY, 0))
    log = logged(rb)
    with torch.inference_mode():
        rb.extend(rows(5, 1))  # the log's row stamps are allocated here
    seq = log.token_seq(rb.storage)
    rb.extend(rows(5, 2))  # rows 5-9, outside inference mode
    log.token_seq(rb.storage)
    assert log.rows_since(seq).tolist() == [5, 6, 7, 8, 9]


def test_a_commit_after_a_few_rows_changed_hashes_only_their_shards(tmp_path, monkeypatch):
    import ckptstore.layout
    import ckptstore.protocols.commit as store_module

    hashed: list[int] = []
    real = store_module.digest

    def counting(data):
        if isinstance(data, memoryview):
            hashed.append(len(data))
        return real(data)

    monkeypatch.setattr(store_module, "digest", counting)
    monkeypatch.setattr(ckptstore.layout, "digest", counting)
    store = ckptstore.Store(tmp_path / "s", shard_bytes=1024)
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(CAPACITY))
    rb.extend(rows(CAPACITY, 0))
    store.commit(rb, tag="a")
    rb.extend(rows(20, 1))  # rows 0-19: obs shards 0 and 1 (16 rows each); reward and index: one shard each
    hashed.clear()
    info = store.commit(rb, tag="a")
    # rehashed: obs shards 0 and 1 (1024 bytes each), reward's only shard (800), the index's shard 0
    # (1024); sampled: the index's other shard (576) and one of obs's 11 others (the last is 512)
    assert sorted(hashed) in ([512, 576, 800, 1024, 1024, 1024], [576, 800, 1024, 1024, 1024, 1024])
    assert info.shards_new == 3  # the index column's values are the same
    hashed.clear()
    fut = store.commit_async(rb, tag="b")  # nothing changed since: every hash reused, one sample per column
    assert fut.result().shards_new == 0 and len(hashed) == 3  # one sampled shard per column
    rb.extend(rows(40, 2))  # rows 20-59: obs shards 1, 2, 3
    hashed.clear()
    gate = threading.Event()  # the background commit waits behind it: what the call hashed is counted alone
    store._committer._async.submit(gate.wait, 60)
    fut = store.commit_async(rb, tag="c")
    # hashed at the call: a sample of obs's and of the index's reused shards; the shards holding the
    # written rows (obs 1-3, the index's 0, reward's one) are copied and hashed by the background commit
    assert len(hashed) == 2
    rb.extend(rows(50, 3))  # after the call: not in commit c
    gate.set()
    assert fut.result().shards_new == 4 and len(hashed) == 2 + 5
    fresh = TensorDictReplayBuffer(storage=LazyTensorStorage(CAPACITY))
    store.checkout("c", into=fresh)
    expected = torch.cat([rows(20, 1)["obs"], rows(40, 2)["obs"], rows(CAPACITY, 0)["obs"][60:]])
    assert_bit_equal(fresh.storage._storage["obs"], expected)
    store.close()


class LoggedBufferMachine(RuleBasedStateMachine):
    """Random schedules of every TorchRL write path, writes the log cannot see, and sync
    and async commits; after each commit a fresh buffer checked out from it must equal the
    buffer as it was at the commit (async: at the call), bit for bit."""

    @initialize(memmap=st.booleans(), shard=st.sampled_from([40, 100, 256, 1024, 4096]), filled=st.integers(1, CAPACITY))  # 40: rows cut in two
    def setup(self, memmap, shard, filled):
        self.dir = Path(tempfile.mkdtemp(prefix="ckpt-writelog-"))
        storage = LazyMemmapStorage(CAPACITY, scratch_dir=self.dir / "mm") if memmap else LazyTensorStorage(CAPACITY)
        self.rb = TensorDictReplayBuffer(storage=storage)
        self.store = ckptstore.Store(self.dir / "store", shard_bytes=shard)
        self.seed = 100
        self.rb.extend(self._data(filled))
        self.commits: list[tuple[str, object, dict]] = []  # (tag, future or info, expected columns)

    def _data(self, k):
        self.seed += 1
        return rows(k, self.seed)

    @rule(k=st.integers(1, 70))
    def extend(self, k):
        self.rb.extend(self._data(k))

    @rule(idx=st.lists(st.integers(0, CAPACITY - 1), min_size=1, max_size=5, unique=True), how=st.sampled_from(["setitem", "list", "numpy", "mask"]))
    def write_rows(self, idx, how):
        idx = [i % len(self.rb) for i in idx]
        idx = list(dict.fromkeys(idx))
        data = self._data(len(idx))
        if how == "setitem":
            self.rb[torch.tensor(idx)] = data
        elif how == "list":
            self.rb.storage.set(idx, data, set_cursor=False)
        elif how == "numpy":
            self.rb.storage.set(np.array(idx), data, set_cursor=False)
        else:
            mask = torch.zeros(CAPACITY, dtype=torch.bool)
            mask[idx] = True
            self.rb.storage.set(mask, data[torch.tensor(idx).argsort().argsort()], set_cursor=False)

    @rule(i=st.integers(0, CAPACITY - 1), how=st.sampled_from(["inplace", "update_", "set_at_"]))
    def unseen_write(self, i, how):
        i %= len(self.rb)
        if how == "inplace":
            self.rb.storage._storage["obs"][i].mul_(-1.5)
        elif how == "update_":
            n = len(self.rb)
            self.rb.update_(TensorDict({"reward": torch.full((n, 1), float(i))}, [n]))
        else:
            self.rb.set_at_("obs", torch.full((1, DIM), float(i)), [i])

    @rule(tag=st.sampled_from(["a", "b"]), asynchronous=st.booleans())
    def commit(self, tag, asynchronous):
        expected = {k: self.rb.storage._storage[k][: len(self.rb)].clone() for k in ("obs", "reward")}
        result = self.store.commit_async(self.rb, tag=tag) if asynchronous else self.store.commit(self.rb, tag=tag)
        self.commits.append((tag, result, expected))

    @invariant()
    def commits_are_exact(self):
        if not getattr(self, "commits", None):
            return
        for tag, result, expected in self.commits:
            info = result.result() if hasattr(result, "result") else result
            got = self.store.checkout(info.id, partial=["storage/data"])
            for k, v in expected.items():
                assert_bit_equal(got["storage", "data", k], v)
        self.commits.clear()

    def teardown(self):
        if hasattr(self, "store"):
            self.store.close()


LoggedBufferMachine.TestCase.settings = settings(
    max_examples=50, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_logged_buffer_commits_are_exact = LoggedBufferMachine.TestCase
