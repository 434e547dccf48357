"""Nemesis harness for time and place: pauses, partitions, clock jumps, stale disks and a
hostile folder, against real processes that contend for one run (issue 35).

What it exercises
-----------------
A seeded schedule (:func:`run_rounds`) runs rounds on one home, a folder or a bucket of
the test S3 server (tests/s3server.py). Each round starts, as fresh interpreters
(``python -m tests.harness.nemesis contender|observer|gcloop``):

``contenders``  two or three processes that each loop: build a ``Checkpointer`` of run
                ``exp`` (short lease), and if it is granted, ``resume`` and commit steps,
                each step's state a pure function of its number (:func:`state_of`); a
                refusal (``RunBusyError``: busy, closed or taken over) closes the
                Checkpointer and goes back to contending;
``observer``    reads ``exp/latest`` again and again, as any reader would, and logs each
                commit it sees with that commit's step;
``gcloop``      ``gc(grace=…)`` and ``fsck`` in a loop (the folder home also walks past the
                hostile entries).

and then lets nemeses loose, chosen by the seed:

``pause``       SIGSTOP the current holder (or the GC) for longer than the lease (or the grace),
                then SIGCONT it: a swapped-out host, a VM migration, a debugger;
``partition``   (bucket) cut the holder off the server: its proxy (tests/delay_proxy.py) is
                stopped for longer than the lease, then restarted on the same port;
``clock``       jump a contender's wall clock (``time.time``, wrapped before ckptstore loads)
                by up to an hour forward or back, and later back again;
``hostile``     (folder) plant what the store did not make: symlinks from ``tmp/``,
                ``blobs/<xx>`` and a ``.pack`` name to a folder outside the store, a FIFO
                where a pack would be; the folder outside holds sentinel files.

:func:`rejoin_rounds` models nodes whose disks come back old: a tiered ``Checkpointer``
(``local=`` a node's disk, ``remote=`` the bucket) saves and pushes; some of its disks are
copied aside and later put back, and the node resumes from its stale disk, with the bucket
reachable or cut off.

The invariant checker (:func:`check_history`) reads every process's log and the store:

1. every acknowledged save checks out exactly (bit for bit) and its step tag still names it
   (the contenders keep every step tag: retention never drops one here);
2. each step is acknowledged at most once; no holder's commit is acknowledged after another
   holder took the run from it (its begin after the other's grant) unless that holder saw it;
3. the run's ``latest``, as the observer and the final read see it, is monotone in step,
   and ends at the highest acknowledged step, or above it at a step whose commit raised (a
   cut network makes an outcome unknown: such a commit may have landed, whole);
4. nothing outside the store changes (the sentinel folder's files and bytes);
5. no process hangs beyond a bound; ``fsck(deep=True)`` is clean at the end;
6. (rejoin) a resume is never older than the bucket's newest step when the bucket is
   reachable, and a node cut off from it never moves the bucket's ``latest`` back.

Replaying a seed
----------------
A failure raises :class:`NemesisFailure`, whose message starts with the seed and::

    python -m tests.harness.nemesis --seed <seed> --rounds <n> --home local|s3    # outside pytest
    CKPT_NEMESIS_SEED=<seed> pytest tests/harness/test_nemesis.py                 # the default test
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from tests import paths

from tests.harness.clock import shift_clock

RUN = "exp"
LATEST = f"{RUN}/latest"
ROWS, COLS = 64, 32  # 8 KiB of float32 a step
ROOT = paths.REPO


class NemesisFailure(AssertionError):
    """An invariant broke; the message starts with the seed and how to replay it."""


def state_of(step: int):
    """The state committed at ``step``: a ``[64, 32]`` float32 tensor drawn from the step."""
    import torch

    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(step))


# --- the processes ---------------------------------------------------------------------------


class _Log:
    def __init__(self, path: str):
        self.f = open(path, "a", buffering=1)  # noqa: SIM115 - one line per event, flushed

    def __call__(self, ev: str, **kw) -> None:
        self.f.write(json.dumps({"ev": ev, "t": time.monotonic(), "pid": os.getpid(), **kw}) + "\n")


def contender(a) -> None:
    """Contend for run ``exp`` until the stop file appears; commit steps while holding it."""
    if a.clock:
        shift_clock(a.clock)
    import torch  # noqa: F401

    from ckptstore import Checkpointer
    from ckptstore.errors import CkptStoreError, RunBusyError

    log, rng = _Log(a.log), random.Random(a.seed)
    log("start")
    w = state_of(0)
    stop = Path(a.stop)
    while not stop.exists():
        try:
            ck = Checkpointer(a.url, {"w": w}, every_n_steps=1, run=RUN, lease_seconds=a.lease, keep_last=None, on_signal=())
        except RunBusyError:
            time.sleep(rng.uniform(0.05, 0.3))
            continue
        except CkptStoreError as exc:  # the server is out of reach (a partition)
            log("error", kind=type(exc).__name__, msg=str(exc)[:200])
            time.sleep(0.3)
            continue
        log("acquired")
        try:
            start = ck.resume()
            log("resumed", step=start)
            while not stop.exists():
                target = ck.steps + 1
                w.copy_(state_of(target))
                log("begin", step=target)
                try:
                    info = ck.step()
                except RunBusyError as exc:
                    log("refused", step=target, kind=type(exc).__name__, msg=str(exc)[:300])
                    break
                except CkptStoreError as exc:
                    log("error", step=target, kind=type(exc).__name__, msg=str(exc)[:200])
                    time.sleep(0.2)
                    continue
                log("ack", step=target, cid=info.id)
                time.sleep(rng.uniform(0.02, 0.25))
        except RunBusyError as exc:
            log("refused", kind=type(exc).__name__, msg=str(exc)[:300])
        except CkptStoreError as exc:
            log("error", kind=type(exc).__name__, msg=str(exc)[:200])
        finally:
            with contextlib.suppress(CkptStoreError):
                ck.close()
            log("closed")
    log("exit")


def observer(a) -> None:
    """Read ``exp/latest`` in a loop through fresh reads; log each commit seen and its step."""
    from ckptstore import Store
    from ckptstore.errors import CkptStoreError

    log = _Log(a.log)
    steps: dict[str, int] = {}
    last = None
    with Store(a.url) if a.url.startswith("s3://") else contextlib.nullcontext() as bucket:
        while not Path(a.stop).exists():
            try:
                store = bucket or Store(a.url)
                cid = store.resolve(LATEST)
                if cid not in steps:
                    steps[cid] = store.info(cid).metadata.get("step")
                if cid != last:
                    log("seen", cid=cid, step=steps[cid])
                    last = cid
                if bucket is None:
                    store.close()
            except CkptStoreError:
                pass
            time.sleep(0.03)


def gcloop(a) -> None:
    """``gc`` with a short grace and a shallow ``fsck``, in a loop."""
    from ckptstore import Store
    from ckptstore.errors import CkptStoreError, NotAStoreError

    log = _Log(a.log)
    while not Path(a.stop).exists():
        try:
            with Store(a.url) as s:
                r = s.gc(grace=f"{a.grace}s")
                log("gc", freed=getattr(r, "bytes_freed", None))
                f = s.fsck()
                if not f.ok:
                    log("fsck", problems=[str(p)[:200] for p in f.problems][:5])
        except NotAStoreError:
            pass  # no contender has committed yet
        except CkptStoreError as exc:
            log("error", kind=type(exc).__name__, msg=str(exc)[:200])
        time.sleep(0.2)


# --- the coordinator ------------------------------------------------------------------------------


@dataclass
class Proc:
    name: str
    proc: subprocess.Popen
    log: Path
    proxy: object | None = None
    clock: Path | None = None


@dataclass
class Round:
    seed: int
    index: int
    home: str
    folder: Path
    url: str
    lease: float
    grace: float
    seconds: float
    events: list[str] = field(default_factory=list)
    procs: list[Proc] = field(default_factory=list)
    outside: Path | None = None
    counts: dict[str, int] = field(default_factory=dict)


def _spawn(role: str, r: Round, name: str, env: dict | None = None, **kw) -> Proc:
    log = r.folder / f"{name}.log"
    args = [sys.executable, "-m", "tests.harness.nemesis", role, "--url", r.url, "--log", str(log), "--stop", str(r.folder / "stop")]
    for k, v in kw.items():
        args += [f"--{k}", str(v)]
    out = open(r.folder / f"{name}.out", "w")  # noqa: SIM115 - closed with the round
    proc = subprocess.Popen(args, cwd=ROOT, env={**os.environ, **(env or {}), "PYTHONWARNINGS": "ignore"}, stdout=out, stderr=subprocess.STDOUT)
    out.close()
    return Proc(name, proc, log, clock=Path(kw["clock"]) if kw.get("clock") else None)


def read_log(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):  # a process killed mid-line
            out.append(json.loads(line))
    return out


def _holder(r: Round) -> Proc | None:
    """The contender that logged a grant most recently and has not closed since."""
    best, at = None, -1.0
    for p in r.procs:
        if not p.name.startswith("c"):
            continue
        evs = read_log(p.log)
        grants = [e for e in evs if e["ev"] == "acquired"]
        if grants and not any(e["ev"] == "closed" and e["t"] > grants[-1]["t"] for e in evs) and grants[-1]["t"] > at:
            best, at = p, grants[-1]["t"]
    return best


def tree_digest(folder: Path) -> dict[str, str]:
    """``{relative path: sha256}`` of every regular file under ``folder`` (links not followed)."""
    out = {}
    for dirpath, _, files in os.walk(folder):
        for f in files:
            p = Path(dirpath) / f
            st = os.lstat(p)
            out[str(p.relative_to(folder))] = hashlib.sha256(p.read_bytes()).hexdigest() if stat.S_ISREG(st.st_mode) else f"mode {st.st_mode:o}"
    return out


def _plant(r: Round, rng: random.Random) -> None:
    """Put a foreign entry into the store folder, pointing outside or blocking (folder home)."""
    root = r.folder / "store"
    kind = rng.choice(["tmp-link", "blobs-link", "pack-link", "fifo-pack", "fifo-tmp"])
    name = uuid.uuid4().hex
    with contextlib.suppress(OSError):
        if kind == "tmp-link":
            os.symlink(r.outside, root / "tmp" / f"{name}.pack.tmp")
        elif kind == "blobs-link":
            os.symlink(r.outside, root / "blobs" / rng.choice(["zz", "zy", name[:2] + "x"]))
        elif kind == "pack-link":
            d = root / "blobs" / name[:2]
            d.mkdir(exist_ok=True)
            os.symlink(r.outside / "victim.pack", d / f"{name}.pack")
        elif kind == "fifo-pack":
            d = root / "blobs" / name[:2]
            d.mkdir(exist_ok=True)
            os.mkfifo(d / f"{name}.pack")
        else:
            os.mkfifo(root / "tmp" / f"{name}.pack.tmp")
        r.events.append(f"hostile {kind}")
        r.counts["hostile"] = r.counts.get("hostile", 0) + 1


def run_round(seed: int, index: int, home: str, base: Path, server=None, seconds: float = 12.0) -> Round:
    rng = random.Random(seed * 1000 + index)
    folder = base / f"round{index}"
    folder.mkdir(parents=True)
    url = str(folder / "store") if home == "local" else f"s3://ckpt/nemesis-{seed}-{index}-{uuid.uuid4().hex[:6]}"
    r = Round(seed, index, home, folder, url, lease=rng.choice([1.5, 2.0]), grace=rng.choice([1.0, 2.0]), seconds=seconds)
    r.outside = folder / "outside"
    r.outside.mkdir()
    for i in range(3):
        (r.outside / f"sentinel{i}.bin").write_bytes(os.urandom(1000 + i))
    (r.outside / "victim.pack").write_bytes(b"not a pack of this store " * 10)
    before = tree_digest(r.outside)
    if home == "local":  # the store exists before the contenders start (so hostile entries have a folder)
        import ckptstore

        ckptstore.Store(url, create=True).close()
    proxies: dict[str, object] = {}
    try:
        n = rng.choice([2, 3])
        for i in range(n):
            env = None
            if home == "s3":
                from tests.delay_proxy import DelayProxy

                proxy = DelayProxy(server.endpoint).start()
                proxies[f"c{i}"] = proxy
                env = {"AWS_ENDPOINT_URL": proxy.endpoint, "XDG_CACHE_HOME": str(folder / f"cache-c{i}")}
            clock = folder / f"c{i}.clock"
            clock.write_text("0")
            r.procs.append(_spawn("contender", r, f"c{i}", env, lease=r.lease, seed=rng.randrange(1 << 30), clock=clock))
        obs_env = {"XDG_CACHE_HOME": str(folder / "cache-obs")} if home == "s3" else None
        r.procs.append(_spawn("observer", r, "obs", obs_env))
        if rng.random() < 0.7:
            r.procs.append(_spawn("gcloop", r, "gc", {"XDG_CACHE_HOME": str(folder / "cache-gc")} if home == "s3" else None, grace=r.grace))
        # the nemeses start once a contender committed (interpreters load torch: slow on a loaded machine)
        started = time.monotonic()
        while time.monotonic() < started + 180 and not any(e["ev"] == "ack" for p in r.procs if p.name.startswith("c") for e in read_log(p.log)):
            time.sleep(0.2)
        time.sleep(rng.uniform(0.0, 1.0))
        end = time.monotonic() + seconds
        kinds = ["pause", "pause", "clock"] + (["partition", "partition"] if home == "s3" else ["hostile", "hostile"])
        while time.monotonic() < end:
            kind = rng.choice(kinds)
            if kind == "pause":
                gc = next((p for p in r.procs if p.name == "gc"), None)
                target = gc if gc is not None and rng.random() < 0.25 else _holder(r)
                if target is None:
                    time.sleep(0.3)
                    continue
                hold = (r.grace if target.name == "gc" else r.lease) * rng.uniform(1.3, 2.5)
                r.events.append(f"pause {target.name} {hold:.2f}s")
                r.counts["pause"] = r.counts.get("pause", 0) + 1
                target.proc.send_signal(signal.SIGSTOP)
                time.sleep(hold)
                target.proc.send_signal(signal.SIGCONT)
            elif kind == "partition":
                target = _holder(r)
                if target is None:
                    time.sleep(0.3)
                    continue
                proxy = proxies[target.name]
                hold = r.lease * rng.uniform(1.3, 2.5)
                r.events.append(f"partition {target.name} {hold:.2f}s")
                r.counts["partition"] = r.counts.get("partition", 0) + 1
                proxy.stop()
                time.sleep(hold)
                proxy.start()  # on the same port: the contender's endpoint works again
            elif kind == "clock":
                target = rng.choice([p for p in r.procs if p.clock is not None])
                jump = rng.choice([-3600.0, -r.lease * 3, r.lease * 3, 3600.0])
                r.events.append(f"clock {target.name} {jump:+.0f}s")
                r.counts["clock"] = r.counts.get("clock", 0) + 1
                target.clock.write_text(str(jump))
                time.sleep(rng.uniform(0.5, 2.0))
                if rng.random() < 0.6:
                    target.clock.write_text("0")
            elif kind == "hostile":
                _plant(r, rng)
            time.sleep(rng.uniform(0.2, 1.0))
    finally:
        (folder / "stop").touch()
        for p in r.procs:
            with contextlib.suppress(ProcessLookupError):
                p.proc.send_signal(signal.SIGCONT)
        for proxy in proxies.values():
            if proxy.proc is None:
                proxy.start()
        hung = []
        deadline = time.monotonic() + 60
        for p in r.procs:
            try:
                p.proc.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                hung.append(p.name)
                p.proc.kill()
                p.proc.wait()
        for proxy in proxies.values():
            proxy.stop()
    r.counts["hung"] = len(hung)
    problems = [f"process {name} did not stop within 60 s of the stop file (a hang)" for name in hung]
    problems += check_history(r, before)
    if problems:
        raise NemesisFailure(_report(r, problems))
    return r


def _fresh_store(url: str):
    import ckptstore

    return ckptstore.Store(url)



def check_history(r: Round, outside_before: dict[str, str]) -> list[str]:
    """The invariants over the round's logs and the store (module docstring, 1 to 5)."""
    import torch

    from ckptstore.errors import NotAStoreError

    problems: list[str] = []
    logs = {p.name: read_log(p.log) for p in r.procs}
    acks: dict[int, list[tuple[str, str]]] = {}
    for name, evs in logs.items():
        for e in evs:
            if e["ev"] == "ack":
                acks.setdefault(e["step"], []).append((name, e["cid"]))
            if e["ev"] == "error" and e.get("kind") not in ("BackendError", "CatalogBusyError", "StoreWriteError", "RunBusyError", "GCLockedError"):
                problems.append(f"{name}: unexpected {e.get('kind')}: {e.get('msg')}")
    for step, who in sorted(acks.items()):
        if len({c for _, c in who}) > 1:
            problems.append(f"step {step} acknowledged {len(who)} times: {who}")
    # a holder's commit begun after another contender was granted the run, acknowledged, and unseen by that contender
    grants = sorted((e["t"], name, next((x.get("step") for x in evs[i:] if x["ev"] == "resumed"), None))
                    for name, evs in logs.items() if name.startswith("c") for i, e in enumerate(evs) if e["ev"] == "acquired")
    for name, evs in logs.items():
        begins: dict[int, float] = {}
        for e in evs:
            if e["ev"] == "begin":
                begins[e["step"]] = e["t"]
            if e["ev"] == "ack":
                t0 = begins.get(e["step"], e["t"])
                for t, other, resumed in grants:
                    if other != name and t0 < t < e["t"] and (resumed or 0) < e["step"]:
                        problems.append(f"{name}'s step {e['step']} was acknowledged after {other} was granted the run and resumed at {resumed}")
                    if other != name and t < t0 and not any(g[1] == name and t < g[0] < t0 for g in grants):
                        problems.append(f"{name} acknowledged step {e['step']}, begun after {other} took the run from it")
    seen = [e["step"] for e in logs.get("obs", []) if e["ev"] == "seen"]
    if any(b < a for a, b in zip(seen, seen[1:])):
        problems.append(f"{LATEST} went backwards as the observer saw it: {seen}")
    # a commit whose call raised (a cut network: "the outcome is unknown") may have landed: in doubt, not acknowledged
    # (and begun by the holder of the run then: no other contender granted the run between its grant and that begin)
    def holder_then(name: str, t: float) -> bool:
        mine = [g for g, who, _ in grants if who == name and g < t]
        return bool(mine) and not any(who != name and mine[-1] < g < t for g, who, _ in grants)

    doubt = set()
    for name, evs in logs.items():
        begun = {e["step"]: e["t"] for e in evs if e["ev"] == "begin"}
        doubt |= {e["step"] for e in evs if e["ev"] == "error" and e.get("step") in begun and holder_then(name, begun[e["step"]])}
    try:
        store = _fresh_store(r.url)
        store.tags()
    except NotAStoreError:  # nothing was ever committed (a first commit creates the store)
        if acks:
            problems.append(f"the store is gone, {sum(len(v) for v in acks.values())} saves were acknowledged")
        store = None
    try:
        if store is None:
            pass
        else:
            top = max(acks, default=None)
            tags = store.tags()
            if LATEST in tags:
                final = tags[LATEST]
                step = store.info(final).metadata.get("step")
                if step in acks and (step != top or final != acks[top][0][1]):
                    problems.append(f"{LATEST} ends at step {step} ({final[:12]}), the highest acknowledged is {top} ({acks[top][0][1][:12]})")
                elif step not in acks and not (step in doubt and (top is None or step > top)):
                    problems.append(f"{LATEST} ends at step {step} ({final[:12]}), neither acknowledged nor in doubt above {top}")
                elif step not in acks:  # in doubt and landed: it must be that step's state all the same
                    got = store.checkout(final, partial=["w"])["w"]
                    if not torch.equal(got.view(torch.uint8), state_of(step).view(torch.uint8)):
                        problems.append(f"{LATEST} ends at step {step} (in doubt) with other bytes")
                if seen and seen[-1] > step:
                    problems.append(f"{LATEST} ends at step {step} below the step {seen[-1]} the observer saw")
            elif top is not None:
                problems.append(f"{LATEST} is gone, the highest acknowledged step is {top}")
            for step, who in sorted(acks.items()):
                cid = who[0][1]
                if tags.get(f"{RUN}/step-{step}") != cid:
                    problems.append(f"acknowledged step {step} ({cid[:12]}) is no longer tagged {RUN}/step-{step}: {tags.get(f'{RUN}/step-{step}')}")
                try:
                    got = store.checkout(cid, partial=["w"])["w"]
                    if not torch.equal(got.view(torch.uint8), state_of(step).view(torch.uint8)):
                        problems.append(f"acknowledged step {step} ({cid[:12]}) checks out other bytes")
                except Exception as exc:  # noqa: BLE001 - any failure to read an acknowledged save is the finding
                    problems.append(f"acknowledged step {step} ({cid[:12]}) cannot be checked out: {type(exc).__name__}: {exc}")
            report = store.fsck(deep=True)
            if not report.ok:
                problems.append(f"fsck(deep=True) reports: {[str(p)[:200] for p in report.problems][:5]}")
    finally:
        if store is not None:
            store.close()
    after = tree_digest(r.outside)
    if after != outside_before:
        problems.append(f"the folder outside the store changed: {sorted(set(after.items()) ^ set(outside_before.items()))[:5]}")
    r.counts["acks"] = sum(len(v) for v in acks.values())
    r.counts["refused"] = sum(1 for evs in logs.values() for e in evs if e["ev"] == "refused")
    return problems


