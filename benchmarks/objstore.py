"""A store on object storage (``Store("s3://bucket/prefix")``) against the wire: commit,
re-commit, partial and whole checkout, push, each next to what the same client needs to
move the same bytes, on moto's S3 server on loopback.

    .venv/bin/python -m benchmarks.objstore                  # 1 GiB state, 3 repetitions
    .venv/bin/python -m benchmarks.objstore --quick          # 64 MiB, 1 repetition: a smoke run, ~10-20 s
    .venv/bin/python -m benchmarks.objstore --ops commit --uploads 8 --pack-mib 32   # an experiment (not the defaults)

One moto server (tests/s3server.py, started here on 127.0.0.1, **not serialized**:
``serialize=False``, moto's plain threaded server, requests overlap; nothing here races
on a ref) holds every object; ``XDG_CACHE_HOME`` points into a temporary folder, so
every store's local cache is fresh. The state is a dict of random float32 tensors of
4 KiB rows (``torch.rand``: incompressible, ckptstore stores it raw), ``--size-mib``
in all: ``blocks/b0`` 6/16, ``b1`` and ``b2`` 4/16 each, ``b3`` 1/16 and ``head`` 1/16
(64 MiB of 1 GiB). A "1 % change" adds 1 to one contiguous block of 1 % of the rows of
every tensor (a ring buffer's overwrite, a fine-tuned slice). Each repetition uses fresh
prefixes and deletes them afterwards. Operations:

1. **commit** of the state into an empty prefix (a new :class:`~ckptstore.Store` on ``s3://``,
   opened outside the timed window) against the **wire floor**: the same bytes as ONE
   object, one create-only PUT of one contiguous buffer through the same client
   (``S3Backend.put_new``, obstore), the two in alternating order. Target: <= 1.3x.
   ``phases`` breaks the commit down: hashing (``_leaves``), the write loop, the wait
   for the uploads (``finish``), and ``index_commit`` (reused-pack checks, record PUT,
   ref CAS, reflog), and from the client's PUTs the pack-upload span and concurrency.
2. **re-commit** after a 1 % change, by the same store: objects and bytes new on the
   bucket (the prefix listed before and after) / the state's bytes. Target: <= 2 %.
3. **partial checkout** of ``head`` from a FRESH process (a child interpreter, a new
   ``XDG_CACHE_HOME``, a new store): bytes fetched against ``head``'s stored bytes
   (its blobs' entries, headers included). Two counts: the blob bytes the reader got
   (``store.io.bytes_read``), and every payload byte the store's client fetched
   (marker, refs, records, ``.idx``, packs; ranged reads counted as sent on the wire,
   i.e. merged as obstore merges them): the store's backend is :class:`CountingBackend`.
   Target: <= 1.1x for both. The open and checkout are timed together.
4. **whole checkout**, in the same child with another fresh cache and store, against
   the **read floor**: one GET of the floor's object (``obstore.get(...).bytes()``).
5. **push** of the state committed in a local store (on the disk of ``--workdir``) to a
   fresh prefix, then of a commit after a 1 % change (blobs mostly present):
   ``TransferReport.objects_written`` / ``bytes_written`` and the bucket's listing.

moto on loopback is CPU-bound Python on the same (2, shared) cores as the client: the
absolute numbers are moto's, the ratios of medians measured in one run are the result.
Results: a table on stdout and JSON (``--output``, default
``benchmarks/results/objstore-<date>.json``). Exit status 1 if a target is missed
(not with ``--quick``: at 64 MiB the 256 KiB shards round a 1 % change up to ~3 %).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))  # tests.s3server when run from anywhere

MiB = 1 << 20
ROW = 1024  # float32 elements per row: 4 KiB
CHANGE = 0.01
BUCKET = "bench"
PARTIAL = "head"
SIXTEENTHS = {"blocks/b0": 6, "blocks/b1": 4, "blocks/b2": 4, "blocks/b3": 1, "head": 1}
OPS = ("commit", "recommit", "partial", "whole", "push")
TARGETS = {"commit_over_floor": 1.3, "recommit_uploaded_fraction": 0.02, "partial_blob_over_stored": 1.1, "partial_total_over_stored": 1.1}


# --- counting what a store's client sends and fetches -------------------------------------------


def category(key: str) -> str:
    """What an object of a store is, from its key (relative to the store's prefix)."""
    if key == "ckptstore.json":
        return "marker"
    if key.endswith(".pack"):
        return "packs"
    if key.endswith(".idx"):
        return "idx"
    head = key.split("/", 1)[0]
    return {"refs": "refs", "commits": "records", "reflog": "reflog", "gc": "gc", "blobs": "blobs"}.get(head, "other")


def merged(ranges: list[tuple[int, int]], gap: int) -> list[tuple[int, int]]:
    """Ranges as obstore requests them: sorted, and merged when at most ``gap`` bytes apart
    (object_store's ``merge_ranges``)."""
    out: list[list[int]] = []
    for s, e in sorted(ranges):
        if out and s <= out[-1][1] + gap:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


class Counter:
    """Requests and payload bytes by operation and object category; PUT intervals. Thread-safe."""

    def __init__(self):
        self.lock = threading.Lock()
        self.fetched: dict[str, dict[str, int]] = {}  # category -> {"requests", "bytes"} (GETs, ranged GETs: wire payload)
        self.requested = 0  # bytes the ranged reads asked for (before merging)
        self.other: dict[str, int] = {"head": 0, "list": 0}
        self.puts: list[tuple[float, float, str, int]] = []  # (start, end, key, bytes)

    def got(self, key: str, requests: int, nbytes: int) -> None:
        with self.lock:
            c = self.fetched.setdefault(category(key), {"requests": 0, "bytes": 0})
            c["requests"] += requests
            c["bytes"] += nbytes

    def count(self, what: str) -> None:
        with self.lock:
            self.other[what] += 1

    def put(self, t0: float, t1: float, key: str, nbytes: int) -> None:
        with self.lock:
            self.puts.append((t0, t1, key, nbytes))

    def total_fetched(self) -> int:
        return sum(c["bytes"] for c in self.fetched.values())

    def summary(self) -> dict:
        put_bytes: dict[str, dict[str, int]] = {}
        for _, _, key, n in self.puts:
            c = put_bytes.setdefault(category(key), {"requests": 0, "bytes": 0})
            c["requests"] += 1
            c["bytes"] += n
        return {"fetched": self.fetched, "fetched_bytes": self.total_fetched(), "ranges_requested_bytes": self.requested,
                "head_requests": self.other["head"], "list_requests": self.other["list"], "put": put_bytes}


class _Got:
    def __init__(self, got, counter: Counter, key: str):
        self._got, self._counter, self._key = got, counter, key

    def __getattr__(self, name):
        return getattr(self._got, name)

    def bytes(self):
        b = self._got.bytes()
        self._counter.got(self._key, 1, len(b))
        return b


class _CountingObstore:
    """The obstore module as S3Backend calls it, counting every request it makes."""

    def __init__(self, obs, counter: Counter):
        self._obs, self.counter = obs, counter

    def __getattr__(self, name):
        return getattr(self._obs, name)

    def get(self, store, key, *args, **kwargs):
        return _Got(self._obs.get(store, key, *args, **kwargs), self.counter, key)

    def get_ranges(self, store, key, *, starts, ends, coalesce):
        out = self._obs.get_ranges(store, key, starts=starts, ends=ends, coalesce=coalesce)
        wire = merged(list(zip(starts, ends)), coalesce)
        self.counter.got(key, len(wire), sum(e - s for s, e in wire))
        with self.counter.lock:
            self.counter.requested += sum(e - s for s, e in zip(starts, ends))
        return out

    def head(self, store, key):
        self.counter.count("head")
        return self._obs.head(store, key)

    def list(self, store, *args, **kwargs):
        self.counter.count("list")
        return self._obs.list(store, *args, **kwargs)

    def put(self, store, key, data, **kwargs):
        n = len(data) if isinstance(data, (bytes, bytearray, memoryview)) else sum(len(p) for p in data)
        t0 = time.perf_counter()
        try:
            return self._obs.put(store, key, data, **kwargs)
        finally:
            self.counter.put(t0, time.perf_counter(), key, n)


def counting_backend(url: str):
    """An :class:`~ckptstore.backends.S3Backend` for ``url`` whose client counts its
    requests (``.counter``: a :class:`Counter`); pass it as ``Store(url, backend=…)``."""
    from ckptstore.backends import S3Backend

    class CountingBackend(S3Backend):
        def __init__(self, url: str, **kwargs):
            super().__init__(url, **kwargs)
            self.counter = Counter()
            self.counter.count("list")  # the constructor's probe (a list of refs/, one request)
            self._obs = _CountingObstore(self._obs, self.counter)

    return CountingBackend(url)


# --- the state -------------------------------------------------------------------------------------


def make_state(size_mib: int, seed: int = 0) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    state: dict = {}
    for path, n in SIXTEENTHS.items():
        rows = max(1, size_mib * MiB * n // 16 // (ROW * 4))
        *outer, name = path.split("/")
        d = state
        for k in outer:
            d = d.setdefault(k, {})
        d[name] = torch.rand(rows, ROW, generator=g)
    return state


def leaves(state) -> dict:
    """``{path: tensor}`` of a nested dict or a TensorDict."""
    out = {}
    for k, v in state.items():
        if isinstance(v, dict) or hasattr(v, "batch_size"):
            out.update({f"{k}/{p}": t for p, t in leaves(v).items()})
        else:
            out[k] = v
    return out


def change(state: dict, gen) -> int:
    """Add 1 to one contiguous block of 1 % of the rows of every tensor; returns the bytes changed."""
    import torch

    n = 0
    for t in leaves(state).values():
        rows = max(1, round(t.shape[0] * CHANGE))
        start = int(torch.randint(0, t.shape[0] - rows + 1, (1,), generator=gen))
        t[start : start + rows] += 1.0
        n += rows * t.shape[1] * 4
    return n


def digests(state) -> dict[str, str]:
    import xxhash

    return {p: xxhash.xxh3_128_hexdigest(t.contiguous().numpy().view("uint8")) for p, t in sorted(leaves(state).items())}


# --- the bucket ------------------------------------------------------------------------------------


def root_store():
    from obstore.store import S3Store

    return S3Store(BUCKET)  # endpoint, credentials and region from the environment


def listing(prefix: str) -> dict[str, tuple[int, str | None]]:
    """``{key: (size, etag)}`` of every object under ``prefix/`` (refs and reflog included)."""
    import obstore

    return {m["path"]: (m["size"], m["e_tag"]) for chunk in obstore.list(root_store(), prefix + "/", chunk_size=1000) for m in chunk}


def uploaded(before: dict, after: dict) -> dict[str, int]:
    """``{key: size}`` of the objects new or rewritten (another ETag: a ref moved) between two listings."""
    return {k: v[0] for k, v in after.items() if before.get(k) != v}


def delete_prefix(prefix: str) -> None:
    import obstore

    store = root_store()
    for key in listing(prefix):
        obstore.delete(store, key)


@contextmanager
def peak_rss():
    """``{"delta": peak RSS during the block - RSS before}`` in bytes (VmHWM reset through
    /proc/self/clear_refs, as benchmarks.measure; the lifetime peak where that is refused)."""
    from .measure import _status, reset_peak_rss

    out: dict = {}
    reset_peak_rss()
    before = _status()["VmRSS"]
    try:
        yield out
    finally:
        out["delta"] = _status()["VmHWM"] - before


# --- timing the commit's phases --------------------------------------------------------------------


@contextmanager
def phases(store, counter: Counter):
    """Time the phases of ``store``'s next commit (wrapping its methods on the instance)."""
    marks: dict[str, float] = {}
    committer = store._committer  # (hashing is the committer's, the index step the home's)
    orig_leaves, orig_writer, orig_index = committer._leaves, store.pack_writer, store.home.index_commit

    def timed_leaves(*a, **k):
        marks["hash_start"] = time.perf_counter()
        try:
            return orig_leaves(*a, **k)
        finally:
            marks["hash_end"] = time.perf_counter()

    def timed_writer():
        w = orig_writer()
        finish = w.finish

        def timed_finish():
            marks.setdefault("finish_start", time.perf_counter())
            finish()
            marks["finish_end"] = time.perf_counter()

        w.finish = timed_finish
        return w

    def timed_index(*a, **k):
        marks["index_start"] = time.perf_counter()
        try:
            return orig_index(*a, **k)
        finally:
            marks["index_end"] = time.perf_counter()

    committer._leaves, store.pack_writer, store.home.index_commit = timed_leaves, timed_writer, timed_index
    out: dict = {}
    marks["start"] = time.perf_counter()
    try:
        yield out
    finally:
        marks["end"] = time.perf_counter()
        del committer._leaves, store.pack_writer, store.home.index_commit
        packs = [(a, b, n) for a, b, key, n in counter.puts if key.endswith(".pack") and a >= marks["start"]]
        out.update({
            "capture_s": marks.get("hash_start", marks["start"]) - marks["start"],
            "hash_s": marks.get("hash_end", 0) - marks.get("hash_start", 0),
            "write_loop_s": marks.get("finish_start", 0) - marks.get("hash_end", 0),
            "upload_wait_s": marks.get("finish_end", 0) - marks.get("finish_start", 0),
            "index_commit_s": marks.get("index_end", 0) - marks.get("index_start", 0),
        })
        if packs:
            span = max(b for _, b, _ in packs) - min(a for a, _, _ in packs)
            out.update({
                "first_pack_put_at_s": min(a for a, _, _ in packs) - marks["start"],
                "pack_puts": len(packs),
                "pack_put_span_s": span,
                "pack_put_sum_s": sum(b - a for a, b, _ in packs),
                "pack_put_concurrency": sum(b - a for a, b, _ in packs) / span if span else 0.0,
                "pack_put_median_s": statistics.median(b - a for a, b, _ in packs),
            })


def warm_up() -> None:
    """Import what a commit and a checkout import lazily (adapters, tensordict...) with a
    tiny local store, so no timed window pays library imports (as benchmarks.run)."""
    import torch

    import ckptstore

    with tempfile.TemporaryDirectory() as d, ckptstore.Store(d) as s:
        s.commit({"a": {"b": torch.zeros(2, 4)}, "c": torch.ones(3)}, tag="w")
        s.checkout("w")
        s.checkout("w", partial="c")


# --- the fresh-process checkouts (a child interpreter) ------------------------------------------------


def child(spec: dict) -> dict:
    """Run in a child: partial checkout with a fresh cache and store, then the whole
    checkout (another fresh cache) and the read floor, in ``spec["order"]``."""
    import obstore

    from ckptstore import Store

    out: dict = {}
    caches = Path(spec["caches"])
    warm_up()

    def checkout(name: str, partial):
        os.environ["XDG_CACHE_HOME"] = str(caches / name)
        t0 = time.perf_counter()
        backend = counting_backend(spec["url"])
        store = Store(spec["url"], create=False, backend=backend)
        td = store.checkout("main", partial=partial)
        seconds = time.perf_counter() - t0
        r = {"seconds": seconds, "io_bytes_read": store.io.bytes_read, "io_blobs_read": store.io.blobs_read, **backend.counter.summary(),
             "digests": digests(td)}
        store.close()
        del td
        return r

    if "partial" in spec["ops"]:
        out["partial"] = checkout("partial", spec["partial"])
    for op in spec["order"]:
        if op == "whole" and "whole" in spec["ops"]:
            out["whole"] = checkout("whole", None)
        elif op == "floor" and "whole" in spec["ops"]:
            store = root_store()
            t0 = time.perf_counter()
            buf = obstore.get(store, spec["floor_key"]).bytes()
            out["floor_get"] = {"seconds": time.perf_counter() - t0, "bytes": len(buf)}
            del buf
    return out


def run_child(spec: dict, cache_root: Path) -> dict:
    import ckptstore

    env = dict(os.environ)
    src = str(Path(ckptstore.__file__).resolve().parents[1])  # the ckptstore this process imported
    env["PYTHONPATH"] = os.pathsep.join([src, str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["XDG_CACHE_HOME"] = str(cache_root)
    proc = subprocess.run([sys.executable, "-m", "benchmarks.objstore", "--child", json.dumps(spec)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1800, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"checkout child failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --- one repetition --------------------------------------------------------------------------------


def repetition(rep: int, state: dict, floor_buf, gen, args, work: Path) -> dict:
    import ckptstore
    from ckptstore import Store
    from ckptstore.objects.packs import BLOB_HEADER

    tag = f"r{rep}-{os.getpid()}"
    url = f"s3://{BUCKET}/commit-{tag}"
    prefix = f"commit-{tag}"
    floor_key = f"floor-{tag}/state"
    state_bytes = sum(t.numel() * 4 for t in leaves(state).values())
    out: dict = {}
    kwargs = {} if args.pack_mib is None else {"pack_bytes": args.pack_mib * MiB}
    try:
        if "commit" in args.ops or "recommit" in args.ops or "partial" in args.ops or "whole" in args.ops:
            floor_backend = counting_backend(f"s3://{BUCKET}")
            backend = counting_backend(url)
            store = Store(url, backend=backend, **kwargs)
            order = ["floor", "commit"] if rep % 2 == 0 else ["commit", "floor"]
            for op in order:
                if op == "floor":
                    with peak_rss() as rss:
                        t0 = time.perf_counter()
                        done = floor_backend.put_new(floor_key, floor_buf)
                        out["floor_put_s"] = time.perf_counter() - t0
                    if not done:
                        raise RuntimeError(f"{floor_key} already existed")
                    out["floor_put_peak_rss_delta"] = rss["delta"]
                else:
                    with phases(store, backend.counter) as ph, peak_rss() as rss:
                        t0 = time.perf_counter()
                        info = store.commit(state, tag="main")
                        out["commit_s"] = time.perf_counter() - t0
                    out["commit_peak_rss_delta"] = rss["delta"]
                    first = listing(prefix)
                    out["commit_phases"] = ph
                    out["commit_objects"], out["commit_bytes"] = len(first), sum(n for n, _ in first.values())
                    out["commit_stored_bytes"] = info.stored_bytes
            out["first_commit"] = info.id
            if "recommit" in args.ops or "partial" in args.ops or "whole" in args.ops:
                out["changed_bytes"] = change(state, gen)
                before = listing(prefix)
                with phases(store, backend.counter) as ph:
                    t0 = time.perf_counter()
                    info2 = store.commit(state, tag="main")
                    out["recommit_s"] = time.perf_counter() - t0
                new = uploaded(before, listing(prefix))
                out["recommit_phases"] = ph
                out["recommit_objects"], out["recommit_bytes"] = len(new), sum(new.values())
                out["recommit_new_bytes"], out["recommit_stored_bytes"] = info2.new_bytes, info2.stored_bytes
                out["recommit_fraction"] = out["recommit_bytes"] / state_bytes
                keys = [k for r in store.manifest(info2.id, [PARTIAL]) for k in r.keys]
                out["partial_logical_bytes"] = sum(n for _, n in dict.fromkeys(keys))
                out["partial_stored_bytes"] = sum(BLOB_HEADER.size + loc.stored_len for loc in store.locate(list(dict.fromkeys(keys))).values())
            store.close()
            floor_backend.close()
            if "partial" in args.ops or "whole" in args.ops:
                expect = digests(state)
                spec = {"url": url, "partial": PARTIAL, "floor_key": floor_key, "caches": str(work / f"child-{rep}"),
                        "order": ["whole", "floor"] if rep % 2 == 0 else ["floor", "whole"], "ops": args.ops}
                got = run_child(spec, work / f"child-{rep}")
                if "partial" in got:
                    p = got.pop("partial")
                    assert p["digests"] == {k: v for k, v in expect.items() if k.startswith(PARTIAL)}, "partial checkout returned other bytes"
                    del p["digests"]
                    out["partial"] = p
                    out["partial_s"] = p["seconds"]
                    out["partial_blob_over_stored"] = p["io_bytes_read"] / out["partial_stored_bytes"]
                    out["partial_total_over_stored"] = p["fetched_bytes"] / out["partial_stored_bytes"]
                if "whole" in got:
                    w = got.pop("whole")
                    assert w["digests"] == expect, "whole checkout returned other bytes"
                    del w["digests"]
                    out["whole"] = w
                    out["whole_s"] = w["seconds"]
                    out["floor_get_s"] = got["floor_get"]["seconds"]
                    assert got["floor_get"]["bytes"] == state_bytes
        if "push" in args.ops:
            local = ckptstore.Store(work / f"local-{rep}")
            local.commit(state, tag="main")
            push_url = f"s3://{BUCKET}/push-{tag}"
            for i in (1, 2):
                if i == 2:
                    change(state, gen)
                    local.commit(state, tag="main")
                before = listing(f"push-{tag}")
                backend = counting_backend(push_url)
                t0 = time.perf_counter()
                report = local.push(backend, "main")
                out[f"push{i}_s"] = time.perf_counter() - t0
                new = uploaded(before, listing(f"push-{tag}"))
                out[f"push{i}"] = {"objects_written": report.objects_written, "bytes_written": report.bytes_written,
                                   "blobs_copied": report.blobs_copied, "bytes_copied": report.bytes_copied,
                                   "listed_new_objects": len(new), "listed_new_bytes": sum(new.values()), **backend.counter.summary()}
                out[f"push{i}_fraction"] = report.bytes_written / state_bytes
                backend.close()
            local.close()
    finally:
        for p in (prefix, f"floor-{tag}", f"push-{tag}"):
            delete_prefix(p)
        for p in work.iterdir():
            shutil.rmtree(p, ignore_errors=True)
    return out


# --- a sweep of settings, in one run -------------------------------------------------------------------


def parse_sweep(text: str) -> list[dict]:
    """``"uploads=4,pack_mib=64;put_mib=16,threads=4;put_mib=1024"`` -> variants: commits with
    ``bucket.UPLOADS`` and ``pack_bytes`` set, or raw PUTs of the state's bytes cut in
    ``put_mib`` pieces, ``threads`` at a time (``put_mib`` >= the size: the one-PUT floor)."""
    out = []
    for part in (p for p in text.split(";") if p.strip()):
        v = {k.strip(): int(x) for k, x in (kv.split("=") for kv in part.split(","))}
        if set(v) - {"uploads", "pack_mib", "put_mib", "threads"} or ("put_mib" in v) == bool({"uploads", "pack_mib"} & set(v)):
            raise ValueError(f"bad sweep variant {part!r}: uploads=N,pack_mib=M (a commit) or put_mib=M[,threads=T] (raw PUTs)")
        v["name"] = part.strip()
        out.append(v)
    return out


def sweep(variants: list[dict], state: dict, floor_buf, reps: int) -> list[dict]:
    """Each repetition runs every variant once, in an order rotated by one per repetition;
    every commit goes to a fresh prefix with a fresh cache, deleted afterwards."""
    from concurrent.futures import ThreadPoolExecutor

    import ckptstore.home.bucket
    from ckptstore import Store

    default_uploads = ckptstore.home.bucket.UPLOADS
    results: list[dict] = []
    for rep in range(reps):
        row: dict = {}
        shift = rep % len(variants)
        for i, v in enumerate(variants[shift:] + variants[:shift]):
            prefix = f"sweep-{rep}-{variants.index(v)}-{os.getpid()}"
            try:
                if "put_mib" in v:
                    backend = counting_backend(f"s3://{BUCKET}/{prefix}")
                    step = v["put_mib"] * MiB
                    pieces = [floor_buf[o : o + step] for o in range(0, len(floor_buf), step)]
                    with ThreadPoolExecutor(v.get("threads", 1)) as pool, peak_rss() as rss:
                        t0 = time.perf_counter()
                        done = list(pool.map(lambda kp, b=backend: b.put_new(f"piece-{kp[0]:05d}", kp[1]), enumerate(pieces)))
                        seconds = time.perf_counter() - t0
                    if not all(done):
                        raise RuntimeError(f"{prefix}: a piece already existed")
                    m = {"seconds": seconds, "peak_rss_delta": rss["delta"], "objects": len(pieces)}
                else:
                    backend = counting_backend(f"s3://{BUCKET}/{prefix}")
                    ckptstore.home.bucket.UPLOADS = v.get("uploads", default_uploads)  # read when the store starts its upload threads
                    try:
                        store = Store(f"s3://{BUCKET}/{prefix}", backend=backend,
                                            **({"pack_bytes": v["pack_mib"] * MiB} if "pack_mib" in v else {}))
                    finally:
                        ckptstore.home.bucket.UPLOADS = default_uploads
                    with phases(store, backend.counter) as ph, peak_rss() as rss:
                        t0 = time.perf_counter()
                        store.commit(state, tag="main")
                        seconds = time.perf_counter() - t0
                    store.close()
                    m = {"seconds": seconds, "peak_rss_delta": rss["delta"], "objects": len(listing(prefix)), "phases": ph}
                backend.close()
            finally:
                delete_prefix(prefix)
            m["position"] = i
            row[v["name"]] = m
        results.append(row)
        print(f"repetition {rep + 1}/{reps}: " + ", ".join(f"{k} {m['seconds']:.3f}" for k, m in row.items()), flush=True)
    return results


def summarize_sweep(variants: list[dict], results: list[dict]) -> dict:
    names = [v["name"] for v in variants]
    med = {n: statistics.median(r[n]["seconds"] for r in results) for n in names}
    out = {n: {"seconds": _stats([r[n]["seconds"] for r in results]), "peak_rss_delta": _stats([r[n]["peak_rss_delta"] for r in results]),
               "objects": results[0][n]["objects"], "over_first": med[n] / med[names[0]]} for n in names}
    one_put = next((v["name"] for v in variants if "put_mib" in v and results[0][v["name"]]["objects"] == 1), None)
    for n in names:
        if one_put is not None:
            out[n]["over_one_put"] = med[n] / med[one_put]
        phs = [r[n]["phases"] for r in results if "phases" in r[n]]
        if phs:
            out[n]["phases"] = {k: statistics.median(p[k] for p in phs if k in p) for k in phs[0]}
    return out


def print_sweep(doc: dict) -> None:
    print(f"\nsweep, {doc['meta']['size_mib']} MiB state, median [min-max] of {doc['meta']['repetitions']} (one run, rotated order):")
    print(f"  {'variant':<34}{'seconds':>26}{'/ first':>9}{'/ one PUT':>11}{'objects':>9}{'peak RSS +MiB':>15}  pack PUTs: concurrency, each s")
    for n, m in doc["summary"]["sweep"].items():
        ph = m.get("phases", {})
        extra = f"  {ph.get('pack_put_concurrency', 0):.2f}, {ph.get('pack_put_median_s', 0):.3f}" if ph else ""
        print(f"  {n:<34}{_s(m, 'seconds'):>26}{m['over_first']:>9.3f}{m.get('over_one_put', float('nan')):>11.3f}{m['objects']:>9}"
              f"{m['peak_rss_delta']['median'] / MiB:>15.0f}{extra}")


# --- summary and table -------------------------------------------------------------------------------


def _stats(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(reps: list[dict], state_bytes: int) -> dict:
    scalars = sorted({k for r in reps for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
    metrics = {k: _stats([r[k] for r in reps if k in r]) for k in scalars}
    for ph in ("commit_phases", "recommit_phases"):
        keys = sorted({k for r in reps for k in r.get(ph, {})})
        if keys:
            metrics[ph] = {k: _stats([r[ph][k] for r in reps if k in r.get(ph, {})]) for k in keys}
    med = {k: v["median"] for k, v in metrics.items() if "median" in v}
    ratios = {}
    if "commit_s" in med and "floor_put_s" in med:
        ratios["commit_over_floor"] = med["commit_s"] / med["floor_put_s"]
    if "recommit_bytes" in med:
        ratios["recommit_uploaded_fraction"] = med["recommit_bytes"] / state_bytes
    if "partial_blob_over_stored" in med:
        ratios["partial_blob_over_stored"] = med["partial_blob_over_stored"]
        ratios["partial_total_over_stored"] = med["partial_total_over_stored"]
    if "whole_s" in med and "floor_get_s" in med:
        ratios["whole_checkout_over_floor_get"] = med["whole_s"] / med["floor_get_s"]
    if "push1_s" in med and "floor_put_s" in med:
        ratios["push1_over_floor_put"] = med["push1_s"] / med["floor_put_s"]
    for i in (1, 2):
        if f"push{i}_fraction" in med:
            ratios[f"push{i}_bytes_over_state"] = med[f"push{i}_fraction"]
    verdicts = {k: ratios[k] <= t for k, t in TARGETS.items() if k in ratios}
    return {"metrics": metrics, "ratios": ratios, "targets": TARGETS, "met": verdicts}


def _s(m: dict, k: str) -> str:
    v = m.get(k)
    return "-" if v is None else f"{v['median']:.3f} [{v['min']:.3f}-{v['max']:.3f}]"


def print_table(doc: dict) -> None:
    m, q, met = doc["summary"]["metrics"], doc["summary"]["ratios"], doc["summary"]["met"]
    mib = doc["meta"]["size_mib"]
    sb = doc["meta"]["state_bytes"]

    def mark(key: str) -> str:
        return "" if key not in met else ("  ok" if met[key] else "  MISSED")

    def med(k: str) -> float:
        return m[k]["median"]

    print(f"\nckptstore on object storage (moto, loopback, not serialized): {mib} MiB state, median [min-max] of {doc['meta']['repetitions']}, seconds")
    print(f"  {'operation':<44}{'ckptstore':>26}{'floor':>26}{'ratio':>9}  target")
    if "commit_s" in m:
        print(f"  {'commit (empty prefix) vs one PUT':<44}{_s(m, 'commit_s'):>26}{_s(m, 'floor_put_s'):>26}"
              f"{q['commit_over_floor']:>9.3f}  <= 1.3{mark('commit_over_floor')}")
        if "commit_peak_rss_delta" in m:
            print(f"      peak RSS during the operation - RSS before: commit +{med('commit_peak_rss_delta') / MiB:.0f} MiB, "
                  f"one PUT +{med('floor_put_peak_rss_delta') / MiB:.0f} MiB")
    if "whole_s" in m:
        print(f"  {'whole checkout (fresh) vs one GET':<44}{_s(m, 'whole_s'):>26}{_s(m, 'floor_get_s'):>26}"
              f"{q['whole_checkout_over_floor_get']:>9.3f}")
    if "recommit_s" in m:
        print(f"  {'re-commit after 1 % change':<44}{_s(m, 'recommit_s'):>26}")
        print(f"      uploaded: {med('recommit_objects'):.0f} objects, {med('recommit_bytes') / MiB:.2f} MiB = "
              f"{q['recommit_uploaded_fraction']:.2%} of the state (changed: {med('changed_bytes') / sb:.2%}){'':8}target <= 2 %"
              f"{mark('recommit_uploaded_fraction')}")
    if "partial_s" in m:
        print(f"  {f'partial checkout {PARTIAL!r}, fresh process':<44}{_s(m, 'partial_s'):>26}")
        print(f"      {PARTIAL} stored {med('partial_stored_bytes') / MiB:.2f} MiB; blob bytes read / stored {q['partial_blob_over_stored']:.4f}"
              f"{mark('partial_blob_over_stored')}; all bytes fetched / stored {q['partial_total_over_stored']:.4f}{mark('partial_total_over_stored')}"
              "  (target <= 1.1)")
    for i, what in ((1, "push (empty prefix) vs one PUT"), (2, "push after 1 % change")):
        if f"push{i}_s" in m:
            ratio = f"{_s(m, 'floor_put_s'):>26}{q['push1_over_floor_put']:>9.3f}" if i == 1 and "push1_over_floor_put" in q else ""
            print(f"  {what:<44}{_s(m, f'push{i}_s'):>26}{ratio}")
            print(f"      uploaded: {med(f'push{i}_objects'):.0f} objects, {med(f'push{i}_bytes') / MiB:.2f} MiB = "
                  f"{q[f'push{i}_bytes_over_state']:.2%} of the state")
    if "commit_phases" in m:
        ph = {k: v["median"] for k, v in m["commit_phases"].items()}
        print(f"  commit phases (medians, s): capture {ph.get('capture_s', 0):.3f}, hash {ph.get('hash_s', 0):.3f}, "
              f"write loop {ph.get('write_loop_s', 0):.3f}, upload wait {ph.get('upload_wait_s', 0):.3f}, index_commit {ph.get('index_commit_s', 0):.3f}; "
              f"{ph.get('pack_puts', 0):.0f} pack PUTs from {ph.get('first_pack_put_at_s', 0):.3f} s, span {ph.get('pack_put_span_s', 0):.3f} s, "
              f"concurrency {ph.get('pack_put_concurrency', 0):.2f}, each {ph.get('pack_put_median_s', 0):.3f} s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.objstore", description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=int, default=None, help="state size, MiB (default 1024; --quick: 64)")
    ap.add_argument("-r", "--repeat", type=int, default=None, help="repetitions (default 3; --quick: 1)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 64 MiB, 1 repetition")
    ap.add_argument("--ops", default=",".join(OPS), help=f"subset of {','.join(OPS)} (partial and whole need the commits)")
    ap.add_argument("--workdir", default=tempfile.gettempdir(), help="where the temporary folder (caches, the local store of push) goes")
    ap.add_argument("-o", "--output", default=None, help="JSON results (default benchmarks/results/objstore-<date>.json)")
    ap.add_argument("--uploads", type=int, default=None, help="experiment: ckptstore.home.bucket.UPLOADS (parallel pack PUTs) for this run")
    ap.add_argument("--pack-mib", type=int, default=None, help="experiment: pack_bytes of the committing store, MiB")
    ap.add_argument("--sweep", help="experiment: only commits and raw PUTs, variants in one run, e.g. "
                    "'uploads=4,pack_mib=64;uploads=8,pack_mib=16;put_mib=1024' (see parse_sweep)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    args.size_mib = args.size_mib or (64 if args.quick else 1024)
    args.repeat = args.repeat or (1 if args.quick else 3)
    args.ops = [o for o in args.ops.split(",") if o]
    if bad := set(args.ops) - set(OPS):
        ap.error(f"unknown --ops {sorted(bad)}")
    variants = parse_sweep(args.sweep) if args.sweep else None
    if {"partial", "whole"} & set(args.ops) or "recommit" in args.ops:
        args.ops = list(dict.fromkeys(["commit", *args.ops]))

    from tests.s3server import MotoServer

    from .run import _git, _host, _versions

    t_start = time.perf_counter()
    started = datetime.now(timezone.utc)
    work = Path(tempfile.mkdtemp(prefix="ckptstore-objbench-", dir=args.workdir))
    reps: list[dict] = []
    try:
        os.environ["XDG_CACHE_HOME"] = str(work / "cache")
        with MotoServer(buckets=[BUCKET], serialize=False) as server:
            os.environ.update(server.env)
            import torch

            import ckptstore
            import ckptstore.home.bucket

            defaults = {"UPLOADS": ckptstore.home.bucket.UPLOADS, "REQUESTS": ckptstore.home.bucket.REQUESTS, "PACK_BYTES": ckptstore.objects.bucketformat.PACK_BYTES}
            if args.uploads is not None:
                ckptstore.home.bucket.UPLOADS = args.uploads
            state = make_state(args.size_mib)
            state_bytes = sum(t.numel() * 4 for t in leaves(state).values())
            floor_buf = memoryview(torch.cat([t.flatten() for t in leaves(state).values()]).numpy()).cast("B")
            gen = torch.Generator().manual_seed(1)
            warm_up()
            with ckptstore.Store(f"s3://{BUCKET}/warm-up") as s:  # and the client's first requests
                s.commit({"a": torch.zeros(4)}, tag="w")
                s.checkout("w")
            delete_prefix("warm-up")
            if variants is not None:
                sweep_results = sweep(variants, state, floor_buf, args.repeat)
            for rep in range(args.repeat if variants is None else 0):
                rep_dir = work / f"rep-{rep}"
                rep_dir.mkdir()
                t0 = time.perf_counter()
                r = repetition(rep, state, floor_buf, gen, args, rep_dir)
                r["repetition_s"] = time.perf_counter() - t0
                reps.append(r)
                print(f"repetition {rep + 1}/{args.repeat}: {r['repetition_s']:.1f} s "
                      + ", ".join(f"{k} {r[k]:.3f}" for k in ("commit_s", "floor_put_s", "recommit_s", "partial_s", "whole_s", "floor_get_s",
                                                               "push1_s", "push2_s") if k in r), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for r in reps:  # flat numbers for the summary
        for i in (1, 2):
            if f"push{i}" in r:
                r[f"push{i}_objects"], r[f"push{i}_bytes"] = r[f"push{i}"]["objects_written"], r[f"push{i}"]["bytes_written"]
    doc = {
        "meta": {
            "started": started.isoformat(timespec="seconds"),
            "wall_s": time.perf_counter() - t_start,
            "size_mib": args.size_mib,
            "state_bytes": state_bytes,
            "tensors": {p: list(t.shape) for p, t in leaves(state).items()},
            "repetitions": args.repeat,
            "quick": args.quick,
            "ops": args.ops,
            "server": "moto (tests/s3server.py) on 127.0.0.1, serialize=False (threaded, requests overlap)",
            "floor_put": "S3Backend.put_new (obstore put, mode='create': one PUT) of one contiguous buffer of the state's bytes",
            "floor_get": "obstore.get(...).bytes() of that object, in the checkout child",
            "change": f"{CHANGE:.0%} of the rows of every tensor, one contiguous block each, +1.0",
            "partial": f"checkout(partial={PARTIAL!r}) in a child process with a fresh XDG_CACHE_HOME and store; open + checkout timed; "
                       "fetched bytes: payloads of every GET, ranged GETs as merged on the wire",
            "library_defaults": defaults,
            "settings": {"UPLOADS": args.uploads or defaults["UPLOADS"], "pack_bytes": (args.pack_mib * MiB) if args.pack_mib else defaults["PACK_BYTES"],
                         "experiment": args.uploads is not None or args.pack_mib is not None},
            "ckptstore": str(Path(ckptstore.__file__).resolve().parent),
            "host": {**_host(), "loadavg_end": os.getloadavg()},
            "versions": {**_versions(), **{p: _version(p) for p in ("obstore", "moto")}},
            "git": _git(),
            "argv": sys.argv[1:] if argv is None else argv,
        },
        "repetitions": reps,
        "summary": summarize(reps, state_bytes),
    }
    if variants is not None:
        doc["meta"]["sweep"] = variants
        doc["repetitions"] = sweep_results
        doc["summary"] = {"sweep": summarize_sweep(variants, sweep_results)}
        out = Path(args.output) if args.output else HERE / "results" / f"objstore-sweep-{started:%Y-%m-%d}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1) + "\n")
        print_sweep(doc)
        print(f"\nwrote {out} ({doc['meta']['wall_s']:.0f} s)")
        return 0
    out = Path(args.output) if args.output else HERE / "results" / f"objstore-{started:%Y-%m-%d}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print_table(doc)
    print(f"\nwrote {out} ({doc['meta']['wall_s']:.0f} s)")
    return 0 if args.quick or all(doc["summary"]["met"].values()) else 1  # the targets are the nominal size's


def _version(pkg: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    raise SystemExit(main())
