"""Model-based stress harness: real operations, in real processes and threads, killed at random.

What it exercises
-----------------
A seeded random scheduler (:func:`run_rounds`) runs rounds against one store folder. Each
round starts a few worker processes — fresh interpreters (``python -m tests.stress worker``)
or forks of the coordinator — in one of these topologies:

``singles``   several processes, each with one :class:`~ckptstore.Store`;
``double``    one process holding two Stores on the same path at once, a thread on each,
              one of which keeps closing and reopening its Store while the other works;
``threads``   one process whose main thread commits (``commit`` / ``commit_async``, the live
              tensors scrambled as soon as ``commit_async`` returns) while a second thread
              checks out, partially checks out and verifies through the same Store;
``cron``      a process that only runs ``gc(grace=0)`` (the first of ``graces``) and ``fsck(deep=True)``
              in a loop;
``cli``       the command line, ``ckptstore fsck --deep --store PATH``, run beside the others;
``mixed``     a random mix of the above.

Some rounds start on a store folder that does not exist yet, all workers opening (creating)
it at the same instant. Workers draw operations at random: commit, commit_async, checkout of
a tag, partial checkout of one leaf or component, checkout ``into`` a fresh module, tag (move a
tag to another tag's commit), delete a tag, gc with ``keep_last`` 1..3 and a short grace, fsck
(shallow or deep), verify, export to a ZIP then import it back under a tag, and opening a
second Store in a process that holds one; a ``single`` worker also retires now and then
(closes its Store and exits while the others run). The coordinator SIGKILLs random processes
at random instants, replacing some killed or retired workers by fresh forks; at the round's
end it either kills the rest or stops them one by one, a few milliseconds apart.

The model
---------
Every committed state is a deterministic function of its step number (:func:`make_state`),
stored as ``metadata={"step": N}``; steps are unique across workers (``worker_id * 10**6 +
counter``). Whoever reads a commit regenerates the state of its step and compares every leaf
bit for bit (dtype, shape, strides, raw bytes; JSON values by type and value). A reader first
resolves a tag to a commit id and then uses only that id, so a tag moving meanwhile is no
false alarm.

Outcomes
--------
Legitimate race outcomes are tolerated and counted: ``RefNotFoundError`` (a tag deleted or a
commit collected by another worker between choosing and using it), ``GCLockedError`` (another
GC is running) and ``CatalogBusyError``. Anything else — ``IntegrityError`` (and its
``BlobMissingError``), ``CatalogCorruptError``, a wrong tensor, an fsck problem, a raw Python
exception — makes the worker print one ``STRESS-FAIL`` diagnostic line and exit with code 17.

After every round, with no process running, the coordinator checks in-process: ``fsck(deep=
True)`` is clean; every tag (and a sample of their lineage) checks out exactly the state of the
step in its commit's metadata; every tag move a worker saw return is in the reflog and each
tag's newest reflog entry is where the tag is (no lost durable commit: ``losses``). Then it
runs ``gc(grace=0)`` and checks again (tags unchanged, no orphan packs or tmp files left).
If ``Store.recover`` exists as a class or static method, some rounds then delete the catalog
files and rebuild it with ``Store.recover(path)``; every tag must check out exactly again.

Replaying a seed
----------------
The seed decides everything the harness chooses: topologies, worker roles, operation
sequences, run times, kill instants. (Thread and process interleavings stay up to the OS, so
a replay repeats the schedule, not necessarily the exact interleaving.) A failure raises
:class:`StressFailure` whose message starts with the seed and the replay command::

    CKPT_STRESS_SEED=<seed> pytest tests/test_stress.py        # replays; CKPT_STRESS_ROUNDS=<n> too
    CKPT_STRESS_SEED=<seed> pytest -m slow tests/test_stress.py    # the 1,000-kill run; CKPT_STRESS_KILLS=<n>
    python -m tests.stress --seed <seed> --rounds 8             # the default test's run, outside pytest
    python -m tests.stress --seed <seed> --rounds 0 --min-kills 1000 --slow    # the slow one

``python -m tests.stress --help`` also lists knobs that step around one known failure to find
the next (``--no-concurrent-create``, ``--no-second-stores``, ``--graces 3600``); a failing
run keeps its folder (stores, per-process ``p<id>.out`` and ``p<id>.ops`` logs) and names it.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import itertools
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tensordict import TensorDict

import ckptstore
from ckptstore.errors import CatalogBusyError, GCLockedError, RefNotFoundError
from tests import paths

ROOT = paths.REPO
SRC = Path(ckptstore.__file__).resolve().parents[1]  # children import the same ckptstore as we do
SHARD_BYTES = 8 << 10  # small shards: a state of ~250 KiB has dozens of them, partly shared between steps
TAGS = ("t0", "t1", "t2", "t3", "t4", "latest")
FAIL_CODE = 17
STEP_BLOCK = 10**6  # step = worker id * STEP_BLOCK + counter: unique across workers
TOLERATED = (RefNotFoundError, GCLockedError, CatalogBusyError)
TOPOLOGIES = ("singles", "double", "threads", "cron", "cli", "mixed")
ROLES = ("single", "double", "threads", "cron")
CATALOG_FILES = ("catalog.sqlite", "catalog.sqlite-wal", "catalog.sqlite-shm")


class StressFailure(AssertionError):
    """A failure found by the harness; the message starts with the seed. ``stats`` so far attached."""

    def __init__(self, message: str, stats: dict | None = None):
        super().__init__(message)
        self.stats = stats


class Mismatch(Exception):
    """A worker read something other than what was committed (or fsck / verify was not clean)."""


# --- the model: the state of step N ------------------------------------------------------


def _gen(*key: int) -> torch.Generator:
    seed = 0x9E3779B97F4A7C15
    for k in key:
        seed = (seed * 1_000_003 + k + 1) % (1 << 63)
    return torch.Generator().manual_seed(seed)


def make_state(step: int) -> dict:
    """The objects committed at ``step``: a deterministic function of it.

    Some leaves never change (dedup across every commit), some change every few steps,
    row blocks of ``blocks`` change at different rates (dedup at shard level), and the
    rest change every step. Dtypes: float32/64/16, bfloat16, complex64, int64, uint8,
    bool; a transposed (non-contiguous) tensor, a zero-element one, NaN payloads and
    -0.0; a nested dict, a TensorDict, an ``nn.Module`` and JSON values.
    """
    blocks = torch.cat([torch.randn(32, 64, generator=_gen(1, j, step // (j + 1))) for j in range(8)])
    weird = torch.randn(64, generator=_gen(9, step))
    bits = weird.view(torch.int32)
    bits[0] = 0x7FC00000 | (step % 0x3FFFFF)  # a NaN with a payload
    bits[1] = -(1 << 31)  # -0.0
    weird[2] = float("inf")
    net = torch.nn.Linear(8, 4)
    with torch.no_grad():
        g = _gen(8, step)
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return {
        "shared": torch.randn(16384, generator=_gen(0)),
        "blocks": blocks,
        "model": {
            "w": torch.randn(64, 32, generator=_gen(2, step // 3)),
            "b": torch.arange(3, dtype=torch.float64) * step,
            "nest": {"i": torch.randint(-(1 << 40), 1 << 40, (40,), generator=_gen(3, step))},
        },
        "half": torch.randn(300, generator=_gen(4, step % 7)).to(torch.bfloat16),
        "f16": torch.randn(33, generator=_gen(4, step)).half(),
        "cplx": torch.randn(17, dtype=torch.complex64, generator=_gen(5, step // 2)),
        "mask": torch.rand(123, generator=_gen(6, step)) > 0.5,
        "u8": torch.randint(0, 256, (1000,), dtype=torch.uint8, generator=_gen(7, step // 2)),
        "perm": torch.randn(16, 24, generator=_gen(10, step)).t(),
        "weird": weird,
        "empty": torch.zeros(0, 3),
        "td": TensorDict({"a": torch.randn(4, 2, generator=_gen(11, step)), "n": {"x": torch.arange(4) + step}}, [4]),
        "net": net,
        "meta": {"step": step, "name": f"s{step}", "vals": [step, step / 7, True, None], "pair": (step % 5, "x"), "keys": {3: "three"}},
    }


def raw_bytes(t: torch.Tensor) -> bytes:
    """The bytes of a contiguous copy: exact for NaN payloads, -0.0, bool, complex, bfloat16."""
    t = t.detach().cpu().contiguous()
    start = t.storage_offset() * t.element_size()
    storage = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
    return storage[start : start + t.numel() * t.element_size()].numpy().tobytes()


def tensor_record(t: torch.Tensor) -> tuple:
    stride = tuple(t.stride()) if t.numel() else None  # a zero-element tensor's strides are arbitrary
    return ("t", str(t.dtype), tuple(t.shape), stride, raw_bytes(t))


def _flatten(obj, prefix: str, out: dict) -> None:
    if isinstance(obj, torch.Tensor):
        out[prefix] = tensor_record(obj)
    elif isinstance(obj, torch.nn.Module):
        for name, t in obj.state_dict().items():
            out[f"{prefix}/{name.replace('.', '/')}"] = tensor_record(t)
    elif isinstance(obj, TensorDict):
        for key in obj.keys(include_nested=True, leaves_only=True):
            key = key if isinstance(key, tuple) else (key,)
            out["/".join((prefix, *key))] = tensor_record(obj.get(key))
    elif isinstance(obj, dict) and all(isinstance(k, str) for k in obj):
        for k, v in obj.items():
            _flatten(v, f"{prefix}/{k}" if prefix else k, out)
    else:
        out[prefix] = ("j", repr(obj))


@functools.lru_cache(maxsize=256)
def expected_leaves(step: int) -> dict:
    """``{leaf path: record}`` of step ``step``; records hold dtype, shape, strides and bytes."""
    out: dict = {}
    _flatten(make_state(step), "", out)
    return out


def leaf_paths(step: int) -> list[str]:
    """Every leaf path and every component prefix: targets for a partial checkout."""
    paths = set(expected_leaves(step))
    for p in list(paths):
        parts = p.split("/")
        paths.update("/".join(parts[:i]) for i in range(1, len(parts)))
    return sorted(paths)


def compare(step: int, td, prefix: str | None = None) -> str | None:
    """``None`` when ``td`` (a checkout) holds exactly step ``step``'s leaves under ``prefix``; else what differs."""
    want = expected_leaves(step)
    if prefix is not None:
        want = {p: r for p, r in want.items() if p == prefix or p.startswith(prefix + "/")}
    if not isinstance(td, TensorDict):
        return f"checkout returned a {type(td).__name__}, not a TensorDict"
    got_tensors = set()
    for key in td.keys(include_nested=True, leaves_only=True):
        got_tensors.add("/".join(key) if isinstance(key, tuple) else key)
    want_tensors = {p for p, r in want.items() if r[0] == "t"}
    if got_tensors != want_tensors:
        return f"tensor leaves differ: missing {sorted(want_tensors - got_tensors)}, unexpected {sorted(got_tensors - want_tensors)}"
    for path, rec in want.items():
        key = tuple(path.split("/"))
        if rec[0] == "t":
            got = tensor_record(td.get(key))
            if got != rec:
                what = [n for n, a, b in zip(("kind", "dtype", "shape", "stride", "bytes"), got, rec) if a != b]
                return f"leaf {path}: {', '.join(what)} differ (got {got[1]} {got[2]} {got[3]}, want {rec[1]} {rec[2]} {rec[3]})"
        else:
            try:
                got = repr(td.get_non_tensor(key))
            except KeyError:
                return f"JSON leaf {path} is missing"
            if got != rec[1]:
                return f"JSON leaf {path}: got {got}, want {rec[1]}"
    return None


