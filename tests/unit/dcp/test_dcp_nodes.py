"""Many nodes, one bucket (issue 25): restore once per replica group, counted in bytes the
S3 server served (tests/s3server.py counts them), on real gloo process groups, each rank
with a cache folder of its own."""

from __future__ import annotations

import os
import uuid

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptstore.backends import open_backend
from ckptstore.dcp import StoreReader, StoreWriter

from tests.unit.dcp.test_dcp_bucket import _tmp_env, on_bucket  # noqa: F401 - the rendezvous folder fixture

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def url(s3_server) -> str:
    return f"s3://ckpt/nodes-{uuid.uuid4().hex[:12]}"


def replicated(rank: int) -> dict:
    """Data-parallel state: 1 MiB of weights and their optimizer moments on every rank (4 + 1
    shards of random float32), a per-rank counter, a step."""
    g = torch.Generator().manual_seed(0)
    return {"model": {"w": torch.randn(4096, 64, generator=g), "b": torch.randn(64, generator=g)},
            "optim": {"m": torch.randn(2048, 64, generator=g)}, f"rank{rank}.seen": torch.full((4,), rank), "step": 11}


def _save(rank: int, world: int, url: str) -> None:
    dcp.save(replicated(rank), storage_writer=StoreWriter(url, tag="t"))


def _load(rank: int, world: int, url: str, restore_once: bool) -> list:
    want = replicated(rank)
    target = {"model": {"w": torch.zeros(4096, 64), "b": torch.zeros(64)}, "optim": {"m": torch.zeros(2048, 64)},
              f"rank{rank}.seen": torch.zeros(4, dtype=torch.int64), "step": 0}
    reader = StoreReader(url, "t", restore_once=restore_once)
    dcp.load(target, storage_reader=reader)
    for a, b in [(target["model"]["w"], want["model"]["w"]), (target["model"]["b"], want["model"]["b"]),
                 (target["optim"]["m"], want["optim"]["m"]), (target[f"rank{rank}.seen"], want[f"rank{rank}.seen"])]:
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert target["step"] == 11
    return [reader.blobs_read, reader.blobs_received]


def packed_bytes(url: str) -> int:
    with open_backend(url) as b:
        return sum(o.size for o in b.list("blobs") if o.key.endswith(".pack"))


@pytest.mark.parametrize("world", [2, 4])
def test_a_load_reads_each_blob_from_the_bucket_once_whatever_the_world_size(s3_server, url, world):
    on_bucket(world, _save, url)
    unique = packed_bytes(url)  # every blob of the one commit, as stored
    s3_server.reset_served()
    reads = on_bucket(world, _load, url, True)
    served = s3_server.served(url)
    # w: 4 shards, m: 2, b: 1 are read by one rank each (balanced by bytes), every rank reads its own counter
    assert sum(r[0] for r in reads) == 7 + world and all(r[0] + r[1] == 7 + 1 for r in reads)
    assert served["bytes"] <= 1.1 * unique, (served, unique)  # packs, their .idx per rank's cache, records, refs
    s3_server.reset_served()
    on_bucket(world, _load, url, False)  # every rank fetches all it needs: world times the replicated bytes
    assert s3_server.served(url)["blob_bytes"] > 0.9 * world * unique


def _load_catching(rank: int, world: int, store: str) -> dict:
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        _load(rank, world, store, True)
    except CheckpointException as exc:  # every rank gets every rank's error
        return {str(r): type(e).__name__ + ": " + str(e) for r, (e, _) in exc.failures.items()}
    return {}


