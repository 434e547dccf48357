"""Bad input found by trying to break ckptstore: each gets its own clear error and
leaves the store and the target as they were."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, TensorDictPrioritizedReplayBuffer

import ckptstore
from ckptstore.protocols.archive import MANIFEST
from ckptstore.errors import (
    CatalogCorruptError,
    InvalidArgumentError,
    InvalidNameError,
    PartialPathError,
    RefNotFoundError,
    ShapeMismatchError,
    TargetMismatchError,
    UnsupportedTypeError,
)

from tests.conftest import row_count, run_fresh
from tests.unit.top.test_cli import cli


def tampered(store, tmp_path, ref: str, path: str, value) -> ckptstore.Store:
    """Export ``ref``, set JSON leaf ``path`` to ``value``, import into a new store as ``latest``."""
    store.export(ref, tmp_path / "export")
    doc = json.loads((tmp_path / "export" / MANIFEST).read_text())
    next(r for r in doc["leaves"] if r["path"] == path)["value"] = ckptstore.core.jsonvalue.dumps(value)
    (tmp_path / "export" / MANIFEST).write_text(json.dumps(doc))
    other = ckptstore.Store(tmp_path / "other", create=True)
    with pytest.raises(ckptstore.errors.ContainerError, match="does not match its id"):
        other.import_from(tmp_path / "export", tag="latest")  # an edited export is no longer the commit it names
    # imported as a new commit (a new message gives up its provenance), the adapters must still refuse the value
    ckptstore.protocols.archive.import_commit(other, tmp_path / "export", "latest", message="tampered")
    return other


def full_state():
    rb = TensorDictPrioritizedReplayBuffer(alpha=0.6, beta=0.4, storage=LazyTensorStorage(50), batch_size=4, priority_key="td_error")
    net = torch.nn.Linear(3, 2)
    return {"rb": rb, "policy": net, "optim": torch.optim.Adam(net.parameters()), "rng": ckptstore.RNGState()}


@pytest.mark.parametrize(
    "path, value",
    [("rng/numpy/pos", 10**9), ("rng/python/version", 99), ("rng/python/gauss_next", "x"), ("rng/numpy/has_gauss", 7)],
)
def test_tampered_rng_state_is_refused_before_anything_is_restored(store, tmp_path, path, value):
    state = full_state()
    state["rb"].extend(TensorDict({"obs": torch.randn(10, 3)}, [10]))
    store.commit(state, tag="s")
    other = tampered(store, tmp_path, "s", path, value)
    target = full_state()
    np_before = np.random.get_state()[1].copy()
    with pytest.raises(TargetMismatchError, match="invalid RNG state"):
        other.checkout("latest", into=target)
    assert len(target["rb"]) == 0 and not target["rb"].storage.initialized  # nothing restored
    assert np.array_equal(np.random.get_state()[1], np_before)
    other.close()


@pytest.mark.parametrize(
    "path, value, match",
    [
        ("rb/storage/len", 10**9, "invalid length"),
        ("rb/writer/cursor", 10**6, "invalid cursor"),
        ("rb/sampler/alpha", "x", "not a number"),
        ("optim/param_groups/0/lr", "fast", "a number was expected"),
    ],
)
def test_tampered_values_are_checked_against_the_target(store, tmp_path, path, value, match):
    state = full_state()
    state["rb"].extend(TensorDict({"obs": torch.randn(10, 3)}, [10]))
    store.commit(state, tag="s")
    other = tampered(store, tmp_path, "s", path, value)
    target = full_state()
    with pytest.raises(TargetMismatchError, match=match):
        other.checkout("latest", into=target)
    assert len(target["rb"]) == 0
    other.close()


def test_optimizer_that_does_not_fit_is_refused(store):
    small = torch.nn.Linear(4, 8)
    adam = torch.optim.Adam(small.parameters())
    small(torch.randn(2, 4)).sum().backward()
    adam.step()
    store.commit({"optim": adam}, tag="a")
    with pytest.raises(ShapeMismatchError, match=r"state/0/exp_avg.*\[8, 4\].*\[16, 4\]"):
        store.checkout("a", into={"optim": torch.optim.Adam(torch.nn.Linear(4, 16).parameters())})
    with pytest.raises(TargetMismatchError, match="Adam.*SGD"):
        store.checkout("a", into={"optim": torch.optim.SGD(torch.nn.Linear(4, 8).parameters(), lr=0.1, momentum=0.9)})


def test_zero_byte_catalog_is_not_turned_into_an_empty_store(tmp_path, monkeypatch, capsys):
    s = ckptstore.Store(tmp_path / "s")
    s.commit({"x": torch.ones(3)}, tag="t")
    s.close()
    (tmp_path / "s" / "catalog.sqlite").write_bytes(b"")
    with pytest.raises(CatalogCorruptError, match="empty"):
        ckptstore.Store(tmp_path / "s")
    code, out, err = cli(monkeypatch, capsys, "tags", "--store", str(tmp_path / "s"), "--json")
    assert code == 1 and out == "" and err.startswith("error: ")
    assert (tmp_path / "s" / "catalog.sqlite").stat().st_size == 0


def test_bad_settings_are_refused_before_anything_is_saved(tmp_path):
    for kwargs in ({"shard_bytes": 0}, {"shard_bytes": -3}, {"shard_bytes": "abc"}, {"compression_level": 100}):
        with pytest.raises(InvalidArgumentError):
            ckptstore.Store(tmp_path / "s", **kwargs)
    assert not (tmp_path / "s").exists()
    ckptstore.Store(tmp_path / "s", create=True).close()
    with pytest.raises(InvalidArgumentError):
        ckptstore.Store(tmp_path / "s", compression_level=-1)
    with ckptstore.Store(tmp_path / "s") as s:
        assert (s.shard_bytes, s.compression_level) == (256 << 10, 3)


def test_tensor_under_a_non_str_key_names_the_key(store):
    for bad, key in (({"x": {2: torch.zeros(3)}}, "x: key 2 is a int"), ({(1, 2): torch.zeros(3)}, r"<root>: key \(1, 2\) is a tuple")):
        with pytest.raises(InvalidNameError, match=key):
            store.commit(bad, tag="t")
    assert store.tags() == {}


def test_unencodable_strings_fail_before_writing_a_pack(store):
    store.commit({"x": torch.ones(2)}, tag="t")
    before = row_count(store)
    packs = sorted(store.root.glob("blobs/*/*.pack"))
    for kwargs in ({"tag": "a\udcff"}, {"message": "m\udcff"}, {"metadata": {"k": "v\udcff"}}, {"metadata": {"k\udcff": 1}}):
        with pytest.raises((InvalidNameError, InvalidArgumentError, UnsupportedTypeError)):
            store.commit({"y": torch.randn(100)}, **kwargs)
    with pytest.raises(RefNotFoundError):
        store.checkout("\udcff")
    assert row_count(store) == before and sorted(store.root.glob("blobs/*/*.pack")) == packs
    assert list((store.root / "tmp").iterdir()) == []


def test_unstorable_tensors_and_cycles(store):
    cyclic = {"t": torch.ones(2)}
    cyclic["me"] = cyclic
    for bad, match in ((torch.eye(3).to_sparse(), "sparse"), (cyclic, "cycle")):  # nested tensors are stored (tests/unit/adapters/test_values.py)
        with pytest.raises(UnsupportedTypeError, match=match):
            store.commit({"x": bad})


def test_partial_paths_that_name_nothing(store):
    store.commit({"policy": torch.nn.Linear(2, 2), "rb": TensorDictPrioritizedReplayBuffer(alpha=1.0, beta=1.0, storage=LazyTensorStorage(4))}, tag="t")
    for bad in (["rb/sampler/nonexistent"], ["policy/weightX"], ["policy/weight/x"]):
        with pytest.raises(PartialPathError, match="components: policy, rb/storage"):
            store.checkout("t", partial=bad)
    with pytest.raises(PartialPathError, match="empty"):
        store.checkout("t", partial=[])
    assert list(store.checkout("t", partial=["policy/weight"])["policy"].keys()) == ["weight"]


def test_failed_import_does_not_create_the_store(tmp_path, monkeypatch, capsys):
    (tmp_path / "junk.zip").write_bytes(b"not a zip")
    code, _, err = cli(monkeypatch, capsys, "import", str(tmp_path / "junk.zip"), "--store", str(tmp_path / "new"))
    assert code == 1 and "truncated or corrupt" in err
    assert not (tmp_path / "new").exists()


def test_cli_argument_errors(tmp_path, monkeypatch, capsys):
    ckptstore.Store(tmp_path / "s", create=True).close()
    for args in (("demo", "--frames", "100"), ("demo", "--every", "0"), ("log", "--limit", "-1", "--store", str(tmp_path / "s"))):
        code, _, err = cli(monkeypatch, capsys, *args)
        assert code == 2, (args, err)
    code, _, err = cli(monkeypatch, capsys, "reflog", "nope", "--store", str(tmp_path / "s"))
    assert code == 1 and "never existed" in err
    with ckptstore.Store(tmp_path / "s") as s, pytest.raises(InvalidArgumentError):
        s.log(limit=0)


BOMB = """
import json, resource, sys, zstandard, xxhash, ckptstore
from ckptstore.objects.packs import BLOB_HEADER, BLOB_MAGIC, FORMAT_VERSION, CODEC_ZSTD
src, dst = sys.argv[1], sys.argv[2]
raw_len = 1 << 30                      # declares 1 GiB of zeros ...
cobj = zstandard.ZstdCompressor(level=1).compressobj()
payload = b"".join(cobj.compress(bytes(1 << 20)) for _ in range(1024)) + cobj.flush()
digest = bytes(16)                      # ... under a hash that does not match
addr = digest.hex() + "-" + str(raw_len)
import os
os.makedirs(src + "/blobs")
open(src + "/blobs/" + addr, "wb").write(BLOB_HEADER.pack(BLOB_MAGIC, FORMAT_VERSION, CODEC_ZSTD, 0, raw_len, len(payload), digest) + payload)
manifest = {"format": "ckptstore-export", "version": 1,
            "commit": {"id": "0" * 32, "parents": [], "created_at": 0.0, "message": "", "metadata": "{}"},
            "components": [{"path": "", "adapter": "tensor", "version": 1, "meta": "{}"}],
            "leaves": [{"path": "", "component": "", "kind": "tensor", "dtype": "uint8", "shape": [raw_len], "stride": None,
                        "nbytes": raw_len, "shard_bytes": raw_len, "value": None, "shards": [addr]}]}
