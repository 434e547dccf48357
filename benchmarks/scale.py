"""How a long-lived store's operations grow with its number of commits.

    .venv/bin/python -m benchmarks.scale                    # 100, 1 000, 5 000 commits (~3 min)
    .venv/bin/python -m benchmarks.scale --sizes 100,1000,5000,20000
    .venv/bin/python -m benchmarks.scale --gc-only 100000   # the GC target: all but 10 of 100 000 droppable
    .venv/bin/python -m benchmarks.scale --bucket 50,200,1000  # a bucket store on moto (measure_bucket)

Each size builds one store of tiny commits (:func:`build`: a 64-element int64 tensor in
8-element shards, one element rewritten per commit, so each commit writes one blob and
two packs, as a real run's commits do; ``latest`` moved every commit, a ``step-N`` tag
every 10th). The build skips fsync (``durable=False``): it is not what is measured.
Then, on that store: ``commit`` (ms per durable commit, fsync on, the median of 20 at
that size), ``log`` (``Store.log("latest")``), ``tags`` (the CLI's ``tags`` into a
null console), ``du``, ``fsck``, ``fsck --deep``, ``recover`` (catalog files deleted
first) and ``gc`` (``keep_last=1``, ``grace=0``: every tagged commit stays, the other
~90 % go). Seconds per operation; the last column of each row pair is the growth
exponent k of time ~ n^k between consecutive sizes (1 is linear). ``fd`` is the
most file descriptors open at once during ``fsck --deep`` and ``recover``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import shutil
import statistics
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import ckptstore

OPS = ("commit", "log", "tags", "du", "fsck", "fsck --deep", "recover", "gc")


@contextmanager
def _no_fsync():
    saved = os.fsync, os.fdatasync
    os.fsync = os.fdatasync = lambda fd: None
    try:
        yield
    finally:
        os.fsync, os.fdatasync = saved


def build(path: str | os.PathLike, n: int, tag_every: int = 10, durable: bool = False) -> dict[str, int]:
    """Make ``n`` commits in a new store at ``path`` through the public API; returns
    ``{tag: step}`` of the tags set (``latest`` on the last commit, ``step-<i>`` on every
    ``tag_every``-th; ``tag_every=0``: ``latest`` only). Commit ``i`` holds
    ``{"x": int64[64] with x[i % 64] = i, "step": i}``. ``durable=False`` skips fsync and
    SQLite's sync (a fast build; a power cut could lose it)."""
    import torch

    x = torch.zeros(64, dtype=torch.int64)
    tags: dict[str, int] = {}
    ctx = _no_fsync() if not durable else contextlib.nullcontext()
    with ctx, ckptstore.Store(path, create=True, shard_bytes=64, workers=1) as s:
        if not durable:
            s.catalog.conn.execute("PRAGMA synchronous=OFF")
        for i in range(n):
            x[i % 64] = i
            names = ["latest"] + ([f"step-{i}"] if tag_every and i % tag_every == 0 else [])
            s.commit({"x": x, "step": i}, tag=names)
            tags.update((t, i) for t in names)
    return tags


def expected_x(step: int):
    """The tensor ``x`` of commit ``step`` of :func:`build`."""
    import torch

    x = torch.zeros(64, dtype=torch.int64)
    for i in range(max(0, step - 63), step + 1):
        x[i % 64] = i
    return x


