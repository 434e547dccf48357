"""Model-based stress harness for the store on object storage (``Store("s3://…")``), and its local home.

What it exercises
-----------------
A seeded scheduler (:func:`run_rounds`) runs rounds against one prefix of a moto S3 server on
loopback (tests/s3server.py). Each round starts real processes — fresh interpreters
(``python -m tests.harness.bucket_stress worker SPEC``) or forks of a forkserver that has imported
torch and ckptstore once — pointed at the server through the standard ``AWS_*`` environment,
each with its own ``XDG_CACHE_HOME`` (a separate cache) or one shared by several processes:

``writer``  commits to its own tag (``w0``…) and to the shared tag ``shared``, checks out and
            partially checks out any tag, moves tags (``tag``) and deletes them;
``reader``  checks out, partially checks out, verifies, lists tags and the log;
``gc``      ``gc(keep_last=1..3, grace=1..5 s)`` in a loop; some GC processes run with their wall
            clock (``time.time`` / ``time.time_ns``, wrapped before ckptstore is imported) skewed
            ahead or behind by more than the grace: a machine whose clock is wrong;
``slow``    a writer (tags ``s0``, ``s1``, ``shared``) whose ``AWS_ENDPOINT_URL`` is a delaying
            proxy (tests/delay_proxy.py) that holds every PUT of a commit record for longer than two
            grace periods: its packs are on the bucket long before its record and its tag move;
``pusher``  the local home: commits to a local store folder (``local-0``, ``local-1``, shared by
            several processes) and pushes its tag (``p0``, ``p1``) to the bucket; pulls any bucket
            tag into the local store (sometimes with ``force``) and checks it out from there.

The coordinator SIGKILLs random processes at random instants (and starts forks in their place:
the loop of tests/harness/base.py, shared with the folder's harness tests/harness/stress.py).
Between rounds, with no process running, it damages or deletes random objects: a flipped byte in
a pack's blob (``pack-flip``), a truncated or deleted pack (``pack-trunc``, ``pack-del``), a flipped
byte in / truncated / deleted ``.idx`` (``idx-flip``, ``idx-trunc``, ``idx-del``), a flipped byte in or
a deleted commit record (``record-flip``, ``record-del``), a tag's ref made garbage, dangling or
deleted (``ref-garbage``, ``ref-dangling``, ``ref-del``), the marker flipped or deleted
(``marker-flip``, ``marker-del``), a reflog object flipped (``reflog-flip``), and, in the local home,
a flipped byte in a local pack's blob (``local-flip``). The damage stays through the next round
(workers then tolerate ckptstore errors, never wrong data nor a raw exception).

The model
---------
Every committed state is :func:`tests.harness.base.make_state` of a step number stored as
``metadata={"step": N}`` (unique: ``worker id * 10**6 + counter``); a commit's record is
checked against its id, so its step says what any checkout must return, bit for bit. The
coordinator keeps a ledger of the damage it did and the original bytes. From the bucket's
objects (and the ledger's originals) it knows where every blob is (every ``.idx``, or the pack
itself), so for each tag whether its commit needs a damaged object: *clean* (needs nothing
damaged), *may-hit* (a blob has a damaged copy, or a copy in a pack whose ``.idx`` is damaged),
*must-hit* (its record, or every copy of one of its blobs, is damaged). A tagged blob that is
nowhere and no damage explains is a *loss*.

Checks, after each round and right after each injection (no process running):

1. every clean tag checks out exactly from a fresh cache folder; a may-hit tag checks out exactly
   or raises a ckptstore error; a must-hit one raises one; every commit a worker saw return under
   a tag is in the bucket's reflog (no lost move); ``tags()``, ``tagged()`` and ``log()`` from a
   fresh cache raise nothing but ckptstore errors (and sometimes the CLI's ``ckptstore tags``);
2. ``fsck(deep=True)`` from a fresh and from a warm cache: with no damage, ok; with damage, every
   problem it reports names something the ledger explains (a damaged key, pack, blob, a hit commit
   or tag, the marker) and every must-report damage is reported (a damaged record, a blob every
   copy of which is damaged, a damaged ref, the marker, a reflog object);
3. then (sometimes) ``gc(grace=0)`` with the damage still there, and 1. and 2. again;
4. repair: ``store.repair()`` if the store has one; then what the bucket's objects allow (an
   ``.idx`` rebuilt from its pack, the marker rewritten): every tag hit only by those must check
   out exactly again (a GC that deleted a live pack whose ``.idx`` was damaged is a loss); then the
   ledger's originals are put back and everything must be clean.

Replaying
---------
The seed decides everything the harness chooses (roles, caches, graces, skews, delays, kill
instants, damage); interleavings stay up to the OS. A failure raises :class:`BucketStressFailure`
whose message starts with the seed and the replay command; the work folder is kept::

    CKPT_BSTRESS_SEED=<seed> pytest tests/harness/test_bucket_stress.py
    python -m tests.harness.bucket_stress --seed <seed> --rounds 6        # outside pytest
    python -m tests.harness.bucket_stress --help                          # knobs: --kinds, --no-slow, --skew-rate ...
"""

from __future__ import annotations

import os
import sys

from tests.harness.clock import shift_clock  # before ckptstore: a worker's clock skew must reach it

if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "worker":  # a fresh worker: skew first
    shift_clock(float(os.environ.get("CKPT_BSTRESS_SKEW", "0") or 0))

import argparse  # noqa: E402
import contextlib  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import uuid  # noqa: E402
from collections import Counter  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import ckptstore  # noqa: E402
from ckptstore.errors import (  # noqa: E402
    BlobMissingError,
    CkptStoreError,
    IntegrityError,
    NotAStoreError,
    RefBusyError,
    RefConflictError,
    RefNotFoundError,
)

from tests import paths  # noqa: E402

from tests.harness.base import (  # noqa: E402  the model and the round loop, shared with the folder harness
    BaseWorker,
    Coordinator,
    HarnessFailure,
    Mismatch,
    Proc,
    Round,
    compare,
    counts,
    leaf_paths,
    make_state,
    redirect_output,
    run_round_loop,
    scramble,
    unlogged_moves,
    wait_for_go,
)
from tests.harness.base import seed_from_env as _seed_from_env  # noqa: E402

ROOT = paths.REPO
SRC = Path(ckptstore.__file__).resolve().parents[1]
SHARD_BYTES = 8 << 10
TAGS = ("w0", "w1", "w2", "w3", "shared", "s0", "s1", "p0", "p1")
ALWAYS_TOLERATED = (RefNotFoundError, RefConflictError, RefBusyError, NotAStoreError)
DAMAGE_KINDS = ("pack-flip", "pack-trunc", "pack-del", "idx-flip", "idx-trunc", "idx-del", "record-flip", "record-del",
                "ref-garbage", "ref-dangling", "ref-del", "marker-flip", "marker-del", "reflog-flip", "local-flip")
#: Damage kinds that leave a tag unusable only through an object the bucket's own objects can rebuild.
REBUILDABLE = ("idx-flip", "idx-trunc", "idx-del", "marker-flip", "marker-del")


class BucketStressFailure(HarnessFailure):
    """A failure found by the harness; the message starts with the seed. ``stats`` attached."""


def _exc(exc: BaseException) -> str:
    return type(exc).__qualname__


# --- the worker ------------------------------------------------------------------------------------


