"""Plain tensors (parameters, moments, TensorDict and dict leaves) reuse their shard
hashes when torch's version counter says they did not change; writes torch does not
count are caught by the per-commit sample, never committed stale."""

from __future__ import annotations

import warnings

import pytest
import torch
from tensordict import TensorDict

import ckptstore
from ckptstore.errors import StaleFingerprintWarning

from tests.conftest import assert_bit_equal


def commit_seeing_reuse(store: ckptstore.Store, obj, tag: str) -> tuple[ckptstore.CommitInfo, set[str]]:
    """Commit; also return the leaves whose hashes a fingerprint vouched for (sample-checked)."""
    import ckptstore.protocols.commit as store_module
    import ckptstore.protocols.reuse as reuse_module

    seen = []
    original, small = store_module.sample_unchanged, reuse_module.small_changed

    def spy(known, mv, p, path):
        seen.append(path)
        return original(known, mv, p, path)

    def spy_small(paths, hashes, ends, values):  # a component's small tensors, unchanged as a whole, in one copy
        seen.extend(paths)
        return small(paths, hashes, ends, values)

    store_module.sample_unchanged = reuse_module.sample_unchanged = spy
    reuse_module.small_changed = spy_small
    try:
        info = store.commit(obj, tag=tag)
    finally:
        store_module.sample_unchanged = reuse_module.sample_unchanged = original
        reuse_module.small_changed = small
    return info, set(seen)


def net_and_opt():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.Tanh(), torch.nn.Linear(512, 8))
    return net, torch.optim.Adam(net.parameters(), lr=1e-3)


def step(net, opt, seed):
    g = torch.Generator().manual_seed(seed)
    opt.zero_grad()
    net(torch.randn(16, 64, generator=g)).square().mean().backward()
    opt.step()


def assert_checkout_equals(store, tag, state: dict):
    back = store.checkout(tag)
    for key, value in state.items():
        assert_bit_equal(back.get(tuple(key.split("/"))), value)


def test_unchanged_plain_state_reuses_every_hash_and_changed_state_is_committed(store):
    net, opt = net_and_opt()
    step(net, opt, 0)
    state = {"model": net, "optim": opt}
    _, reused = commit_seeing_reuse(store, state, "a")
    assert reused == set()  # first commit: nothing known yet
    info, reused = commit_seeing_reuse(store, state, "b")
    tensors = {f"model/{k}" for k in net.state_dict()} | {
        f"optim/state/model%2F{n}/{m}" for n, _ in net.named_parameters() for m in ("exp_avg", "exp_avg_sq", "step")
    }
    assert reused == tensors
    assert (info.shards_new, info.new_bytes) == (0, 0)
    step(net, opt, 1)  # in-place updates bump every version counter: nothing is reused
    _, reused = commit_seeing_reuse(store, state, "c")
    assert reused == set()
    assert_checkout_equals(store, "c", {f"model/{k}": v for k, v in net.state_dict().items()})


@pytest.mark.parametrize("how", ["data", "numpy"])
def test_writes_torch_does_not_count_are_caught_and_committed(store, how):
    net, _ = net_and_opt()
    store.commit({"model": net}, tag="a")
    weight = net[0].weight
    version = weight._version
    if how == "data":  # what TorchRL's SoftUpdate does to target parameters
        weight.data.lerp_(torch.ones_like(weight), 0.5)
    else:
        weight.detach().numpy()[3, 5] = 42.0  # one element of a one-shard tensor
    assert weight._version == version  # torch did not count it
    with pytest.warns(StaleFingerprintWarning, match="model/0.weight: its bytes changed without torch counting a write"):
        store.commit({"model": net}, tag="b")
    assert_checkout_equals(store, "b", {"model/0.weight": weight.detach()})


def test_async_commit_checks_the_sample_when_it_snapshots(store):
    net, _ = net_and_opt()
    store.commit_async({"model": net}, tag="a").result()
    net[2].weight.data.mul_(2)
    with pytest.warns(StaleFingerprintWarning, match="model/2.weight"):
        future = store.commit_async({"model": net}, tag="b")
    expected = net[2].weight.detach().clone()
    with torch.no_grad():
        net[2].weight.add_(1)  # training goes on: the snapshot already holds the right bytes
    future.result()
    assert_checkout_equals(store, "b", {"model/2.weight": expected})


def test_a_replaced_tensor_is_rehashed_even_at_the_same_address(store):
    td = TensorDict({"x": torch.zeros(1 << 18)}, [])
    store.commit(td, tag="a")
    for i in range(1, 4):
        del td["x"]
        td["x"] = torch.full((1 << 18,), float(i))  # a new tensor, version 0, often at the freed address
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a new storage is not reused, so nothing is stale
            store.commit(td, tag=f"v{i}")
        assert_checkout_equals(store, f"v{i}", {"x": torch.full((1 << 18,), float(i))})


