"""Multi-rank torch.distributed.checkpoint: DCP's FileSystemWriter/FileSystemReader against
ckptstore's StoreWriter/StoreReader, side by side in one run, on 2 and 4 gloo ranks (CPU).

    .venv/bin/python -m benchmarks.dcp                     # 2 and 4 ranks, 128 MiB per rank, ~2 min on 2 cores
    .venv/bin/python -m benchmarks.dcp --ranks 2 --mib-per-rank 8 --saves 3 --repetitions 1   # a quick look

Each rank holds its own shard of a model (FSDP-like: ``rank<r>.layer<i>`` float32 tensors of
1 KiB rows, random, so incompressible) plus a small replicated part. Operations, timed on
rank 0 between barriers (wall time of the whole collective operation):

- ``first save``: into an empty folder / an empty store;
- ``re-save``: after 1 % of the rows of every tensor changed (one contiguous block per tensor);
- ``load``: into preallocated tensors (``dcp.load``), right after the save (warm page cache for both);
- ``stored after N saves``: N saves in a row, each after another 1 % change: bytes on disk of
  N FileSystemWriter folders against the one store folder.

Targets (issue 12): first save <= 1.2x, re-save <= 0.1x, load <= 1.2x, stored <= 0.15x.
Results: a table on stdout and JSON (``--output``, default ``benchmarks/results/dcp.json``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import tempfile
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path

TARGETS = {"first_save": 1.2, "resave": 0.1, "load": 1.2, "stored": 0.15}
ROW = 256  # float32 elements per row: 1 KiB


def _tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _rank_main(rank: int, world: int, cfg: dict, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from ckptstore.dcp import StoreReader, StoreWriter

    warnings.simplefilter("ignore")
    try:
        dist.init_process_group("gloo", init_method=f"file://{cfg['rendezvous']}", rank=rank, world_size=world, timeout=timedelta(minutes=10))
        g = torch.Generator().manual_seed(1000 + rank)
        rows = cfg["mib_per_rank"] * (1 << 20) // (cfg["tensors"] * ROW * 4)
        sd = {f"rank{rank}.layer{i}": torch.randn(rows, ROW, generator=g) for i in range(cfg["tensors"])}
        sd["shared.embed"] = torch.randn(64, ROW, generator=torch.Generator().manual_seed(7))  # replicated: DCP saves one copy
        sd["step"] = 0
        changed = max(1, rows // 100)

        def change(k: int) -> None:
            for name, t in sd.items():
                if isinstance(t, torch.Tensor) and name.startswith("rank"):
                    start = int(torch.randint(0, rows - changed + 1, (1,), generator=g))
                    t[start : start + changed] += 1.0
            sd["step"] = k

        def timed(fn) -> float:
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dist.barrier()
            return time.perf_counter() - t0

        work = Path(cfg["workdir"])
        results: dict[str, list] = {"fs_first": [], "store_first": [], "fs_resave": [], "store_resave": [], "fs_load": [], "store_load": [],
                                    "store_new_bytes": []}
        for rep in range(cfg["repetitions"]):
            fs_dir, store_dir = work / f"fs-{rep}", work / f"store-{rep}"
            base = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in sd.items()}
            results["fs_first"].append(timed(lambda d=fs_dir: dcp.save(sd, storage_writer=dcp.FileSystemWriter(d / "0"))))
            results["store_first"].append(timed(lambda d=store_dir: dcp.save(sd, storage_writer=StoreWriter(d, tag="s0"))))
            change(1)
            results["fs_resave"].append(timed(lambda d=fs_dir: dcp.save(sd, storage_writer=dcp.FileSystemWriter(d / "1"))))
            w = StoreWriter(store_dir, tag="s1")
            results["store_resave"].append(timed(lambda w=w: dcp.save(sd, storage_writer=w)))
            if w.commit_info is not None:
                results["store_new_bytes"].append([w.commit_info.new_bytes, w.commit_info.logical_bytes])
            target = {k: (torch.empty_like(v) if isinstance(v, torch.Tensor) else None) for k, v in sd.items()}
            results["fs_load"].append(timed(lambda t=target, d=fs_dir: dcp.load(t, storage_reader=dcp.FileSystemReader(d / "1"))))
            assert all(torch.equal(target[k], sd[k]) for k in sd if isinstance(sd[k], torch.Tensor))
            target = {k: (torch.empty_like(v) if isinstance(v, torch.Tensor) else None) for k, v in sd.items()}
            results["store_load"].append(timed(lambda t=target, d=store_dir: dcp.load(t, storage_reader=StoreReader(d, "s1"))))
            assert all(torch.equal(target[k], sd[k]) for k in sd if isinstance(sd[k], torch.Tensor)) and target["step"] == 1
            dist.barrier()
            if rank == 0:
                shutil.rmtree(fs_dir)
                shutil.rmtree(store_dir)
            sd.update(base)
        # stored bytes after N saves, each after a 1 % change
        fs_root, store_root = work / "fs-n", work / "store-n"
        for k in range(cfg["saves"]):
            dcp.save(sd, storage_writer=dcp.FileSystemWriter(fs_root / str(k)))
            dcp.save(sd, storage_writer=StoreWriter(store_root, tag=f"step-{k}"))
            change(k + 2)
        dist.barrier()
        if rank == 0:
            results["fs_stored"] = _tree_bytes(fs_root)
            results["store_stored"] = _tree_bytes(store_root)
            results["logical_per_save"] = sum(v.numel() * 4 for v in sd.values() if isinstance(v, torch.Tensor)) * world - sd["shared.embed"].numel() * 4 * (world - 1)
            Path(out).write_text(json.dumps(results))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent, which names the rank
        Path(out + f".rank{rank}.err").write_text(traceback.format_exc())
        os._exit(1)
    os._exit(0)


def run_ranks(target, world: int, cfg: dict, out: str, timeout: float, what: str) -> dict:
    """Run ``target(rank, world, cfg, out)`` in ``world`` forkserver processes (torch and
    DCP preloaded), stopping all of them when one fails or after ``timeout`` seconds; the
    JSON a rank wrote to ``out``. Raises RuntimeError (``what`` and the ranks' tracebacks,
    from ``<out>.rank<r>.err``) when a rank failed or none wrote ``out``."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed.checkpoint", "ckptstore.dcp"])
    procs = [ctx.Process(target=target, args=(r, world, cfg, out)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(p.is_alive() for p in procs):
        if any(p.exitcode not in (None, 0) for p in procs):
            break
        time.sleep(0.1)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(10)
    errors = sorted(Path(out).parent.glob(Path(out).name + ".rank*.err"))
    if errors or not Path(out).exists():
        raise RuntimeError(f"{what} failed: " + ("\n".join(e.read_text() for e in errors) or "timed out"))
    return json.loads(Path(out).read_text())


def run_world(world: int, cfg: dict, timeout: float) -> dict:
    work = Path(tempfile.mkdtemp(prefix=f"ckptstore-dcp-{world}-", dir=cfg["workdir_root"]))
    try:
        cfg = {**cfg, "workdir": str(work / "data"), "rendezvous": str(work / "rendezvous")}
        return run_ranks(_rank_main, world, cfg, str(work / "result.json"), timeout, f"{world} ranks")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def summarize(world: int, r: dict) -> dict:
    med = {k: statistics.median(v) for k, v in r.items() if isinstance(v, list) and v and not isinstance(v[0], list)}
    new, logical = r["store_new_bytes"][0] if r["store_new_bytes"] else (0, 0)
    return {
        "ranks": world,
        "seconds": med,
        "ratios": {
            "first_save": med["store_first"] / med["fs_first"],
            "resave": med["store_resave"] / med["fs_resave"],
            "load": med["store_load"] / med["fs_load"],
            "stored": r["store_stored"] / r["fs_stored"],
        },
        "resave_new_bytes_fraction": new / logical if logical else None,
        "stored_bytes": {"fs": r["fs_stored"], "store": r["store_stored"], "logical_per_save": r["logical_per_save"]},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.dcp", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="2,4", help="world sizes to run, comma-separated")
    ap.add_argument("--mib-per-rank", type=int, default=128, help="MiB of model shards per rank")
    ap.add_argument("--tensors", type=int, default=2, help="tensors per rank")
    ap.add_argument("--saves", type=int, default=10, help="saves for the stored-bytes comparison")
    ap.add_argument("-r", "--repetitions", type=int, default=3)
    ap.add_argument("--workdir", default=tempfile.gettempdir(), help="where the checkpoints are written (a real disk, not tmpfs)")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("-o", "--output", default="benchmarks/results/dcp.json")
    args = ap.parse_args(argv)
    cfg = {"mib_per_rank": args.mib_per_rank, "tensors": args.tensors, "saves": args.saves, "repetitions": args.repetitions,
           "workdir_root": args.workdir}
    rows = []
    failed = False
    for world in (int(x) for x in args.ranks.split(",")):
        summary = summarize(world, run_world(world, cfg, args.timeout))
        rows.append(summary)
        s, q = summary["seconds"], summary["ratios"]
        print(f"\n{world} ranks, {args.mib_per_rank} MiB per rank (median of {args.repetitions}):")
        print(f"  {'operation':<22}{'FileSystem s':>14}{'StoreWriter/Reader s':>22}{'ratio':>8}{'target':>8}")
        for name, fs, st, key in (("first save", "fs_first", "store_first", "first_save"), ("re-save after 1 %", "fs_resave", "store_resave", "resave"),
                                  ("load", "fs_load", "store_load", "load")):
            ok = q[key] <= TARGETS[key]
            failed |= not ok
            print(f"  {name:<22}{s[fs]:>14.3f}{s[st]:>22.3f}{q[key]:>8.3f}{'<= ' + str(TARGETS[key]):>8}{'' if ok else '  MISSED'}")
        b = summary["stored_bytes"]
        ok = q["stored"] <= TARGETS["stored"]
        failed |= not ok
        print(f"  {'stored, ' + str(args.saves) + ' saves':<22}{b['fs'] / 2**20:>12.1f}Mi{b['store'] / 2**20:>20.1f}Mi{q['stored']:>8.3f}{'<= 0.15':>8}{'' if ok else '  MISSED'}")
        print(f"  re-save wrote {summary['resave_new_bytes_fraction']:.2%} of the logical bytes")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": vars(args), "results": rows}, indent=2))
    print(f"\nwrote {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
