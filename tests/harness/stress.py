"""Model-based stress harness: real operations, in real processes and threads, killed at random.

What it exercises
-----------------
A seeded random scheduler (:func:`run_rounds`) runs rounds against one store folder. Each
round starts a few worker processes — fresh interpreters (``python -m tests.harness.stress worker``)
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

What is shared
--------------
The model, the worker's plumbing, the kill/restart loop and the reading of the workers' logs
are tests/harness/base.py's, shared with the harness of the store on object storage
(tests/harness/bucket_stress.py); this module keeps what a store folder needs: its topologies and
roles, what it tolerates, and its checks (the reflog, ``gc(grace=0)``, ``Store.recover``).

Replaying a seed
----------------
The seed decides everything the harness chooses: topologies, worker roles, operation
sequences, run times, kill instants. (Thread and process interleavings stay up to the OS, so
a replay repeats the schedule, not necessarily the exact interleaving.) A failure raises
:class:`StressFailure` whose message starts with the seed and the replay command::

    CKPT_STRESS_SEED=<seed> pytest tests/harness/test_stress.py        # replays; CKPT_STRESS_ROUNDS=<n> too
    CKPT_STRESS_SEED=<seed> pytest -m slow tests/harness/test_stress.py    # the 1,000-kill run; CKPT_STRESS_KILLS=<n>
    python -m tests.harness.stress --seed <seed> --rounds 8             # the default test's run, outside pytest
    python -m tests.harness.stress --seed <seed> --rounds 0 --min-kills 1000 --slow    # the slow one

``python -m tests.harness.stress --help`` also lists knobs that step around one known failure to find
the next (``--no-concurrent-create``, ``--no-second-stores``, ``--graces 3600``); a failing
run keeps its folder (stores, per-process ``p<id>.out`` and ``p<id>.ops`` logs) and names it.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
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
from dataclasses import dataclass
from pathlib import Path

import torch

import ckptstore
from ckptstore.errors import CatalogBusyError, GCLockedError, RefNotFoundError
from tests import paths

from tests.harness.base import (  # the model and the round loop, shared with the bucket harness
    FAIL_CODE,
    STEP_BLOCK,
    BaseWorker,
    Coordinator,
    HarnessFailure,
    Mismatch,
    Proc,
    Round,
    _flatten,
    compare,
    counts,
    expected_leaves,
    leaf_paths,
    make_state,
    raw_bytes,
    redirect_output,
    run_round_loop,
    scramble,
    tensor_record,
    unlogged_moves,
    wait_for_go,
)
from tests.harness.base import seed_from_env as _seed_from_env

__all__ = ["SLOW", "StressFailure", "format_stats", "run_rounds", "seed_from_env", "make_state", "compare", "leaf_paths",
           "scramble", "expected_leaves", "raw_bytes", "tensor_record", "Mismatch", "FAIL_CODE", "STEP_BLOCK"]

ROOT = paths.REPO
SRC = Path(ckptstore.__file__).resolve().parents[1]  # children import the same ckptstore as we do
SHARD_BYTES = 8 << 10  # small shards: a state of ~250 KiB has dozens of them, partly shared between steps
TAGS = ("t0", "t1", "t2", "t3", "t4", "latest")
TOLERATED = (RefNotFoundError, GCLockedError, CatalogBusyError)
TOPOLOGIES = ("singles", "double", "threads", "cron", "cli", "mixed")
ROLES = ("single", "double", "threads", "cron")
CATALOG_FILES = ("catalog.sqlite", "catalog.sqlite-wal", "catalog.sqlite-shm")


class StressFailure(HarnessFailure):
    """A failure found by the harness; the message starts with the seed. ``stats`` so far attached."""


def _exc_name(exc: BaseException) -> str:
    mod = type(exc).__module__
    return type(exc).__qualname__ if mod in ("__main__", __name__, Mismatch.__module__, "builtins") else f"{mod}.{type(exc).__qualname__}"


# --- the worker ----------------------------------------------------------------------------


class Worker(BaseWorker):
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

    FAIL_TAG = "STRESS-FAIL"

    def __init__(self, store: str, seed: int, wid: int, role: str, rdir: str, graces: tuple[float, ...], second_stores: bool):
        super().__init__(seed, wid, role, rdir)
        self.path = Path(store)
        self.graces = graces
        self.second_stores = second_stores
        self.retired = False

    # - plumbing (the rest: BaseWorker) -

    def stopped(self) -> bool:
        return self.retired or super().stopped()

    def open_store(self) -> ckptstore.Store:
        return ckptstore.Store(self.path, shard_bytes=SHARD_BYTES, workers=2, create=True)  # a writer: creates it if missing

    def describe(self, exc: BaseException) -> str:
        return f"{_exc_name(exc)}: {exc}"

    def fail(self, ctx: dict, exc: BaseException) -> None:
        super().fail(ctx, exc, where=f"thread={threading.current_thread().name} ")

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

    def play(self) -> None:
        getattr(self, f"role_{self.role}")(random.Random(f"{self.seed}:{self.wid}:main"))

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
        return self.open_until_stopped(self.open_store)  # retried after CatalogBusyError (another process creating the store)

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
    wait_for_go(rdir, wid)
    return Worker(store, seed, wid, role, rdir, graces, second_stores).run()


# --- the coordinator -------------------------------------------------------------------------


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
        redirect_output(out)
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


class Harness(Coordinator):
    """State of one :func:`run_rounds` call (see its docstring); the round loop is :class:`Coordinator`'s."""

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
            proc = Proc(wid, role, "cli", out, popen)
        else:
            method = method or ("exec" if rnd.rng.random() < self.o.exec_share else "fork")
            args = (str(self.store), self.seed, wid, role, str(rnd.rdir), self.o.graces, self.o.second_stores)
            if method == "exec":
                cmd = [sys.executable, "-m", "tests.harness.stress", "worker", str(self.store), str(self.seed), str(wid), role, str(rnd.rdir),
                       ",".join(map(str, self.o.graces)), str(int(self.o.second_stores))]
                with out.open("wb") as f:
                    popen = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=f, stderr=subprocess.STDOUT)
                proc = Proc(wid, role, method, out, popen)
            else:
                proc = Proc(wid, role, method, out, _fork_worker(args, out))
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

    # - the hooks of Coordinator's loop -

    def may_replace_killed(self, p: Proc) -> bool:
        return p.role != "cli"

    def replace(self, rnd: Round, p: Proc) -> Proc:
        return self.spawn(rnd, p.role, "fork")

    def on_exit(self, rnd: Round, p: Proc, now: float, end: float) -> None:
        """A worker that retired (exit 0), or a CLI run that ended: a worker may be replaced by a fork."""
        if p.method != "cli" and rnd.rng.random() < self.o.respawn and end - now > 0.3:
            self.spawn(rnd, p.role, "fork")

    def on_tick(self, rnd: Round, now: float, end: float) -> None:
        if self._topology == "cli" and self._clis < self.o.cli_max and not any(p.method == "cli" for p in self.live) and end - now > 2:
            self.spawn(rnd, "cli")
            self._clis += 1

    def on_log_line(self, parts: list[str], events: list) -> None:
        if parts[0] in ("D", "T", "X") and len(parts) in (3, 4):
            events.append(tuple(parts))

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
        self._topology, self._clis = topology, 0
        _, end = self.start_round(rnd, procs, run_for)
        if topology == "cli":
            self.spawn(rnd, "cli")
            self._clis = 1
        if self.verbose:
            print(f"round {index}: {topology} {roles} store={self.store.name} for {run_for:.1f} s", flush=True)
        self.drive(rnd, end)
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
        events = super().collect_logs(rnd)
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
        lost = unlogged_moves(events, reflog)
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
    replay = replay or f"CKPT_STRESS_SEED={seed} pytest tests/harness/test_stress.py"
    h = Harness(Path(store_path), seed, Options(workers=workers, kill_rate=kill_rate, **options), verbose, replay)
    h.root.mkdir(parents=True, exist_ok=True)
    print(f"stress seed {seed} (replay: {replay}); Store.recover {'exercised' if h.can_recover else 'absent: skipped'}", flush=True)
    try:
        run_round_loop(h, rounds, lambda: h.stats["kills"] >= min_kills, max_seconds)
    finally:
        h.abort()
    h.stats["seconds"] = round(time.monotonic() - h.started, 1)
    return h.stats


def format_stats(stats: dict) -> str:
    """One readable block of the stats."""
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
    return _seed_from_env("CKPT_STRESS_SEED")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "worker":  # python -m tests.harness.stress worker STORE SEED WID ROLE ROUND_DIR GRACES SECOND_STORES
        store, seed, wid, role, rdir, graces, second = argv[1:8]
        return worker_main(store, int(seed), int(wid), role, rdir, tuple(float(g) for g in graces.split(",")), second == "1")
    p = argparse.ArgumentParser(prog="python -m tests.harness.stress", description="Run the ckptstore stress harness.")
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
        f"python -m tests.harness.stress --seed {seed} --rounds {a.rounds} --workers {a.workers} --kill-rate {a.kill_rate} "
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