def test_a_blob_that_fails_verification_on_its_reader_fails_the_load_on_every_rank(tmp_path):
    """The rank that reads a shared blob finds it corrupt: it raises BlobCorruptError, and
    every other rank an IntegrityError naming it, instead of waiting on its broadcast."""
    from tests.unit.dcp.test_dcp import run_ranks

    store = str(tmp_path / "store")
    run_ranks(2, _save, store)
    pack = max((tmp_path / "store").rglob("*.pack"), key=lambda p: p.stat().st_size)  # the replicated items' pack
    data = bytearray(pack.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside one of w's shards
    pack.write_bytes(bytes(data))
    seen = run_ranks(2, _load_catching, store)
    assert seen[0] == seen[1] and len(seen[0]) == 2, seen
    kinds = sorted(e.split(":")[0] for e in seen[0].values())
    assert kinds == ["BlobCorruptError", "IntegrityError"], seen
    reader = next(r for r, e in seen[0].items() if e.startswith("BlobCorruptError"))
    other = next(e for e in seen[0].values() if e.startswith("IntegrityError"))
    assert f"rank(s) [{reader}] could not read the blobs they read for the other ranks" in other


# --- a local tier per node, one bucket: Checkpointer(local=, remote=) --------------------------------


def _with_nodes(rank: int, world: int, per_node: int, folders: str, fn, *args):
    """Rank ``rank`` on node ``rank // per_node``, whose local disk is ``folders/node<k>``."""
    import os

    os.environ["LOCAL_WORLD_SIZE"] = str(per_node)
    return fn(rank, world, f"{folders}/node{rank // per_node}", *args)


def on_nodes(nodes: int, per_node: int, folders, fn, *args, expect_ok: bool = True) -> list:
    return on_bucket(nodes * per_node, _with_nodes, per_node, str(folders), fn, *args, expect_ok=expect_ok)


def trained(rank: int, step: int) -> dict:
    """The state of a data-parallel job after ``step`` steps: replicated weights, per-rank data."""
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(2048, 64, generator=g), "b": torch.randn(64, generator=g),
            f"mine{rank}": torch.full((8,), 1000 * step + rank, dtype=torch.int64)}


def tiered(local: str, url: str, state: dict, **kw):
    import ckptstore

    return ckptstore.Checkpointer(None, {"state": state}, dcp=True, local=local, remote=url, every_n_steps=2, keep_last=2,
                                  on_signal=(), part_timeout=30, **kw)


def _train(rank: int, world: int, local: str, url: str, steps: int) -> dict:
    state = trained(rank, 0)
    ckpt = tiered(local, url, state)
    for step in range(1, steps + 1):
        state.update(trained(rank, step))  # in place of training,
        torch.distributed.all_reduce(torch.zeros(1))  # and of its gradients' all-reduce: the ranks go in step
        ckpt.step()
    ckpt.wait_pushed()
    return {"durable": ckpt.durable_steps, "not_durable": ckpt.not_durable_steps}


def _resume(rank: int, world: int, local: str, url: str) -> list:
    state = {"w": torch.zeros(2048, 64), "b": torch.zeros(64), f"mine{rank}": torch.zeros(8, dtype=torch.int64)}
    ckpt = tiered(local, url, state)
    step = ckpt.resume()
    want = trained(rank, step)
    for k in ("w", "b"):
        assert torch.equal(state[k].view(torch.uint8), want[k].view(torch.uint8)), k
    return [step, ckpt.resumed_from, int(state[f"mine{rank}"][0])]


