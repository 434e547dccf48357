"""torch.distributed.checkpoint to and from a store on object storage
(``StoreWriter("s3://…")``, ``StoreReader("s3://…")``) against the moto server: real gloo
process groups (tests/unit/dcp/test_dcp.py's harness), each rank with a cache folder of its own
(``XDG_CACHE_HOME``: no shared filesystem but the harness's rendezvous and result files),
real SIGKILLs, exact values and exact object counts on the bucket."""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptstore
from ckptstore import Store
from ckptstore.backends import open_backend
from ckptstore.home.bucket_cache import cache_folder
from ckptstore.objects.bucketformat import commit_key
from ckptstore.home.bucket_io import DetachedPackWriter
from ckptstore.dcp import StoreReader, StoreWriter
from ckptstore.layout import DEFAULT_SHARD_BYTES

from tests.conftest import assert_bit_equal
from tests.unit.dcp.test_dcp import (
    ROWS,
    _global,
    _KillCoordinatorBeforeFinish,
    _load_sharded,
    _save_sharded,
    run_ranks,
    state_of,
    weights,
    zeroed,
)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _tmp_env(tmp_path, monkeypatch):
    monkeypatch.setenv("DCP_TEST_TMP", str(tmp_path))


@pytest.fixture
def url(s3_server) -> str:
    return f"s3://ckpt/dcp-{uuid.uuid4().hex[:12]}"


def on_bucket(world: int, fn, *args, expect_ok: bool = True) -> list:
    """``run_ranks`` with the server's AWS_* environment and, per rank, a fresh cache folder
    of its own (the forkserver's environment predates the server's)."""
    env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    caches = str(Path(os.environ["DCP_TEST_TMP"]) / f"caches-{uuid.uuid4().hex[:8]}")
    return run_ranks(world, _with_env, env, caches, fn, *args, expect_ok=expect_ok)


def _with_env(rank: int, world: int, env: dict, caches: str, fn, *args):
    os.environ.update(env)
    os.environ["XDG_CACHE_HOME"] = f"{caches}/rank{rank}"
    return fn(rank, world, *args)


def keys(url: str) -> set[str]:
    """Every object and ref (``refs/<name>``) under the store's prefix."""
    with open_backend(url) as b:
        return {o.key for o in b.list()} | {f"refs/{r}" for r in b.list_refs()}


def kinds(new: set[str]) -> dict[str, int]:
    """How many of each kind of object ``new`` holds."""
    out: dict[str, int] = {}
    for k in new:
        kind = k.rsplit(".", 1)[1] if k.startswith("blobs/") else k.split("/", 1)[0]
        out[kind] = out.get(kind, 0) + 1
    return out


# --- save, unchanged re-save, edit, load: 2 and 4 ranks -------------------------------------------


