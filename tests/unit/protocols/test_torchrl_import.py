"""Importing TorchRL 0.14 replay-buffer dumps and torchrl.checkpoint saves, without unpickling."""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import stat
import struct
import zipfile

import numpy as np
import pytest
import torch
from tensordict import TensorDict, TensorDictBase, is_non_tensor
from torchrl.checkpoint import Checkpoint, GlobalRNGState, StateDictCheckpointAdapter
from torchrl.data import LazyMemmapStorage, LazyTensorStorage, ReplayBuffer, TensorDictPrioritizedReplayBuffer, TensorDictReplayBuffer
from torchrl.data.replay_buffers import RoundRobinWriter, SamplerWithoutReplacement

import ckptstore
from ckptstore.errors import ContainerError
from ckptstore.protocols.torchrl_import import import_torchrl

from tests.conftest import assert_bit_equal, row_count

CAP = 100
SETTINGS = (
    'buffer settings {"batch_size": 8, "consume_after_n_samples": null}, not state: ckptstore restores into a buffer built with its own'
)
PREFETCH = "pickle of the buffer's prefetch settings and queue, never unpickled: a restored buffer starts with an empty queue"
STORAGE_KEYS = [("obs",), ("act",), ("next", "r"), ("next", "done")]


def chunk(start: int, n: int) -> TensorDict:
    i = torch.arange(start, start + n)
    nxt = {"r": i[:, None].float() * 0.5, "done": i[:, None] % 7 == 0}
    return TensorDict({"obs": i[:, None].float().expand(n, 3).clone(), "act": i, "next": nxt}, [n])


def prioritized() -> TensorDictPrioritizedReplayBuffer:
    return TensorDictPrioritizedReplayBuffer(alpha=0.6, beta=0.4, storage=LazyTensorStorage(CAP), batch_size=8, priority_key="td_error")


def filled_prioritized() -> TensorDictPrioritizedReplayBuffer:
    """120 rows written into 100 slots, every priority set, max priority 9.0 at row 3."""
    rb = prioritized()
    for start in (0, 40, 80):
        rb.extend(chunk(start, 40))
    rb.update_priority(torch.arange(CAP), torch.linspace(0.1, 5.0, CAP))
    rb.update_priority(torch.tensor([3, 7]), torch.tensor([9.0, 0.05]))
    return rb


def without_replacement(tmp_path, name: str) -> TensorDictReplayBuffer:
    storage = LazyMemmapStorage(50, scratch_dir=tmp_path / name)
    return TensorDictReplayBuffer(storage=storage, sampler=SamplerWithoutReplacement(), batch_size=8)


def samples(rb, k: int = 6) -> list:
    torch.manual_seed(0)
    np.random.seed(0)
    return [rb.sample() for _ in range(k)]


def assert_same_samples(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor):
            assert_bit_equal(x, y)
            continue
        assert set(x.keys(True, True)) == set(y.keys(True, True))
        for key in x.keys(True, True):
            assert_bit_equal(x[key], y[key])


def assert_prioritized_restored(fresh, rb) -> None:
    assert (len(fresh), fresh.writer._cursor, fresh.writer._write_count) == (CAP, 20, 120)
    for key in [*STORAGE_KEYS, ("index",)]:
        assert_bit_equal(fresh.storage._storage[key][:CAP], rb.storage._storage[key][:CAP])
    assert fresh.storage._storage["act"][:3].tolist() == [100, 101, 102]
    idx = torch.arange(CAP)
    for tree in ("_sum_tree", "_min_tree"):
        assert_bit_equal(torch.as_tensor(getattr(fresh.sampler, tree)[idx]), torch.as_tensor(getattr(rb.sampler, tree)[idx]))
    assert fresh.sampler._max_priority == (9.0, 3)
    assert (float(rb.sampler._max_priority[0]), int(rb.sampler._max_priority[1])) == (9.0, 3)
    assert (fresh.sampler._alpha, fresh.sampler._beta, fresh.sampler._eps) == (0.6, 0.4, 1e-8)
    assert_same_samples(samples(fresh), samples(rb))


