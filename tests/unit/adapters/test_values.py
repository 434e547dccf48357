"""Values a training loop holds (issue 24): every built-in adapter by name in a fresh process,
numpy scalars, raw bytes, heterogeneous lazy stacks, nested tensors, every TorchRL storage,
sampler and writer, torchrl.checkpoint checkpoints from before use_store, StoreWriter's folder,
tensorclasses, and TensorStorages backed by pytrees or holding non-tensor columns."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from tensordict import LazyStackedTensorDict, TensorDict

import ckptstore
from ckptstore import Progress, Store
from ckptstore.errors import NotAStoreError, UnsupportedTypeError

from tests.conftest import assert_bit_equal, commit_edited, raw_bytes, run_fresh
from tests import paths


def _builtin_names() -> list[str]:
    import ckptstore.adapters.torchrl  # noqa: F401
    import ckptstore.dcp  # noqa: F401
    from ckptstore.adapters import REGISTRY

    return sorted(n for n, a in REGISTRY.by_name.items() if type(a).__module__.startswith("ckptstore."))


def test_every_builtin_adapter_resolves_by_name_in_a_fresh_interpreter():
    names = _builtin_names()
    assert "ckptstore.core.progress" in names and "dcp" in names and "torchrl.storage.tensor" in names
    proc = run_fresh(
        """
        import json, sys
        from ckptstore.adapters import REGISTRY
        from ckptstore.errors import AdapterError
        bad = {}
        for name in json.loads(sys.argv[1]):
            try:
                REGISTRY.named(name, "")
            except AdapterError as exc:
                bad[name] = str(exc)
        print(json.dumps(bad))
        """,
        json.dumps(names),
    )
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {}


def _every_value(tmp_path):
    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

    torch.manual_seed(0)
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(8), batch_size=2)
    rb.extend(TensorDict({"obs": torch.arange(12.0).reshape(6, 2)}, [6]))
    net = torch.nn.Linear(2, 2)
    return {
        "progress": Progress(step=7, frames=70, best_metric=np.mean([1.0, 2.5])), "rng": ckptstore.RNGState(), "net": net,
        "optim": torch.optim.Adam(net.parameters()), "rb": rb, "np": np.arange(3, dtype=np.int16), "raw": b"\x00raw",
        "td": TensorDict({"x": torch.ones(2)}, [2]), "values": {"n": np.float32(0.25), "t": torch.arange(3)},
    }


def test_a_store_of_every_builtin_adapter_imports_pulls_recovers_and_checks_out_in_fresh_interpreters(tmp_path):
    src = Store(tmp_path / "src", create=True)
    src.commit(_every_value(tmp_path), tag="t")
    src.export("t", tmp_path / "x.zip")
    src.close()
    check = """
s = ckptstore.Store(sys.argv[1])
out = s.checkout("t", partial=["progress", "raw", "values"])
assert int(out["progress", "step"]) == 7 and type(out["progress", "best_metric"]) is np.float64, out
assert out["raw"] == b"\\x00raw" and type(out["values", "n"]) is np.float32, out
assert s.fsck(deep=True).ok
"""
    head = "import sys, numpy as np, ckptstore\n"
    # import: the command line, in a fresh interpreter (refused before: "unknown adapter 'ckptstore.core.progress'")
    proc = subprocess.run([sys.executable, "-m", "ckptstore.cli", "import", str(tmp_path / "x.zip"), "--tag", "t", "--store", str(tmp_path / "imp")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # pull (from the imported store), then checkout
    run_fresh(head + 'ckptstore.Store(sys.argv[1], create=True).pull(sys.argv[2], "t")\n' + check, str(tmp_path / "pulled"), str(tmp_path / "imp"))
    # recover (the catalog rebuilt from the packs alone), then checkout
    shutil.copytree(tmp_path / "pulled", tmp_path / "lost")
    for f in (tmp_path / "lost").glob("catalog.sqlite*"):
        f.unlink()
    run_fresh(head + "ckptstore.Store.recover(sys.argv[1])\n" + check, str(tmp_path / "lost"))
    # checkout into live objects, in an interpreter that built them after opening the store
    proc = run_fresh(head + """