def _save_resave_load(rank: int, world: int, url: str) -> dict:
    out: dict = {}
    sd = state_of(rank)
    w = StoreWriter(url, tag="step-1", message="first", metadata={"step": 1})
    dcp.save(sd, storage_writer=w)
    first = w.commit_info
    out["cache_after_save"] = cache_folder(url).exists()  # only the coordinator opens the store to save
    if rank == 0:
        out["first"] = [first.id, first.logical_bytes, first.new_bytes, first.shards_total, first.shards_new]
        out["keys1"] = sorted(keys(url))
    w = StoreWriter(url, tag="step-1")  # unchanged: every blob is on the bucket already
    dcp.save(sd, storage_writer=w)
    if rank == 0:
        out["second"] = [w.commit_info.id, w.commit_info.new_bytes, w.commit_info.shards_new, list(w.commit_info.parents)]
        out["keys2"] = sorted(keys(url))
    sd["model"]["w"][:40] += 1  # 40 of 4096 rows, all in the first 1024-row shard
    w = StoreWriter(url, tag="step-3")  # a new tag: dedup against the newest DCP commit in the coordinator's cache
    dcp.async_save(sd, storage_writer=w).result()
    if rank == 0:
        out["third"] = [w.commit_info.new_bytes, w.commit_info.shards_new, list(w.commit_info.parents)]
        out["keys3"] = sorted(keys(url))
    target = zeroed(rank)
    reader = StoreReader(url, "step-3")
    dcp.load(target, storage_reader=reader)
    for a, b in [(target["model"]["w"], sd["model"]["w"]), (target["model"]["b"], sd["model"]["b"]), (target["zeros"], sd["zeros"]),
                 (target["zeros2"], sd["zeros2"]), (target[f"rank{rank}.counter"], torch.full((3,), rank, dtype=torch.int64))]:
        assert_bit_equal(a, b)
    cfg = target["config"]
    assert target["step"] == 7 and type(target["step"]) is int and cfg["betas"] == (0.9, 0.999) and type(cfg["betas"]) is tuple
    assert cfg["lr"] == 1e-3 and cfg["name"] == "adam" and cfg["nan"] != cfg["nan"] and cfg["none"] is None
    out["read"] = [reader.blobs_read, reader.blobs_received]
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_save_resave_and_load_through_a_bucket(url, world):
    results = on_bucket(world, _save_resave_load, url)
    r0 = results[0]
    assert [r["cache_after_save"] for r in results] == [True] + [False] * (world - 1)
    w_bytes, counters = ROWS * 64 * 4, world * 3 * 8
    cid1, logical, new, total, shards_new = r0["first"]
    # w: 4 shards, b: 1, zeros and zeros2: 1 each of one address, a counter per rank
    assert [logical, new, total, shards_new] == [w_bytes + 64 * 4 + 2 * 1024 * 64 * 4 + counters,
                                                 w_bytes + 64 * 4 + 1024 * 64 * 4 + counters, 7 + world, 6 + world]
    # the first save made the store (marker and its copy), each rank uploaded one pack and its .idx, then record, ref, reflog
    assert kinds(set(r0["keys1"])) == {"ckptstore.json": 1, "marker": 1, "pack": world, "idx": world, "commits": 1, "refs": 1, "reflog": 1}
    # the unchanged re-save uploaded no blob: its record and reflog object, the ref moved in place
    cid2, new2, shards_new2, parents2 = r0["second"]
    assert (new2, shards_new2, parents2) == (0, 0, [cid1])
    added = set(r0["keys2"]) - set(r0["keys1"])
    assert kinds(added) == {"commits": 1, "reflog": 1} and commit_key(cid2) in added
    # 1 % of w's rows changed: one 256 KiB shard, one pack and its .idx from the rank that writes w
    assert r0["third"] == [DEFAULT_SHARD_BYTES, 1, []]
    assert kinds(set(r0["keys3"]) - set(r0["keys2"])) == {"pack": 1, "idx": 1, "commits": 1, "refs": 1, "reflog": 1}
    # each rank read only its plan's blobs: each of the replicated items' 6 (w's 4, b, the one
    # zeros shard) on one rank, in runs of about equal bytes, received by the others; and its own counter
    split = [3, 3] if world == 2 else [2, 1, 1, 2]
    assert [r["read"] for r in results] == [[n + 1, 6 - n] for n in split]
    s = Store(url)
    assert set(s.tags()) == {"step-1", "step-3"} and [c.id for c in s.log("step-1")] == [cid2, cid1]
    expected = weights()["model.w"]
    expected[:40] += 1
    td = s.checkout("step-3")
    assert_bit_equal(td["model.w"], expected)
    assert_bit_equal(td["rank1.counter"], torch.full((3,), 1, dtype=torch.int64))
    assert td["config.betas"] == (0.9, 0.999) and td["step"] == 7
    assert s.fsck(deep=True).ok
    s.close()


# --- resharding: 4 ranks save, 2 and 1 load; a re-save from fresh caches uploads nothing --------------