def leaves(td: TensorDictBase, prefix: tuple = ()) -> dict:
    """``{nested key: tensor or JSON value}`` of a checkout without ``into``."""
    out = {}
    for key in td.keys():
        value = td.get(key)
        if is_non_tensor(value):
            out[(*prefix, key)] = value.data
        elif isinstance(value, TensorDictBase):
            out.update(leaves(value, (*prefix, key)))
        else:
            out[(*prefix, key)] = value
    return out


def components(store, ref: str) -> dict[str, tuple[str, int, dict]]:
    return {p: (c["adapter"], c["version"], c["meta"]) for p, c in store.components(ref).items()}


# --- replay-buffer dumps -----------------------------------------------------------------


def test_dumps_prioritized_lazy_tensor_storage(store, tmp_path):
    rb = filled_prioritized()
    rb.dumps(tmp_path / "rb")
    info, report = import_torchrl(store, tmp_path / "rb", tag="imported")
    assert info.tags == ("imported",)
    assert info.metadata == {
        "imported_from": str(tmp_path / "rb"), "format": "torchrl.replay_buffer.dumps",
        "skipped": [["buffer_metadata.json", SETTINGS], ["prefetch.pkl", PREFETCH]],
    }
    assert report.format == "torchrl.replay_buffer.dumps"
    assert report.components == ["storage", "writer", "sampler"]
    assert report.skipped == [("buffer_metadata.json", SETTINGS), ("prefetch.pkl", PREFETCH)]
    rb_classes = "torchrl.data.replay_buffers"
    assert components(store, "imported") == {
        "storage": ("torchrl.storage.tensor", 1, {"class": f"{rb_classes}.storages.TensorStorage", "imported_from": "storage"}),
        "writer": (
            "torchrl.writer.round_robin", 2, {"class": f"{rb_classes}.writers.RoundRobinWriter", "imported_from": "writer/metadata.json"}
        ),
        "sampler": ("torchrl.sampler.prioritized", 2, {"class": f"{rb_classes}.samplers.PrioritizedSampler", "imported_from": "sampler"}),
    }
    fresh = prioritized()
    assert store.checkout("imported", into=fresh) is fresh
    assert_prioritized_restored(fresh, rb)


def test_dumps_import_matches_a_commit_of_the_live_buffer(store, tmp_path):
    rb = filled_prioritized()
    rb.dumps(tmp_path / "rb")
    import_torchrl(store, tmp_path / "rb", tag="imported")
    store.commit(rb, tag="native")
    imported, native = leaves(store.checkout("imported")), leaves(store.checkout("native"))
    assert list(imported) == list(native)
    assert len(native) == 21
    for key, b in native.items():
        a = imported[key]
        if key[-2:-1] == ("max_priority",):  # TorchRL's dump writes the max priority as JSON numbers
            assert (a, type(a)) == ((9.0, float) if key[-1] == "value" else (3, int))
            assert float(b) == a
        elif isinstance(b, torch.Tensor):
            assert_bit_equal(a, b)
        else:
            assert (a, type(a)) == (b, type(b)), key


def test_dumps_without_replacement_memmap_storage(store, tmp_path):
    rb = without_replacement(tmp_path, "orig")
    rb.extend(chunk(0, 30))
    rb.extend(chunk(30, 30))
    torch.manual_seed(1)
    rb.sample()
    rb.sample()
    assert rb.sampler._sample_list.shape == (34,)
    rb.dumps(tmp_path / "rb")
    _, report = import_torchrl(store, tmp_path / "rb", tag="swr")
    assert report.components == ["storage", "writer", "sampler"]
    assert components(store, "swr")["sampler"] == (
        "torchrl.sampler.without_replacement", 1,
        {"class": "torchrl.data.replay_buffers.samplers.SamplerWithoutReplacement", "imported_from": "sampler"},
    )
    fresh = without_replacement(tmp_path, "fresh")
    store.checkout("swr", into=fresh)
    assert (len(fresh), fresh.writer._cursor, fresh.writer._write_count) == (50, 10, 60)
    for key in STORAGE_KEYS:
        assert_bit_equal(fresh.storage._storage[key], rb.storage._storage[key])
    assert fresh.storage._storage["act"][:3].tolist() == [50, 51, 52]
    assert_bit_equal(fresh.sampler._sample_list, rb.sampler._sample_list)
    assert (fresh.sampler.len_storage, fresh.sampler.drop_last, fresh.sampler.shuffle, fresh.sampler._ran_out) == (50, False, True, False)
    assert_same_samples(samples(fresh, 8), samples(rb, 8))  # 34 rows left: the 5th batch starts a new permutation


