"""Many nodes, one bucket (issue 25), side by side in one run against one moto server
(tests/s3server.py on 127.0.0.1, serialized) and real gloo process groups on this machine.

    .venv/bin/python -m benchmarks.nodes                  # 32 MiB of replicated state, ~3 min on 2 cores
    .venv/bin/python -m benchmarks.nodes --mib 8 --saves 2 --worlds 2,4   # a quick look

Each rank holds a data-parallel state: ``--mib`` MiB of replicated float32 (random, so
incompressible; 1 % of its rows change before each save) and a small tensor of its own.

- **blocking time per save** (2 simulated nodes of 1 rank, median of ``--saves``): what the
  training loop waits for, timed on rank 0 between barriers: ``Checkpointer(local=, remote=)``
  (its node's local commit; the push runs behind), the same node-local ``dcp.save`` to a
  ``StoreWriter`` folder alone (``local only``, the reference of the 1.1x target), ``dcp.save``
  with a ``StoreWriter("s3://…")`` straight to the bucket, and DCP's ``async_save`` to a
  ``FileSystemWriter`` folder (until it returns its future);
- **bucket bytes per load** at each of ``--worlds`` ranks, ``StoreReader`` with and without
  restore-once: GET body bytes the server sent during one ``dcp.load``, against the packs'
  bytes of the commit (unique stored bytes);
- **resume** (the same 2 nodes): ``Checkpointer.resume()`` on the surviving nodes (their
  local folders) against new nodes (empty folders): seconds and bucket bytes.

Results: a table on stdout and JSON (``--output``, default ``benchmarks/results/nodes.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import urllib.request
import warnings
from datetime import timedelta
from pathlib import Path

from .dcp import run_ranks

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.s3server when run from anywhere
ROW = 256  # float32 elements per row: 1 KiB


def _served(endpoint: str, reset: bool = False) -> dict:
    req = urllib.request.Request(endpoint + "/__served__", data=b"" if reset else None, method="POST" if reset else "GET")
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def _state(rank: int, mib: int):
    import torch

    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(mib * 1024, ROW, generator=g), f"mine{rank}": torch.full((64,), rank, dtype=torch.int64)}


def _rank_main(rank: int, world: int, cfg: dict, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import ckptstore
    from ckptstore.dcp import StoreReader, StoreWriter
    from ckptstore.tiers import node_layout

    warnings.simplefilter("ignore")
    os.environ.update(cfg["env"])
    os.environ["XDG_CACHE_HOME"] = f"{cfg['work']}/cache{rank}-{cfg['phase']}"
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    try:
        dist.init_process_group("gloo", init_method=f"file://{cfg['work']}/rdzv-{cfg['phase']}", rank=rank, world_size=world,
                                timeout=timedelta(minutes=10))
        work, res = Path(cfg["work"]), {}
        state = _state(rank, cfg["mib"])

        def timed(fn) -> float:
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            t = time.perf_counter() - t0
            dist.barrier()
            return t

        def change(k: int) -> None:
            rows = state["w"].shape[0] // 100
            state["w"][k * rows : (k + 1) * rows] += 1.0

        if cfg["phase"] == "saves":
            ckpt = ckptstore.Checkpointer(None, {"state": state}, dcp=True, every_n_steps=1, on_signal=(), keep_last=2,
                                          local=f"{work}/nvme{rank}", remote=f"{cfg['url']}/tiered", part_timeout=600)
            node_group = node_layout(1).group  # the local-only arm saves over node groups of its own
            async_group = dist.new_group(backend="gloo")  # async_save's collectives run in its thread: not on the barriers' group
            times: dict[str, list] = {"tiered": [], "local_only": [], "bucket": [], "dcp_async_fs": []}
            for k in range(cfg["saves"]):
                change(k)
                ckpt.steps = k
                times["tiered"].append(timed(ckpt.commit))
                times["local_only"].append(timed(lambda: dcp.save(state, storage_writer=StoreWriter(f"{work}/alone{rank}", tag=f"s{k}"),
                                                                  process_group=node_group)))
                times["bucket"].append(timed(lambda: dcp.save(state, storage_writer=StoreWriter(f"{cfg['url']}/direct", tag=f"s{k}"))))
                futures = []
                times["dcp_async_fs"].append(timed(lambda: futures.append(dcp.async_save(state, storage_writer=dcp.FileSystemWriter(f"{work}/fs{k}"), process_group=async_group))))
                futures[0].result()
            t0 = time.perf_counter()
            ckpt.wait_pushed()
            res["push_drain_s"] = time.perf_counter() - t0
            res["times"] = times
            res["durable"] = ckpt.durable_steps
        elif cfg["phase"] in ("resume-surviving", "resume-new"):
            target = {"w": torch.zeros_like(state["w"]), f"mine{rank}": torch.zeros(64, dtype=torch.int64)}
            folder = f"{work}/nvme{rank}" if cfg["phase"] == "resume-surviving" else f"{work}/new{rank}"
            ckpt = ckptstore.Checkpointer(None, {"state": target}, dcp=True, on_signal=(), local=folder, remote=f"{cfg['url']}/tiered")
            if rank == 0:
                _served(cfg["endpoint"], reset=True)
            res["seconds"] = timed(ckpt.resume)
            res["from"] = ckpt.resumed_from
            res["served"] = _served(cfg["endpoint"]) if rank == 0 else None
        else:  # loads at this world size
            url = f"{cfg['url']}/load-{world}"
            dcp.save(state, storage_writer=StoreWriter(url, tag="t"))
            dist.barrier()
            warm = {"w": torch.zeros_like(state["w"]), f"mine{rank}": torch.zeros(64, dtype=torch.int64)}
            dcp.load(warm, storage_reader=StoreReader(url, "t"))  # every rank's cache filled first: both arms start warm
            for once in (True, False):
                target = {"w": torch.zeros_like(state["w"]), f"mine{rank}": torch.zeros(64, dtype=torch.int64)}
                if rank == 0:
                    _served(cfg["endpoint"], reset=True)
                res[f"seconds_{once}"] = timed(lambda: dcp.load(target, storage_reader=StoreReader(url, "t", restore_once=once)))
                assert torch.equal(target["w"], state["w"])
                if rank == 0:
                    res[f"served_{once}"] = _served(cfg["endpoint"])["bytes"]
            if rank == 0:
                from ckptstore.backends import open_backend

                with open_backend(url) as b:
                    res["unique"] = sum(o.size for o in b.list("blobs") if o.key.endswith(".pack"))
        if rank == 0:
            Path(out).write_text(json.dumps(res))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent, which names the rank
        Path(out + f".rank{rank}.err").write_text(traceback.format_exc())
        os._exit(1)
    os._exit(0)


def run(world: int, cfg: dict, timeout: float = 1200) -> dict:
    return run_ranks(_rank_main, world, cfg, f"{cfg['work']}/{cfg['phase']}.json", timeout, f"{cfg['phase']} on {world} ranks")


def main(argv: list[str] | None = None) -> int:
    from tests.s3server import MotoServer

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=32, help="MiB of replicated state per rank")
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--worlds", default="2,4,8")
    ap.add_argument("--output", default=str(ROOT / "benchmarks/results/nodes.json"))
    a = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="ckptstore-nodes-")
    try:
        with MotoServer(buckets=["bench"]) as server:
            base = {"work": work, "mib": a.mib, "saves": a.saves, "env": server.env, "endpoint": server.endpoint, "url": "s3://bench/nodes"}
            saves = run(2, {**base, "phase": "saves"})
            surviving = run(2, {**base, "phase": "resume-surviving"})
            new = run(2, {**base, "phase": "resume-new"})
            loads = {w: run(w, {**base, "phase": f"loads-{w}"}) for w in [int(x) for x in a.worlds.split(",")]}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in saves["times"].items()}
    result = {"mib": a.mib, "saves": a.saves, "blocking_s": med, "blocking_all_s": saves["times"], "push_drain_s": saves["push_drain_s"],
              "durable": saves["durable"], "tiered_over_local_only": med["tiered"] / med["local_only"],
              "loads": {str(w): {"unique_bytes": r["unique"], "served_restore_once": r["served_True"], "served_every_rank": r["served_False"],
                                 "ratio_restore_once": r["served_True"] / r["unique"], "ratio_every_rank": r["served_False"] / r["unique"],
                                 "seconds_restore_once": r["seconds_True"], "seconds_every_rank": r["seconds_False"]} for w, r in loads.items()},
              "resume": {"surviving": {"seconds": surviving["seconds"], "from": surviving["from"], "bucket_bytes": surviving["served"]["bytes"]},
                         "new": {"seconds": new["seconds"], "from": new["from"], "bucket_bytes": new["served"]["bytes"]}}}
    Path(a.output).parent.mkdir(parents=True, exist_ok=True)
    Path(a.output).write_text(json.dumps(result, indent=1))
    print(f"blocking seconds per save ({a.mib} MiB replicated, 2 nodes, median of {a.saves}):")
    for k, v in med.items():
        print(f"  {k:14s} {v:7.3f}")
    print(f"  tiered / local only = {result['tiered_over_local_only']:.2f} (target <= 1.1); push drain after the last save {saves['push_drain_s']:.2f} s")
    print("bucket bytes per load / unique stored bytes:")
    for w, r in result["loads"].items():
        print(f"  {w} ranks: restore once {r['ratio_restore_once']:.3f}, every rank {r['ratio_every_rank']:.3f} "
              f"({r['seconds_restore_once']:.2f} s vs {r['seconds_every_rank']:.2f} s)")
    for k, r in result["resume"].items():
        print(f"resume on {k} nodes: {r['seconds']:.2f} s from {r['from']}, {r['bucket_bytes']} bucket bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