def test_a_local_tier_per_node_and_one_bucket_resume_on_surviving_new_and_fewer_nodes(s3_server, url, tmp_path):
    nodes = tmp_path / "nodes"
    out = on_nodes(2, 2, nodes, _train, url, 6)  # saves at steps 2, 4, 6; each node's first rank pushes
    # each node's first rank pushed the newest save whenever it was free (a save pushed while a newer one
    # waited is skipped and reported); the last one is durable: node 0 composed both nodes' parts
    for o in out[::2]:
        assert o["durable"][-1] == 6 and sorted(o["durable"] + o["not_durable"]) == [2, 4, 6], out
    assert [o["durable"] + o["not_durable"] for o in out[1::2]] == [[], []]  # the other ranks push nothing
    with ckptstore_store(url) as bucket:
        assert sorted(bucket.tags()) == ["latest"] + [f"step-{s}" for s in out[0]["durable"]]  # the parts' tags are gone
        assert bucket.resolve("latest") == bucket.resolve("step-6")
        td = bucket.checkout("step-6")
        assert torch.equal(td["state.w"], trained(0, 6)["w"]) and [int(td[f"state.mine{r}"][0]) for r in range(4)] == [6000, 6001, 6002, 6003]
    for k in (0, 1):  # keep_last=2 on each node's own disk
        with ckptstore_store(nodes / f"node{k}") as disk:
            assert sorted(disk.tags()) == ["latest", "step-4", "step-6"]
    s3_server.reset_served()
    assert on_nodes(2, 2, nodes, _resume, url) == [[6, "local", 6000 + r] for r in range(4)]
    served = s3_server.served(url)  # surviving nodes: no blob read from the bucket, only its newest step (the client's
    assert served["gets"] == 4 and served["blob_gets"] == 0, served  # opening listing, a listing of refs, that step's tag and record)
    import shutil

    shutil.copytree(nodes, tmp_path / "copy")
    with ckptstore_store(nodes / "node1") as disk:
        disk.delete_tag("step-6")  # node 1's disk lost the newest save: node 0's step-6 is never mixed with node 1's step-4
    assert on_nodes(2, 2, nodes, _resume, url) == [[6, "remote", 6000 + r] for r in range(4)]
    with ckptstore_store(tmp_path / "copy" / "node0") as disk:  # a flipped byte in node 0's copy of w at step 6
        key = next(leaf.keys[0] for leaf in disk.record("step-6").leaves if leaf.path == "state.w")
        loc = disk.locate([key])[key]
    pack = next((tmp_path / "copy" / "node0").rglob(f"{loc.pack}.pack"))
    data = bytearray(pack.read_bytes())
    data[loc.offset + loc.stored_len - 1] ^= 0xFF
    pack.write_bytes(bytes(data))
    assert on_nodes(2, 2, tmp_path / "copy", _resume, url) == [[6, "remote", 6000 + r] for r in range(4)]  # fails to verify: the bucket
    fresh = tmp_path / "new-nodes"
    assert on_nodes(2, 2, fresh, _resume, url) == [[6, "remote", 6000 + r] for r in range(4)]  # empty disks: the bucket
    assert on_nodes(1, 3, tmp_path / "one-node", _resume, url) == [[6, "remote", 6000 + r] for r in range(3)]  # 3 ranks on one node: resharded


def ckptstore_store(where):
    from ckptstore import Store

    return Store(str(where))


# --- the cluster: SIGKILL at random points of the saves and pushes, resume anywhere ---------------

#: where a rank SIGKILLs itself: (what is patched, who may die): a rank's blob writes and its node's
#: local commit, a node's background push, node 0's composing of the parts and its bucket commit
HOOKS = {"write": ("ckptstore.dcp:StoreWriter.write_data", "any"), "finish": ("ckptstore.dcp:StoreWriter.finish", "first"),
         "push": ("ckptstore.store:Store.push", "first"), "compose": ("ckptstore.tiers:compose", "zero"),
         "bucket-commit": ("ckptstore.home.bucket:BucketHome.before_commit", "zero")}


def _die_at(where: str, nth: int) -> None:
    import importlib
    import os
    import signal

    module, name = where.split(":")
    owner = importlib.import_module(module)
    *path, attr = name.split(".")
    for p in path:
        owner = getattr(owner, p)
    original, calls = getattr(owner, attr), [0]

    def dying(*args, **kwargs):
        calls[0] += 1
        if calls[0] == nth:
            os.kill(os.getpid(), signal.SIGKILL)  # the harness then SIGKILLs every other rank
        return original(*args, **kwargs)

    setattr(owner, attr, dying)
    if module == "ckptstore.tiers":
        import ckptstore.tiers

        ckptstore.tiers.compose = dying


def _train_and_die(rank: int, world: int, local: str, url: str, steps: int, victim: int, where: str, nth: int) -> dict:
    if rank == victim:
        _die_at(where, nth)
    return _train(rank, world, local, url, steps)