def test_dumps_without_replacement_before_any_sample(store, tmp_path):
    rb = without_replacement(tmp_path, "orig")
    rb.extend(chunk(0, 10))
    rb.dumps(tmp_path / "rb")
    assert json.loads((tmp_path / "rb/sampler/meta.json").read_text())["_sample_list"] == {"type": "NonTensorData"}
    import_torchrl(store, tmp_path / "rb", tag="swr")
    fresh = without_replacement(tmp_path, "fresh")
    store.checkout("swr", into=fresh)
    assert (len(fresh), fresh.writer._cursor, fresh.writer._write_count) == (10, 10, 10)
    assert (fresh.sampler._sample_list, fresh.sampler.len_storage, fresh.sampler._ran_out) == (None, 0, False)
    assert_same_samples(samples(fresh, 3), samples(rb, 3))


def plain() -> ReplayBuffer:
    return ReplayBuffer(storage=LazyTensorStorage(20), batch_size=4, writer=RoundRobinWriter(track_generations=True))


def test_dumps_random_sampler_plain_tensor_storage(store, tmp_path):
    rb = plain()
    rb.extend(torch.arange(52).view(26, 2).float())
    rb.dumps(tmp_path / "rb")
    assert not (tmp_path / "rb" / "sampler").exists()
    _, report = import_torchrl(store, tmp_path / "rb", tag="plain")
    assert report.skipped == [("buffer_metadata.json", SETTINGS.replace('"batch_size": 8', '"batch_size": 4')), ("prefetch.pkl", PREFETCH)]
    assert components(store, "plain")["sampler"] == (
        "torchrl.sampler.random", 1, {"class": "torchrl.data.replay_buffers.samplers.RandomSampler", "imported_from": "."},
    )
    assert leaves(store.checkout("plain", partial=["sampler"])) == {("sampler",): {}}
    fresh = plain()
    store.checkout("plain", into=fresh)
    assert (len(fresh), fresh.writer._cursor, fresh.writer._write_count) == (20, 6, 26)
    assert fresh.writer._generation.tolist() == [1] * 6 + [0] * 14
    assert_bit_equal(fresh.storage._storage, rb.storage._storage)
    assert fresh.storage._storage[:2].tolist() == [[40.0, 41.0], [42.0, 43.0]]
    assert_same_samples(samples(fresh), samples(rb))


# --- torchrl.checkpoint --------------------------------------------------------------------


def make_net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


def adam_step(net: torch.nn.Module, adam: torch.optim.Optimizer) -> None:
    adam.zero_grad()
    net(torch.linspace(-1, 1, 15).view(5, 3)).pow(2).sum().backward()
    adam.step()


def draws() -> tuple:
    return random.random(), float(np.random.rand()), np.random.randn(2).tolist(), torch.rand(3).tolist()