def test_dtensor_saved_on_four_ranks_to_a_bucket_loads_on_two_and_one(url):
    saved = on_bucket(4, _save_sharded, url)
    assert saved[0][0] is not None and saved[1:] == [None] * 3
    s = Store(url)
    assert sorted(leaf.path for leaf in s.record("sharded").leaves) == sorted(
        ["a/0,0", "a/4,0", "a/8,0", "a/12,0", "b/0,0", "b/0,1", "b/0,2", "b/0,3", "plain", "epoch", "tiny/0", "tiny/1", "tiny/2"])
    a, b = _global()
    td = s.checkout("sharded", partial=["a"])
    assert_bit_equal(torch.cat([td["a", k] for k in ("0,0", "4,0", "8,0", "12,0")]), a)
    # the blobs each rank needs, as locally: 6 and 7 on two ranks (plain's one read by one rank only), 11 on one
    assert on_bucket(2, _load_sharded, url) == [6, 5]
    assert on_bucket(1, _load_sharded, url) == [11]
    before = keys(url)
    again = on_bucket(4, _save_sharded, url)  # new processes, new caches: dedup comes from the bucket's index
    assert again[0][1:] == [0, 0] and again[0][0] != saved[0][0]
    added = keys(url) - before
    assert kinds(added) == {"commits": 1, "reflog": 1} and commit_key(again[0][0]) in added
    assert s.log("sharded")[0].id == again[0][0] and s.log("sharded")[0].parents == (saved[0][0],)
    s.close()


# --- crashes: SIGKILL of a rank after its upload, of the coordinator before finish -------------------


def _save_and_die(rank: int, world: int, url: str, kind: str, packs_before: int) -> None:
    sd = {"w": torch.randn(2048, 64), f"r{rank}a": torch.randn(2048, 64), f"r{rank}b": torch.randn(512, 64)}
    if kind == "rank" and rank == 1:  # SIGKILL once its pack is up and every other rank's too: the orphans are known
        finish = DetachedPackWriter.finish

        def finish_then_die(self):
            finish(self)
            deadline = time.monotonic() + 20
            while sum(k.endswith(".pack") for k in keys(url)) < packs_before + world and time.monotonic() < deadline:
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)

        DetachedPackWriter.finish = finish_then_die
    writer = StoreWriter if kind == "rank" else _KillCoordinatorBeforeFinish
    dcp.save(sd, storage_writer=writer(url, tag="crash"))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kind", ["rank", "coordinator"])
def test_sigkill_mid_save_to_a_bucket_leaves_no_commit_and_gc_removes_the_orphans(url, kind, world):
    s = Store(url)
    s.commit({"kept": torch.arange(10)}, tag="crash")
    before, kept = s.resolve("crash"), keys(url)
    outcome = on_bucket(world, _save_and_die, url, kind, kinds(kept)["pack"], expect_ok=False)
    assert outcome[1 if kind == "rank" else 0][0] == -signal.SIGKILL
    assert s.resolve("crash") == before and [c.id for c in s.log()] == [before] and [r["action"] for r in s.reflog()] == ["commit"]
    orphans = keys(url) - kept
    assert kinds(orphans) == {"pack": world, "idx": world}  # each rank's pack and index; no record, no ref or reflog move
    report = s.gc(grace=0)
    assert (report.packs_deleted, report.commits_dropped) == (world, 0)
    assert keys(url) == kept  # the orphans, the GC's mark and its clock probe are gone; all else stays
    assert s.fsck(deep=True).ok
    assert_bit_equal(s.checkout("crash")["kept"], torch.arange(10))
    s.close()


# --- Checkpointer(dcp=True): pushing to a bucket, and committing to one ---------------------------------


