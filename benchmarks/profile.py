"""Profile ckptstore's W1 (or W6) operations with pyinstrument (statistical, wall-clock).

    .venv/bin/python -m benchmarks.profile [--w1-mib 1024] [--out DIR]
    .venv/bin/python -m benchmarks.profile --workload w6 [--w6-mib 512]

Builds the W1 buffer (the benchmark's data and change), then profiles, each in
this one process: the first commit, the re-commit after 1 % of rows changed, the
unchanged re-commit, a full checkout into memory and a checkout into the existing
buffer. Prints one call tree per operation (frames under 2 % of the time hidden)
and, with ``--out``, writes them as HTML too. Notes from these runs are kept in
``docs/performance.md``. Timings here include the profiler's overhead (~1 ms
sampling); the benchmark suite is the reference for times.

``--workload w6`` profiles the plain TensorDict instead: first commit, unchanged
re-commit, checkout with the page cache warm, and checkout after the packs were
evicted from the page cache (cold). It then times cold reads of the same pack files
by access pattern, with no hashing and no fresh memory (reads into one reused
buffer), to separate the disk's rate from what ckptstore does with it: one thread
with 64 MiB ``preadv`` calls (the floor's pattern), one thread with 256 KiB calls
in file order, and two threads working through 8 contiguous chunks of each pack
(``Store._map``'s split) in 256 KiB calls, on one shared file descriptor (what a
checkout's reader threads do, one blob per call) or on one descriptor per thread.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from pyinstrument import Profiler

import ckptstore

from .measure import evict_tree
from .spec import Sizes
from .workloads import Data, gen_w1, gen_w6, w1_build, w1_change, w6_build


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=("w1", "w6"), default="w1")
    ap.add_argument("--w1-mib", type=float, default=1024.0)
    ap.add_argument("--w6-mib", type=float, default=512.0)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ckptstore-profile"))
    ap.add_argument("--out", type=Path, help="also write one HTML profile per operation here")
    args = ap.parse_args(argv)
    data_dir = Path(tempfile.mkdtemp(prefix="ckptstore-profile-", dir="/dev/shm"))
    shutil.rmtree(args.workdir, ignore_errors=True)
    if args.workload == "w6":
        try:
            profile_w6(args, data_dir)
        finally:
            shutil.rmtree(data_dir, ignore_errors=True)
            shutil.rmtree(args.workdir, ignore_errors=True)
        return
    try:
        gen_w1(Sizes(w1_mib=args.w1_mib), data_dir)
        data = Data(data_dir)
        rb = w1_build(data)
        store = ckptstore.Store(args.workdir / "store")
        existing = w1_build(data)
        ops = [
            ("commit", lambda: store.commit(rb, tag="latest")),
            ("commit_after_change", lambda: store.commit(rb, tag="latest")),
            ("commit_unchanged", lambda: store.commit(rb, tag="latest")),
            ("checkout", lambda: store.checkout("latest")),
            ("checkout_into_existing", lambda: store.checkout("latest", into=existing)),
        ]
        for name, op in ops:
            if name == "commit_after_change":
                w1_change(rb, data)
            _profile(name, op, args.out)
        store.close()
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
        shutil.rmtree(args.workdir, ignore_errors=True)


def _profile(name: str, op, out: Path | None) -> None:
    profiler = Profiler(interval=0.001)
    with profiler:
        op()
    print(f"\n===== {name} =====")
    print(profiler.output_text(color=False, show_all=False, time="seconds", flat=False, processor_options={"filter_threshold": 0.02}))
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.html").write_text(profiler.output_html())


def profile_w6(args: argparse.Namespace, data_dir: Path) -> None:
    gen_w6(Sizes(w6_mib=args.w6_mib), data_dir)
    td = w6_build(Data(data_dir))
    store = ckptstore.Store(args.workdir / "store")
    store_root = args.workdir / "store"

    def cold_checkout():
        return store.checkout("latest")

    ops = [
        ("w6_commit", lambda: store.commit(td, tag="latest")),
        ("w6_commit_unchanged", lambda: store.commit(td, tag="latest")),
        ("w6_checkout_warm", lambda: store.checkout("latest")),
        ("w6_checkout_cold", cold_checkout),
    ]
    for name, op in ops:
        if name == "w6_checkout_cold":
            evict_tree(store_root)
        _profile(name, op, args.out)
    store.close()
    packs = sorted(p for p in store_root.rglob("*.pack"))
    print("\n===== cold reads of the packs by pattern (no hashing, one reused buffer) =====")
    for label, block, threads, shared in (("1 thread, 64 MiB preadv", 64 << 20, 1, True), ("1 thread, 256 KiB preadv", 256 << 10, 1, True),
                                          ("2 threads, 8 chunks, 256 KiB preadv, shared fd", 256 << 10, 2, True),
                                          ("2 threads, 8 chunks, 256 KiB preadv, fd per thread", 256 << 10, 2, False)):
        evict_tree(store_root)
        total, secs = _read_pattern(packs, block, threads, shared)
        print(f"{label}: {total / (1 << 20):.0f} MiB in {secs:.3f} s = {total / secs / 1e9:.2f} GB/s")


def _read_pattern(packs: list[Path], block: int, threads: int, shared_fd: bool) -> tuple[int, float]:
    """Cold-read every pack in ``block``-byte preadv calls. With 2 threads: each pack's blocks
    are cut into 8 contiguous chunks that the threads take in turn (thread k: chunks k, k+2, ...)."""
    import os
    import threading
    import time

    total = 0
    t0 = time.perf_counter()
    for pack in packs:
        size = pack.stat().st_size
        blocks = list(range(0, size, block))
        n = -(-len(blocks) // 8) if threads > 1 else len(blocks)
        chunks = [blocks[i: i + n] for i in range(0, len(blocks), n)]
        fds = [os.open(pack, os.O_RDONLY)] if shared_fd else [os.open(pack, os.O_RDONLY) for _ in range(threads)]
        got = [0] * threads

        def worker(k: int, chunks=chunks, fds=fds, got=got) -> None:
            buf = bytearray(block)
            fd = fds[0 if shared_fd else k]
            for chunk in chunks[k::threads]:
                for off in chunk:
                    got[k] += os.preadv(fd, [buf], off)

        ts = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        for fd in fds:
            os.close(fd)
        total += sum(got)
    return total, time.perf_counter() - t0


if __name__ == "__main__":
    main()