s = ckptstore.Store(sys.argv[1])
comps = s.components("t")
p = ckptstore.Progress()
s.checkout("t", into={"progress": p, "raw": None}, partial=["progress", "raw"])
print(comps["progress"]["adapter"], p.step, p.frames, type(p.best_metric).__name__, p.best_metric)
""", str(tmp_path / "src"))
    assert proc.stdout.split() == ["ckptstore.core.progress", "7", "70", "float64", "1.75"]


# --- numpy scalars ------------------------------------------------------------------------------

SCALARS = [np.float64(0.1), np.float32(1 / 3), np.float16(-2.5), np.int64(-(2**40)), np.int32(7), np.uint8(255),
           np.uint64(2**64 - 1), np.bool_(True), np.float32("nan"), np.float64("-inf"), np.complex64(1 - 2j), np.mean([1.0, 2.0, 4.0])]


def _same(a, b) -> bool:
    return type(a) is type(b) and (a == b or (a != a and b != b))


def test_numpy_scalars_are_stored_without_pickle_and_come_back_as_their_type(tmp_path):
    s = Store(tmp_path / "s", create=True)
    obj = {"d": {f"k{i}": x for i, x in enumerate(SCALARS)}, "nested": {"l": [SCALARS[0], (SCALARS[3], {"b": SCALARS[7]})]},
           "top": np.float32(0.5), "progress": Progress(best_metric=np.float32(0.75), step=3)}
    s.commit(obj, tag="t")
    into = {"d": {}, "nested": {}, "top": None, "progress": Progress()}
    out = s.checkout("t", into=into)
    assert all(_same(out["d"][f"k{i}"], x) for i, x in enumerate(SCALARS))
    l = out["nested"]["l"]
    assert _same(l[0], SCALARS[0]) and type(l[1]) is tuple and _same(l[1][0], SCALARS[3]) and _same(l[1][1]["b"], SCALARS[7])
    assert _same(out["top"], np.float32(0.5)) and _same(into["progress"].best_metric, np.float32(0.75)) and into["progress"].step == 3
    plain = s.checkout("t", partial=["d"])
    assert _same(plain["d", "k1"], SCALARS[1])
    assert {r.path: r.kind for r in s.manifest("t")}["d/k1"] == "json"
    record = s.catalog.rows("SELECT record FROM commits WHERE id = ?", (s.resolve("t"),))[0]["record"]
    assert '\\"$\\":\\"numpy\\",\\"dtype\\":\\"<f4\\",\\"v\\":0.3333333432674408' in record  # the commit record: JSON, no pickle


def test_a_numpy_metric_set_during_training_is_committed_and_resumed(tmp_path):
    progress = Progress()
    ckpt = ckptstore.Checkpointer(Store(tmp_path / "s", create=True), {"progress": progress}, every_n_steps=2, on_signal=())
    returns = np.array([1.0, 2.0, 4.5])
    for _ in range(4):
        progress.best_metric = np.mean(returns)  # None when the Checkpointer was built
        progress.step += 1
        ckpt.step()
    again = Progress()
    ckptstore.Checkpointer(Store(tmp_path / "s"), {"progress": again}, every_n_steps=2, on_signal=()).resume()
    assert again.step == 4 and type(again.best_metric) is np.float64 and again.best_metric == np.mean(returns)


@pytest.mark.parametrize("bad", [np.longdouble(1.0), np.str_("s"), np.datetime64("2020-01-01")])
def test_numpy_scalars_without_an_exact_json_form_are_refused_naming_the_path(tmp_path, bad):
    s = Store(tmp_path / "s", create=True)
    with pytest.raises(UnsupportedTypeError, match=r"d/x: (values of type|no adapter for objects of type) numpy\.(longdouble|str_|datetime64)"):
        s.commit({"d": {"x": bad}}, tag="t")
    assert s.tags() == {}


# --- raw bytes ----------------------------------------------------------------------------------


def test_raw_bytes_are_blobs_deduplicated_verified_partial_and_come_back_as_their_type(tmp_path):
    s = Store(tmp_path / "s", create=True)
    payload = bytes(range(256)) * 2048  # 512 KiB: two shards
    obj = {"d": {"b": payload, "ba": bytearray(b"mutable"), "bio": io.BytesIO(b"stream" * 10), "empty": b""}, "top": b"top"}
    first = s.commit(obj, tag="a")
    leaves = {r.path: r for r in s.manifest("a")}
    assert {p: (leaves[p].kind, leaves[p].dtype, leaves[p].shape) for p in ("d/b", "d/ba", "d/bio", "d/empty", "top")} == {
        "d/b": ("tensor", "uint8", (524288,)), "d/ba": ("tensor", "uint8", (7,)), "d/bio": ("tensor", "uint8", (60,)),
        "d/empty": ("tensor", "uint8", (0,)), "top": ("tensor", "uint8", (3,))}
    assert len(leaves["d/b"].keys) == 128 and first.shards_total == 132  # 4 KiB shards: a byte is a row (at most 4096 rows a shard)
    again = s.commit({"copy": {"b": bytearray(payload)}}, tag="b")  # the same bytes as another type: no new blob
    assert again.new_bytes == 0 and again.shards_new == 0
    target = {"d": {"ba": bytearray(), "bio": io.BytesIO(b"old")}, "top": None}
    bio = target["d"]["bio"]
    out = s.checkout("a", into=target)
    d = out["d"]
    assert type(d["b"]) is bytes and d["b"] == payload and d["ba"] == bytearray(b"mutable") and type(d["ba"]) is bytearray
    assert d["bio"] is bio and bio.getvalue() == b"stream" * 10 and bio.tell() == 0 and d["empty"] == b"" and out["top"] == b"top"
    s.io.blobs_read = 0
    part = s.checkout("a", partial=["d/ba"])
    assert part["d", "ba"] == bytearray(b"mutable") and s.io.blobs_read == 1
    assert s.checkout("a", partial=["top"])["top"] == b"top"
    assert s.fsck(deep=True).ok


def test_raw_bytes_inside_lists_are_refused_with_what_to_do(tmp_path):
    s = Store(tmp_path / "s", create=True)
    with pytest.raises(UnsupportedTypeError, match=r"d/x\[0\]: raw bytes \(bytes\) are stored as blobs only as a component or as the value of a dict key"):
        s.commit({"d": {"x": [b"a"]}}, tag="t")


def test_store_writer_keeps_raw_bytes_items_as_blobs(tmp_path):
    import torch.distributed.checkpoint as dcp

    from ckptstore.dcp import StoreReader, StoreWriter

    raw = io.BytesIO(bytes(range(200)) * 5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w = StoreWriter(tmp_path / "s", tag="t")
        dcp.save({"w": torch.arange(4.0), "raw": raw, "b": b"xyz", "ba": bytearray(b"q"), "e": b"", "n": 3}, storage_writer=w)
        s = Store(tmp_path / "s")
        leaves = {r.path: (r.kind, r.dtype, r.shape) for r in s.manifest("t")}
        assert leaves == {"w": ("tensor", "float32", (4,)), "raw": ("tensor", "uint8", (1000,)), "b": ("tensor", "uint8", (3,)),
                          "ba": ("tensor", "uint8", (1,)), "e": ("tensor", "uint8", (0,)), "n": ("json", None, None)}
        target = {"w": torch.zeros(4), "raw": io.BytesIO(), "b": b"", "ba": bytearray(), "e": None, "n": 0}
        dcp.load(target, storage_reader=StoreReader(s, "t"))
    assert type(target["raw"]) is io.BytesIO and target["raw"].getvalue() == raw.getvalue()
    assert target["b"] == b"xyz" and type(target["ba"]) is bytearray and target["ba"] == b"q" and target["n"] == 3
    assert type(target["e"]) is bytes and target["e"] == b""
    assert_bit_equal(target["w"], torch.arange(4.0))
    plain = s.checkout("t")
    assert plain["raw"].getvalue() == raw.getvalue() and plain["b"] == b"xyz"


def test_store_writer_into_a_folder_of_other_files_says_what_to_pass(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from ckptstore.dcp import StoreWriter

    folder = tmp_path / "checkpoints"
    (folder / "step-100").mkdir(parents=True)
    (folder / "step-100" / ".metadata").write_bytes(b"dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointException, match=r"pass a new or empty folder, e\.g\. .*checkpoints/store inside your checkpoint folder"):
            dcp.save({"w": torch.ones(2)}, storage_writer=StoreWriter(folder, tag="t"))
        assert sorted(p.name for p in folder.iterdir()) == ["step-100"]
        dcp.save({"w": torch.ones(2)}, storage_writer=StoreWriter(folder / "store", tag="t"))
    assert Store(folder / "store").tags().keys() == {"t"}
    with pytest.raises(NotAStoreError, match="inside your checkpoint folder"):
        from ckptstore.dcp import StoreReader

        StoreReader(folder, "t")


# --- heterogeneous lazy stacks ----------------------------------------------------------------


def _describe(td):
    if isinstance(td, LazyStackedTensorDict):
        return ("lazy", td.stack_dim, list(td.batch_size), [_describe(m) for m in td.tensordicts])
    return (type(td).__name__, list(td.batch_size), sorted(
        (k, _describe(v) if isinstance(v, (TensorDict, LazyStackedTensorDict)) else (v.dtype, tuple(v.shape), v.flatten().tolist()))
        for k, v in td.items()))


def _stacks():
    a = TensorDict({"x": torch.arange(3.0), "n": {"q": torch.arange(2)}}, [])
    b = TensorDict({"y": torch.full((2,), 7, dtype=torch.int32)}, [])
    c = TensorDict({"x": torch.arange(3.0) + 1, "z": torch.ones(1)}, [])
    return {
        "disjoint": LazyStackedTensorDict(a, b),
        "one_shared_key": LazyStackedTensorDict(a, c),
        "ragged": LazyStackedTensorDict(a, TensorDict({"x": torch.arange(5.0), "n": {"q": torch.arange(2)}}, [])),
        "stack_dim_1": LazyStackedTensorDict(TensorDict({"x": torch.ones(2, 3)}, [2]), TensorDict({"w": torch.arange(2)}, [2]), stack_dim=1),
        "inside_a_tensordict": TensorDict({"s": LazyStackedTensorDict(a, b), "t": torch.arange(2)}, [2]),
        "empty_member": LazyStackedTensorDict(a, TensorDict({}, [])),
    }


@pytest.mark.parametrize("name", list(_stacks()))
def test_heterogeneous_lazy_stacks_round_trip_with_their_members_keys_and_stack_dim(tmp_path, name):
    td = _stacks()[name]
    s = Store(tmp_path / "s", create=True)
    s.commit(td, tag="t")
    assert _describe(s.checkout("t")) == _describe(td)
    assert _describe(s.checkout("t", into=TensorDict({}, td.batch_size))) == _describe(td)
    s.commit({"rb": {"td": td}}, tag="nested")  # a component of a dict of objects
    assert _describe(s.checkout("nested", into={"rb": {"td": None}})["rb"]["td"]) == _describe(td)


def _bits(td):
    """``td``'s structure and every leaf's dtype, shape and bytes (lazy stacks member by member)."""
    from tensordict import is_tensor_collection

    if isinstance(td, LazyStackedTensorDict):
        return ("lazy", td.stack_dim, list(td.batch_size), [_bits(m) for m in td.tensordicts])
    return (type(td).__name__, list(td.batch_size), sorted(
        (k, _bits(v) if is_tensor_collection(v) else (v.dtype, tuple(v.shape), raw_bytes(v))) for k, v in td.items()))


def test_tensordict_state_version_3_reads_version_2_and_refuses_newer(tmp_path):
    """Version 3 added meta ``lazy``. Version-2 records (without it, and those written with it
    before the version was bumped) check out bit-exactly; a version-4 record is refused."""
    from ckptstore.errors import AdapterVersionError

    plain = TensorDict({"x": torch.randn(4, 3, generator=torch.Generator().manual_seed(0)), "n": {"q": torch.arange(4)}}, [4])
    lazy = _stacks()["inside_a_tensordict"]
    s = Store(tmp_path / "s", create=True)
    s.commit({"plain": plain, "lazy": lazy}, tag="now")
    assert {p: c["version"] for p, c in s.show("now")["components"].items()} == {"plain": 3, "lazy": 3}
    commit_edited(s, {"plain": plain, "lazy": lazy}, "v2", version={"plain": 2, "lazy": 2})
    assert {p: c["version"] for p, c in s.show("v2")["components"].items()} == {"plain": 2, "lazy": 2}
    back = s.checkout("v2")
    assert _bits(back["plain"]) == _bits(plain) and _bits(back["lazy"]) == _bits(lazy)
    into = s.checkout("v2", into={"plain": TensorDict({}, [4]), "lazy": TensorDict({}, [2])})
    assert _bits(into["plain"]) == _bits(plain) and _bits(into["lazy"]) == _bits(lazy)
    commit_edited(s, {"plain": plain}, "v4", version={"plain": 4})
    with pytest.raises(AdapterVersionError, match=r"plain: stored by tensordict version 4, this ckptstore has version 3; upgrade"):
        s.checkout("v4")


# --- nested tensors -----------------------------------------------------------------------------


def _nested():
    values = torch.randn(9, 4, generator=torch.Generator().manual_seed(3))
    return {
        "jagged": torch.nested.nested_tensor([torch.arange(3.0), torch.arange(5.0) * 2, torch.zeros(0)], layout=torch.jagged),
        "jagged_2d": torch.nested.nested_tensor_from_jagged(values, torch.tensor([0, 2, 2, 9])),
        "jagged_lengths": torch.nested.nested_tensor_from_jagged(values, torch.tensor([0, 3, 6]), lengths=torch.tensor([2, 1])),
        "strided": torch.nested.nested_tensor([torch.ones(2, 3, dtype=torch.float64), torch.arange(12.0, dtype=torch.float64).reshape(4, 3)]),
        "int": torch.nested.nested_tensor([torch.arange(4), torch.arange(1)], layout=torch.jagged),
    }


def _parts(t):
    if t.layout == torch.jagged:
        return ("jagged", t._ragged_idx, t.values(), t.offsets(), t.lengths())
    return ("strided", [x for x in t.unbind()])


def _assert_same_nested(a, b):
    assert a.is_nested and a.layout == b.layout and a.dtype == b.dtype
    pa, pb = _parts(a), _parts(b)
    assert pa[0] == pb[0]
    flat_a = [x for p in pa[1:] for x in (p if isinstance(p, list) else [p])]
    flat_b = [x for p in pb[1:] for x in (p if isinstance(p, list) else [p])]
    assert len(flat_a) == len(flat_b)
    for x, y in zip(flat_a, flat_b):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            assert_bit_equal(x, y)
        else:
            assert x == y


def test_nested_tensors_store_values_and_offsets_and_rebuild_bit_exactly(tmp_path):
    nts = _nested()
    s = Store(tmp_path / "s", create=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s.commit({"d": nts, "td": TensorDict({"nt": nts["jagged"]}, [])}, tag="t")
        paths = {r.path: (r.dtype, r.shape) for r in s.manifest("t")}
        assert paths["d/jagged/values"] == ("float32", (8,)) and paths["d/jagged/offsets"] == ("int64", (4,))
        assert paths["d/jagged_lengths/lengths"] == ("int64", (2,)) and paths["d/strided/sizes"] == ("int64", (2, 2))
        out = s.checkout("t", into={"d": {}, "td": TensorDict({}, [])})
        for name, nt in nts.items():
            _assert_same_nested(out["d"][name], nt)
        _assert_same_nested(out["td"]["nt"], nts["jagged"])
        plain = s.checkout("t", partial=["d/strided"])
        _assert_same_nested(plain["d", "strided"], nts["strided"])
        _assert_same_nested(s.checkout("t", into={"d": {}}, partial=["d"])["d"]["jagged_2d"], nts["jagged_2d"])


# --- torchrl.checkpoint before use_store --------------------------------------------------------


def test_checkpoints_saved_before_use_store_still_load_through_torchrls_own_adapters(tmp_path):
    from torchrl.checkpoint import Checkpoint
    from torchrl.data import LazyTensorStorage, ReplayBuffer

    from ckptstore.torchrl_checkpoint import use_store

    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(net.parameters())
    rb = ReplayBuffer(storage=LazyTensorStorage(10))
    rb.extend(TensorDict({"x": torch.arange(6.0).reshape(6, 1)}, [6]))
    net(torch.ones(1, 3)).sum().backward()
    opt.step()
    Checkpoint(policy=net, optimizer=opt, replay_buffer=rb, step=5).save(tmp_path / "old")  # before the line was added

    net2 = torch.nn.Linear(3, 2)
    opt2 = torch.optim.Adam(net2.parameters())
    rb2 = ReplayBuffer(storage=LazyTensorStorage(10))
    ckpt = use_store(Checkpoint(policy=net2, optimizer=opt2, replay_buffer=rb2, step=0), Store(tmp_path / "store", create=True))
    result = ckpt.load(tmp_path / "old")
    assert result.loaded == {"policy", "optimizer", "replay_buffer", "step"} and result.values == {"step": 5} and not result.incompatible
    assert_bit_equal(net2.weight, net.weight)
    assert_bit_equal(opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert_bit_equal(rb2[:]["x"], rb[:]["x"])
    ckpt.save(tmp_path / "new")  # the next save goes to the store
    adapters = {n: r["adapter"] for n, r in Checkpoint.manifest(tmp_path / "new")["components"].items()}
    assert adapters == {"policy": "ckptstore.store", "optimizer": "ckptstore.store", "replay_buffer": "ckptstore.store", "step": "torchrl.json"}
    net3 = torch.nn.Linear(3, 2)
    assert use_store(Checkpoint(policy=net3), Store(tmp_path / "store")).load(tmp_path / "new", components=["policy"]).loaded == {"policy"}
    assert_bit_equal(net3.weight, net.weight)


# --- every TorchRL storage, sampler and writer ----------------------------------------------------

CAP = 16


def _rows(start: int, n: int = 12) -> TensorDict:
    i = torch.arange(start, start + n)
    traj = i // 3
    return TensorDict({"obs": i[:, None].float().expand(n, 3).clone(), "traj": traj, "query": traj % 2,
                       "policy_version": torch.zeros(n, dtype=torch.long), "r": (i * 7 % 5).float(),
                       "next": {"done": (i % 3 == 2)[:, None], "reward": i[:, None].float()}}, [n])


def _buffer(storage=None, sampler=None, writer=None):
    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

    kw = {"storage": storage if storage is not None else LazyTensorStorage(CAP), "batch_size": 4}
    kw.update({k: v for k, v in (("sampler", sampler), ("writer", writer)) if v is not None})
    return TensorDictReplayBuffer(**kw)


def _supported():
    import torchrl.data.replay_buffers as r

    return {
        "TensorStorage": lambda: _buffer(r.TensorStorage(_rows(0, CAP).zero_())),
        "LazyTensorStorage": lambda: _buffer(r.LazyTensorStorage(CAP)),
        "LazyMemmapStorage": lambda: _buffer(r.LazyMemmapStorage(CAP)),
        "ListStorage": lambda: _buffer(r.ListStorage(CAP)),
        "LazyStackStorage": lambda: _buffer(r.LazyStackStorage(CAP)),
        "CompressedListStorage": lambda: _buffer(r.CompressedListStorage(CAP)),
        "RandomSampler": lambda: _buffer(sampler=r.RandomSampler()),
        "SamplerWithoutReplacement": lambda: _buffer(sampler=r.SamplerWithoutReplacement()),
        "PrioritizedSampler": lambda: _buffer(sampler=r.PrioritizedSampler(CAP, alpha=0.7, beta=0.5)),
        "SliceSampler": lambda: _buffer(sampler=r.SliceSampler(num_slices=2, traj_key="traj")),
        "SliceSamplerWithoutReplacement": lambda: _buffer(sampler=r.SliceSamplerWithoutReplacement(num_slices=2, traj_key="traj")),
        "PrioritizedSliceSampler": lambda: _buffer(sampler=r.PrioritizedSliceSampler(CAP, alpha=0.7, beta=0.5, num_slices=2, traj_key="traj")),
        "StreamingSliceSampler": lambda: _buffer(sampler=r.StreamingSliceSampler(slice_len=2, traj_key="traj")),
        "ConsumingSampler": lambda: _buffer(sampler=r.ConsumingSampler(2)),
        "PromptGroupSampler": lambda: _buffer(sampler=r.PromptGroupSampler(num_groups=2, group_key="query")),
        "StalenessAwareSampler": lambda: _buffer(sampler=r.StalenessAwareSampler()),
        "RoundRobinWriter": lambda: _buffer(writer=r.RoundRobinWriter()),
        "TensorDictRoundRobinWriter": lambda: _buffer(writer=r.TensorDictRoundRobinWriter()),
        "TensorDictMaxValueWriter": lambda: _buffer(writer=r.TensorDictMaxValueWriter(rank_key="r")),
        "ImmutableDatasetWriter": lambda: _buffer(r.TensorStorage(_rows(0, CAP)), writer=r.ImmutableDatasetWriter()),
    }


def _refused():
    import torchrl.data.replay_buffers as r

    return {
        "StorageEnsemble": (lambda: r.StorageEnsemble(r.LazyTensorStorage(3), r.LazyTensorStorage(3)), "an ensemble of storages"),
        "StoreStorage": (lambda: r.StoreStorage.__new__(r.StoreStorage), "its items live in an external key-value server"),  # needs a Redis server to build
        "SamplerEnsemble": (lambda: r.SamplerEnsemble(r.RandomSampler(), r.RandomSampler()), "an ensemble of samplers"),
        "WriterEnsemble": (lambda: r.WriterEnsemble(r.RoundRobinWriter()), "an ensemble of writers"),
        "Storage": (lambda: r.Storage(4), "the base class, with no state of its own"),
    }


def _exported_parts() -> dict[str, type]:
    import inspect

    import torchrl.data as d
    import torchrl.data.replay_buffers as r

    bases = (r.Storage, r.Sampler, r.Writer)
    return {n: c for m in (d, r) for n in dir(m) if inspect.isclass(c := getattr(m, n)) and issubclass(c, bases)
            and not inspect.isabstract(c)}


def test_every_exported_torchrl_storage_sampler_and_writer_is_covered_and_listed_in_the_docs():
    exported = _exported_parts()
    assert set(exported) == set(_supported()) | set(_refused()), sorted(set(exported) ^ (set(_supported()) | set(_refused())))
    table = {}
    for line in (paths.DOCS / "adapters.md").read_text().splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0] in exported:
            table[cells[0]] = cells[2]
    assert {n: s.split()[0] for n, s in table.items()} == {**dict.fromkeys(_supported(), "supported"), **dict.fromkeys(_refused(), "refused")}


def _draw(rb) -> list:
    torch.manual_seed(5)
    np.random.seed(5)
    return [rb.sample() for _ in range(2)]


def _assert_same_samples(a: list, b: list) -> None:
    for x, y in zip(a, b, strict=True):
        assert set(x.keys(True, True)) == set(y.keys(True, True))
        for k in x.keys(True, True):
            assert_bit_equal(x[k], y[k])


@pytest.mark.parametrize("name", list(_supported()))
def test_every_supported_torchrl_part_round_trips_and_continues_bit_identically(tmp_path, name):
    from torchrl.data.replay_buffers import ImmutableDatasetWriter

    make = _supported()[name]
    s = Store(tmp_path / "s", create=True)
    rb = make()
    grows = not isinstance(rb._writer, ImmutableDatasetWriter)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if grows:
            rb.extend(_rows(0))
            rb.extend(_rows(12))  # 24 rows into 16 slots: wraps around
        _draw(rb)  # advances the samplers that keep state
        s.commit(rb, tag="t")
        again = make()
        s.checkout("t", into=again)
        _assert_same_samples(_draw(rb), _draw(again))
        if grows:
            rb.extend(_rows(100))
            again.extend(_rows(100))
        _assert_same_samples(_draw(rb), _draw(again))
    assert len(rb) == len(again)


@pytest.mark.parametrize("name", list(_refused()))
def test_unsupported_torchrl_parts_are_refused_saying_what_they_are_and_what_is_supported(tmp_path, name):
    from torchrl.data.replay_buffers import Sampler, Storage

    make, why = _refused()[name]
    s = Store(tmp_path / "s", create=True)
    obj = make()
    kind = "storage" if isinstance(obj, Storage) else "sampler" if isinstance(obj, Sampler) else "writer"
    with pytest.raises(UnsupportedTypeError) as info:
        s.commit({"rb": {"part": obj}}, tag="t")
    message = str(info.value)
    assert message.startswith(f"rb/part: a {type(obj).__module__}.{type(obj).__qualname__} (a TorchRL {kind}) cannot be stored: {why}")
    assert {"storage": "CompressedListStorage, ListStorage, TensorStorage (docs/adapters.md)",
            "sampler": "PrioritizedSampler, ", "writer": "ImmutableDatasetWriter, RoundRobinWriter, TensorDictMaxValueWriter (docs"}[kind] in message
    assert s.tags() == {}


def test_a_nested_tensor_checked_out_in_part_comes_back_as_its_parts(tmp_path):
    nt = _nested()["jagged_lengths"]
    s = Store(tmp_path / "s", create=True)
    s.commit({"d": {"nt": nt}}, tag="t")
    part = s.checkout("t", partial=["d/nt/values", "d/nt/offsets"])  # without lengths: not the nested tensor
    assert sorted(part["d", "nt"].keys()) == ["offsets", "values"]
    assert_bit_equal(part["d", "nt", "values"], nt.values())


# --- tensorclasses and pytree-backed storages (the peers' own tests, issue 24) ----------------


def _tensorclasses():
    from tensordict import tensorclass

    @tensorclass
    class Sample:
        obs: torch.Tensor
        inner: TensorDict
        count: int
        label: str
        extra: dict

    @tensorclass
    class Other:
        obs: torch.Tensor

    return Sample, Other


def test_a_tensorclass_commits_and_restores_into_its_class_or_as_a_tensordict(tmp_path):
    Sample, Other = _tensorclasses()
    data = Sample(obs=torch.arange(6.0).reshape(2, 3), inner=TensorDict({"y": torch.arange(4)}, [4]), count=3, label="a string",
                  extra={"k": [1, "v"]}, batch_size=[])
    s = Store(tmp_path / "s", create=True)
    s.commit(data, tag="t")
    kinds = {r.path: r.kind for r in s.manifest("t")}
    assert kinds == {"obs": "tensor", "inner/y": "tensor", "count": "tensor", "label": "json", "extra": "json"}
    target = Sample(obs=torch.zeros(2, 3), inner=TensorDict({"y": torch.zeros(4, dtype=torch.int64)}, [4]), count=0, label="", extra={},
                    batch_size=[])
    obs = target.obs
    out = s.checkout("t", into=target)
    assert out is target and out.obs is obs and (out == data).all()
    assert out.label == "a string" and out.extra == {"k": [1, "v"]} and out.count == 3 and out.inner.batch_size == (4,)
    plain = s.checkout("t")  # no target: a TensorDict of the fields, the class is never imported
    assert type(plain) is TensorDict and plain["label"] == "a string" and plain["inner"].batch_size == (4,)
    assert_bit_equal(plain["obs"], data.obs)
    with pytest.raises(ckptstore.errors.TargetMismatchError, match="stored a .*Sample, target is a .*Other"):
        s.checkout("t", into=Other(obs=torch.zeros(2, 3), batch_size=[]))
    s.commit({"sample": data, "step": 1}, tag="d")  # inside a dict: a component of its own
    inside = s.checkout("d")
    assert type(inside["sample"]) is TensorDict and inside["sample", "label"] == "a string" and inside["sample", "inner"].batch_size == (4,)


@pytest.mark.parametrize("storage_cls", ["LazyTensorStorage", "LazyMemmapStorage"])
@pytest.mark.parametrize("initialized", [True, False])
def test_a_pytree_backed_storage_round_trips_its_structure_and_rows(tmp_path, storage_cls, initialized):
    import torchrl.data
    from torch.utils._pytree import tree_flatten, tree_map

    cls = getattr(torchrl.data, storage_cls)
    data = {"a": torch.arange(3), "b": {"c": [torch.ones(3), (-torch.arange(6.0).reshape(3, 2),)]}, 30: -torch.ones(3, 1)}
    source = cls(max_size=10)
    source.set(range(3), data)
    s = Store(tmp_path / "s", create=True)
    s.commit(source, tag="t")
    target = cls(max_size=10)
    if initialized:
        target.set(range(3), tree_map(lambda x: torch.zeros_like(x), data))
    s.checkout("t", into=target)
    assert len(target) == 3 and list(target._storage) == ["a", "b", 30] and type(target._storage["b"]["c"][1]) is tuple
    got, spec = tree_flatten(target[:])
    want, want_spec = tree_flatten(source[:])
    assert spec == want_spec
    for g, w in zip(got, want, strict=True):
        assert_bit_equal(g, w)
    other = cls(max_size=10)
    other.set(range(3), {"a": torch.zeros(3, dtype=torch.int64)})
    with pytest.raises(ckptstore.errors.TargetMismatchError, match="pytree structure differs"):
        s.checkout("t", into=other)


def test_a_pytree_storage_holding_something_else_is_refused_naming_it(tmp_path):
    from torchrl.data import LazyTensorStorage

    storage = LazyTensorStorage(4)
    storage.set(range(2), {"a": torch.ones(2)})
    storage._storage["a"] = {1.5: storage._storage["a"]}  # a float key
    with pytest.raises(UnsupportedTypeError, match=r"storage/data/a: a pytree-backed storage holding a builtins.dict; supported"):
        Store(tmp_path / "s", create=True).commit(storage, tag="t")


@pytest.mark.parametrize("initialized", [True, False])
def test_a_tensorclass_storage_keeps_its_str_field_row_by_row(tmp_path, initialized):
    from tensordict import NonTensorStack
    from torchrl.data import LazyMemmapStorage

    Sample, _ = _tensorclasses()

    def sample(n, fill):
        return Sample(obs=torch.full((n, 3), fill), inner=TensorDict({"y": torch.full((n,), int(fill))}, [n]),
                      count=torch.full((n,), int(fill)), label="text", extra={"k": 1}, batch_size=[n])
    source = LazyMemmapStorage(max_size=8)
    source.set(range(3), sample(3, 1.0))
    source._storage._tensordict.set_at_("label", NonTensorStack.from_list(["x", "y", "z"]), slice(0, 3))
    s = Store(tmp_path / "s", create=True)
    s.commit(source, tag="t")
    assert {r.path: r.kind for r in s.manifest("t") if r.path.startswith("data/")} == {
        "data/obs": "tensor", "data/inner/y": "tensor", "data/count": "tensor", "data/label": "json", "data/extra": "json"}
    target = LazyMemmapStorage(max_size=8)
    if initialized:
        target.set(range(3), sample(3, 0.0))
    s.checkout("t", into=target)
    fields = target._storage._tensordict if initialized else target._storage
    assert type(target._storage) is (Sample if initialized else TensorDict)  # never written: no class to rebuild, a TensorDict
    assert fields.get("label")[:3].tolist() == ["x", "y", "z"] and (target[:3] == source[:3]).all()