def scramble(state: dict) -> None:
    """Overwrite every live tensor and JSON list of ``state`` (after ``commit_async`` returned)."""
    with torch.no_grad():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                v.zero_() if v.dtype != torch.bool else v.logical_not_()
            elif isinstance(v, torch.nn.Module):
                for p in v.parameters():
                    p.fill_(12345.0)
            elif isinstance(v, TensorDict):
                v.apply_(lambda t: t.zero_())
            elif isinstance(v, dict):
                scramble(v)
                if isinstance(v.get("vals"), list):
                    v["vals"].append("scrambled")


def _exc_name(exc: BaseException) -> str:
    mod = type(exc).__module__
    return type(exc).__qualname__ if mod in ("__main__", __name__, "builtins") else f"{mod}.{type(exc).__qualname__}"


# --- the worker ----------------------------------------------------------------------------


class Worker:
    """One worker process: loops random operations on the store until ``<round dir>/stop-<wid>`` exists
    (a ``single`` worker also retires by itself now and then: it closes its Store and exits 0).

    Writes one line per operation to ``p<wid>.ops`` (``O op``, ``R op ExcType`` for a
    tolerated race) and one per durable change it saw return (``D cid tags step``,
    ``T tag cid``, ``X tag cid``). On a failure it prints ``STRESS-FAIL ...`` and exits 17.
    """

    WEIGHTS = {
        "commit": 20, "commit_async": 10, "checkout": 20, "partial": 10, "into": 5, "tag": 8, "delete_tag": 4,
        "gc": 5, "fsck": 4, "verify": 5, "export_import": 4,
    }

    def __init__(self, store: str, seed: int, wid: int, role: str, rdir: str, graces: tuple[float, ...], second_stores: bool):
        self.path, self.seed, self.wid, self.role = Path(store), seed, wid, role
        self.rdir = Path(rdir)
        self.graces = graces
        self.second_stores = second_stores
        self.stop_file = self.rdir / f"stop-{wid}"
        self.retired = False
        self.counter = itertools.count()
        self.log_fd = os.open(self.rdir / f"p{wid}.ops", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    # - plumbing -

    def log(self, line: str) -> None:
        os.write(self.log_fd, (line + "\n").encode())

    def stopped(self) -> bool:
        return self.retired or self.stop_file.exists()

    def next_step(self) -> int:
        return self.wid * STEP_BLOCK + next(self.counter)

    def open_store(self) -> ckptstore.Store:
        return ckptstore.Store(self.path, shard_bytes=SHARD_BYTES, workers=2, create=True)  # a writer: creates it if missing

    def fail(self, ctx: dict, exc: BaseException) -> None:
        detail = " ".join(f"{k}={v}" for k, v in ctx.items())
        msg = f"{_exc_name(exc)}: {exc}".replace("\n", " | ")
        line = f"STRESS-FAIL seed={self.seed} worker={self.wid} role={self.role} thread={threading.current_thread().name} {detail}: {msg}"
        with contextlib.suppress(Exception):
            self.log("F " + line)
            print(line, flush=True)
            traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(FAIL_CODE)

    def run_op(self, name: str, fn, *args) -> None:
        """Run one operation; tolerate the legitimate races, exit 17 on anything else."""
        ctx = {"op": name}
        try:
            fn(ctx, *args)
        except TOLERATED as exc:
            kind = type(exc).__name__
            if isinstance(exc, RefNotFoundError):  # the tag was absent, or its commit went before it was used
                kind += "(tag)" if "cid" not in ctx else "(commit)"
            self.log(f"R {name} {kind}")
            time.sleep(0.002)  # a reader thread on a store without tags yet must not spin
            return
        except BaseException as exc:
            self.fail(ctx, exc)
        self.log(f"O {name}")

    def resolve(self, s: ckptstore.Store, ctx: dict, rng: random.Random) -> tuple[str, int]:
        """A random tag's commit id and step: the tag is resolved once; the id is used after."""
        ctx["tag"] = tag = rng.choice(TAGS)
        ctx["cid"] = cid = s.resolve(tag)
        meta = s.info(cid).metadata
        if not isinstance(meta, dict) or "step" not in meta:
            raise Mismatch(f"commit {cid} has metadata {meta!r}, without a step")
        ctx["step"] = meta["step"]
        return cid, meta["step"]

    # - operations -

    def op_commit(self, ctx: dict, s: ckptstore.Store, rng: random.Random, use_async: bool = False) -> None:
        ctx["step"] = step = self.next_step()
        tags = [] if rng.random() < 0.1 else rng.sample(TAGS, rng.choice((1, 1, 2)))
        ctx["tags"] = ",".join(tags) or "-"
        state = make_state(step)
        if use_async:
            future = s.commit_async(state, tag=tags or None, message=f"step {step}", metadata={"step": step})
            scramble(state)  # the snapshot was taken when commit_async returned
            info = future.result()
        else:
            info = s.commit(state, tag=tags or None, message=f"step {step}", metadata={"step": step})
        ctx["cid"] = info.id
        self.log(f"D {info.id} {ctx['tags']} {step}")
        if sorted(info.tags) != sorted(tags):
            raise Mismatch(f"commit returned tags {info.tags}, moved {tags}")

    def op_checkout(self, ctx: dict, s: ckptstore.Store, rng: random.Random) -> None:
        cid, step = self.resolve(s, ctx, rng)
        diff = compare(step, s.checkout(cid))
        if diff:
            raise Mismatch(diff)

    def op_partial(self, ctx: dict, s: ckptstore.Store, rng: random.Random) -> None:
        cid, step = self.resolve(s, ctx, rng)
        ctx["partial"] = path = rng.choice(leaf_paths(step))
        diff = compare(step, s.checkout(cid, partial=path), prefix=path)
        if diff:
            raise Mismatch(diff)

    def op_into(self, ctx: dict, s: ckptstore.Store, rng: random.Random) -> None:
        cid, step = self.resolve(s, ctx, rng)
        net = torch.nn.Linear(8, 4)
        s.checkout(cid, into={"net": net}, partial=["net"])
        got: dict = {}
        _flatten({"net": net}, "", got)
        want = {p: r for p, r in expected_leaves(step).items() if p.startswith("net/")}
        if got != want:
            raise Mismatch(f"checkout into a module: {sorted(p for p in want if got.get(p) != want[p])} differ")

    def op_tag(self, ctx: dict, s: ckptstore.Store, rng: random.Random) -> None:
        src, dst = rng.sample(TAGS, 2)
        ctx["tag"] = f"{dst}<-{src}"
        cid = s.tag(dst, src)
        self.log(f"T {dst} {cid}")

    def op_delete_tag(self, ctx: dict, s: ckptstore.Store, rng: random.Random) -> None:
        ctx["tag"] = tag = rng.choice(TAGS)
        cid = s.delete_tag(tag)
        self.log(f"X {tag} {cid}")

    def op_gc(self, ctx: dict, s: ckptstore.Store, rng: random.Random, grace: float | None = None) -> None:
        ctx["keep_last"] = keep = rng.randint(1, 3)
        ctx["grace"] = grace = rng.choice(self.graces) if grace is None else grace
        s.gc(keep_last=keep, grace=grace)

    def op_fsck(self, ctx: dict, s: ckptstore.Store, rng: random.Random, deep: bool | None = None) -> None:
        ctx["deep"] = deep = rng.random() < 0.5 if deep is None else deep
        report = s.fsck(deep=deep)
        if not report.ok:
            raise Mismatch(f"fsck(deep={deep}) not ok: {report.problems[:3]}")

    def op_verify(self, ctx: dict, s: ckptstore.Store, rng: random.Random) -> None:
        cid, _ = self.resolve(s, ctx, rng)
        report = s.verify(cid)
        if not report.ok:
            raise Mismatch(f"verify not ok: {report.problems[:3]}")

    def op_export_import(self, ctx: dict, s: ckptstore.Store, rng: random.Random) -> None:
        cid, step = self.resolve(s, ctx, rng)
        dest = self.rdir / f"x-{self.wid}-{next(self.counter)}.zip"
        s.export(cid, dest)
        ctx["new_tag"] = tag = rng.choice(TAGS)
        info = s.import_from(dest, tag=tag)
        ctx["new_cid"] = info.id
        self.log(f"D {info.id} {tag} {step}")
        dest.unlink()
        if info.metadata.get("step") != step:
            raise Mismatch(f"import of {cid} (step {step}) gave metadata {info.metadata}")

    def random_op(self, s: ckptstore.Store, rng: random.Random, weights: dict | None = None) -> None:
        weights = weights or self.WEIGHTS
        name = rng.choices(list(weights), list(weights.values()))[0]
        if name == "commit_async":
            self.run_op(name, self.op_commit, s, rng, True)
        else:
            self.run_op(name, getattr(self, f"op_{name}"), s, rng)

    # - roles -

    def run(self) -> int:
        torch.set_num_threads(1)
        rng = random.Random(f"{self.seed}:{self.wid}:main")
        getattr(self, f"role_{self.role}")(rng)
        return 0

    def _thread(self, name: str, fn, *args) -> threading.Thread:
        def body():
            try:
                fn(*args)
            except BaseException as exc:  # a bug in the harness or an error outside an op
                self.fail({"op": "thread"}, exc)

        t = threading.Thread(target=body, name=name, daemon=True)
        t.start()
        return t

    def role_single(self, rng: random.Random) -> None:
        """One Store, random operations; sometimes a second Store opened beside it for one operation.

        Now and then the worker retires: it closes its (last) connection and exits while others run.
        """
        s = self._open()
        while not self.stopped():
            if rng.random() < 0.01:
                self.retired = True
                self.log("O retire")
            elif self.second_stores and rng.random() < 0.06:
                self.run_op("second_store", self._second_store, s, rng)
            else:
                self.random_op(s, rng)
        s.close()

    def _open(self) -> ckptstore.Store:
        box: list[ckptstore.Store] = []
        while not box:  # retried after CatalogBusyError (another process creating the store)
            if self.stopped():
                os._exit(0)  # the round ended before the store could be opened
            self.run_op("open", lambda ctx: box.append(self.open_store()))
        return box[0]

    def _second_store(self, ctx: dict, s: ckptstore.Store, rng: random.Random) -> None:
        ctx["second"] = "open"
        with self.open_store() as s2:
            op = rng.choice(("checkout", "fsck", "commit"))
            ctx["second"] = op
            getattr(self, f"op_{op}")(ctx, s2, rng)

    def role_double(self, rng: random.Random) -> None:
        """Two Stores on the same path in this process, a thread on each; thread B keeps reopening its Store."""
        a = self._open()
        b = self._open()
        stores = {"A": a, "B": b}

        def loop(label: str, trng: random.Random) -> None:
            while not self.stopped():
                if label == "B" and trng.random() < 0.12:
                    def reopen(ctx):  # a third Store opens while A and the old B are open
                        old, stores["B"] = stores["B"], self.open_store()
                        old.close()
                    self.run_op("reopen", reopen)
                else:
                    self.random_op(stores[label], trng)

        threads = [self._thread(f"store-{label}", loop, label, random.Random(f"{self.seed}:{self.wid}:{label}")) for label in "AB"]
        for t in threads:
            t.join()
        for st in stores.values():
            st.close()

    def role_threads(self, rng: random.Random) -> None:
        """Main thread commits (sync and async); a second thread checks out through the same Store."""
        s = self._open()
        readers = {"checkout": 10, "partial": 8, "verify": 3, "into": 3}

        def reader(trng: random.Random) -> None:
            while not self.stopped():
                self.random_op(s, trng, readers)

        t = self._thread("reader", reader, random.Random(f"{self.seed}:{self.wid}:reader"))
        writers = {"commit": 4, "commit_async": 8, "tag": 1, "gc": 1}
        while not self.stopped():
            self.random_op(s, rng, writers)
        t.join()
        s.close()

    def role_cron(self, rng: random.Random) -> None:
        """gc(grace=graces[0], 0 by default) and fsck(deep=True) in a loop, as from cron."""
        s = self._open()
        while not self.stopped():
            self.run_op("gc", self.op_gc, s, rng, self.graces[0])
            self.run_op("fsck", self.op_fsck, s, rng, True)
            time.sleep(rng.uniform(0, 0.2))
        s.close()


def worker_main(store: str, seed: int, wid: int, role: str, rdir: str, graces: tuple[float, ...], second_stores: bool) -> int:
    """Entry point of a worker (in a fresh interpreter or a fork): ready, wait for go, run."""
    rd = Path(rdir)
    (rd / f"ready-{wid}").touch()
    while not (rd / "go").exists():
        time.sleep(0.005)
    return Worker(store, seed, wid, role, rdir, graces, second_stores).run()


# --- the coordinator -------------------------------------------------------------------------


@dataclass
class Proc:
    """A process of a round: a worker (exec or fork) or a CLI run."""

    wid: int
    role: str
    method: str  # "exec", "fork" or "cli"
    pid: int
    out: Path
    popen: subprocess.Popen | None = None
    kill_at: float | None = None
    code: int | None = None
    killed: bool = False

    def poll(self) -> int | None:
        if self.code is None:
            if self.popen is not None:
                self.code = self.popen.poll()
            else:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    self.code = os.waitstatus_to_exitcode(status)
        return self.code

    def wait(self, timeout: float | None = None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                return None
            time.sleep(0.01)
        return self.code

    def kill(self) -> bool:
        """SIGKILL; true when the signal ended a running process (not one that had already exited)."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        self.wait()
        self.killed = self.code == -signal.SIGKILL
        return self.killed

    def diagnostic(self) -> str:
        text = self.out.read_text(errors="replace") if self.out.exists() else ""
        fails = [line for line in text.splitlines() if line.startswith("STRESS-FAIL")]
        if fails:
            return fails[0]
        return "output tail: " + " | ".join(text.strip().splitlines()[-12:])


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH", "")) if p)
    env["PYTHONWARNINGS"] = "ignore"
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _cli_command() -> list[str]:
    script = Path(sys.executable).with_name("ckptstore")
    return [str(script)] if script.exists() else [sys.executable, "-m", "ckptstore.cli"]


def _fork_worker(args: tuple, out: Path) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 70  # pragma: no cover - the child
    try:
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.stdout = sys.stderr = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        code = worker_main(*args)
    except BaseException:
        with contextlib.suppress(Exception):
            traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        os._exit(code)


@dataclass(frozen=True)
class Options:
    """The knobs of :func:`run_rounds` (besides seed, rounds and stop conditions).

    workers: processes per round (before replacements); kill_rate: chance that a process gets
    a kill instant in its round; respawn: chance that a killed or retired worker is replaced
    by a fork; run_time: seconds a round runs, drawn uniformly; exec_share: share of a round's
    first workers started as fresh interpreters rather than forks of this process (a fresh
    interpreter pays the torch import, ~3-4 s of CPU). graces: grace periods (seconds) workers
    pass to gc (the cron role always uses the first). fresh_store_rate: share of rounds on a
    new store (always round 0), which all workers create at the same instant unless
    ``concurrent_create`` is false. second_stores: false leaves out the ``double`` role and
    the second Store a ``single`` worker opens. recover_rate: share of rounds followed by a
    catalog rebuild, when ``Store.recover`` exists. cli_max: CLI fsck runs per ``cli`` round.
    straggler_timeout: seconds a stopped worker may take to exit before it is killed.
    The last knobs exist to look past a known failure to the next one.
    """

    workers: int = 3
    kill_rate: float = 0.5
    respawn: float = 0.5
    run_time: tuple[float, float] = (1.5, 4.0)
    exec_share: float = 0.5
    graces: tuple[float, ...] = (0.0, 0.05, 0.3)
    fresh_store_rate: float = 0.15
    concurrent_create: bool = True
    second_stores: bool = True
    recover_rate: float = 0.25
    cli_max: int = 2
    straggler_timeout: float = 30.0


#: The long run's settings (``pytest -m slow``): most workers killed, killed ones replaced by forks.
SLOW = {"workers": 4, "kill_rate": 0.9, "respawn": 0.9, "exec_share": 0.15, "run_time": (2.0, 5.0)}


@dataclass
class Round:
    """Bookkeeping of one round."""

    index: int
    rdir: Path
    rng: random.Random  # every choice made within the round: one round's timing cannot shift the next one's plan
    procs: list[Proc] = field(default_factory=list)
    collected: bool = False


class Harness:
    """State of one :func:`run_rounds` call (see its docstring)."""

    def __init__(self, root: Path, seed: int, options: Options, verbose: bool, replay: str):
        self.root = Path(root)
        self.seed = seed
        self.replay = replay
        self.o = options
        self.verbose = verbose
        self.store = self.root / "store-0"
        self.live: list[Proc] = []
        self.round: Round | None = None
        self.started = time.monotonic()
        self.stats: dict = {
            "seed": seed, "rounds": 0, "kills": 0, "end_of_round_kills": 0, "stragglers": 0, "processes": 0,
            "processes_by_role": Counter(), "processes_by_method": Counter(), "topologies": Counter(), "ops": 0,
            "ops_by_kind": Counter(), "races": 0, "races_by_kind": Counter(), "durable_events": 0, "losses": 0,
            "tags_checked": 0, "commits_checked": 0, "fresh_stores": 0, "recoveries": 0, "seconds": 0.0,
        }
        recover = inspect.getattr_static(ckptstore.Store, "recover", None)
        self.can_recover = isinstance(recover, (classmethod, staticmethod))
        self.recovered: set[Path] = set()  # stores whose catalog was rebuilt: their reflog may start afresh

    # - failures -

    def failure(self, rnd: int, what: str) -> StressFailure:
        if self.round is not None and not self.round.collected:
            with contextlib.suppress(Exception):
                self.collect_logs(self.round)
        self.stats["seconds"] = round(time.monotonic() - self.started, 1)
        postmortem = ""
        if not self.live:
            with contextlib.suppress(Exception), ckptstore.Store(self.store, create=False) as s:
                report = s.fsck(deep=True)
                postmortem = f"; post-mortem fsck(deep=True): {'ok' if report.ok else report.problems[:3]}"
        msg = f"stress seed {self.seed} failed in round {rnd} (replay: {self.replay}): {what}{postmortem}"
        print(msg, flush=True)
        print(format_stats(self.stats), flush=True)
        return StressFailure(msg, self.stats)

    # - processes -

    def spawn(self, rnd: Round, role: str, method: str | None = None) -> Proc:
        wid = rnd.index * 1000 + len(rnd.procs) + 1  # the same in a replay of the round; steps follow from it
        assert len(rnd.procs) < 999, "too many processes in one round"
        out = rnd.rdir / f"p{wid}.out"
        if role == "cli":
            with out.open("wb") as f:
                popen = subprocess.Popen([*_cli_command(), "fsck", "--deep", "--store", str(self.store)], cwd=ROOT, env=_env(),
                                         stdout=f, stderr=subprocess.STDOUT)
            proc = Proc(wid, role, "cli", popen.pid, out, popen)
        else:
            method = method or ("exec" if rnd.rng.random() < self.o.exec_share else "fork")
            args = (str(self.store), self.seed, wid, role, str(rnd.rdir), self.o.graces, self.o.second_stores)
            if method == "exec":
                cmd = [sys.executable, "-m", "tests.stress", "worker", str(self.store), str(self.seed), str(wid), role, str(rnd.rdir),
                       ",".join(map(str, self.o.graces)), str(int(self.o.second_stores))]
                with out.open("wb") as f:
                    popen = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=f, stderr=subprocess.STDOUT)
                proc = Proc(wid, role, method, popen.pid, out, popen)
            else:
                proc = Proc(wid, role, method, _fork_worker(args, out), out)
        rnd.procs.append(proc)
        self.live.append(proc)
        self.stats["processes"] += 1
        self.stats["processes_by_role"][role] += 1
        self.stats["processes_by_method"][proc.method] += 1
        return proc

    def reap(self, rnd: Round, proc: Proc) -> None:
        """Account for a process that ended; raise StressFailure when it did not end well."""
        self.live.remove(proc)
        code = proc.code
        if proc.killed:
            return
        if proc.method == "cli":
            text = proc.out.read_text(errors="replace") if proc.out.exists() else ""
            if code == 0:
                self.stats["ops"] += 1
                self.stats["ops_by_kind"]["cli_fsck"] += 1
                return
            if code == 1 and "stayed locked" in text:
                self.stats["races"] += 1
                self.stats["races_by_kind"]["cli_fsck:CatalogBusyError"] += 1
                return
            self.abort()
            raise self.failure(rnd.index, f"`ckptstore fsck --deep` (process {proc.wid}) exited {code}: {proc.diagnostic()}")
        if code != 0:
            self.abort()
            raise self.failure(rnd.index, f"process {proc.wid} ({proc.role}, {proc.method}) exited {code}: {proc.diagnostic()}")

    def abort(self) -> None:
        """SIGKILL every process still running."""
        for p in list(self.live):
            p.kill()
            self.live.remove(p)

    # - one round -

    def roles(self, topology: str, r: random.Random) -> list[str]:
        k = self.o.workers
        two = self.o.second_stores
        roles = ROLES if two else tuple(x for x in ROLES if x != "double")
        if topology == "singles":
            return ["single"] * k
        if topology == "double":
            return ["double"] + ["single"] * (k - 1)
        if topology == "threads":
            return ["threads"] + [r.choice(("single", "threads")) for _ in range(k - 1)]
        if topology == "cron":
            return ["cron"] + [r.choice(("single", "double" if two else "threads")) for _ in range(k - 1)]
        if topology == "cli":
            return ["single"] * (k - 1) + [r.choice(("double", "threads") if two else ("threads",))]
        return [r.choice(roles) for _ in range(k)]

    def run_round(self, index: int) -> None:
        rnd = self.round = Round(index, self.root / f"round-{index}", random.Random(f"{self.seed}:round:{index}"))
        rng = rnd.rng
        rnd.rdir.mkdir(parents=True)
        fresh = index == 0 or rng.random() < self.o.fresh_store_rate
        if fresh:  # every worker creates the store at the same instant
            self.store = self.root / f"store-{index}"
            self.stats["fresh_stores"] += 1
            if not self.o.concurrent_create:
                ckptstore.Store(self.store, shard_bytes=SHARD_BYTES, create=True).close()
        topology = rng.choice(TOPOLOGIES if self.o.second_stores else tuple(t for t in TOPOLOGIES if t != "double"))
        self.stats["topologies"][topology] += 1
        roles = self.roles(topology, rng)
        run_for = rng.uniform(*self.o.run_time)
        procs = [self.spawn(rnd, role) for role in roles]
        deadline = time.monotonic() + 120
        while not all((rnd.rdir / f"ready-{p.wid}").exists() for p in procs):  # torch imports in fresh interpreters
            for p in procs:
                if p.code is None and p.poll() is not None:
                    self.reap(rnd, p)
                    raise self.failure(index, f"process {p.wid} ({p.role}, {p.method}) exited {p.code} before it was ready")
            if time.monotonic() > deadline:
                self.abort()
                raise self.failure(index, "workers did not start within 120 s")
            time.sleep(0.02)
        (rnd.rdir / "go").touch()
        t0 = time.monotonic()
        end = t0 + run_for
        for p in procs:
            if rng.random() < self.o.kill_rate:
                p.kill_at = t0 + rng.uniform(0, run_for)
        clis = 0
        if topology == "cli":
            self.spawn(rnd, "cli")
            clis = 1
        if self.verbose:
            print(f"round {index}: {topology} {roles} store={self.store.name} for {run_for:.1f} s", flush=True)
        while time.monotonic() < end:
            now = time.monotonic()
            for p in list(self.live):
                if p.kill_at is not None and now >= p.kill_at and p.code is None:
                    if p.kill():
                        self.stats["kills"] += 1
                    self.reap(rnd, p)
                    if p.role != "cli" and rng.random() < self.o.respawn and end - now > 0.3:
                        q = self.spawn(rnd, p.role, "fork")
                        if rng.random() < self.o.kill_rate:
                            q.kill_at = now + rng.uniform(0, end - now)
                elif p.poll() is not None:
                    self.reap(rnd, p)  # a worker that retired (exit 0), or a CLI run that ended
                    if p.method != "cli" and rng.random() < self.o.respawn and end - now > 0.3:
                        self.spawn(rnd, p.role, "fork")
            if topology == "cli" and clis < self.o.cli_max and not any(p.method == "cli" for p in self.live) and end - now > 2:
                self.spawn(rnd, "cli")
                clis += 1
            time.sleep(0.005)
        if rng.random() < 0.3:  # kill everything left at the round's end
            for p in list(self.live):
                if p.kill():
                    self.stats["end_of_round_kills"] += 1
                self.reap(rnd, p)
        for p in rng.sample(self.live, len(self.live)):  # staggered: each exit closes a connection while others still run
            (rnd.rdir / f"stop-{p.wid}").touch()
            time.sleep(rng.uniform(0, 0.15))
        for p in list(self.live):
            if p.wait(self.o.straggler_timeout + (60 if p.method == "cli" else 0)) is None:
                self.stats["stragglers"] += 1
                p.kill()
                p.killed = True  # stuck, not failed: counted as a straggler
            self.reap(rnd, p)
        events = self.collect_logs(rnd)
        self.check(rnd, events)
        self.stats["rounds"] += 1
        shutil.rmtree(rnd.rdir, ignore_errors=True)

    def collect_logs(self, rnd: Round) -> list[tuple]:
        """Add the round's operation counts to the stats; return its durable events."""
        rnd.collected = True
        events = []
        for p in rnd.procs:
            f = rnd.rdir / f"p{p.wid}.ops"
            if not f.exists():
                continue
            for line in f.read_text(errors="replace").splitlines():
                parts = line.split()
                if not parts:
                    continue
                if parts[0] == "O" and len(parts) == 2:
                    self.stats["ops"] += 1
                    self.stats["ops_by_kind"][parts[1]] += 1
                elif parts[0] == "R" and len(parts) == 3:
                    self.stats["races"] += 1
                    self.stats["races_by_kind"][f"{parts[1]}:{parts[2]}"] += 1
                elif parts[0] in ("D", "T", "X") and len(parts) in (3, 4):
                    events.append(tuple(parts))
        self.stats["durable_events"] += len(events)
        return events

    # - checks, with no process running -

    def check_tags(self, s: ckptstore.Store, index: int, when: str, lineage: bool) -> dict[str, tuple[str, int]]:
        """Every tag (and with ``lineage`` a sample of each tag's lineage) checks out its step exactly."""
        found: dict[str, tuple[str, int]] = {}
        steps: dict[str, int] = {}  # commit id -> step, each commit checked once
        for tag, cid in s.tags().items():
            if cid not in steps:
                meta = s.info(cid).metadata
                if "step" not in meta:
                    raise self.failure(index, f"{when}: tag {tag} names commit {cid} without a step in its metadata: {meta!r}")
                diff = compare(meta["step"], s.checkout(cid))
                if diff:
                    raise self.failure(
                        index, f"{when}: tag {tag} (commit {cid}, step {meta['step']}) does not check out what was committed: {diff}"
                    )
                steps[cid] = meta["step"]
            found[tag] = (cid, steps[cid])
            self.stats["tags_checked"] += 1
        if lineage:
            ancestors = sorted({c.id for tag in found for c in s.log(tag)} - set(steps))
            for cid in self.round.rng.sample(ancestors, min(len(ancestors), 12)):
                step = s.info(cid).metadata.get("step")
                diff = compare(step, s.checkout(cid))
                if diff:
                    raise self.failure(index, f"{when}: commit {cid} (step {step}) does not check out what was committed: {diff}")
                self.stats["commits_checked"] += 1
        return found

    def check_fsck(self, s: ckptstore.Store, index: int, when: str, clean: bool = False) -> None:
        report = s.fsck(deep=True)
        if not report.ok:
            raise self.failure(index, f"{when}: fsck(deep=True) not ok: {report.problems[:5]}")
        if clean and (report.orphan_packs or report.tmp_files):
            raise self.failure(index, f"{when}: gc(grace=0) with no process running left {len(report.orphan_packs)} orphan packs, "
                                      f"{report.tmp_files} tmp files")

    def check_durable(self, s: ckptstore.Store, index: int, events: list[tuple]) -> None:
        """No durable change a worker saw return is lost; every tag is where its newest reflog row says."""
        reflog = s.reflog()  # newest first
        moves = {(r["tag"], r["new_commit"]) for r in reflog}
        deletes = {(r["tag"], r["old_commit"]) for r in reflog if r["action"] == "delete"}
        lost = []
        for ev in events:
            if ev[0] == "D" and ev[2] != "-":
                lost += [f"commit {ev[1]} tag {t}" for t in ev[2].split(",") if (t, ev[1]) not in moves]
            elif ev[0] == "T" and (ev[1], ev[2]) not in moves:
                lost.append(f"tag {ev[1]} -> {ev[2]}")
            elif ev[0] == "X" and (ev[1], ev[2]) not in deletes:
                lost.append(f"delete of tag {ev[1]} (at {ev[2]})")
        tags = s.tags()
        newest: dict[str, dict] = {}
        for r in reflog:
            newest.setdefault(r["tag"], r)
        for tag, r in newest.items():
            where = None if r["action"] == "delete" else r["new_commit"]
            if tags.get(tag) != where:
                lost.append(f"tag {tag} is at {tags.get(tag)}, its newest reflog row says {where}")
        if self.store not in self.recovered:
            lost += [f"tag {t} has no reflog row" for t in tags if t not in newest]
        if lost:
            self.stats["losses"] += len(lost)
            raise self.failure(index, f"{len(lost)} durable changes lost: {lost[:5]}")

    def check(self, rnd: Round, events: list[tuple]) -> None:
        index, rng = rnd.index, rnd.rng
        try:
            s = ckptstore.Store(self.store, shard_bytes=SHARD_BYTES, create=not self.store.exists())
        except Exception as exc:
            raise self.failure(index, f"after the round: opening the store: {type(exc).__name__}: {exc}") from exc
        with s:
            try:
                self.check_fsck(s, index, "after the round")
                before = self.check_tags(s, index, "after the round", lineage=True)
                self.check_durable(s, index, events)
                s.gc(keep_last=rng.randint(1, 3), grace=0)
                self.check_fsck(s, index, "after gc(grace=0)", clean=True)
                after = self.check_tags(s, index, "after gc(grace=0)", lineage=False)
                if after != before:
                    raise self.failure(index, f"gc changed the tags: {before} -> {after}")
            except StressFailure:
                raise
            except Exception as exc:
                raise self.failure(index, f"checking the store: {_exc_name(exc)}: {exc}") from exc
        if self.can_recover and rng.random() < self.o.recover_rate:
            self.recover(index, after)

    def recover(self, index: int, tags: dict[str, tuple[str, int]]) -> None:
        """Delete the catalog (no process has the store open), rebuild it from the packs, check every tag."""
        for name in CATALOG_FILES:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.store / name)
        try:
            ckptstore.Store.recover(self.store)
            with ckptstore.Store(self.store, create=False) as s:
                self.check_fsck(s, index, "after recover")
                got = self.check_tags(s, index, "after recover", lineage=False)
        except StressFailure:
            raise
        except Exception as exc:
            raise self.failure(index, f"recover: {_exc_name(exc)}: {exc}") from exc
        want = {t: step for t, (_, step) in tags.items()}
        if {t: step for t, (_, step) in got.items()} != want:
            raise self.failure(index, f"after recover the tags name steps {got}, before {want}")
        self.stats["recoveries"] += 1
        self.recovered.add(self.store)


def run_rounds(
    store_path: str | os.PathLike,
    seed: int,
    rounds: int | None = 8,
    workers: int = 3,
    kill_rate: float = 0.5,
    *,
    min_kills: int = 0,
    max_seconds: float | None = None,
    verbose: bool = False,
    replay: str | None = None,
    **options,
) -> dict:
    """Run the stress scheduler under folder ``store_path`` (stores, round folders) and return its stats.

    Args:
        seed: seeds ``random.Random``; everything the harness chooses follows from it.
        rounds: rounds to run (``None``: until ``min_kills``).
        workers, kill_rate, options: see :class:`Options`.
        min_kills: keep starting rounds until that many processes were SIGKILLed mid-round.
        max_seconds: start no round after that many seconds.
        replay: the command that replays this run, for the failure message (default: the
            default test with ``CKPT_STRESS_SEED``).

    Returns:
        ``{"seed", "rounds", "kills", "processes", "processes_by_role", "ops", "races",
        "losses", ...}`` (see :func:`format_stats`).

    Raises:
        StressFailure: a worker exited 17 (or otherwise failed), or a check after a round
            failed; the message names the seed and how to replay it.
    """
    replay = replay or f"CKPT_STRESS_SEED={seed} pytest tests/test_stress.py"
    h = Harness(Path(store_path), seed, Options(workers=workers, kill_rate=kill_rate, **options), verbose, replay)
    h.root.mkdir(parents=True, exist_ok=True)
    print(f"stress seed {seed} (replay: {replay}); Store.recover {'exercised' if h.can_recover else 'absent: skipped'}", flush=True)
    try:
        for index in itertools.count():
            if rounds is not None and index >= rounds and h.stats["kills"] >= min_kills:
                break
            if rounds is None and h.stats["kills"] >= min_kills:
                break
            if max_seconds is not None and time.monotonic() - h.started > max_seconds:
                break
            h.run_round(index)
    finally:
        h.abort()
    h.stats["seconds"] = round(time.monotonic() - h.started, 1)
    return h.stats


def format_stats(stats: dict) -> str:
    """One readable block of the stats."""
    def counts(c) -> str:
        return ", ".join(f"{k} {v}" for k, v in sorted(c.items())) or "-"

    return (
        f"stress seed {stats['seed']}: {stats['rounds']} rounds in {stats['seconds']} s; kills {stats['kills']} "
        f"(+{stats['end_of_round_kills']} at round ends, {stats['stragglers']} stragglers); processes {stats['processes']} "
        f"[{counts(stats['processes_by_role'])}; {counts(stats['processes_by_method'])}]; topologies [{counts(stats['topologies'])}]; "
        f"ops {stats['ops']} [{counts(stats['ops_by_kind'])}]; tolerated races {stats['races']} [{counts(stats['races_by_kind'])}]; "
        f"durable events {stats['durable_events']}; losses {stats['losses']}; checked {stats['tags_checked']} tags, "
        f"{stats['commits_checked']} ancestors; fresh stores {stats['fresh_stores']}; recoveries {stats['recoveries']}"
    )


def seed_from_env() -> int:
    """``CKPT_STRESS_SEED`` if set, else a new random seed (printed by :func:`run_rounds`)."""
    env = os.environ.get("CKPT_STRESS_SEED")
    return int(env) if env else random.SystemRandom().randrange(1 << 31)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "worker":  # python -m tests.stress worker STORE SEED WID ROLE ROUND_DIR GRACES SECOND_STORES
        store, seed, wid, role, rdir, graces, second = argv[1:8]
        return worker_main(store, int(seed), int(wid), role, rdir, tuple(float(g) for g in graces.split(",")), second == "1")
    p = argparse.ArgumentParser(prog="python -m tests.stress", description="Run the ckptstore stress harness.")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--rounds", type=int, default=8, help="0: until --min-kills")
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--kill-rate", type=float, default=0.5)
    p.add_argument("--min-kills", type=int, default=0)
    p.add_argument("--slow", action="store_true", help="the slow test's settings (SLOW; overrides --workers and --kill-rate)")
    p.add_argument("--graces", default="0,0.05,0.3", help="grace periods (seconds) workers pass to gc, comma-separated")
    p.add_argument("--no-concurrent-create", action="store_true", help="create each fresh store before its workers start")
    p.add_argument("--no-second-stores", action="store_true", help="never open two Stores on the store in one process")
    p.add_argument("--max-seconds", type=float, default=None)
    p.add_argument("--dir", default=None, help="working folder (default: a new temporary one, removed on success)")
    a = p.parse_args(argv)
    seed = a.seed if a.seed is not None else seed_from_env()
    replay = (
        f"python -m tests.stress --seed {seed} --rounds {a.rounds} --workers {a.workers} --kill-rate {a.kill_rate} "
        f"--min-kills {a.min_kills} --graces {a.graces}" + " --slow" * a.slow
        + " --no-concurrent-create" * a.no_concurrent_create + " --no-second-stores" * a.no_second_stores
    )
    work = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="ckpt-stress-"))
    try:
        options = {"workers": a.workers, "kill_rate": a.kill_rate, **(SLOW if a.slow else {})}
        stats = run_rounds(work, seed, a.rounds or None, min_kills=a.min_kills, max_seconds=a.max_seconds,
                           graces=tuple(float(g) for g in a.graces.split(",")), concurrent_create=not a.no_concurrent_create,
                           second_stores=not a.no_second_stores, verbose=True, replay=replay, **options)
    except StressFailure:
        print(f"store kept under {work}")
        return 1
    print(format_stats(stats))
    if not a.dir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
