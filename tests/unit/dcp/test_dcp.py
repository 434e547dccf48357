"""torch.distributed.checkpoint through ckptstore (ckptstore.dcp): real gloo process
groups on the CPU (ranks forked from a forkserver that has this module preloaded,
rendezvous through a FileStore in tmp_path, hard timeouts), real SIGKILLs, exact
values and exact blob counts."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
import traceback
import uuid
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import ckptstore
from ckptstore import Store
from ckptstore.dcp import StoreReader, StoreWriter, item_path
from ckptstore.errors import (
    IntegrityError,
    InvalidArgumentError,
    InvalidNameError,
    RefNotFoundError,
    TargetMismatchError,
    UnsupportedTypeError,
)
from ckptstore.layout import DEFAULT_SHARD_BYTES
from ckptstore.objects.records import LeafRecord

from tests.conftest import assert_bit_equal

pytestmark = pytest.mark.timeout(120)

ROWS = 4096  # 4096 x 64 float32 = 1 MiB: 4 shards of 1024 rows (256 KiB) each


# --- a real process group: forked ranks, results as JSON ---------------------------------------


def _write_result(out: Path, result: dict) -> None:
    """Atomically: the harness SIGKILLs the other ranks when one fails, maybe mid-write."""
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, out)


def _entry(rank: int, world: int, fn, args: tuple, root: str) -> None:
    out = Path(root) / f"rank{rank}.json"
    try:
        warnings.simplefilter("ignore")
        dist.init_process_group("gloo", init_method=f"file://{root}/rendezvous", rank=rank, world_size=world, timeout=timedelta(seconds=30))
        result = fn(rank, world, *args)
        dist.barrier()
        dist.destroy_process_group()
        _write_result(out, {"ok": result})
    except BaseException:
        _write_result(out, {"error": traceback.format_exc()})
        os._exit(1)
    os._exit(0)


def run_ranks(world: int, fn, *args, timeout: float = 60, expect_ok: bool = True) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` forked ranks in one gloo group; return each
    rank's JSON result. A rank that dies or hangs ends the run: the others are SIGKILLed."""
    root = Path(os.environ["DCP_TEST_TMP"]) / f"pg-{uuid.uuid4().hex[:8]}"
    root.mkdir(parents=True)
    ctx = multiprocessing.get_context("forkserver")  # ranks fork from a clean single-threaded server, not from pytest
    ctx.set_forkserver_preload([__name__])
    procs = [ctx.Process(target=_entry, args=(r, world, fn, args, str(root)), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(p.is_alive() for p in procs):
        if any(p.exitcode not in (None, 0) for p in procs):  # one failed or was killed: the others would wait on it
            break
        time.sleep(0.02)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(10)
    results = [json.loads(f.read_text()) if (f := root / f"rank{r}.json").exists() else None for r in range(world)]
    if expect_ok:
        for r, (p, res) in enumerate(zip(procs, results)):
            assert p.exitcode == 0 and res and "ok" in res, f"rank {r} exit {p.exitcode}: {res and res.get('error')}"
        return [res["ok"] for res in results]
    return [(p.exitcode, res) for p, res in zip(procs, results)]


@pytest.fixture(autouse=True)
def _tmp_env(tmp_path, monkeypatch):
    monkeypatch.setenv("DCP_TEST_TMP", str(tmp_path))


def weights(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model.w": torch.randn(ROWS, 64, generator=g), "model.b": torch.randn(64, generator=g)}


def state_of(rank: int, seed: int = 0) -> dict:
    """One rank's state dict: replicated weights, a per-rank tensor, non-tensor values."""
    w = weights(seed)
    return {
        "model": {"w": w["model.w"], "b": w["model.b"]},
        "zeros": torch.zeros(1024, 64),  # the same bytes as "zeros2", which DCP does not plan as replicas
        "zeros2": torch.zeros(1024, 64),
        f"rank{rank}.counter": torch.full((3,), rank, dtype=torch.int64),
        "step": 7,
        "config": {"lr": 1e-3, "betas": (0.9, 0.999), "name": "adam", "nan": float("nan"), "none": None},
    }


def zeroed(rank: int) -> dict:
    return {
        "model": {"w": torch.zeros(ROWS, 64), "b": torch.zeros(64)},
        "zeros": torch.ones(1024, 64),
        "zeros2": torch.ones(1024, 64),
        f"rank{rank}.counter": torch.zeros(3, dtype=torch.int64),
        "step": 0,
        "config": {"lr": 0.0, "betas": None, "name": "", "nan": 0.0, "none": 1},
    }


def _save_edit_load(rank: int, world: int, store: str) -> dict:
    out = {}
    sd = state_of(rank)
    w = StoreWriter(store, tag="step-1", message="first", metadata={"step": 1})
    dcp.save(sd, storage_writer=w)
    out["first"] = None if w.commit_info is None else w.commit_info.id
    out["info1"] = None if w.commit_info is None else [w.commit_info.logical_bytes, w.commit_info.new_bytes, w.commit_info.shards_total, w.commit_info.shards_new]
    sd["model"]["w"][:40] += 1  # 40 of 4096 rows (1 %), all in the first 1024-row shard
    w = StoreWriter(store, tag="step-1")  # the same tag: its commit is the parent
    dcp.save(sd, storage_writer=w)
    out["info2"] = None if w.commit_info is None else [w.commit_info.new_bytes, w.commit_info.shards_new, list(w.commit_info.parents)]
    sd["model"]["w"][-40:] -= 1
    fut = dcp.async_save(sd, storage_writer=StoreWriter(store, tag="step-3"))  # another tag: dedup against the newest DCP commit
    fut.result()
    target = zeroed(rank)
    reader = StoreReader(store, "step-3")
    dcp.load(target, storage_reader=reader)
    assert torch.equal(target["model"]["w"], sd["model"]["w"]) and target["model"]["w"].view(torch.int32).equal(sd["model"]["w"].view(torch.int32))
    assert torch.equal(target["model"]["b"], sd["model"]["b"])
    assert torch.equal(target["zeros"], sd["zeros"]) and torch.equal(target["zeros2"], sd["zeros2"])
    assert torch.equal(target[f"rank{rank}.counter"], torch.full((3,), rank, dtype=torch.int64))
    cfg = target["config"]
    assert target["step"] == 7 and type(target["step"]) is int
    assert cfg["betas"] == (0.9, 0.999) and type(cfg["betas"]) is tuple and cfg["lr"] == 1e-3 and cfg["name"] == "adam"
    assert cfg["nan"] != cfg["nan"] and cfg["none"] is None
    out["blobs_read"] = [reader.blobs_read, reader.blobs_received]
    return out


def _resave_untracked(rank: int, world: int, store: str) -> list:
    sd = state_of(rank)
    infos = []
    for step, edit in enumerate([None, None, "data", "numpy"]):
        if edit == "data":
            sd["model"]["w"].data.mul_(2)  # every row, without a version bump: the reuse sample catches it
        elif edit == "numpy":
            sd["model"]["w"].numpy()[:, :] += 1
        w = StoreWriter(store, tag="t")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dcp.save(sd, storage_writer=w)
        stale = sum("changed without torch counting a write" in str(c.message) for c in caught)
        infos.append([step, stale, None if w.commit_info is None else w.commit_info.new_bytes])
        target = zeroed(rank)
        dcp.load(target, storage_reader=StoreReader(store, "t"))
        assert target["model"]["w"].view(torch.int32).equal(sd["model"]["w"].view(torch.int32))
    return infos


def test_resaves_reuse_hashes_and_catch_writes_torch_does_not_count(tmp_path):
    r0, r1 = run_ranks(2, _resave_untracked, str(tmp_path / "store"))
    w_bytes = ROWS * 64 * 4
    assert [i[2] for i in r0] == [ROWS * 64 * 4 + 64 * 4 + 1024 * 64 * 4 + 2 * 3 * 8, 0, w_bytes, w_bytes]
    # the rank that writes model.w (DCP plans a replicated item on one rank) warned for each untracked write
    assert [a[1] + b[1] for a, b in zip(r0, r1)] == [0, 0, 1, 1]


def test_save_resave_async_and_load_on_two_ranks(tmp_path, monkeypatch, capsys):
    store_path = str(tmp_path / "store")
    r0, r1 = run_ranks(2, _save_edit_load, store_path)
    assert r1["first"] is None and r1["info1"] is None  # only the coordinator commits
    s = Store(store_path)
    # w: 4 shards (1 MiB), b: 1, zeros/zeros2: 1 each, but the same address; counters: 1 each
    logical = ROWS * 64 * 4 + 64 * 4 + 2 * 1024 * 64 * 4 + 2 * 3 * 8
    assert r0["info1"] == [logical, ROWS * 64 * 4 + 64 * 4 + 1024 * 64 * 4 + 2 * 3 * 8, 9, 8]
    # the re-save after 1 %: one shard of w (256 KiB) is new; parent is the first commit
    assert r0["info2"] == [DEFAULT_SHARD_BYTES, 1, [r0["first"]]]
    step3 = s.info("step-3")
    assert step3.parents == () and (step3.shards_new, step3.new_bytes) == (1, DEFAULT_SHARD_BYTES)
    # each rank read only its plan's blobs, and each replicated one (w's 4, b, the one zeros shard
    # of zeros and zeros2) on one rank only, which sent it to the other: w's first 3 shards on
    # rank 0, the last, b and zeros on rank 1; and its own counter
    assert r0["blobs_read"] == r1["blobs_read"] == [3 + 1, 3]
    assert len(s.log()) == 3 and set(s.tags()) == {"step-1", "step-3"}
    assert [c.id for c in s.log("step-1")] == [s.resolve("step-1"), r0["first"]]
    # an ordinary commit: checkout keyed by the fqns exactly, partial of one fqn, show, diff, fsck, export
    td = s.checkout("step-3")
    assert sorted(td.keys()) == sorted(["model.w", "model.b", "zeros", "zeros2", "rank0.counter", "rank1.counter", "step", "config.lr",
                                        "config.betas", "config.name", "config.nan", "config.none"])
    expected = weights()["model.w"]
    expected[:40] += 1
    expected[-40:] -= 1
    assert_bit_equal(td["model.w"], expected)
    assert td["config.betas"] == (0.9, 0.999) and td["step"] == 7
    before = s.io.blobs_read
    one = s.checkout("step-3", partial=["model.w"])
    assert list(one.keys()) == ["model.w"] and s.io.blobs_read - before == 4
    shown = {leaf["path"]: leaf for leaf in s.show("step-1")["leaves"]}
    assert shown["model.w"]["shards"] == 4 and shown["model.w"]["shared_with_parent"] == 3
    ranks = s.components("step-1")[""]["meta"]["items"]
    assert ranks["rank1.counter"]["chunks"][0][3] == 1 and ranks["rank0.counter"]["chunks"][0][3] == 0
    diff = s.diff("step-1", "step-3")
    assert [(d.path, d.shards_changed) for d in diff.leaves if d.status != "unchanged"] == [("model.w", 1)]
    assert diff.new_bytes == DEFAULT_SHARD_BYTES
    assert s.fsck(deep=True).ok
    exported = s.export("step-3", tmp_path / "out.zip")
    other = Store(tmp_path / "other", create=True)
    assert other.import_from(exported, tag="x").id == s.resolve("step-3")
    assert_bit_equal(other.checkout("x")["model.w"], expected)
    with pytest.raises(TargetMismatchError, match="stored by dcp"):
        s.checkout("step-3", into={"model.w": torch.zeros(1)})
    # `ckptstore show`: per item (the leaves) and per rank
    from rich.console import Console

    from ckptstore.cli import common as cli_module

    monkeypatch.setattr("sys.argv", ["ckptstore", "show", "step-3", "--store", store_path])
    monkeypatch.setattr(cli_module, "console", Console(width=300, highlight=False))
    with pytest.raises(SystemExit) as done:
        cli_module.main()
    assert done.value.code in (0, None)
    out = capsys.readouterr().out
    assert "written by rank" in out and "model.w" in out and "rank1.counter" in out
    per_rank = {}
    for meta in s.components("step-3")[""]["meta"]["items"].values():
        for rank in [meta["rank"]] if "bytes" in meta else [c[3] for c in meta["chunks"]]:
            per_rank[rank] = per_rank.get(rank, 0) + 1
    assert sorted(per_rank) == [0, 1] and sum(per_rank.values()) == 12


def test_single_process_save_refuses_non_json_and_changes_nothing(tmp_path):
    path = tmp_path / "store"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointException, match=r"opt\.hook: values of type builtins\.set cannot be stored without pickle"):
            dcp.save({"w": torch.ones(3), "opt": {"hook": {1, 2}}}, storage_writer=StoreWriter(path, tag="t"))
        s = Store(path)
        assert s.tags() == {} and s.log() == [] and not list((path / "blobs").rglob("*.pack"))
        w = StoreWriter(s, tag="t", metadata={"run": "a"})
        dcp.save({"w": torch.arange(6.0), "e": Ellipsis, "s": slice(1, None, 2), "k": ({1: "int key"},)}, storage_writer=w)
        target = {"w": torch.zeros(6), "e": None, "s": None, "k": None}
        dcp.load(target, storage_reader=StoreReader(s, w.commit_info.id[:8]))
    assert target["e"] is Ellipsis and target["s"] == slice(1, None, 2) and target["k"] == ({1: "int key"},)
    assert torch.equal(target["w"], torch.arange(6.0)) and s.info("t").metadata == {"run": "a"}


def test_bad_arguments_raise_clear_errors(tmp_path):
    with pytest.raises(InvalidNameError):
        StoreWriter(tmp_path / "s", tag="bad\ntag")
    with pytest.raises(UnsupportedTypeError, match="metadata"):
        StoreWriter(tmp_path / "s", tag="t", metadata={"x": object()})
    with pytest.raises(InvalidArgumentError):
        StoreWriter(42, tag="t")
    s = Store(tmp_path / "s", create=True)
    with pytest.raises(RefNotFoundError):
        StoreReader(s, "nope")
    s.commit({"w": torch.ones(2)}, tag="plain")
    with pytest.raises(InvalidArgumentError, match="was not made by torch.distributed.checkpoint"):
        StoreReader(s, "plain")


def test_crafted_store_is_refused_or_read_as_data_never_unpickled(tmp_path):
    """A crafted commit (valid record, hostile content): metadata that disagrees with the
    leaves is an IntegrityError; a JSON leaf holding pickle bytes is loaded as that text."""
    import pickle

    s = Store(tmp_path / "s", create=True)
    payload = pickle.dumps(os.system).decode("latin-1")  # a pickle that would call os.system if unpickled

    def craft(meta_items: dict, leaves: list[LeafRecord], tag: str) -> None:
        from ckptstore.adapters.base import Captured

        comp = Captured("", "dcp", 1, {"dcp": 1, "items": meta_items, "planner_data": None, "version": None}, {})
        s.commit_manifest([comp], leaves, [], None, [tag], "", {}, None, time.perf_counter())

    from ckptstore.core import jsonvalue

    craft({"x": {"bytes": "x", "rank": 0}}, [LeafRecord("x", "", "json", None, None, 0, None, jsonvalue.dumps(payload))], "evil")
    target = {"x": None}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=StoreReader(s, "evil"))
    assert target["x"] == payload
    chunk = {"dtype": "float32", "size": [4], "requires_grad": False, "memory_format": "contiguous_format", "pin_memory": False,
             "chunks": [[[0], [4], "y", 0]]}
    craft({"y": chunk}, [LeafRecord("y", "", "json", None, None, 0, None, jsonvalue.dumps(1))], "liar")
    with pytest.raises(IntegrityError, match="leaf 'y' is missing or differs"):
        StoreReader(s, "liar")
    craft({"y": {**chunk, "dtype": "pickle"}}, [], "bad-dtype")
    with pytest.raises(IntegrityError, match="dtype"):
        StoreReader(s, "bad-dtype")


# --- resharding: 4 ranks save, 2 and 1 load ----------------------------------------------------


def _global(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(13, 6, generator=g), torch.randn(8, 4, generator=g)


def _save_sharded(rank: int, world: int, store: str) -> list | None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    a, b = _global()
    sd = {"a": distribute_tensor(a, mesh, [Shard(0)]), "b": distribute_tensor(b, mesh, [Shard(1)]), "plain": b.clone(), "epoch": 3,
          "tiny": distribute_tensor(torch.arange(2.0), mesh, [Shard(0)])}  # 2 rows on 4 ranks: ranks 2 and 3 hold empty chunks
    w = StoreWriter(store, tag="sharded")
    dcp.save(sd, storage_writer=w)
    return None if w.commit_info is None else [w.commit_info.id, w.commit_info.new_bytes, w.commit_info.shards_new]


def _load_sharded(rank: int, world: int, store: str) -> int:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    a, b = _global()
    sd = {"a": distribute_tensor(torch.zeros(13, 6), mesh, [Shard(0)]), "b": distribute_tensor(torch.zeros(8, 4), mesh, [Shard(1)]),
          "plain": torch.zeros(8, 4), "epoch": 0, "tiny": distribute_tensor(torch.zeros(2), mesh, [Shard(0)])}
    reader = StoreReader(store, "sharded")
    dcp.load(sd, storage_reader=reader)
    assert torch.equal(sd["a"].full_tensor(), a) and torch.equal(sd["b"].full_tensor(), b) and torch.equal(sd["plain"], b)
    assert sd["epoch"] == 3 and torch.equal(sd["tiny"].full_tensor(), torch.arange(2.0))
    return reader.blobs_read


def test_dtensor_saved_on_four_ranks_loads_on_two_and_one(tmp_path):
    store_path = str(tmp_path / "store")
    ids = run_ranks(4, _save_sharded, store_path)
    assert ids[0] is not None and ids[1:] == [None, None, None]
    s = Store(store_path)
    paths = [leaf.path for leaf in s.record("sharded").leaves]
    # a: rows 4+4+4+1 on ranks 0-3; b: one column each; plain: whole, saved once
    assert sorted(paths) == sorted(["a/0,0", "a/4,0", "a/8,0", "a/12,0", "b/0,0", "b/0,1", "b/0,2", "b/0,3", "plain", "epoch",
                                    "tiny/0", "tiny/1", "tiny/2"])  # ranks 2 and 3 both hold the empty chunk at offset 2: saved once
    assert item_path("a", (4, 0), whole=False) == "a/4,0"
    info = s.info("sharded")
    assert (info.logical_bytes, info.shards_total) == (13 * 6 * 4 + 2 * 8 * 4 * 4 + 2 * 4, 9 + 3)
    td = s.checkout("sharded", partial=["a"])
    a, _ = _global()
    assert_bit_equal(torch.cat([td["a", k] for k in ("0,0", "4,0", "8,0", "12,0")]), a)
    # two ranks: rank 0 needs rows 0-6 of a (2 chunks), columns 0-1 of b (2), plain (1), tiny row 0 (1);
    # rank 1 rows 7-12 of a (3), 2 columns of b, plain, tiny row 1; no rank reads the empty chunk;
    # the two small blobs both need (plain, and a's chunk of rows 4-7) are read by rank 0 (the first run)
    # and sent to rank 1: 11 in all
    assert run_ranks(2, _load_sharded, store_path) == [6, 5]
    assert run_ranks(1, _load_sharded, store_path) == [11]


# --- crashes: SIGKILL of a rank mid-save, of the coordinator before finish -----------------------


class _KillCoordinatorBeforeFinish(StoreWriter):
    def finish(self, metadata, results):
        os.kill(os.getpid(), signal.SIGKILL)


def _save_and_die(rank: int, world: int, store: str, kind: str) -> None:
    sd = {"w": torch.randn(2048, 64), f"r{rank}a": torch.randn(2048, 64), f"r{rank}b": torch.randn(512, 64)}
    if kind == "rank" and rank == 1:  # this forked rank only: SIGKILL after its first blob is in its (tmp) pack
        from ckptstore.objects.packs import PackWriter

        append, count = PackWriter.append, []

        def append_then_die(self, raw, digest=None):
            loc = append(self, raw, digest)
            count.append(loc)
            if len(count) == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            return loc

        PackWriter.append = append_then_die
    writer = StoreWriter if kind == "rank" else _KillCoordinatorBeforeFinish
    dcp.save(sd, storage_writer=writer(store, tag="crash"))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kind", ["rank", "coordinator"])
def test_sigkill_mid_save_leaves_no_commit_and_gc_cleans(tmp_path, kind, world):
    store_path = str(tmp_path / "store")
    s = Store(store_path, create=True)
    s.commit({"kept": torch.arange(10)}, tag="crash")
    before = s.resolve("crash")
    outcome = run_ranks(world, _save_and_die, store_path, kind, expect_ok=False)
    dead = 1 if kind == "rank" else 0
    assert outcome[dead][0] == -signal.SIGKILL
    assert s.resolve("crash") == before and len(s.log()) == 1 and [r["action"] for r in s.reflog()] == ["commit"]
    packs = list(Path(store_path, "blobs").rglob("*.pack"))
    assert len(packs) > 2  # the kept commit's blob and record packs, and the dead save's orphans
    report = s.gc(grace=0)
    assert report is not None
    left = sorted(p.name for p in Path(store_path, "blobs").rglob("*.pack"))
    fsck = s.fsck(deep=True)
    assert fsck.ok and fsck.orphan_packs == [] and fsck.tmp_files == 0
    assert len(left) == 1 and not list(Path(store_path, "tmp").iterdir())  # the kept commit's blob and record packs, consolidated
    assert_bit_equal(s.checkout("crash")["kept"], torch.arange(10))


# --- Checkpointer in DCP mode ----------------------------------------------------------------------


def _checkpointer_run(rank: int, world: int, store: str) -> list:
    torch.manual_seed(0)  # replicated, as under DDP: DCP saves one copy
    model = torch.nn.Linear(8, 4)
    ckpt = ckptstore.Checkpointer(store, {"model": model, "extra": {"seen": 5}}, every_n_steps=2, dcp=True, keep_last=1, on_signal=())
    assert ckpt.resume() is None
    infos = []
    for _ in range(4):
        with torch.no_grad():
            model.weight.add_(1.0)
        infos.append(ckpt.step())
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    fresh = torch.nn.Linear(8, 4)
    torch.nn.init.zeros_(fresh.weight)
    again = ckptstore.Checkpointer(store, {"model": fresh, "extra": {"seen": -1}}, every_n_steps=2, dcp=True, on_signal=())
    assert again.resume() == 4 and again.objects["extra"] == {"seen": 5}
    assert all(torch.equal(fresh.state_dict()[k], saved[k]) for k in saved)
    return [None if i is None else i.id for i in infos]


def test_checkpointer_dcp_mode_on_two_ranks(tmp_path):
    store_path = str(tmp_path / "store")
    r0, r1 = run_ranks(2, _checkpointer_run, store_path)
    assert r0[0] is None and r0[1] is not None and r0[2] is None and r0[3] is not None and r1 == [None] * 4
    s = Store(store_path)
    assert set(s.tags()) == {"latest", "step-4"} and s.resolve("latest") == r0[3]
    assert s.checkout("latest", partial=["checkpointer.step"])["checkpointer.step"] == 4


# --- multi-rank RL: each rank's own replay buffer, one checkpoint ----------------------------------


def _buffer(rank: int, fill: bool):
    """A prioritized buffer of 256 rows; ``fill=False``: the restore target, as full but with other data."""
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, TensorDictPrioritizedReplayBuffer

    rb = TensorDictPrioritizedReplayBuffer(alpha=0.6, beta=0.4, storage=LazyTensorStorage(256), batch_size=8)
    g = torch.Generator().manual_seed(100 + rank)
    n = 300 + 17 * rank if fill else 270  # past capacity: the writer wraps around (the target: other rows, other cursor)
    if not fill:
        g.manual_seed(999)
    rb.extend(TensorDict({"obs": torch.randn(n, 5, generator=g), "action": torch.randint(4, (n,), generator=g)}, [n]))
    if fill:
        rb.update_priority(torch.arange(0, 256, 3), torch.rand(86, generator=g) + 0.1)
    return rb


def _rl_ranks(rank: int, world: int, store: str) -> int:
    from ckptstore.adapters import capture
    from ckptstore.dcp import AdapterState

    torch.manual_seed(0)
    policy = torch.nn.Linear(5, 4)  # replicated learner weights
    rb = _buffer(rank, fill=True)
    w = StoreWriter(store, tag="rl")
    dcp.save({f"rb{rank}": AdapterState(rb), "policy": policy}, storage_writer=w)
    fresh, fresh_policy = _buffer(rank, fill=False), torch.nn.Linear(5, 4)
    dcp.load({f"rb{rank}": AdapterState(fresh), "policy": fresh_policy}, storage_reader=StoreReader(store, "rl"))
    want, got = capture(rb), capture(fresh)
    assert [(c.path, c.adapter) for c in want] == [(c.path, c.adapter) for c in got]
    for a, b in zip(want, got):
        assert a.leaves.keys() == b.leaves.keys()
        for k, v in a.leaves.items():
            if isinstance(v, torch.Tensor):
                assert_bit_equal(b.leaves[k], v)
            else:
                assert b.leaves[k] == v, (k, b.leaves[k], v)
    assert len(fresh) == len(rb) == 256 and torch.equal(fresh_policy.weight, policy.weight)
    import numpy as np

    torch.manual_seed(5), np.random.seed(5)
    s1 = rb.sample()
    torch.manual_seed(5), np.random.seed(5)
    s2 = fresh.sample()
    assert torch.equal(s1["index"], s2["index"]) and torch.equal(s1["obs"], s2["obs"])
    return len(rb)


def test_each_rank_restores_its_own_replay_buffer(tmp_path):
    store_path = str(tmp_path / "store")
    assert run_ranks(2, _rl_ranks, store_path) == [256, 256]
    s = Store(store_path)
    comps = s.components("rl")
    assert list(comps) == [""] and comps[""]["adapter"] == "dcp"
    items = comps[""]["meta"]["items"]
    assert items["rb0.components"]["rank"] == 0 and items["rb1.components"]["rank"] == 1
    assert s.fsck(deep=True).ok


def test_benchmark_runs_side_by_side(tmp_path):
    """benchmarks.dcp at tiny sizes: both systems run on 2 ranks and every ratio is reported (timings are not checked)."""
    from benchmarks import dcp as bench

    out = tmp_path / "dcp.json"
    bench.main(["--ranks", "2", "--mib-per-rank", "1", "--saves", "2", "-r", "1", "--workdir", str(tmp_path), "-o", str(out)])
    (result,) = json.loads(out.read_text())["results"]
    assert result["ranks"] == 2 and set(result["ratios"]) == {"first_save", "resave", "load", "stored"}
    assert result["stored_bytes"]["logical_per_save"] == 2 * (1 << 20) + 64 * 256 * 4