class _PeakFds:
    """The most file descriptors this process had open while inside the block."""

    def __init__(self):
        self.peak = 0
        self._stop = threading.Event()

    def _count(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, len(os.listdir("/proc/self/fd")))
            self._stop.wait(0.002)

    def __enter__(self):
        self._thread = threading.Thread(target=self._count, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(n: int, workdir: Path) -> dict[str, float]:
    """Build an ``n``-commit store under ``workdir`` and time every operation on it."""
    import torch
    from rich.console import Console

    from ckptstore import cli
    from ckptstore.cli import common as cli_common

    path = workdir / f"s{n}"
    shutil.rmtree(path, ignore_errors=True)
    build(path, n - 20)
    out: dict[str, float] = {}
    with ckptstore.Store(path) as s:
        times = []
        x = torch.zeros(64, dtype=torch.int64)
        for i in range(n - 20, n):
            x[i % 64] = i
            names = ["latest"] + ([f"step-{i}"] if i % 10 == 0 else [])
            times.append(_timed(lambda: s.commit({"x": x, "step": i}, tag=names)))
        out["commit"] = statistics.median(times)
        out["log"] = _timed(lambda: s.log("latest"))
        cli_common.console = Console(file=io.StringIO(), width=200)
        out["tags"] = _timed(lambda: cli.tags(store=str(path)))
        out["du"] = _timed(s.du)
        out["fsck"] = _timed(lambda: s.fsck())
        with _PeakFds() as fds:
            out["fsck --deep"] = _timed(lambda: s.fsck(deep=True))
    for name in ("catalog.sqlite", "catalog.sqlite-wal", "catalog.sqlite-shm"):
        (path / name).unlink(missing_ok=True)
    with fds:
        out["recover"] = _timed(lambda: ckptstore.Store.recover(path))
    out["fd"] = fds.peak
    with ckptstore.Store(path) as s:
        out["gc"] = _timed(lambda: s.gc(keep_last=1, grace=0))
    shutil.rmtree(path, ignore_errors=True)
    return out


def gc_only(n: int, workdir: Path, keep: int = 10) -> tuple[float, float, int]:
    """Build ``n`` commits with ``latest`` only; returns (build s, GC s, commits left)
    for a GC keeping the ``keep`` newest."""
    path = workdir / f"gc{n}"
    shutil.rmtree(path, ignore_errors=True)
    t_build = _timed(lambda: build(path, n, tag_every=0))
    with ckptstore.Store(path) as s:
        t_gc = _timed(lambda: s.gc(keep_last=keep, grace=0))
        left = len(s.log())
    shutil.rmtree(path, ignore_errors=True)
    return t_build, t_gc, left


def table(sizes: list[int], results: dict[int, dict[str, float]], ops: tuple[str, ...] = (*OPS, "fd")) -> str:
    """Markdown: seconds per operation and size, and the growth exponent between sizes."""
    head = "| operation | " + " | ".join(f"{n:,} commits" for n in sizes) + " | " + " | ".join(
        f"k {a:,}→{b:,}" for a, b in zip(sizes, sizes[1:])) + " |"
    lines = [head, "|" + "---|" * (1 + 2 * len(sizes) - 1)]
    for op in ops:
        cells = [f"{results[n][op]:.0f}" if op == "fd" else f"{results[n][op]:.3f}" for n in sizes]
        ks = []
        for a, b in zip(sizes, sizes[1:]):
            ta, tb = results[a][op], results[b][op]
            ks.append(f"{math.log(tb / ta) / math.log(b / a):.2f}" if ta > 0 and tb > 0 else "-")
        lines.append(f"| {op} | " + " | ".join(cells) + " | " + " | ".join(ks) + " |")
    return "\n".join(lines)


BUCKET_OPS = ("commit", "tags (fresh)", "tags (warm)", "log (fresh)", "log limit 10 (fresh)", "info (fresh)", "show (fresh)", "fsck",
              "fsck --deep", "gc")


def measure_bucket(n: int, workdir: Path) -> dict[str, float]:
    """The same tiny commits on a bucket store (moto on loopback): ``n`` commits to
    ``latest`` (no other tag), then each operation; "fresh" ones from an empty cache (a
    machine that never saw the store), "warm" from the writer's cache."""
    import torch

    url = f"s3://bench/scale-{n}-{time.time_ns()}"
    x = torch.zeros(64, dtype=torch.int64)
    out: dict[str, float] = {}
    with ckptstore.Store(url, cache=workdir / f"w{n}") as s:
        t0 = time.perf_counter()
        for i in range(n):
            x[i % 64] = i
            s.commit({"x": x, "step": i}, tag="latest")
        out["commit"] = (time.perf_counter() - t0) / n
        fresh = lambda k: ckptstore.Store(url, cache=workdir / f"f{n}-{k}")  # noqa: E731
        out["tags (fresh)"] = _timed(lambda: fresh("t").tags())
        out["tags (warm)"] = _timed(s.tags)
        out["log (fresh)"] = _timed(lambda: fresh("l").log("latest"))
        out["log limit 10 (fresh)"] = _timed(lambda: fresh("k").log("latest", limit=10))
        out["info (fresh)"] = _timed(lambda: fresh("i").info("latest"))
        out["show (fresh)"] = _timed(lambda: fresh("s").show("latest"))
        out["fsck"] = _timed(s.fsck)
        out["fsck --deep"] = _timed(lambda: s.fsck(deep=True))
        out["gc"] = _timed(lambda: s.gc(keep_last=1, grace=0))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="100,1000,5000", help="commit counts, comma-separated")
    ap.add_argument("--gc-only", type=int, help="only the GC of this many commits, all but 10 droppable")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--bucket", default=None, help="commit counts of a bucket store on moto (e.g. 50,200,1000) instead")
    args = ap.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="ckptstore-scale-", dir=args.workdir))
    try:
        if args.bucket:
            import sys

            sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.s3server
            from tests.s3server import MotoServer

            sizes = [int(v) for v in args.bucket.split(",")]
            with MotoServer(buckets=["bench"], serialize=True) as server:
                os.environ.update(server.env)
                results = {n: measure_bucket(n, workdir) for n in sizes}
            print(table(sizes, results, BUCKET_OPS))
            return
        if args.gc_only:
            t_build, t_gc, left = gc_only(args.gc_only, workdir)
            print(f"{args.gc_only:,} commits: built in {t_build:.1f} s; gc (keep_last=10) {t_gc:.2f} s; {left} commits left")
            return
        sizes = [int(v) for v in args.sizes.split(",")]
        results = {}
        for n in sizes:
            results[n] = measure(n, workdir)
            print(f"{n:,} commits: " + ", ".join(f"{k} {v:.3f}" for k, v in results[n].items()), flush=True)
        print(table(sizes, results))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
