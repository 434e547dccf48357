"""Many nodes, one bucket (issue 25): restore once per replica group, counted in bytes the
S3 server served (tests/s3server.py counts them), on real gloo process groups, each rank
with a cache folder of its own."""

from __future__ import annotations

import uuid

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptstore.backends import open_backend
from ckptstore.dcp import StoreReader, StoreWriter

from .test_dcp_bucket import _tmp_env, on_bucket  # noqa: F401 - the rendezvous folder fixture

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
    served = s3_server.served()
    # w: 4 shards, m: 2, b: 1 are read by one rank each (balanced by bytes), every rank reads its own counter
    assert sum(r[0] for r in reads) == 7 + world and all(r[0] + r[1] == 7 + 1 for r in reads)
    assert served["bytes"] <= 1.1 * unique, (served, unique)  # packs, their .idx per rank's cache, records, refs
    s3_server.reset_served()
    on_bucket(world, _load, url, False)  # every rank fetches all it needs: world times the replicated bytes
    assert s3_server.served()["blob_bytes"] > 0.9 * world * unique


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
    from .test_dcp import run_ranks

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