def test_reuse_hashes_false_always_hashes(tmp_path):
    store = ckptstore.Store(tmp_path / "s", create=True, reuse_hashes=False)
    net, _ = net_and_opt()
    store.commit({"model": net}, tag="a")
    net[0].weight.data.fill_(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, reused = commit_seeing_reuse(store, {"model": net}, "b")
    assert reused == set()
    assert_checkout_equals(store, "b", {"model/0.weight": torch.full((512, 64), 3.0)})


def test_shared_and_file_backed_tensors_get_no_fingerprint(tmp_path):
    from ckptstore.adapters.base import plain_token

    shared = torch.zeros(4).share_memory_()
    path = tmp_path / "m.bin"
    path.write_bytes(bytes(16))
    mapped = torch.from_file(str(path), shared=True, size=4, dtype=torch.float32)
    with torch.inference_mode():
        inference = torch.zeros(4)
    assert [plain_token(t) for t in (shared, mapped, inference)] == [None, None, None]
    assert plain_token(torch.zeros(4)) is not None


def test_async_commit_copies_only_the_shards_that_changed(tmp_path):
    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

    import ckptstore.protocols.commit as store_module

    store = ckptstore.Store(tmp_path / "s", create=True, shard_bytes=4096)
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(4096), batch_size=4)
    rb.extend(TensorDict({"obs": torch.randn(4096, 16)}, [4096]))  # 64-byte rows: 64 shards of 64 rows
    store.commit_async(rb, tag="a").result()
    real = store_module._Prehashed

    def commit_async_counting_copies(tag):
        copied = []

        class Counting(real):  # a subclass, not a function: the background commit may test isinstance against it
            def __init__(self, record, shards, reused, last):
                copied.append(len(shards) - len(reused))
                super().__init__(record, shards, reused, last)

        store_module._Prehashed = Counting
        try:
            return store.commit_async(rb, tag=tag), copied
        finally:
            store_module._Prehashed = real

    # the storage's write log names rows 0-9 (the ring wraps): the shard holding them is copied in
    # each column, obs and TorchRL's index, and hashed in the background
    rb.extend(TensorDict({"obs": torch.full((10, 16), 7.0)}, [10]))
    expected_b = rb.storage._storage["obs"].clone()
    future_b, copied = commit_async_counting_copies("b")
    assert copied == [1, 1]
    rb.storage._storage["obs"][:] = -1  # training goes on: every row changes after the call returns
    assert future_b.result().shards_new == 1  # obs shard 0; the index column holds the same row numbers
    # a write the log does not see (an in-place op on the column): every obs shard is hashed at the
    # call and those whose hash changed are copied (all 64); the index column's token is unchanged:
    # its hashes and blob ids are taken at the call, nothing is copied
    expected_c = rb.storage._storage["obs"].clone()
    future_c, copied = commit_async_counting_copies("c")
    assert copied == [64, 0]
    rb.storage._storage["obs"][:] = 5
    assert future_c.result().shards_new == 1  # all 64 obs shards hold the same bytes
    assert_bit_equal(store.checkout("b")["storage", "data", "obs"], expected_b)
    assert_bit_equal(store.checkout("c")["storage", "data", "obs"], expected_c)


def test_unchanged_recommit_of_many_small_leaves_writes_no_blob_and_one_row_per_leaf_and_shard(tmp_path):
    """Many small leaves committed again unchanged: every hash and blob id is reused (no new
    blob, no new pack of blobs), and the catalog gets exactly one leaves row per leaf and one
    shards row per shard, pointing at the first commit's blobs; both commits check out equal."""
    store = ckptstore.Store(tmp_path / "s", shard_bytes=4096)
    state = {f"t{i}": torch.rand(8) for i in range(300)}
    state["big"] = torch.rand(3000)  # 3 shards of 4000, 4000, 4000 bytes
    state["json"] = {"a": [1, 2]}
    first = store.commit(state, tag="a")
    cat = store.catalog
    blobs = cat.rows("SELECT count(*) FROM blobs", raw=True)[0][0]
    packs = cat.rows("SELECT count(*) FROM packs", raw=True)[0][0]
    _, reused = commit_seeing_reuse(store, state, "b")
    again = store.info("b")
    assert reused == {f"t{i}" for i in range(300)} | {"big"}
    assert (again.shards_new, again.new_bytes, again.shards_total) == (0, 0, 303)
    assert cat.rows("SELECT count(*) FROM blobs", raw=True)[0][0] == blobs
    assert cat.rows("SELECT count(*) FROM packs", raw=True)[0][0] == packs + 1  # the commit's record pack only
    assert cat.rows("SELECT count(*) FROM leaves WHERE commit_id = ?", (again.id,), raw=True)[0][0] == 0  # first's rows, shared
    assert cat.rows("SELECT count(*) FROM commit_leaves WHERE commit_id = ?", (again.id,), raw=True)[0][0] == 302
    rows = cat.rows(
        "SELECT l.path, s.seq, s.blob_id FROM shards s JOIN commit_leaves l ON l.id = s.leaf_id WHERE l.commit_id = ? ORDER BY l.path, s.seq",
        (again.id,), raw=True,
    )
    old = cat.rows(
        "SELECT l.path, s.seq, s.blob_id FROM shards s JOIN leaves l ON l.id = s.leaf_id WHERE l.commit_id = ? ORDER BY l.path, s.seq", (first.id,), raw=True
    )
    assert len(rows) == 303 and rows == old
    assert store.record("b").leaves == store.record("a").leaves
    before = state["t7"].clone()
    state["t7"].add_(1)  # one leaf changes: one new blob
    third = store.commit(state, tag="c")
    assert (third.shards_new, third.new_bytes) == (1, 32)
    for tag in ("a", "b", "c"):
        back = store.checkout(tag)
        assert_bit_equal(back["t7"], state["t7"] if tag == "c" else before)
        assert_bit_equal(back["big"], state["big"])
    assert store.fsck().ok