@pytest.mark.parametrize("fmt", ["directory", "archive"])
def test_checkpoint_directory_and_archive(store, tmp_path, fmt):
    torch.manual_seed(0)
    net = make_net()
    adam = torch.optim.Adam(net.parameters(), lr=1e-3)
    adam_step(net, adam)
    rb = filled_prioritized()
    dest = tmp_path / ("ckpt.zip" if fmt == "archive" else "ckpt")
    random.seed(7)
    np.random.seed(7)
    np.random.randn()  # a cached gaussian in numpy's state
    Checkpoint(
        policy=net, optim=adam, rb=rb, meta={"step": 3, "tags": ["a", "b"]}, history=[1, 2.5, "x"], rng=GlobalRNGState()
    ).save(dest, format=fmt)
    expected = draws()  # the generators as saved: rng is the last component written
    random.seed(123)
    np.random.seed(123)
    torch.manual_seed(123)

    info, report = import_torchrl(store, dest, tag="ckpt", message="from torchrl")
    assert report.format == f"torchrl.checkpoint.{fmt}"
    assert report.components == ["history", "meta", "optim", "policy", "rb/storage", "rb/writer", "rb/sampler", "rng"]
    assert report.skipped == [("components/0004-rb/buffer_metadata.json", SETTINGS), ("components/0004-rb/prefetch.pkl", PREFETCH)]
    assert info.message == "from torchrl"
    assert info.metadata["torchrl_checkpoint"]["versions"]["torchrl"] == "0.14.1"
    assert {p: c[:2] for p, c in components(store, "ckpt").items()} == {
        "history": ("json", 1), "meta": ("dict", 1), "optim": ("torch.optim.Optimizer", 1), "policy": ("torch.nn.Module", 1),
        "rb/storage": ("torchrl.storage.tensor", 1), "rb/writer": ("torchrl.writer.round_robin", 2),
        "rb/sampler": ("torchrl.sampler.prioritized", 2), "rng": ("rng", 1),
    }
    policy_meta = {"class": "torch.nn.modules.module.Module", "imported_from": "components/0003-policy/state.json"}
    assert components(store, "ckpt")["policy"][2] == policy_meta

    store.checkout("ckpt", into={"rng": ckptstore.RNGState()})
    assert draws() == expected

    torch.manual_seed(1)
    net2 = make_net()
    adam2 = torch.optim.Adam(net2.parameters(), lr=0.5)
    rb2, meta2 = prioritized(), {}
    target = {"policy": net2, "optim": adam2, "rb": rb2, "meta": meta2, "history": []}
    assert store.checkout("ckpt", into=target) is target
    for key, value in net.state_dict().items():
        assert_bit_equal(net2.state_dict()[key], value)
    state, state2 = adam.state_dict(), adam2.state_dict()
    assert state2["param_groups"] == state["param_groups"]
    assert state2["param_groups"][0]["lr"] == 1e-3 and state2["param_groups"][0]["params"] == [0, 1, 2, 3]
    assert sorted(state2["state"]) == [0, 1, 2, 3]
    for i in range(4):
        assert sorted(state2["state"][i]) == ["exp_avg", "exp_avg_sq", "step"]
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert_bit_equal(state2["state"][i][name], state["state"][i][name])
    assert float(state2["state"][0]["step"]) == 1.0
    adam_step(net, adam)
    adam_step(net2, adam2)
    for key, value in net.state_dict().items():
        assert_bit_equal(net2.state_dict()[key], value)
    assert target["meta"] is meta2 and meta2 == {"step": 3, "tags": ["a", "b"]}
    assert target["history"] == [1, 2.5, "x"]
    assert_prioritized_restored(rb2, rb)


# --- refused and malformed input -----------------------------------------------------------


def test_pickled_state_dict_payload_is_refused(store, tmp_path):
    ckpt = Checkpoint(meta={"step": 1})
    ckpt.register("policy", make_net(), adapter=StateDictCheckpointAdapter(payload_format="torch"))
    ckpt.save(tmp_path / "ckpt")
    assert (tmp_path / "ckpt/components/0001-policy/state.pt").is_file()
    before = row_count(store)
    with pytest.raises(ContainerError, match=r"ckpt/components/0001-policy/state\.pt: a torch\.save pickle"):
        import_torchrl(store, tmp_path / "ckpt", tag="x")
    assert row_count(store) == before
    assert store.tags() == {}