def _report(r: Round, problems: list[str]) -> str:
    return (f"seed {r.seed} round {r.index} ({r.home}): {len(problems)} violation(s); replay: "
            f"python -m tests.harness.nemesis --seed {r.seed} --rounds {r.index + 1} --home {r.home}\n  "
            + "\n  ".join(problems) + f"\n  nemeses: {r.events}\n  logs kept in {r.folder}")


def run_rounds(seed: int, rounds: int, home: str, base: Path, server=None, seconds: float = 12.0) -> dict[str, int]:
    """``rounds`` rounds on ``home`` ("local" or "s3"; "s3" needs the test S3 ``server``);
    raises :class:`NemesisFailure` at the first round with a violation; returns the totals
    of what was done (pauses, partitions, clock jumps, hostile entries, acks, refusals)."""
    print(f"nemesis: seed {seed}, {rounds} rounds on {home}", flush=True)
    totals: dict[str, int] = {}
    for i in range(rounds):
        r = run_round(seed, i, home, base, server, seconds)
        for k, v in r.counts.items():
            totals[k] = totals.get(k, 0) + v
        shutil.rmtree(r.folder, ignore_errors=True)
    return totals


# --- stale disks: a tiered run whose node comes back with an old disk -------------------------------


def rejoin_rounds(seed: int, rejoins: int, base: Path, server) -> dict[str, int]:
    """Until ``rejoins`` stale rejoins are done: a node resumes a tiered run from a disk copied aside earlier (stale),
    with the bucket reachable (it must resume at the bucket's newest step or later) or cut off
    (it resumes from its disk with a warning, and its pushes never move the bucket's latest to
    a lower step). Runs in this process: one rank, no process group. Raises NemesisFailure."""
    import warnings

    import torch

    from ckptstore import Checkpointer, Store

    from tests.delay_proxy import DelayProxy

    rng = random.Random(seed)
    url = f"s3://ckpt/rejoin-{seed}-{uuid.uuid4().hex[:6]}"
    disks: list[Path] = []
    counts = {"rejoin": 0, "fresh": 0, "cut": 0}
    problems: list[str] = []
    bucket_seen: list[int] = []
    proxy = DelayProxy(server.endpoint).start()
    saved_env = {k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "XDG_CACHE_HOME")}
    os.environ["AWS_ENDPOINT_URL"] = proxy.endpoint

    def bucket_step() -> int | None:
        os.environ["AWS_ENDPOINT_URL"] = server.endpoint
        try:
            with Store(url) as b:
                return b.info(b.resolve(LATEST)).metadata.get("step") if LATEST in b.tags() else None
        finally:
            os.environ["AWS_ENDPOINT_URL"] = proxy.endpoint

    try:
        i = -1
        while counts["rejoin"] < rejoins:
            i += 1
            stale = i >= 2 and bool(disks) and rng.random() < 0.8
            folder = base / f"disk{i}"
            if stale:
                shutil.copytree(rng.choice(disks), folder)
            cut = stale and rng.random() < 0.3
            os.environ["XDG_CACHE_HOME"] = str(base / f"cache{i}")
            newest = bucket_step()
            w = torch.zeros(ROWS, COLS)
            if cut:
                proxy.stop()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                ck = Checkpointer(None, {"w": w}, dcp=True, local=folder, remote=url, run=RUN, every_n_steps=1,
                                  keep_last=None, remote_keep_last=None, push_attempts=1, push_backoff=0.1, on_signal=())
                try:
                    start = ck.resume() or 0
                except Exception as exc:  # noqa: BLE001 - a cut-off resume may fail, clearly
                    start = None
                    if not cut:
                        problems.append(f"rejoin {i}: resume raised {type(exc).__name__}: {exc}")
            if start is not None and start > 0 and not torch.equal(w.view(torch.uint8), state_of(start).view(torch.uint8)):
                problems.append(f"rejoin {i}: resumed step {start} with other bytes")
            if not cut and newest is not None and (start or 0) < newest:
                problems.append(f"rejoin {i}: resumed at step {start} from a stale disk, the bucket holds step {newest}")
            if cut and newest is not None and (start or 0) < newest and not any("bucket" in str(c.message) or "remote" in str(c.message) for c in caught):
                problems.append(f"rejoin {i}: resumed at step {start} (bucket at {newest}) while cut off, with no warning")
            counts["rejoin" if stale else "fresh"] += 1
            counts["cut"] += cut
            if start is not None:
                for _ in range(rng.randint(1, 3)):
                    w.copy_(state_of(ck.steps + 1))
                    ck.step()
                with contextlib.suppress(Exception):
                    ck.wait_pushed(timeout=30)
            ck.close()
            if cut:
                proxy.start()
                after = bucket_step()
                if newest is not None and (after is None or after < newest):
                    problems.append(f"rejoin {i}: the bucket's latest went from step {newest} to {after} while a node was cut off")
            now = bucket_step()
            if now is not None:
                bucket_seen.append(now)
            if i % 2 == 0 or not stale:
                disks.append(base / f"aside{i}")
                shutil.copytree(folder, disks[-1])
            if problems:
                break
        if any(b < a for a, b in zip(bucket_seen, bucket_seen[1:])):
            problems.append(f"the bucket's {LATEST} went backwards: {bucket_seen}")
    finally:
        proxy.stop()
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if problems:
        raise NemesisFailure(f"seed {seed} (rejoin): {len(problems)} violation(s); replay: python -m tests.harness.nemesis --seed {seed} "
                             f"--rejoins {rejoins}\n  " + "\n  ".join(problems) + f"\n  bucket steps seen: {bucket_seen}")
    return counts


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("contender", "observer", "gcloop"):
        p = argparse.ArgumentParser()
        p.add_argument("role")
        for name in ("url", "log", "stop", "clock"):
            p.add_argument(f"--{name}", default="")
        p.add_argument("--lease", type=float, default=2.0)
        p.add_argument("--grace", type=float, default=1.0)
        p.add_argument("--seed", type=int, default=0)
        a = p.parse_args(argv)
        {"contender": contender, "observer": observer, "gcloop": gcloop}[a.role](a)
        return
    p = argparse.ArgumentParser(description="the nemesis harness: pauses, partitions, clock jumps, stale disks, hostile folders")
    p.add_argument("--seed", type=int, default=int(time.time()))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--home", choices=["local", "s3"], default="local")
    p.add_argument("--seconds", type=float, default=12.0)
    p.add_argument("--rejoins", type=int, default=0, help="run the stale-disk rounds instead (needs the S3 server)")
    a = p.parse_args(argv)
    import tempfile

    from tests.s3server import MotoServer

    base = Path(tempfile.mkdtemp(prefix="nemesis-"))
    with MotoServer(buckets=["ckpt"], serialize=True) as server:
        os.environ.update(server.env)
        os.environ.setdefault("XDG_CACHE_HOME", str(base / "cache"))
        if a.rejoins:
            print(rejoin_rounds(a.seed, a.rejoins, base, server))
        else:
            print(run_rounds(a.seed, a.rounds, a.home, base, server, a.seconds))


if __name__ == "__main__":
    main()