class Worker(BaseWorker):
    """One worker process; loops random operations until ``<round dir>/stop-<wid>`` exists.

    Writes to ``p<wid>.ops``: ``O op`` per operation that returned, ``R op Exc`` per tolerated
    error, ``D cid tags step`` per commit (or push) that returned, ``G skew`` per GC run of a
    skewed clock, ``S cid`` per slow commit that returned. A failure prints ``BSTRESS-FAIL …``
    and exits 17.
    """

    FAIL_TAG = "BSTRESS-FAIL"

    def __init__(self, spec: dict):
        super().__init__(spec["seed"], spec["wid"], spec["role"], spec["rdir"])
        self.spec = spec
        self.url = spec["url"]
        self.damaged = spec["damaged"]  # damage is on the bucket or the local home during this round
        self.min_grace = min(spec["graces"])
        self.rng = random.Random(f"{spec['seed']}:{self.wid}")

    def describe(self, exc: BaseException) -> str:
        return f"{_exc(exc)}: {exc}" if not isinstance(exc, Mismatch) else f"wrong data: {exc}"

    def run_op(self, name: str, fn, *args) -> None:
        ctx: dict = {"op": name}
        t0 = time.monotonic()
        try:
            fn(ctx, *args)
        except Mismatch as exc:
            self.fail(ctx, exc)
        except ALWAYS_TOLERATED as exc:
            self.log(f"R {name} {_exc(exc)}")
            time.sleep(0.005)
            return
        except CkptStoreError as exc:
            if self.damaged:
                self.log(f"R {name} damage:{_exc(exc)}")
                time.sleep(0.005)
                return
            if isinstance(exc, (IntegrityError, BlobMissingError)) and "cid" in ctx and time.monotonic() - ctx.get("t_resolved", t0) > self.min_grace:
                self.log(f"R {name} stale:{_exc(exc)}")  # a reader has the grace period to finish, no more
                return
            self.fail(ctx, exc)
        except BaseException as exc:
            self.fail(ctx, exc)
        self.log(f"O {name}")

    def resolve(self, s, ctx: dict, tag: str | None = None) -> tuple[str, int]:
        if tag is None and self.rng.random() < 0.7:
            names = sorted(s.tags())
            tag = self.rng.choice(names) if names else None
        ctx["tag"] = tag = tag or self.rng.choice(TAGS)
        ctx["cid"] = cid = s.resolve(tag)
        ctx["t_resolved"] = time.monotonic()
        meta = s.infos([cid])[cid].metadata
        if not isinstance(meta, dict) or "step" not in meta:
            raise Mismatch(f"commit {cid} has metadata {meta!r}, without a step")
        ctx["step"] = meta["step"]
        return cid, meta["step"]

    # - operations on the bucket -

    def op_commit(self, ctx: dict, s, tags: list[str], use_async: bool = False) -> None:
        ctx["step"] = step = self.next_step()
        ctx["tags"] = ",".join(tags)
        state = make_state(step)
        if use_async:
            fut = s.commit_async(state, tag=tags, message=f"step {step}", metadata={"step": step})
            scramble(state)
            info = fut.result()
        else:
            info = s.commit(state, tag=tags, message=f"step {step}", metadata={"step": step})
        ctx["cid"] = info.id
        self.log(f"D {info.id} {','.join(tags)} {step}")
        if self.role == "slow":
            self.log(f"S {info.id}")
        if sorted(info.tags) != sorted(tags):
            raise Mismatch(f"commit returned tags {info.tags}, moved {tags}")

    def op_checkout(self, ctx: dict, s) -> None:
        cid, step = self.resolve(s, ctx)
        diff = compare(step, s.checkout(cid))
        if diff:
            raise Mismatch(diff)

    def op_partial(self, ctx: dict, s) -> None:
        cid, step = self.resolve(s, ctx)
        ctx["partial"] = path = self.rng.choice(leaf_paths(step))
        diff = compare(step, s.checkout(cid, partial=path), prefix=path)
        if diff:
            raise Mismatch(diff)

    def op_verify(self, ctx: dict, s) -> None:
        cid, _ = self.resolve(s, ctx)
        report = s.verify(cid)
        if not report.ok and not self.damaged:
            raise Mismatch(f"verify of {cid} not ok: {report.problems[:3]}")

    def op_tag(self, ctx: dict, s) -> None:
        src, dst = self.rng.sample(TAGS, 2)
        ctx["tag"] = f"{dst}<-{src}"
        cid = s.tag(dst, src)
        self.log(f"T {dst} {cid}")

    def op_delete_tag(self, ctx: dict, s) -> None:
        ctx["tag"] = tag = self.rng.choice(TAGS)
        s.delete_tag(tag)

    def op_list(self, ctx: dict, s) -> None:
        what = ctx["what"] = self.rng.choice(("tags", "tagged", "log", "reflog"))
        getattr(s, what)()

    def op_gc(self, ctx: dict, s) -> None:
        ctx["keep_last"] = keep = self.rng.randint(1, 3)
        ctx["grace"] = grace = self.spec["grace"]
        s.gc(keep_last=keep, grace=grace)
        if self.spec["skew"]:
            self.log(f"G {self.spec['skew']:+.1f}")

    # - the local home -

    def op_push(self, ctx: dict, local) -> None:
        tag = ctx["tag"] = f"p{self.spec['local_slot']}"
        ctx["step"] = step = self.next_step()
        info = local.commit(make_state(step), tag=tag, message=f"step {step}", metadata={"step": step})
        ctx["cid"] = info.id
        local.push(self.url, tag, force=self.rng.random() < 0.3)
        self.log(f"D {info.id} {tag} {step}")

    def op_pull(self, ctx: dict, local) -> None:
        ctx["tag"] = tag = self.rng.choice(TAGS)
        local.pull(self.url, tag, force=self.rng.random() < 0.5)
        cid = local.resolve(tag)
        ctx["cid"] = cid
        step = local.info(cid).metadata["step"]
        diff = compare(step, local.checkout(cid))
        if diff:
            raise Mismatch(f"pulled {tag} ({cid}): {diff}")

    def op_lcheckout(self, ctx: dict, local) -> None:
        tags = list(local.tags())
        if not tags:
            return
        ctx["tag"] = tag = self.rng.choice(tags)
        ctx["cid"] = cid = local.resolve(tag)
        step = local.info(cid).metadata["step"]
        diff = compare(step, local.checkout(cid))
        if diff:
            raise Mismatch(f"local {tag}: {diff}")

    # - roles -

    def open(self):
        return self.open_until_stopped(lambda: ckptstore.Store(self.url, shard_bytes=SHARD_BYTES, workers=2))

    def role_writer(self) -> None:
        s = self.open()
        own = self.spec["own_tag"]
        weights = {"own": 25, "both": 8, "shared": 6, "async": 6, "checkout": 14, "partial": 10, "verify": 3, "tag": 5,
                   "delete_tag": 2, "list": 3}
        while not self.stop_file.exists():
            op = self.rng.choices(list(weights), list(weights.values()))[0]
            if op in ("own", "both", "shared", "async"):
                tags = {"own": [own], "both": [own, "shared"], "shared": ["shared"], "async": [own]}[op]
                self.run_op("commit", self.op_commit, s, tags, op == "async")
            else:
                self.run_op(op, getattr(self, f"op_{op}"), s)
        s.close()

    def role_slow(self) -> None:
        s = self.open()
        own = self.spec["own_tag"]
        while not self.stop_file.exists():
            tags = [own, "shared"] if self.rng.random() < 0.3 else [own]
            self.run_op("slow_commit", self.op_commit, s, tags)
        s.close()

    def role_reader(self) -> None:
        s = self.open()
        weights = {"checkout": 10, "partial": 10, "verify": 3, "list": 4}
        while not self.stop_file.exists():
            op = self.rng.choices(list(weights), list(weights.values()))[0]
            self.run_op(op, getattr(self, f"op_{op}"), s)
            time.sleep(0.01)
        s.close()

    def role_gc(self) -> None:
        s = self.open()
        while not self.stop_file.exists():
            self.run_op("gc", self.op_gc, s)
            time.sleep(self.rng.uniform(0.05, 0.4))
        s.close()

    def role_pusher(self) -> None:
        local = ckptstore.Store(self.spec["local"], shard_bytes=SHARD_BYTES, create=True)
        weights = {"push": 10, "pull": 8, "lcheckout": 6}
        while not self.stop_file.exists():
            op = self.rng.choices(list(weights), list(weights.values()))[0]
            self.run_op(op, getattr(self, f"op_{op}"), local)
        local.close()


def worker_main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    if not wait_for_go(spec["rdir"], spec["wid"], give_up_when_stopped=True):
        return 0
    return Worker(spec).run()


def _fork_entry(spec_path: str, env: dict, out: str) -> None:  # pragma: no cover - in the forked child
    redirect_output(out)
    os.environ.update(env)
    shift_clock(float(env.get("CKPT_BSTRESS_SKEW", "0") or 0))
    code = 70
    try:
        code = worker_main(spec_path)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        os._exit(code)


def _warm() -> None:
    """What the forkserver imports once, so that a fork starts committing at once."""
    from ckptstore.home import bucket  # noqa: F401
    from ckptstore.protocols import checkout  # noqa: F401
    from ckptstore.protocols import remote  # noqa: F401
    from ckptstore.adapters import REGISTRY, capture

    capture(make_state(0), REGISTRY)


_CTX = None