def _resume_and_go_on(rank: int, world: int, local: str, url: str, more: int) -> list:
    state = {"w": torch.zeros(2048, 64), "b": torch.zeros(64), f"mine{rank}": torch.zeros(8, dtype=torch.int64)}
    ckpt = tiered(local, url, state)
    step = ckpt.resume() or 0
    want = trained(rank, step)
    if step:  # every tensor of one step: the replicated ones and this rank's own
        for k in want:
            assert torch.equal(state[k].view(torch.uint8), want[k].view(torch.uint8)), (k, step)
    resumed = [step, ckpt.resumed_from]
    for s in range(step + 1, step + more + 1):
        state.update(trained(rank, s))
        torch.distributed.all_reduce(torch.zeros(1))
        ckpt.step()
    ckpt.wait_pushed()
    return resumed


def cluster_case(seed: int, tmp_path, url: str) -> None:
    import random

    from ckptstore import Store

    rng = random.Random(seed)
    nodes, per = rng.choice([(2, 1), (2, 2)])
    kind = rng.choice(sorted(HOOKS))
    where, who = HOOKS[kind]
    victim = {"any": rng.randrange(nodes * per), "first": per * rng.randrange(nodes), "zero": 0}[who]
    nth = rng.randint(1, 4)
    first = tmp_path / f"s{seed}-nodes"
    died = on_nodes(nodes, per, first, _train_and_die, url, 8, victim, where, nth, expect_ok=False)  # saves at 2, 4, 6, 8
    with Store(url) as bucket:
        durable = bucket.checkout("latest", partial=["checkpointer.step"])["checkpointer.step"] if "latest" in bucket.tags() else 0
    disks = {}
    for k in range(nodes):
        try:
            with Store(str(first / f"node{k}")) as disk:
                disks[k] = sorted(disk.tags())
        except Exception as exc:  # noqa: BLE001 - a disk the kill left without a store
            disks[k] = type(exc).__name__
    print(f"seed {seed}: local tags {disks}")
    then = rng.choice(["same", "new", "fewer"])
    folders = first if then == "same" else tmp_path / f"s{seed}-{then}"
    layout = (nodes, per) if then != "fewer" else (1, rng.choice([1, 2]))
    print(f"seed {seed}: {nodes} node(s) x {per}, rank {victim} killed at call {nth} of {where}: exits {[d[0] for d in died]}, "
          f"bucket latest step {durable}; resume on {then} nodes {layout}")
    out = on_nodes(*layout, folders, _resume_and_go_on, url, 4)
    print(f"seed {seed}: resumed {out}")
    steps = {tuple(o) for o in out}
    assert len(steps) == 1, out  # every rank restored the same step, from the same tier
    step, tier = out[0]
    assert step in (0, 2, 4, 6, 8) and step >= durable, (out, durable)  # a complete step, never older than the bucket's
    assert then == "same" or step == durable and tier in (None, "remote"), (out, durable)  # new disks: the bucket's
    with Store(url) as bucket:  # the resumed run went on and made its newest save durable
        assert bucket.checkout("latest", partial=["checkpointer.step"])["checkpointer.step"] == step + 4
        assert torch.equal(bucket.checkout("latest", partial=["state.w"])["state.w"], trained(0, step + 4)["w"])


SEEDS = [int(s) for s in os.environ.get("CKPT_CLUSTER_SEEDS", "").split(",") if s]


@pytest.mark.parametrize("seed", SEEDS or [100, 109, 116])
def test_cluster_sigkill_anywhere_then_resume_restores_one_complete_step(s3_server, tmp_path, seed):
    """Replay a failing seed with CKPT_CLUSTER_SEEDS=<seed> (it is in the test id and the failure)."""
    url = f"s3://ckpt/cluster-{seed}-{uuid.uuid4().hex[:8]}"
    try:
        cluster_case(seed, tmp_path, url)
    except AssertionError as exc:
        raise AssertionError(f"cluster seed {seed} (replay: CKPT_CLUSTER_SEEDS={seed} pytest {__file__} -k cluster): {exc}") from None


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("seed", range(100, 130))
def test_cluster_long_schedule(s3_server, tmp_path, seed):
    test_cluster_sigkill_anywhere_then_resume_restores_one_complete_step(s3_server, tmp_path, seed)