def _checkpointer_run(rank: int, world: int, store: str, push_to: str | None) -> list:
    torch.manual_seed(0)  # replicated, as under DDP
    model = torch.nn.Linear(8, 4)
    ckpt = ckptstore.Checkpointer(store, {"model": model, "extra": {"seen": 5}}, every_n_steps=2, dcp=True, keep_last=1,
                                  on_signal=(), push_to=push_to)
    assert ckpt.resume() is None
    infos = []
    for _ in range(4):
        with torch.no_grad():
            model.weight.add_(1.0)
        infos.append(ckpt.step())
    pushed = ckpt.wait_pushed() if push_to is not None else None
    assert ckpt.push_error is None
    fresh = torch.nn.Linear(8, 4)
    torch.nn.init.zeros_(fresh.weight)
    again = ckptstore.Checkpointer(store, {"model": fresh, "extra": {"seen": -1}}, every_n_steps=2, dcp=True, on_signal=())
    assert again.resume() == 4 and again.objects["extra"] == {"seen": 5}
    for k, v in model.state_dict().items():
        assert_bit_equal(fresh.state_dict()[k], v)
    return [[None if i is None else i.id for i in infos], None if pushed is None else [pushed.commit, pushed.tag]]


@pytest.mark.parametrize("where", ["push_to", "store"])
def test_checkpointer_dcp_mode_with_a_bucket_on_two_ranks(tmp_path, url, where):
    local = str(tmp_path / "store")
    store, push_to = (local, url) if where == "push_to" else (url, None)
    (ids0, pushed0), (ids1, pushed1) = on_bucket(2, _checkpointer_run, store, push_to)
    assert ids0[0] is None and ids0[1] is not None and ids0[2] is None and ids0[3] is not None and ids1 == [None] * 4
    remote = Store(url)
    assert remote.resolve("latest") == ids0[3]
    if where == "push_to":  # the coordinator pushed "latest" after its commits; the newest push names the last one
        assert pushed0 == [ids0[3], "latest"] and pushed1 is None
        assert set(remote.tags()) == {"latest"}
        here = Store(local)
        want, got = here.checkout("latest"), remote.checkout("latest")
        assert sorted(got.keys()) == sorted(want.keys())
        for k in want.keys(include_nested=True, leaves_only=True):
            if isinstance(want[k], torch.Tensor):
                assert_bit_equal(got[k], want[k])
            else:
                assert got[k] == want[k], k
        here.close()
    else:
        assert set(remote.tags()) == {"latest", "step-4"} and not (tmp_path / "store").exists()
    assert remote.checkout("latest", partial=["checkpointer.step"])["checkpointer.step"] == 4
    assert remote.fsck(deep=True).ok
    remote.close()


def test_a_save_overlapping_a_gc_repack_reuses_the_repacked_copy(url, monkeypatch):
    """A GC between a DCP save's plan and its commit repacks the half-dead pack holding a
    blob the save reuses (and marks the old pack): the commit finds the copy in the new pack
    instead of failing (found by a tester: the save failed until that GC's sweep)."""
    grace = 2.0
    w = torch.randn(4096, 64, generator=torch.Generator().manual_seed(0))  # 4 shards of 1,024 rows
    dcp.save({"w": w}, storage_writer=StoreWriter(url, tag="step-0"))
    w[1024:] += 1  # shards 1..3 change: shard 0 stays in step-0's pack
    dcp.save({"w": w}, storage_writer=StoreWriter(url, tag="step-1"))
    with Store(url) as other:
        other.delete_tag("step-0")  # step-0's pack is 1/4 live: a GC repacks it
    time.sleep(grace + 1.5)  # step-0's record is older than the grace period
    finish, reports = StoreWriter.finish, []

    def gc_then_finish(self, metadata, results):
        with Store(url) as cron:
            reports.append(cron.gc(grace=f"{grace:g}s"))
        return finish(self, metadata, results)

    monkeypatch.setattr(StoreWriter, "finish", gc_then_finish)
    w[2048:] += 1
    writer = StoreWriter(url, tag="step-2")
    dcp.save({"w": w}, storage_writer=writer)
    assert reports[0].packs_repacked == 1
    assert writer.commit_info.shards_total == 4
    with Store(url) as s:
        assert_bit_equal(s.checkout("step-2")["w"], w)
        assert s.fsck(deep=True).ok