class _CreatesFile:
    """Unpickling this calls ``open(path, "w")``: proof that a file was unpickled."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def test_malicious_prefetch_pickle_is_skipped_never_unpickled(store, tmp_path):
    proof = tmp_path / "proof"
    pickle.loads(pickle.dumps(_CreatesFile(proof))).close()
    assert proof.exists()  # the payload works when unpickled
    rb = filled_prioritized()
    rb.dumps(tmp_path / "rb")
    marker = tmp_path / "marker"
    (tmp_path / "rb" / "prefetch.pkl").write_bytes(pickle.dumps(_CreatesFile(marker)))
    _, report = import_torchrl(store, tmp_path / "rb", tag="rb")
    assert report.skipped == [("buffer_metadata.json", SETTINGS), ("prefetch.pkl", PREFETCH)]
    assert not marker.exists()
    fresh = prioritized()
    store.checkout("rb", into=fresh)
    assert not marker.exists()
    assert_bit_equal(fresh.storage._storage["obs"], rb.storage._storage["obs"])


@pytest.mark.parametrize("delta", [-4, 4])
def test_tampered_memmap_size_is_refused(store, tmp_path, delta):
    filled_prioritized().dumps(tmp_path / "rb")
    obs = tmp_path / "rb" / "storage" / "obs.memmap"
    data = obs.read_bytes()
    obs.write_bytes(data[:delta] if delta < 0 else data + bytes(delta))
    before = row_count(store)
    with pytest.raises(ContainerError, match=rf"rb/storage/obs\.memmap: {1200 + delta} bytes, but torch\.float32 \[100, 3\] takes 1200"):
        import_torchrl(store, tmp_path / "rb")
    assert row_count(store) == before


def _edit_json(path, edit) -> None:
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))


def _meta_dtype(meta: dict) -> dict:
    meta["obs"]["dtype"] = "torch.float33"
    return meta


def _tree_value(d) -> None:
    with open(d / "sampler/sumtree.memmap", "r+b") as f:
        f.write(struct.pack("<d", 0.1))  # not a float32 value


DUMPS_DAMAGE = {
    "unknown dtype": (lambda d: _edit_json(d / "storage/meta.json", _meta_dtype), r"rb/storage/meta\.json: unknown dtype 'torch\.float33'"),
    "bad json": (lambda d: (d / "writer/metadata.json").write_text('{"cursor": 20,'), r"rb/writer/metadata\.json: not valid JSON"),
    "missing file": (lambda d: (d / "sampler/mintree.memmap").unlink(), r"rb/sampler/mintree\.memmap: missing"),
    "symlink": (lambda d: os.symlink(d / "storage/act.memmap", d / "storage/link.memmap"), r"rb/storage/link\.memmap: a symbolic link"),
    "unknown pickle": (
        lambda d: (d / "sampler/extra.pt").write_bytes(b"\x80\x04N."), r"rb/sampler/extra\.pt: a pickle, which may hold state"
    ),
    "unknown file": (lambda d: (d / "storage/notes.bin").write_bytes(b"x"), r"rb/storage/notes\.bin: a file this importer does not know"),
    "pickled transform": (
        lambda d: (d / "transform.t").write_bytes(b"\x80\x04N."), r"rb/transform\.t: the buffer's transform state, pickled"
    ),
    "tree values": (_tree_value, r"rb/sampler/sumtree\.memmap: holds values that are not float32 values"),
    "tree size": (
        lambda d: _edit_json(d / "sampler/sampler_metadata.json", lambda m: {**m, "_max_capacity": 99.0}),
        r"rb/sampler/sumtree\.memmap: 800 bytes, but torch\.float64 \[99\] takes 792",
    ),
}


@pytest.mark.parametrize("case", sorted(DUMPS_DAMAGE))
def test_malformed_dumps_are_refused(store, tmp_path, case):
    filled_prioritized().dumps(tmp_path / "rb")
    damage, message = DUMPS_DAMAGE[case]
    damage(tmp_path / "rb")
    before = row_count(store)
    with pytest.raises(ContainerError, match=message):
        import_torchrl(store, tmp_path / "rb", tag="x")
    assert row_count(store) == before


def test_buffer_generator_state_is_refused(store, tmp_path):
    rb = ReplayBuffer(storage=LazyTensorStorage(10), batch_size=2, generator=torch.Generator().manual_seed(3))
    rb.extend(torch.arange(6.0))
    rb.dumps(tmp_path / "rb")
    with pytest.raises(ContainerError, match=r"rb/rng_state: the buffer's own generator state"):
        import_torchrl(store, tmp_path / "rb")
    assert store.log() == []


def _component_path(m: dict) -> dict:
    m["components"]["meta"]["path"] = "../outside"
    return m


def _drop_listed_file(m: dict) -> dict:
    m["components"]["rb"]["files"].remove("writer/metadata.json")
    return m


def _state_json_kind(d) -> None:
    _edit_json(d / "components/0001-policy/state.json", lambda s: {"kind": "set", "items": []})


MANIFEST_DAMAGE = {
    "unknown format": (
        lambda m: {**m, "format": "torchrl.other"}, r"ckpt/manifest\.json: format 'torchrl\.other' is not 'torchrl\.checkpoint'"
    ),
    "newer version": (lambda m: {**m, "format_version": 2}, r"ckpt/manifest\.json: format_version 2 is not supported"),
    "unknown adapter": (lambda m: {**m, "components": {**m["components"], "meta": {**m["components"]["meta"], "adapter": "my.adapter"}}},
                        r"adapter 'my\.adapter', which this importer does not read"),
    "escaping path": (_component_path, r"ckpt/manifest\.json: unsafe path '\.\./outside'"),
    "unlisted file": (_drop_listed_file, r"ckpt/components/0002-rb/writer/metadata\.json: not listed in manifest\.json"),
}


@pytest.mark.parametrize("case", sorted([*MANIFEST_DAMAGE, "state kind"]))
def test_malformed_checkpoints_are_refused(store, tmp_path, case):
    Checkpoint(meta={"step": 1}, policy=make_net(), rb=filled_prioritized()).save(tmp_path / "ckpt")
    if case == "state kind":
        _state_json_kind(tmp_path / "ckpt")
        message = r"ckpt/components/0001-policy/state\.json: state-dict entries of kind 'set' are not supported"
    else:
        edit, message = MANIFEST_DAMAGE[case]
        _edit_json(tmp_path / "ckpt/manifest.json", edit)
    before = row_count(store)
    with pytest.raises(ContainerError, match=message):
        import_torchrl(store, tmp_path / "ckpt", tag="x")
    assert row_count(store) == before


@pytest.mark.parametrize("entry", ["../escape.json", "link"])
def test_unsafe_archive_entries_are_refused(store, tmp_path, entry):
    Checkpoint(meta={"step": 1}).save(tmp_path / "ckpt.zip", format="archive")
    with zipfile.ZipFile(tmp_path / "ckpt.zip") as src, zipfile.ZipFile(tmp_path / "bad.zip", "w") as dst:
        for info in src.infolist():
            dst.writestr(info, src.read(info))
        extra = zipfile.ZipInfo(entry)
        if entry == "link":
            extra.external_attr = (stat.S_IFLNK | 0o777) << 16
        dst.writestr(extra, "/etc/passwd")
    message = r"bad\.zip/\.\./escape\.json: unsafe path" if entry != "link" else r"bad\.zip/link: a symbolic link"
    with pytest.raises(ContainerError, match=message):
        import_torchrl(store, tmp_path / "bad.zip")
    assert store.log() == []


def test_not_a_torchrl_checkpoint(store, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ContainerError, match=r"empty: neither a TorchRL checkpoint \(no manifest\.json\) nor a replay-buffer dump"):
        import_torchrl(store, tmp_path / "empty")
    (tmp_path / "file.zip").write_bytes(b"not a zip")
    with pytest.raises(ContainerError, match=r"file\.zip: neither a folder nor a readable ZIP archive"):
        import_torchrl(store, tmp_path / "file.zip")
    shutil.rmtree(tmp_path / "empty")
    assert store.log() == []


def test_other_formats_are_named_not_parsed(tmp_path):
    store = ckptstore.Store(tmp_path / "s", create=True)
    store.commit({"x": torch.ones(2)}, tag="t")
    torch.save({"a": torch.ones(2)}, tmp_path / "state.pt")
    store.export("t", tmp_path / "e.zip")
    store.export("t", tmp_path / "edir")
    for src, match in (("state.pt", "is a torch.save file .* never unpickles"), ("e.zip", "is a ckptstore export.*ckptstore import"),
                       ("edir", "is a ckptstore export")):
        with pytest.raises(ckptstore.errors.ContainerError, match=match):
            store.import_torchrl(tmp_path / src)
    assert list(store.tags()) == ["t"]
    store.close()