def _context():
    global _CTX
    if _CTX is None:
        import multiprocessing

        os.environ["CKPT_BSTRESS_FORKSERVER"] = "1"  # the forkserver imports this module and warms it
        _CTX = multiprocessing.get_context("forkserver")
        _CTX.set_forkserver_preload([__spec__.name if __spec__ is not None else __name__])  # importable wherever this file lives
    return _CTX


# --- the coordinator -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    """Knobs of :func:`run_rounds`.

    writers: writer processes per round (1..writers); kill_rate: chance a process gets a kill
    instant; respawn: chance a killed process is replaced by a fork; run_time: seconds a round
    runs; exec_share: share of processes started as fresh interpreters (the rest: forkserver
    forks); graces: GC grace periods (seconds); gc_rate, reader_rate, pusher_rate, slow_rate:
    chance a round has a GC / reader / pusher / slow writer; skew_rate: chance the GC's clock is
    skewed (±(grace + 2..5 s)); skews: which directions ("ahead", "behind"); damage_rate: chance
    damage is injected after a round; damages: 1..damages objects at once; kinds: damage kinds
    drawn from; gc0_rate: chance of a ``gc(grace=0)`` by the coordinator after a round (damage present or not);
    cli_rate: chance the CLI's ``ckptstore tags`` runs in a damage check; shared_cache: chance
    a process shares a cache folder with others.
    """

    writers: int = 2
    kill_rate: float = 0.4
    respawn: float = 0.5
    run_time: tuple[float, float] = (2.0, 4.0)
    exec_share: float = 0.15
    graces: tuple[float, ...] = (1.0, 2.0, 3.0, 5.0)
    gc_rate: float = 0.8
    reader_rate: float = 0.4
    pusher_rate: float = 0.4
    slow_rate: float = 0.3
    skew_rate: float = 0.3
    skews: tuple[str, ...] = ("ahead", "behind")
    damage_rate: float = 0.6
    damages: int = 2
    kinds: tuple[str, ...] = DAMAGE_KINDS
    gc0_rate: float = 0.5
    cli_rate: float = 0.2
    shared_cache: float = 0.5
    straggler_timeout: float = 45.0
    check_reflog_gc: bool = True
    listing_check: bool = True
    slow_delay: float | None = None  # fixed delay of the slow writer's record PUTs (default: past mark + sweep of the round's grace)


#: The slow test's settings: more processes, most of them killed.
SLOW = {"writers": 3, "kill_rate": 0.8, "respawn": 0.8, "run_time": (2.0, 5.0), "damage_rate": 0.8, "damages": 3}


@dataclass
class Damage:
    """One ledger entry: what was damaged and how to put it back."""

    kind: str
    key: str  # object key on the bucket ("" for the local home: ``path``)
    original: bytes | None = None
    written: bytes | None = None  # what we left there (None: deleted)
    pack: str | None = None  # pack id (pack / idx kinds)
    offset: int | None = None  # pack-flip: the damaged entry's offset; local-flip: file offset
    cid: str | None = None  # record kinds
    tag: str | None = None  # ref kinds
    path: str | None = None  # local-flip: the pack file
    address: str | None = None  # pack-flip / local-flip: the damaged blob
    version: str | None = None  # ref kinds: the version we wrote
    local: str | None = None  # local-flip: the local store folder

    def describe(self) -> str:
        what = self.key or self.path
        return f"{self.kind} {what}" + (f" (blob {self.address})" if self.address else "")


class Harness(Coordinator):
    """State of one :func:`run_rounds` call; the round loop is :class:`Coordinator`'s, the checks and the damage are here."""

    TOLERATED_KEY = "tolerated"
    RESPAWN_MARGIN = 0.5
    KILL_WAIT = 60.0

    def __init__(self, root: Path, url: str, env: dict, seed: int, o: Options, verbose: bool, replay: str):
        self.root, self.url, self.env, self.seed, self.o = Path(root), url, env, seed, o
        self.verbose, self.replay = verbose, replay
        self.live: list[Proc] = []
        self.ledger: list[Damage] = []
        self.started = time.monotonic()
        self.stats: dict = {
            "seed": seed, "rounds": 0, "processes": 0, "processes_by_role": Counter(), "processes_by_method": Counter(), "kills": 0,
            "damages": 0, "damages_by_kind": Counter(), "skewed_gcs": 0, "skewed_gc_runs": 0, "slow_commits": 0, "slow_writers": 0,
            "losses": 0, "ops": 0, "ops_by_kind": Counter(), "tolerated": 0, "tolerated_by_kind": Counter(), "tags_checked": 0,
            "fsck_runs": 0, "repairs": 0, "gc0_with_damage": 0, "local_kills": 0, "cli_runs": 0, "seconds": 0.0,
        }
        self.fresh_n = itertools.count()
        self.entries: dict[str, list] = {}  # pack id -> entries (from a pristine .idx or the pack): packs are immutable
        self.needs: dict[str, set] = {}  # commit id -> blob keys, from its verified record
        self.proxy = None
        self.backend = ckptstore.backends.open_backend(url)
        self.locals = [self.root / "local-0", self.root / "local-1"]
        self.local_acked: set[int] = set()  # slots of the local stores a pusher's commit returned in
        self.round: Round | None = None
        self.gc0_clean = False
        self.failed: list[str] = []

    # - failures -

    def failure(self, rnd: int, what: str, loss: bool = False) -> BucketStressFailure:
        if loss:
            self.stats["losses"] += 1
        self.abort()
        self.stats["seconds"] = round(time.monotonic() - self.started, 1)
        dmg = "; ".join(d.describe() for d in self.ledger) or "none"
        msg = (f"bucket stress seed {self.seed} failed in round {rnd} (replay: {self.replay}): {what} "
               f"[damage on the bucket: {dmg}; work folder {self.root}]")
        print(msg, flush=True)
        print(format_stats(self.stats), flush=True)
        return BucketStressFailure(msg, self.stats)

    # - processes -

    def spawn(self, rnd: Round, role: str, extra: dict, method: str | None = None) -> Proc:
        wid = rnd.index * 1000 + len(rnd.procs) + 1
        out = rnd.rdir / f"p{wid}.out"
        r = rnd.rng
        method = method or ("exec" if r.random() < self.o.exec_share else "fork")
        cache = self.root / "cache-shared" if r.random() < self.o.shared_cache else self.root / f"cache-{wid}"
        env = {**self.env, "XDG_CACHE_HOME": str(cache), "CKPT_BSTRESS_SKEW": str(extra.get("skew", 0.0))}
        if role == "slow":
            env["AWS_ENDPOINT_URL"] = self.proxy.endpoint
        spec = {"url": self.url, "seed": self.seed, "wid": wid, "role": role, "rdir": str(rnd.rdir), "graces": list(self.o.graces),
                "damaged": bool(self.ledger), "grace": extra.get("grace", self.o.graces[0]), "skew": extra.get("skew", 0.0),
                "own_tag": extra.get("own_tag"), "local": extra.get("local"), "local_slot": extra.get("local_slot")}
        spec_path = rnd.rdir / f"spec-{wid}.json"
        spec_path.write_text(json.dumps(spec))
        if method == "exec":
            full = {**os.environ, **env, "PYTHONPATH": os.pathsep.join(p for p in (str(SRC), str(ROOT)) if p),
                    "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
            with out.open("wb") as f:
                handle = subprocess.Popen([sys.executable, "-m", "tests.harness.bucket_stress", "worker", str(spec_path)], cwd=ROOT, env=full,
                                          stdout=f, stderr=subprocess.STDOUT)
        else:
            handle = _context().Process(target=_fork_entry, args=(str(spec_path), env, str(out)))
            handle.start()
        p = Proc(wid, role, method, out, handle, fail_tag="BSTRESS-FAIL", skew=extra.get("skew", 0.0), extra=extra)
        rnd.procs.append(p)
        self.live.append(p)
        self.stats["processes"] += 1
        self.stats["processes_by_role"][role] += 1
        self.stats["processes_by_method"][method] += 1
        if extra.get("skew"):
            self.stats["skewed_gcs"] += 1
        if role == "slow":
            self.stats["slow_writers"] += 1
        return p

    def reap(self, rnd: Round, p: Proc) -> None:
        """A process ended; a failed one is kept for the end of the round, whose checks say more (a loss, where)."""
        self.live.remove(p)
        if p.killed:
            return
        if p.code != 0:
            self.failed.append(f"process {p.wid} ({p.role}, {p.method}, skew {p.skew:+.1f}) exited {p.code}: {p.diagnostic()}")

    # - the hooks of Coordinator's loop -

    def kill_instant(self, p: Proc, rng: random.Random, t0: float, run_for: float) -> float:
        # the slow writer is killed late if at all: its commits take seconds
        return t0 + (rng.uniform(run_for * 0.7, run_for) if p.role == "slow" else rng.uniform(0, run_for))

    def may_replace_killed(self, p: Proc) -> bool:
        return p.killed

    def replace(self, rnd: Round, p: Proc) -> Proc:
        return self.spawn(rnd, p.role, p.extra, "fork")

    def replacement_kill_instant(self, rng: random.Random, now: float, end: float) -> float:
        return now + rng.uniform(0.2, max(0.3, end - now))

    def on_kill(self, p: Proc) -> None:
        if p.role == "pusher":
            self.stats["local_kills"] += 1

    def on_log_line(self, parts: list[str], events: list) -> None:
        if parts[0] == "D" and len(parts) == 4:
            events.append(parts)
            if parts[2] in ("p0", "p1"):  # a pusher's commit returned: that local store exists
                self.local_acked.add(int(parts[2][1:]))
        elif parts[0] == "G":
            self.stats["skewed_gc_runs"] += 1
        elif parts[0] == "S":
            self.stats["slow_commits"] += 1

    # - one round -

    def plan(self, rnd: Round) -> tuple[list[tuple[str, dict]], float, dict]:
        r, o = rnd.rng, self.o
        roles: list[tuple[str, dict]] = []
        for i in range(r.randint(1, o.writers)):
            roles.append(("writer", {"own_tag": f"w{r.randrange(4)}"}))
        if r.random() < o.reader_rate:
            roles.append(("reader", {}))
        if r.random() < o.pusher_rate:
            slot = r.randrange(len(self.locals))
            roles.append(("pusher", {"local": str(self.locals[slot]), "local_slot": slot}))
        info: dict = {}
        run_for = r.uniform(*o.run_time)
        if r.random() < o.gc_rate:
            grace = r.choice(o.graces)
            extra = {"grace": grace}
            if o.skews and r.random() < o.skew_rate:
                sign = 1 if r.choice(o.skews) == "ahead" else -1
                extra["skew"] = round(sign * (grace + r.uniform(2.0, 5.0)), 2)
            roles.append(("gc", extra))
            info["gc"] = extra
            if r.random() < o.slow_rate:
                if o.slow_delay is None:
                    small = min(o.graces)
                    extra["grace"] = grace = min(grace, r.choice([g for g in o.graces if g <= max(small, 2.0)]))
                    delay = round(2 * (grace + 1.0) + r.uniform(1.0, 2.5), 2)  # longer than mark + sweep of its new packs
                else:
                    delay = o.slow_delay
                roles.append(("slow", {"own_tag": f"s{r.randrange(2)}", "delay": delay}))
                info["slow_delay"] = delay
                run_for = max(run_for, delay + 2.5)
        return roles, run_for, info

    def run_round(self, index: int) -> None:
        rnd = self.round = Round(index, self.root / f"round-{index}", random.Random(f"{self.seed}:round:{index}"))
        rnd.rdir.mkdir(parents=True)
        rng = rnd.rng
        roles, run_for, info = self.plan(rnd)
        self.proxy.set_rules([{"method": "PUT", "key": "/commits/", "seconds": info["slow_delay"]}] if "slow_delay" in info else [])
        procs = [self.spawn(rnd, role, extra) for role, extra in roles]
        if self.verbose:
            print(f"round {index}: {[p.role + (f'({p.skew:+.1f})' if p.skew else '') for p in procs]} for {run_for:.1f} s {info} "
                  f"damage: {[d.describe() for d in self.ledger]}", flush=True)
        _, end = self.start_round(rnd, procs, run_for)
        self.drive(rnd, end)
        for p in rng.sample(self.live, len(self.live)):
            (rnd.rdir / f"stop-{p.wid}").touch()
        for p in list(self.live):
            if p.wait(self.o.straggler_timeout) is None:
                p.kill()
                raise self.failure(index, f"process {p.wid} ({p.role}) did not stop within {self.o.straggler_timeout} s: {p.diagnostic()}")
            self.reap(rnd, p)
        events = self.collect_logs(rnd)
        self.settle()
        self.gc0_clean = False
        if self.failed:
            try:
                self.check(index, "after the round", events)
            except BucketStressFailure as exc:
                raise BucketStressFailure(f"{exc}; and a worker failed: {self.failed[0]}", self.stats) from None
            raise self.failure(index, self.failed[0])
        self.check(index, "after the round", events)
        if self.ledger:
            if rng.random() < self.o.gc0_rate:
                self.gc0(index)
                self.check(index, "after gc(grace=0) with the damage present", [])
            self.repair(index)
        elif rng.random() < self.o.gc0_rate:
            self.gc0(index)
        if self.o.check_reflog_gc:
            self.check_reflog_collected(index)
        if rng.random() < self.o.damage_rate:
            self.inject(rnd)
            self.check(index, "right after the damage", [], cli=rng.random() < self.o.cli_rate)
        self.stats["rounds"] += 1
        shutil.rmtree(rnd.rdir, ignore_errors=True)

    def settle(self) -> None:
        """Forget damage that a process has written over: a ref moved by a ``tag`` or ``delete_tag`` of that name,
        or a deleted tag a commit recreated (the ref no longer holds the injected bytes), and a deleted marker a
        writer completed from its copy (as after a first writer killed between the two): nothing is damaged."""
        for d in [d for d in self.ledger if d.kind.startswith("ref-")]:
            ref = self.backend.read_ref(d.tag)
            if (ref is not None) if d.kind == "ref-del" else (ref is None or ref.data != d.written):
                self.ledger.remove(d)
        for d in [d for d in self.ledger if d.kind == "marker-del" and d.key == "ckptstore.json"]:
            if self.backend.head(d.key) is not None:
                self.ledger.remove(d)

    # - stores for the checks -

    def fresh(self):
        folder = self.root / "fresh" / f"c{next(self.fresh_n)}"
        return ckptstore.Store(self.url, cache=folder, shard_bytes=SHARD_BYTES)

    def warm(self):
        return ckptstore.Store(self.url, cache=self.root / "warm-cache", shard_bytes=SHARD_BYTES)

    def gc0(self, index: int) -> None:
        if self.ledger:
            self.stats["gc0_with_damage"] += 1
        self.gc0_clean = not self.ledger
        try:
            self.gc0_at = self.backend.now()  # the server's clock before the GC: what it can be asked to have collected
        except CkptStoreError:
            self.gc0_clean = False  # (no clock: the reflog check is skipped this round)
        with self.warm() as s:
            try:
                s.gc(grace=0, keep_last=3)
            except NotAStoreError:
                pass
            except CkptStoreError as exc:
                if not self.ledger:
                    raise self.failure(index, f"gc(grace=0) with no damage and no process running: {_exc(exc)}: {exc}") from exc
            except Exception as exc:
                raise self.failure(index, f"gc(grace=0) raised a raw {_exc(exc)}: {exc}") from exc

    # - the truth: where every blob is, what each tag needs -

    def _entries(self, pid: str, listed: dict):
        """Entries of pack ``pid`` from a pristine ``.idx`` or the pack itself (None: unknown)."""
        from ckptstore.objects.packindex import decode_index, index_key, pack_key, scan_pack

        if pid in self.entries:
            return self.entries[pid]
        damaged = {d.key for d in self.ledger}
        pk, ik = pack_key(pid), index_key(pid)
        es = None
        if ik in listed and ik not in damaged and pk in listed:
            with contextlib.suppress(CkptStoreError):
                es = decode_index(self.backend.get(ik), pid, listed[pk].size)
        if es is None and pk in listed and pk not in damaged:
            with contextlib.suppress(CkptStoreError):
                es = scan_pack(self.backend.get(pk), pid)
        if es is not None:
            self.entries[pid] = es
        return es

    def _needs(self, cid: str) -> set | None:
        from ckptstore.objects.bucketformat import fetch_record

        if cid not in self.needs:
            try:
                rec = fetch_record(self.backend, cid)
            except CkptStoreError:
                return None
            self.needs[cid] = {k for leaf in rec.leaves for k in leaf.keys}
        return self.needs[cid]

    def _lineage(self, heads: set) -> set:
        """Every commit whose record the bucket holds on the lineage of ``heads`` (themselves included)."""
        from ckptstore.objects.bucketformat import fetch_record

        seen, stack = set(), list(heads)
        while stack:
            c = stack.pop()
            if c in seen:
                continue
            seen.add(c)
            with contextlib.suppress(CkptStoreError):
                stack += fetch_record(self.backend, c).parents
        return seen

    def survey(self) -> dict:
        """Tags, commits, blob locations and what each commit's status is under the ledger."""
        from ckptstore.layout import address
        from ckptstore.objects.packs import BLOB_HEADER, BLOB_MAGIC
        from ckptstore.objects.bucketformat import read_tag

        listed = {o.key: o for o in self.backend.list("blobs")}
        pids = {k.rsplit("/", 1)[1][:-5] for k in listed if k.endswith(".pack")}
        pids |= {d.pack for d in self.ledger if d.kind == "pack-del"}
        loc: dict = {}
        for pid in pids:
            for e in self._entries(pid, listed) or ():
                if e.magic == BLOB_MAGIC:
                    loc.setdefault((e.loc.digest, e.loc.raw_len), []).append((pid, e.loc.offset, e.loc.offset + BLOB_HEADER.size + e.loc.stored_len))
        whole = {d.pack for d in self.ledger if d.kind in ("pack-trunc", "pack-del")}
        degraded = {d.pack for d in self.ledger if d.kind.startswith("idx-")}
        spots = {(d.pack, d.offset) for d in self.ledger if d.kind == "pack-flip"}
        bad_records = {d.cid for d in self.ledger if d.kind in ("record-flip", "record-del")}
        commits = {o.key.rsplit("/", 1)[1] for o in self.backend.list("commits")} | {d.cid for d in self.ledger if d.kind == "record-del"}
        refs = {}
        bad_tags = {d.tag for d in self.ledger if d.kind.startswith("ref-")}
        for name in set(self.backend.list_refs()) | bad_tags:
            if name in bad_tags:
                refs[name] = next(d for d in self.ledger if d.tag == name).cid
                continue
            with contextlib.suppress(CkptStoreError):
                cid = read_tag(self.backend, name)[0]
                if cid:
                    refs[name] = cid

        def status(cid: str) -> tuple[str, list[str]]:
            if cid in bad_records:
                return "must", [f"record of {cid}"]
            keys = self._needs(cid)
            if keys is None:
                return "lost", [f"the record of commit {cid} is missing or damaged and no damage explains it"]
            # Every damaged blob of the commit is named, not only the first: fsck reports each blob every copy of which
            # is damaged ("blob X is in no pack", "... is truncated"), one line per blob, and the check in fsck() below
            # accepts a line only if it names something the ledger explains. Returning at the first such blob left the
            # others unexplained whenever one damaged pack held two or more of a commit's blobs: seeds 4242 (pack-trunc:
            # 3 blobs past the cut) and 777 (pack-del: 12 blobs of one commit in the deleted pack) failed so in round 1.
            must, may = [], []
            for k in sorted(keys):
                ls = loc.get(k, [])
                if not ls:
                    return "lost", [f"blob {address(*k)} of commit {cid} is in no pack on the bucket"]
                bad = [(p, a) for p, a, b in ls if p in whole or any(q == p and a <= off < b for q, off in spots)]
                deg = [p for p, _, _ in ls if p in degraded]
                if len(bad) == len(ls):
                    must.append(f"blob {address(*k)}")
                elif bad or deg:
                    may.append(f"blob {address(*k)}")
            return ("must" if must else "may" if may else "clean"), must + may

        st = {cid: status(cid) for cid in commits}
        for cid in set(refs.values()) - commits:
            st[cid] = status(cid)
        return {"refs": refs, "bad_tags": bad_tags, "commits": commits, "status": st, "loc": loc, "listed": listed}

    # - the checks -

    def check(self, index: int, when: str, events: list, cli: bool = False) -> None:
        sv = self.survey()
        refs, st = sv["refs"], sv["status"]
        lost = [(t, st[c][1]) for t, c in refs.items() if t not in sv["bad_tags"] and st[c][0] == "lost"]
        if lost:
            self.stats["losses"] += len(lost) - 1
            raise self.failure(index, f"{when}: {len(lost)} tags lost data no damage explains: {lost[:4]}", loss=True)
        # A record no tag reaches whose blobs are gone is what a commit killed between its record and its ref move leaves
        # when a GC swept its packs meanwhile (it never returned: nothing is lost); in a tag's lineage it is a loss.
        reach = self._lineage({c for t, c in refs.items() if t not in sv["bad_tags"]})
        orphaned = sorted(c for c in sv["commits"] if st[c][0] == "lost" and c not in set(refs.values()) and c in reach)
        if orphaned:
            raise self.failure(index, f"{when}: {len(orphaned)} commit records on the bucket need blobs that are gone with no damage to "
                                      f"explain it: {[st[c][1][0] for c in orphaned[:3]]}")
        # 1. every tag from a fresh cache
        try:
            s = self.fresh()
        except Exception as exc:
            raise self.failure(index, f"{when}: opening the store from a fresh cache: {_exc(exc)}: {exc}", loss=bool(refs)) from exc
        with s:
            for tag, cid in sorted(refs.items()):
                if tag in sv["bad_tags"]:
                    continue
                kind = st[cid][0]
                try:
                    got_cid = s.resolve(tag)
                    step = s.infos([got_cid])[got_cid].metadata["step"]
                    td = s.checkout(got_cid)
                except CkptStoreError as exc:
                    if kind == "clean":
                        raise self.failure(index, f"{when}: tag {tag} (commit {cid}), which needs no damaged object, does not check out "
                                                  f"from a fresh cache: {_exc(exc)}: {exc}", loss=True) from exc
                    continue
                except Exception as exc:
                    raise self.failure(index, f"{when}: checking out tag {tag} from a fresh cache raised a raw {_exc(exc)}: {exc}") from exc
                if got_cid != cid:
                    raise self.failure(index, f"{when}: tag {tag} resolves to {got_cid}, the bucket's ref says {cid}")
                diff = compare(step, td)
                if diff:
                    raise self.failure(index, f"{when}: tag {tag} (commit {cid}, {kind}) checks out wrong data from a fresh cache: {diff}",
                                       loss=True)
                if kind == "must":
                    raise self.failure(index, f"{when}: tag {tag} (commit {cid}) needs a damaged object ({st[cid][1][:2]}) yet checked "
                                              f"out: the damage was not where the ledger says")
                self.stats["tags_checked"] += 1
            for what in ("tags", "tagged", "log") if self.o.listing_check else ():
                try:
                    getattr(s, what)()
                except CkptStoreError as exc:
                    if not self.ledger:
                        raise self.failure(index, f"{when}: {what}() from a fresh cache with no damage: {_exc(exc)}: {exc}") from exc
                except Exception as exc:
                    raise self.failure(index, f"{when}: {what}() from a fresh cache raised a raw {_exc(exc)}: {exc}") from exc
            # no lost move: every commit a worker saw return under a tag is in the reflog
            if events:
                try:
                    reflog = s.reflog()
                except CkptStoreError as exc:
                    if not self.ledger:
                        raise self.failure(index, f"{when}: reflog(): {_exc(exc)}: {exc}") from exc
                    reflog = None
                if reflog is not None:
                    # retention governs the reflog: the move of a commit GC has dropped (its record gone) may go with it
                    gone = unlogged_moves(events, reflog, still_there=s.has_commit)
                    if gone:
                        raise self.failure(index, f"{when}: {len(gone)} tag moves that returned are not in the reflog: {gone[:4]}", loss=True)
            self.fsck(index, f"{when}, fresh cache", s, sv)
        try:
            w = self.warm()
        except Exception as exc:
            raise self.failure(index, f"{when}: opening the store from a warm cache: {_exc(exc)}: {exc}", loss=bool(refs)) from exc
        with w:
            with contextlib.suppress(Exception):
                w.tags()  # the warm cache as a machine that had seen everything: it knew the damaged objects' originals
            self.fsck(index, f"{when}, warm cache", w, sv)
        if cli:
            self.cli_tags(index, when)
        self.check_local(index, when)

    def fsck(self, index: int, when: str, s, sv: dict) -> None:
        if not sv["refs"] and not sv["commits"] and not self.ledger:
            return  # nothing committed yet: not a store
        self.stats["fsck_runs"] += 1
        try:
            rep = s.fsck(deep=True)
        except CkptStoreError as exc:
            raise self.failure(index, f"{when}: fsck(deep=True) raised {_exc(exc)} instead of reporting: {exc}") from exc
        except Exception as exc:
            raise self.failure(index, f"{when}: fsck(deep=True) raised a raw {_exc(exc)}: {exc}") from exc
        bucket_damage = [d for d in self.ledger if d.kind != "local-flip"]
        if not bucket_damage:
            if not rep.ok:
                raise self.failure(index, f"{when}: fsck(deep=True) with no damage is not ok: {rep.problems[:4]}")
            return
        st = sv["status"]
        hit = {c for c, (k, _) in st.items() if k in ("may", "must")}
        tags_hit = {t for t, c in sv["refs"].items() if c in hit} | sv["bad_tags"]
        tokens = {d.key for d in bucket_damage} | {d.pack for d in bucket_damage if d.pack} | {d.address for d in bucket_damage if d.address}
        tokens |= hit | {d.cid for d in bucket_damage if d.cid} | {"ckptstore.json"}
        tokens |= {f"'{t}'" for t in tags_hit}
        tokens |= {w.split()[-1] for c in hit for w in st[c][1] if w.startswith("blob ")}
        tokens.discard(None)
        unexplained = [p for p in rep.problems if not any(t in p for t in tokens)]
        extra_commits = [c for c in getattr(rep, "damaged_commits", []) if c not in hit]
        extra_tags = [t for t in getattr(rep, "damaged_tags", []) if t not in tags_hit]
        if unexplained or extra_commits or extra_tags:
            raise self.failure(index, f"{when}: fsck(deep=True) reports what was not damaged: problems {unexplained[:3]}, commits "
                                      f"{extra_commits[:3]}, tags {extra_tags[:3]}")
        text = "\n".join(rep.problems)
        named = set(getattr(rep, "damaged_commits", [])) | set(getattr(rep, "damaged_tags", []))
        # A commit no intact tag reaches (one killed before its ref move, or one a damaged ref or record cut off) whose
        # blobs are damaged is listed as an orphan: fsck cannot tell the two apart (the pack's damage is reported on its own)
        reach = self._lineage({c for t, c in sv["refs"].items() if t not in sv["bad_tags"]})
        cut = any(d.kind.startswith("record-") for d in bucket_damage)  # fsck's walk stops at a damaged record; ours does not
        named |= {c for c in getattr(rep, "orphan_commits", []) if cut or c not in reach}

        def reported(*names: str) -> bool:
            return any(n in named or n in text or f"'{n}'" in text for n in names)

        missed = []
        deleted = {d.cid for d in bucket_damage if d.kind == "record-del"}
        for c in sorted(sv["commits"] - deleted):
            if st[c][0] == "must" and not reported(c):
                missed.append(f"commit {c} ({st[c][1][0]})")
        for t, c in sorted(sv["refs"].items()):
            d = next((d for d in bucket_damage if d.tag == t), None)
            if d is not None and d.kind != "ref-del" and not reported(t):
                missed.append(f"tag {t} ({d.kind})")
            elif d is None and c in deleted and not reported(t, c):
                missed.append(f"tag {t}, whose record {c} was deleted")
        for d in bucket_damage:
            # A deleted marker is damage only where the prefix holds a store (refs or commit records): fsck says
            # "ckptstore.json is missing, though the prefix holds a store" (bucketformat.marker_problem), and a prefix
            # with neither is an empty one that its first commit makes a store. On a loaded machine every writer of
            # seed 4242 was killed before its first commit (ops: gc 10, open 6), and round 2's marker-del was then
            # rightly not reported.
            holds = d.kind != "marker-del" or bool(self.backend.list_refs() or self.backend.list("commits"))
            if d.kind.startswith("marker-") and holds and "ckptstore.json" not in text:
                missed.append(d.describe())
            if d.kind == "reflog-flip" and d.key not in text and self.backend.head(d.key) is not None:
                missed.append(d.describe())  # (a GC may have collected it with its dropped commits: retention governs the reflog)
        if missed:
            raise self.failure(index, f"{when}: fsck(deep=True) does not report injected damage: {missed[:4]} (it reported "
                                      f"{rep.problems[:3]})")

    def cli_tags(self, index: int, when: str) -> None:
        self.stats["cli_runs"] += 1
        env = {**os.environ, **self.env, "XDG_CACHE_HOME": str(self.root / "fresh" / f"cli{next(self.fresh_n)}"), "PYTHONWARNINGS": "ignore",
               "PYTHONPATH": str(SRC)}
        proc = subprocess.run([sys.executable, "-m", "ckptstore.cli", "tags", "--store", self.url], env=env, capture_output=True,
                              text=True, timeout=300)
        if proc.returncode not in (0, 1) or "Traceback" in proc.stderr + proc.stdout:
            tail = " | ".join((proc.stdout + proc.stderr).strip().splitlines()[-4:])
            raise self.failure(index, f"{when}: `ckptstore tags --store {self.url}` from a fresh cache exited {proc.returncode}: {tail}")

    def check_local(self, index: int, when: str) -> None:
        """The local home: fsck(deep) reports exactly the local damage; every tag not hit checks out exactly."""
        for slot, folder in enumerate(self.locals):
            if not folder.exists():
                continue
            damaged = [d for d in self.ledger if d.kind == "local-flip" and d.local == str(folder)]
            try:
                s = ckptstore.Store(folder, create=False)
            except NotAStoreError:
                if slot in self.local_acked:
                    raise
                continue  # every pusher was SIGKILLed while it created this store, none committed: the next one finishes it
            with s:
                hit = set()
                for cid in (c.id for c in s.log()):
                    keys = {k for leaf in s.record(cid).leaves for k in leaf.keys}
                    if any(ckptstore.layout.address(*k) == d.address for d in damaged for k in keys):
                        hit.add(cid)
                self.stats["fsck_runs"] += 1
                rep = s.fsck(deep=True)
                if not damaged and not rep.ok:
                    raise self.failure(index, f"{when}: the local home {folder.name}: fsck(deep=True) not ok: {rep.problems[:3]}")
                if damaged and (set(rep.damaged_commits) != hit or not rep.problems):
                    raise self.failure(index, f"{when}: the local home {folder.name}: fsck reports damaged commits {rep.damaged_commits}, "
                                              f"the damage hits {sorted(hit)}")
                for tag, cid in s.tags().items():
                    step = s.info(cid).metadata["step"]
                    try:
                        diff = compare(step, s.checkout(cid))
                    except CkptStoreError as exc:
                        if cid in hit:
                            continue
                        raise self.failure(index, f"{when}: local tag {tag} ({cid}) does not check out: {_exc(exc)}: {exc}", loss=True) from exc
                    if diff:
                        raise self.failure(index, f"{when}: local tag {tag} ({cid}) checks out wrong data: {diff}", loss=True)
                    self.stats["tags_checked"] += 1

    def check_reflog_collected(self, index: int) -> None:
        """After a gc(grace=0) with no damage and no process running, no reflog object names only
        commits the bucket no longer has (a GC collects the history of what it collected)."""
        if self.ledger or not self.gc0_clean:
            return
        commits = {o.key.rsplit("/", 1)[1] for o in self.backend.list("commits")}
        stale = []
        for o in self.backend.list("reflog"):
            if o.mtime >= self.gc0_at:
                # Written (server clock, whole seconds) while or after the GC ran, so younger than its cutoff: a GC
                # collects only objects older than its cutoff (invariant 5), and a PUT a writer sent just before its
                # SIGKILL can land after the kill on a loaded server ("no process running" is not "no request in
                # flight"). Not the GC's to have collected; the next GC does. Objects older than the GC stay checked.
                self.stats["reflog_younger_than_gc0"] = self.stats.get("reflog_younger_than_gc0", 0) + 1
                continue
            try:
                m = json.loads(self.backend.get(o.key))
                named = {m.get("new"), m.get("old")} - {None}
            except (CkptStoreError, ValueError, AttributeError):
                continue
            if named and not named & commits:
                stale.append(f"{o.key} (mtime {o.mtime}, naming {sorted(named)})")
        if stale:
            raise self.failure(index, f"after gc(grace=0) with no process running, {len(stale)} reflog objects name only commits the "
                                      f"GC collected (reflog objects are never collected); the GC started at {self.gc0_at} (server "
                                      f"clock): {stale[:2]}")

    # - damage -

    def _raw_put(self, key: str, data: bytes) -> None:
        import obstore
        from obstore.store import S3Store

        from ckptstore.backends.s3 import parse_s3_url

        bucket, prefix = parse_s3_url(self.url)
        obstore.put(S3Store(bucket, prefix=prefix), key, data)

    def _raw_delete(self, key: str) -> None:
        import obstore
        from obstore.store import S3Store

        from ckptstore.backends.s3 import parse_s3_url

        bucket, prefix = parse_s3_url(self.url)
        obstore.delete(S3Store(bucket, prefix=prefix), key)

    def inject(self, rnd: Round) -> None:
        from ckptstore.objects.packindex import index_key, pack_key
        from ckptstore.objects.packs import BLOB_HEADER, BLOB_MAGIC
        from ckptstore.objects.bucketformat import commit_key, ref_payload

        r = rnd.rng
        sv = self.survey()
        listed = sv["listed"]
        b = self.backend
        done = 0
        for _ in range(r.randint(1, self.o.damages)):
            kind = r.choice(self.o.kinds)
            taken = {d.key for d in self.ledger} | {d.path for d in self.ledger}
            # prefer objects a tag needs: damage that hits nothing tests little
            tagged_cids = sorted(set(sv["refs"].values()) & sv["commits"])
            tagged_keys = {k for c in tagged_cids for k in (self._needs(c) or ())}
            packs = sorted(p for p in (k.rsplit("/", 1)[1][:-5] for k in listed if k.endswith(".pack"))
                           if pack_key(p) not in taken and index_key(p) not in taken and self._entries(p, listed))
            used = [p for p in packs if any((e.loc.digest, e.loc.raw_len) in tagged_keys for e in self.entries[p] if e.magic == BLOB_MAGIC)]
            packs = used if used and r.random() < 0.8 else packs
            d = None
            if kind.startswith("pack-") and packs:
                pid = r.choice(packs)
                key = pack_key(pid)
                data = b.get(key)
                if kind == "pack-flip":
                    blobs = [e for e in self.entries[pid] if e.magic == BLOB_MAGIC and e.loc.stored_len > 0]
                    if not blobs:
                        continue
                    e = r.choice(blobs)
                    at = e.loc.offset + (r.randrange(BLOB_HEADER.size) if r.random() < 0.2 else BLOB_HEADER.size + r.randrange(e.loc.stored_len))
                    bad = bytearray(data)
                    bad[at] ^= 1 << r.randrange(8)
                    d = Damage(kind, key, data, bytes(bad), pack=pid, offset=at, address=e.loc.address)
                elif kind == "pack-trunc":
                    d = Damage(kind, key, data, data[: r.randrange(16, len(data))], pack=pid)
                else:
                    d = Damage(kind, key, data, None, pack=pid)
            elif kind.startswith("idx-") and packs:
                pid = r.choice(packs)
                key = index_key(pid)
                if key not in listed:
                    continue
                data = b.get(key)
                if kind == "idx-flip":
                    bad = bytearray(data)
                    bad[r.randrange(len(data))] ^= 1 << r.randrange(8)
                    written = bytes(bad)
                else:
                    written = data[: r.randrange(0, len(data))] if kind == "idx-trunc" else None
                d = Damage(kind, key, data, written, pack=pid)
            elif kind.startswith("record-"):
                cids = sorted(c for c in (tagged_cids if r.random() < 0.8 else sv["commits"]) if commit_key(c) not in taken and c in sv["commits"])
                if not cids:
                    continue
                cid = r.choice(cids)
                key = commit_key(cid)
                data = b.get(key)
                self._needs(cid)
                if kind == "record-flip":
                    bad = bytearray(data)
                    bad[r.randrange(len(data))] ^= 1 << r.randrange(7)
                    written = bytes(bad)
                else:
                    written = None
                d = Damage(kind, key, data, written, cid=cid)
            elif kind.startswith("ref-"):
                names = sorted(t for t in sv["refs"] if f"refs/{t}" not in taken and t not in sv["bad_tags"])
                if not names:
                    continue
                tag = r.choice(names)
                ref = b.read_ref(tag)
                cid = sv["refs"][tag]
                d = Damage(kind, f"refs/{tag}", ref.data, None, tag=tag, cid=cid)
                if kind == "ref-del":
                    self._raw_delete(f"refs/{tag}")  # behind the backend's back: refs are no objects to it
                else:
                    payload = b'{"commit": 12' if kind == "ref-garbage" else ref_payload(uuid.UUID(int=r.getrandbits(128)).hex, None, "commit", 0.0)
                    d.written = payload
                    d.version = b.cas_ref(tag, payload, ref.version)
            elif kind.startswith("marker-"):
                key = "ckptstore.json"
                if key in taken or b.head(key) is None:
                    continue
                data = b.get(key)
                bad = bytearray(data)
                bad[r.randrange(len(data))] ^= 1 << r.randrange(7)
                d = Damage(kind, key, data, bytes(bad) if kind == "marker-flip" else None)
            elif kind == "reflog-flip":
                objs = [o.key for o in b.list("reflog") if o.key not in taken]
                if not objs:
                    continue
                key = r.choice(sorted(objs))
                data = b.get(key)
                bad = bytearray(data)
                bad[r.randrange(len(data))] = ord("#")
                d = Damage(kind, key, data, bytes(bad))
            elif kind == "local-flip":
                d = self._local_damage(r, taken)
            if d is None:
                continue
            if d.kind.startswith("ref-"):
                pass  # done through the refs interface above
            elif d.kind == "local-flip":
                with open(d.path, "r+b") as f:
                    f.seek(d.offset)
                    f.write(d.written)
            elif d.written is None:
                b.delete(d.key)
            else:
                self._raw_put(d.key, d.written)
            self.ledger.append(d)
            done += 1
            self.stats["damages"] += 1
            self.stats["damages_by_kind"][d.kind] += 1
        if self.verbose and done:
            print(f"  damage: {[d.describe() for d in self.ledger]}", flush=True)

    def _local_damage(self, r: random.Random, taken: set):
        from ckptstore.objects.packs import BLOB_HEADER

        folders = [f for f in self.locals if f.exists()]
        if not folders:
            return None
        folder = r.choice(folders)
        with ckptstore.Store(folder, create=False) as s:
            tags = s.tags()
            if not tags:
                return None
            cid = tags[r.choice(sorted(tags))]
            keys = sorted({k for leaf in s.record(cid).leaves for k in leaf.keys if k[1] > 0})
            if not keys:
                return None
            key = r.choice(keys)
            loc = s.locate([key])[key]
            path = folder / "blobs" / loc.pack[:2] / f"{loc.pack}.pack"
        if str(path) in taken:
            return None
        at = loc.offset + BLOB_HEADER.size + r.randrange(max(1, loc.stored_len))
        os.chmod(path, 0o644)
        with open(path, "rb") as f:
            f.seek(at)
            orig = f.read(1)
        return Damage("local-flip", "", orig, bytes([orig[0] ^ 0x10]), offset=at, path=str(path), address=loc.address, local=str(folder))

    # - repair -

    def repair(self, index: int) -> None:
        """Repair: the store's own (if any), then what the objects allow, then the ledger's originals."""
        from ckptstore.objects.packindex import encode_index, pack_key, scan_pack

        self.stats["repairs"] += 1
        before = self.survey()
        with self.fresh() as s:
            fn = getattr(s, "repair", None)
            if callable(fn):
                try:
                    fn()
                except CkptStoreError:
                    pass
                except Exception as exc:
                    raise self.failure(index, f"repair() raised a raw {_exc(exc)}: {exc}") from exc
        # what the bucket's own objects allow: an .idx from its pack, the marker
        for d in [d for d in self.ledger if d.kind in REBUILDABLE]:
            if d.kind.startswith("idx-"):
                if self.backend.head(pack_key(d.pack)) is None:
                    # a GC deleted the pack: a loss only if a tagged commit needs a blob of it that no other pack holds (a
                    # pack whose commits were all dropped may go, and a repack may have copied its live blobs elsewhere)
                    from ckptstore.objects.packs import BLOB_MAGIC

                    held = {(e.loc.digest, e.loc.raw_len) for e in self.entries.get(d.pack) or () if e.magic == BLOB_MAGIC}
                    now = self.survey()["loc"]
                    tagged = {c for t, c in before["refs"].items() if t not in before["bad_tags"]}
                    needed = [c for c in sorted(tagged) if any(k in held and k not in now for k in self._needs(c) or ())]
                    if needed:
                        raise self.failure(index, f"the pack {d.pack}, whose .idx was damaged ({d.kind}), is gone from the bucket, though "
                                                  f"tagged commits need its blobs ({needed[:3]}): a GC deleted a live pack", loss=True)
                    self.ledger.remove(d)
                    continue
                self._raw_put(d.key, encode_index(scan_pack(self.backend.get(pack_key(d.pack)), d.pack)))
            else:
                self._raw_put(d.key, d.original)
            self.ledger.remove(d)
        after = self.survey()
        lost_by = {c for c, (k, _) in after["status"].items() if k == "lost"}
        # a damaged ref (deleted, dangling, garbage) no longer protects its commit: GC may collect what only it named
        if lost_by & {c for t, c in after["refs"].items() if t not in after["bad_tags"]}:
            raise self.failure(index, f"after rebuilding the .idx and marker: tagged commits {sorted(lost_by)[:3]} lost blobs", loss=True)
        self.check(index, "after rebuilding what the bucket's objects allow", [])
        # the ledger's originals put back ("a backup")
        for d in list(self.ledger):
            if d.kind.startswith("ref-") and (after["status"].get(d.cid, ("lost",))[0] == "lost" or d.cid not in after["commits"]):
                # while the ref was damaged, GC collected the commit only it named (its blobs, or its record first while its
                # packs wait for the grace period): a ref cannot bring it back
                self._raw_delete(d.key)
            elif d.kind.startswith("ref-"):
                ref = self.backend.read_ref(d.tag)
                if d.kind == "ref-del" and ref is None:
                    self.backend.cas_ref(d.tag, d.original, None)
                elif ref is not None and d.written is not None and ref.data == d.written:
                    self.backend.cas_ref(d.tag, d.original, ref.version)
            elif d.kind == "local-flip":
                with open(d.path, "r+b") as f:
                    f.seek(d.offset)
                    f.write(d.original)
            elif d.kind.startswith("pack-") and self.backend.head(d.key) is None and d.kind != "pack-del":
                pass  # a GC deleted the damaged pack: nothing to put back (check below says if it was needed)
            else:
                self.backend.delete(d.key)
                self._raw_put(d.key, d.original)
            self.ledger.remove(d)
        self.check(index, "after the originals were put back", [])

    def close(self) -> None:
        self.abort()
        with contextlib.suppress(Exception):
            self.backend.close()


def run_rounds(root, seed: int, rounds: int | None = 6, *, url: str | None = None, env: dict | None = None, min_kills: int = 0,
               min_damages: int = 0, max_seconds: float | None = None, verbose: bool = False, replay: str | None = None, **options) -> dict:
    """Run the bucket harness under folder ``root`` against ``url`` (default: a new prefix of a moto
    server this call starts) and return its stats; see the module docstring.

    Raises:
        BucketStressFailure: a worker failed or a check after a round failed (the message names the seed).
    """
    from tests.delay_proxy import DelayProxy
    from tests.s3server import MotoServer

    replay = replay or f"CKPT_BSTRESS_SEED={seed} pytest tests/harness/test_bucket_stress.py"
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    server = None
    saved = dict(os.environ)
    try:
        if env is None:
            server = MotoServer(buckets=["ckpt"], serialize=True).start()
            env = server.env
        url = url or f"s3://ckpt/bstress-{seed}-{uuid.uuid4().hex[:8]}"
        os.environ.update(env)
        os.environ["XDG_CACHE_HOME"] = str(root / "coordinator-cache")
        o = Options(**options)
        h = Harness(root, url, dict(env), seed, o, verbose, replay)
        print(f"bucket stress seed {seed} (replay: {replay}) on {url}", flush=True)
        with DelayProxy(env["AWS_ENDPOINT_URL"]) as proxy:
            h.proxy = proxy
            try:
                run_round_loop(h, rounds, lambda: h.stats["kills"] >= min_kills and h.stats["damages"] >= min_damages, max_seconds)
            finally:
                h.close()
        h.stats["seconds"] = round(time.monotonic() - h.started, 1)
        return h.stats
    finally:
        os.environ.clear()
        os.environ.update(saved)
        if server is not None:
            server.stop()


def format_stats(stats: dict) -> str:
    return (f"bucket stress seed {stats['seed']}: {stats['rounds']} rounds in {stats['seconds']} s; processes {stats['processes']} "
            f"[{counts(stats['processes_by_role'])}; {counts(stats['processes_by_method'])}]; kills {stats['kills']} "
            f"({stats['local_kills']} in the local home); damages {stats['damages']} [{counts(stats['damages_by_kind'])}]; "
            f"skewed GCs {stats['skewed_gcs']} ({stats['skewed_gc_runs']} runs); slow writers {stats['slow_writers']}, slow commits "
            f"{stats['slow_commits']}; gc(grace=0) with damage {stats['gc0_with_damage']}; repairs {stats['repairs']}; ops {stats['ops']} "
            f"[{counts(stats['ops_by_kind'])}]; tolerated {stats['tolerated']} [{counts(stats['tolerated_by_kind'])}]; tags checked "
            f"{stats['tags_checked']}; fsck runs {stats['fsck_runs']}; CLI runs {stats['cli_runs']}; losses {stats['losses']}")


def seed_from_env() -> int:
    return _seed_from_env("CKPT_BSTRESS_SEED")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "worker":
        return worker_main(argv[1])
    p = argparse.ArgumentParser(prog="python -m tests.harness.bucket_stress", description="the object-storage stress harness")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--rounds", type=int, default=6, help="0: until --min-kills and --min-damages")
    p.add_argument("--min-kills", type=int, default=0)
    p.add_argument("--min-damages", type=int, default=0)
    p.add_argument("--slow", action="store_true", help="the slow test's settings")
    p.add_argument("--kinds", default=",".join(DAMAGE_KINDS), help="damage kinds, comma-separated ('' : none)")
    p.add_argument("--damage-rate", type=float, default=None)
    p.add_argument("--damages", type=int, default=None)
    p.add_argument("--graces", default=None, help="GC grace periods, comma-separated seconds")
    p.add_argument("--skew-rate", type=float, default=None)
    p.add_argument("--skews", default=None, help="ahead,behind")
    p.add_argument("--slow-rate", type=float, default=None)
    p.add_argument("--gc-rate", type=float, default=None)
    p.add_argument("--gc0-rate", type=float, default=None)
    p.add_argument("--kill-rate", type=float, default=None)
    p.add_argument("--pusher-rate", type=float, default=None)
    p.add_argument("--writers", type=int, default=None)
    p.add_argument("--slow-delay", type=float, default=None, help="seconds the slow writer's record PUTs wait (default: past two graces)")
    p.add_argument("--shared-cache", type=float, default=None, help="chance a process shares a cache folder (0: every one its own)")
    p.add_argument("--run-time", default=None, help="LOW,HIGH seconds")
    p.add_argument("--no-reflog-gc-check", action="store_true", help="do not require a GC to collect the reflog of what it collected")
    p.add_argument("--no-listing-check", action="store_true", help="do not call tags()/tagged()/log() from a fresh cache in the checks")
    p.add_argument("--dir", default=None)
    a = p.parse_args(argv)
    seed = a.seed if a.seed is not None else seed_from_env()
    opts: dict = dict(SLOW) if a.slow else {}
    opts["kinds"] = tuple(k for k in a.kinds.split(",") if k)
    for name in ("damage_rate", "damages", "skew_rate", "slow_rate", "gc_rate", "gc0_rate", "kill_rate", "pusher_rate", "writers",
                 "shared_cache", "slow_delay"):
        if getattr(a, name) is not None:
            opts[name] = getattr(a, name)
    if a.graces:
        opts["graces"] = tuple(float(g) for g in a.graces.split(","))
    if a.skews is not None:
        opts["skews"] = tuple(s for s in a.skews.split(",") if s)
    if a.run_time:
        opts["run_time"] = tuple(float(x) for x in a.run_time.split(","))
    if a.no_reflog_gc_check:
        opts["check_reflog_gc"] = False
    if a.no_listing_check:
        opts["listing_check"] = False
    if not opts["kinds"]:
        opts["damage_rate"] = 0.0
    replay = "python -m tests.harness.bucket_stress " + " ".join(argv if "--seed" in argv else [*argv, "--seed", str(seed)])
    work = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="ckpt-bstress-"))
    try:
        stats = run_rounds(work, seed, a.rounds or None, min_kills=a.min_kills, min_damages=a.min_damages, verbose=True, replay=replay, **opts)
    except BucketStressFailure:
        print(f"work folder kept: {work}")
        return 1
    print(format_stats(stats))
    if not a.dir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
elif __name__.endswith("bucket_stress") and os.environ.get("CKPT_BSTRESS_FORKSERVER") == "1":  # tests.harness.bucket_stress, wherever it lives
    _warm()