open(src + "/ckptstore-export.json", "w").write(json.dumps(manifest))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    ckptstore.Store(dst).import_from(src)
except ckptstore.errors.ContainerError as exc:
    print("rejected", "hash mismatch" in str(exc))
print("peak_growth_kib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""


def test_decompression_bomb_is_rejected_in_bounded_memory(tmp_path):
    out = run_fresh(BOMB, str(tmp_path / "bomb"), str(tmp_path / "dst")).stdout.split()
    assert out[:2] == ["rejected", "True"]
    assert int(out[3]) < 64 * 1024  # KiB: streamed, never the declared 1 GiB


def test_export_folder_is_world_readable(store, tmp_path):
    store.commit({"x": torch.ones(1)}, tag="t")
    store.export("t", tmp_path / "e")
    assert (tmp_path / "e").stat().st_mode & 0o777 == 0o755


def test_message_and_metadata_of_the_wrong_type_are_argument_errors(store):
    for kwargs in ({"message": 123}, {"metadata": [1, 2]}):
        with pytest.raises(InvalidArgumentError, match="message must be|metadata must be"):
            store.commit({"x": torch.ones(1)}, tag="t", **kwargs)
    assert store.tags() == {}


def test_fsck_sample_rereads_a_sample_without_deep(store):
    store.commit({f"x{i}": torch.randn(100) for i in range(40)}, tag="t")
    report = store.fsck(sample=0.5)
    assert 0 < report.blobs_checked < 40 and report.ok
