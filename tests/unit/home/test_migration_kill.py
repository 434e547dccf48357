"""A migration killed at any instant is finished by the next writable open (invariant 16).

Each trial copies a fixture store of an older schema (every one the repository has:
``c26_schema_v1`` and ``schema_v1_many``, schema 1; ``schema_v3`` and
``default_run_before_runs``, schema 3), opens it in a child process and SIGKILLs the
child a seeded random delay after it starts opening (delays spread over the time from
an anchor to the end of the open, measured first without a kill; the anchor, a third of
the kills each: the start, the migration's backup file appearing, the catalog's WAL first
holding a frame, i.e. the migration's commit), so kills land before, inside and after the schema
migration and the record backfill. Then, in this process:

- ``recover --force`` on a copy of the killed store keeps every tag and commit;
- the store opened writable has every tag exact, no backfill pending, ``fsck(deep=True)``
  clean, and after ``gc(grace=0)`` every tagged commit reads back exactly.

Where each kill landed is read from the catalog with plain SQLite (old schema, migrated
with records still missing from the packs, done) and printed with the seed. Replay a seed
with ``CKPTSTORE_KILL_SEED=<seed>``; ``python tests/unit/home/test_migration_kill.py --trials 200``
runs the loop against whatever ``ckptstore`` the PYTHONPATH gives (e.g. an older checkout)
and prints the counts.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

import ckptstore

FIXTURES = next(p for p in Path(__file__).resolve().parents if p.name == "tests") / "fixtures"  # at any depth (also run as a script)
#: (fixture, its schema version, share of the trials): the schema-1 stores need the record backfill.
OLD_STORES = [("schema_v1_many", 1, 6), ("c26_schema_v1", 1, 2), ("schema_v3", 3, 1), ("default_run_before_runs", 3, 1)]

_CHILD = r"""
import os, sys, time
import ckptstore
print("ready", flush=True)
sys.stdin.readline()
t0 = time.perf_counter()
store = ckptstore.Store(sys.argv[1], create=False)
store.tags()
print("opened", time.perf_counter() - t0, flush=True)
store.close()
"""


def fixture_state(name: str) -> tuple[dict[str, str], set[str]]:
    """The fixture's tags and commit ids, read with plain SQLite (read-only, immutable)."""
    conn = sqlite3.connect(f"file:{FIXTURES / name / 'catalog.sqlite'}?mode=ro&immutable=1", uri=True)
    try:
        return dict(conn.execute("SELECT name, commit_id FROM tags")), {r[0] for r in conn.execute("SELECT id FROM commits")}
    finally:
        conn.close()


def where_killed(path: Path) -> str:
    """Which state the kill left, from the catalog alone: ``old`` (not migrated), ``pending``
    (migrated, some commit's record not yet in a pack), ``done``."""
    conn = sqlite3.connect(f"file:{path / 'catalog.sqlite'}?mode=ro", uri=True)
    try:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version < ckptstore.home.catalog.SCHEMA_VERSION:
            return "old"
        (missing,), = conn.execute("SELECT COUNT(*) FROM commits WHERE id NOT IN (SELECT name FROM records WHERE kind = 1)")
        return "pending" if missing else "done"
    finally:
        conn.close()


class Child:
    """A child process that has imported ckptstore and waits to open ``path``."""

    def __init__(self, path: Path):
        self.path = path
        self.proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.ready = False

    def wait_ready(self) -> None:
        if not self.ready:
            line = self.proc.stdout.readline()
            assert line == "ready\n", f"child failed to start: {line!r}"
            self.ready = True

    def go(self, delay: float | None, anchor: str = "start") -> dict[str, float]:
        """Start the open. With ``delay``: SIGKILL ``delay`` seconds after ``anchor`` (or as
        soon as the child exits): ``start``; ``backup``: the migration's backup file appears
        (just before its transaction); ``wal``: the catalog's WAL first holds a frame (the
        migration's transaction commits; the record backfill follows). Without: let the open finish;
        returns the seconds from each anchor to its end."""
        self.wait_ready()
        assert not any(self.path.glob("catalog.sqlite.v*.bak")), "a fixture with a backup already"
        wal = self.path / "catalog.sqlite-wal"
        reached = {"backup": lambda: any(self.path.glob("catalog.sqlite.v*.bak")), "wal": lambda: wal.exists() and wal.stat().st_size > 32}  # (more than its header)
        seen = {"start": time.perf_counter()}
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        for name in (reached if delay is None else [anchor] if anchor != "start" else []):
            while self.proc.poll() is None and not reached[name]():
                time.sleep(0.0003)
            seen[name] = time.perf_counter()
        if delay is None:
            out = self.proc.stdout.readline()
            assert self.proc.wait(120) == 0 and out.startswith("opened "), out
            end = time.perf_counter()
            return {name: end - t for name, t in seen.items()}
        time.sleep(delay)
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(60)
        return {}


def check_store(path: Path, tags: dict[str, str], commits: set[str], name: str) -> list[str]:
    """Violations of invariant 16 at ``path`` (a killed store): recover on a copy, then the
    store itself opened writable, checked, collected and read back. An exception is a
    violation too (named with the step that raised it)."""
    bad: list[str] = []

    def recovered() -> None:
        copy = path.with_name(path.name + "-recover")
        shutil.copytree(path, copy)
        try:
            report = ckptstore.Store.recover(copy, force=True)
            if report.tags != tags:
                bad.append(f"recover --force kept {len(report.tags)} of {len(tags)} tags: lost {sorted(set(tags) - set(report.tags))[:5]}")
            if report.dropped_commits or report.commits != len(commits):
                bad.append(f"recover --force kept {report.commits} of {len(commits)} commits; dropped {len(report.dropped_commits)}")
            with ckptstore.Store(copy, create=False) as s:
                if s.tags() != tags:
                    bad.append("the recovered store's tags differ")
        finally:
            shutil.rmtree(copy)

    def reopened() -> None:
        with ckptstore.Store(path, create=False) as s:
            if s.tags() != tags:
                bad.append(f"tags differ after reopening: {len(s.tags())} of {len(tags)}")
            if {c.id for c in s.log()} != commits:
                bad.append("commits differ after reopening")
            if getattr(s.catalog, "backfill_pending", False):
                bad.append("the backfill is still pending after a writable open")
            fsck = s.fsck(deep=True)
            if not fsck.ok:
                bad.append(f"fsck --deep: {len(fsck.problems)} problems, e.g. {fsck.problems[:1]}")
            s.gc(grace=0)
            if name == "schema_v1_many":
                numbers = json.loads((FIXTURES / "schema_v1_many.expected.json").read_text())["commits"]
                for tag, cid in tags.items():
                    got = s.checkout(tag)
                    want = {"w": torch.full((32,), float(numbers[cid])), "shared": torch.arange(256)}
                    if not all(torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)) for k in want):
                        bad.append(f"tag {tag}: checkout after gc differs from what was committed")
            else:
                for tag in tags:
                    if not s.verify(tag).ok:
                        bad.append(f"tag {tag} does not verify after gc")
            fsck = s.fsck(deep=True)
            if not fsck.ok:
                bad.append(f"fsck --deep after gc: {len(fsck.problems)} problems, e.g. {fsck.problems[:1]}")

    for step in (recovered, reopened):
        try:
            step()
        except Exception as exc:  # (a violation like the others: reported with the trial's seed)
            bad.append(f"{step.__name__}: {type(exc).__name__}: {exc}")
    return bad


def kill_loop(root: Path, trials: int, seed: int, log=print) -> tuple[Counter, list[str]]:
    """``trials`` seeded kills spread over the fixtures (:data:`OLD_STORES`); returns the
    count of each ``(fixture, kill state)`` and of each ``(fixture, kill state, "violated")``
    (the trials with a violation), and the violations found."""
    rng = random.Random(seed)
    weights = [w for *_, w in OLD_STORES]
    plan = [OLD_STORES[i % len(OLD_STORES)] for i in range(len(OLD_STORES))]  # each fixture at least once
    plan += rng.choices(OLD_STORES, weights, k=max(0, trials - len(plan)))
    plan = plan[:trials]
    expected = {name: fixture_state(name) for name, _, _ in OLD_STORES}

    def prepare(i: int) -> Child:
        path = root / f"trial-{i}"
        shutil.copytree(FIXTURES / plan[i][0], path)
        (path / "tmp").mkdir(exist_ok=True)  # (git keeps no empty folder; a store without one: see the read-only test)
        return Child(path)

    first = prepare(0) if plan else None  # (imports beside the calibration)
    # How long an open takes here and now, per fixture (one open without a kill each; the
    # children import side by side).
    calibrating = {}
    for name, _, _ in OLD_STORES:
        path = root / f"calibrate-{name}"
        shutil.copytree(FIXTURES / name, path)
        (path / "tmp").mkdir(exist_ok=True)
        calibrating[name] = Child(path)
    windows = {}
    for name, child in calibrating.items():
        windows[name] = child.go(None)  # from each anchor to the end of the open
        with ckptstore.Store(child.path, create=False) as s:
            assert s.tags() == expected[name][0]
        shutil.rmtree(child.path)
    log(f"seed {seed}: open times from start/backup/wal to the end: "
        f"{', '.join(n + ' ' + '/'.join(f'{t * 1000:.0f}' for t in w.values()) + ' ms' for n, w in windows.items())}")
    states: Counter = Counter()
    violations: list[str] = []

    child = first
    for i, (name, _, _) in enumerate(plan):
        path = child.path
        # A third of the kills anywhere in the open, a third from the migration's start on, a
        # third from its commit on (where a kill used to lose the records for good).
        anchor = rng.choice(["start", "backup", "wal"])
        delay = rng.uniform(0, windows[name][anchor] * 1.1)
        child.go(delay, anchor)
        if i + 1 < len(plan):  # the next child imports while this trial is checked
            child = prepare(i + 1)
        state = where_killed(path)
        states[(name, state)] += 1
        bad = check_store(path, *expected[name], name)
        if bad:
            states[(name, state, "violated")] += 1
            when = f"{delay * 1000:.1f} ms after {anchor}"
            violations += [f"trial {i} ({name}, killed {when}, {state}): {b}" for b in bad]
        shutil.rmtree(path)
    return states, violations


def run_trials(tmp_path: Path, trials: int) -> None:
    seed = int(os.environ.get("CKPTSTORE_KILL_SEED", random.randrange(1 << 32)))
    print(f"migration kill trials: seed {seed} (replay: CKPTSTORE_KILL_SEED={seed})")
    states, violations = kill_loop(tmp_path, trials, seed)
    print("kill states:", dict(sorted(states.items())))
    assert sum(n for k, n in states.items() if len(k) == 2) == trials
    assert violations == [], f"seed {seed}: {len(violations)} violations: {violations[:5]}"


def test_a_migration_killed_at_any_instant_is_finished_by_the_next_open(tmp_path):
    run_trials(tmp_path, 10)


@pytest.mark.slow
def test_two_hundred_migration_kills(tmp_path):
    run_trials(tmp_path, 200)


def test_recover_force_on_a_store_killed_between_migration_and_backfill_keeps_everything(tmp_path):
    """The state a kill between the migration's commit and the backfill's leaves, made
    exactly (the migration run by a bare :class:`~ckptstore.home.catalog.Catalog`, which does
    not backfill): recover --force finishes the backfill first and keeps all 60 commits
    and 20 tags; a writable open does the same."""
    tags, commits = fixture_state("schema_v1_many")
    for name in ("a", "b"):
        shutil.copytree(FIXTURES / "schema_v1_many", tmp_path / name)
        cat = ckptstore.home.catalog.Catalog(tmp_path / name / "catalog.sqlite", create=False)
        assert cat.migrated_from == 1 and cat.backfill_pending
        cat.close()
        assert where_killed(tmp_path / name) == "pending"
    report = ckptstore.Store.recover(tmp_path / "a", force=True)
    assert (report.tags, report.commits, report.dropped_commits, report.ok) == (tags, 60, {}, True)
    with ckptstore.Store(tmp_path / "b", create=False) as s:
        assert not s.catalog.backfill_pending and s.tags() == tags and s.fsck(deep=True).ok
        assert len(s.catalog.rows("SELECT * FROM records WHERE kind = 1")) == 60


def _leave_wal_files(store: Path) -> None:
    """Leave ``catalog.sqlite-wal`` and ``-shm`` beside the catalog, as a reader that exited
    without closing does."""
    code = "import os, sqlite3, sys; sqlite3.connect(sys.argv[1]).execute('SELECT COUNT(*) FROM sqlite_master').fetchall(); os._exit(0)"
    subprocess.run([sys.executable, "-c", code, str(store / "catalog.sqlite")], check=True)
    assert (store / "catalog.sqlite-wal").exists() and (store / "catalog.sqlite-shm").exists()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptstore.cli", *args], capture_output=True, text=True, timeout=300)


def test_a_read_only_old_store_reads_or_asks_for_one_writable_open(tmp_path):
    """Read-only bind mounts (root runs the tests: chmod would not stop it) of old stores
    with -wal/-shm beside the catalog and no tmp/ (git keeps no empty folder): schema 3 reads
    (API and CLI: tags, show, checkout, fsck, du, gc --dry-run), schema 1 says in one line
    that it needs one writable open; neither says "damaged"; one whose upgrade was killed
    before its records reached the packs reads, and fsck says one writable open finishes
    it; nothing is written."""
    from tests.unit.top.test_hardening import read_only_view

    src = tmp_path / "src"
    for name in ("schema_v3", "c26_schema_v1"):
        shutil.copytree(FIXTURES / name, src / name)
        _leave_wal_files(src / name)
    with ckptstore.Store(src / "current") as s:  # the current schema, its tmp/ dropped by a copy tool
        s.commit({"x": torch.arange(5)}, tag="t")
    (src / "current" / "tmp").rmdir()
    shutil.copytree(FIXTURES / "schema_v1_many", src / "pending")  # migrated, its records not yet in packs (as a kill leaves it)
    ckptstore.home.catalog.Catalog(src / "pending" / "catalog.sqlite", create=False).close()
    before = sorted(str(p.relative_to(src)) for p in src.rglob("*"))
    with read_only_view(src, tmp_path / "ro") as ro:
        tags, _ = fixture_state("schema_v3")
        with ckptstore.Store(ro / "schema_v3", create=False) as s:
            assert not s.catalog.writable and s.catalog.user_version == 3 and s.tags() == tags
            assert torch.equal(s.checkout("x")["x"].view(torch.uint8), torch.arange(6.0).view(torch.uint8))
            assert s.show("t")["leaves"][0]["shards"] == 1
            assert s.fsck(deep=True).ok and s.du()["tmp_bytes"] == 0
            assert s.gc(grace=0, dry_run=True).dry_run
        with ckptstore.Store(ro / "current", create=False) as s:
            assert not s.catalog.writable
            report = s.fsck(deep=True)
            assert report.ok and report.tmp_files == 0 and s.du()["commits"] == 1
            assert s.gc(grace=0, dry_run=True).dry_run
        with ckptstore.Store(ro / "pending", create=False) as s:  # read as it is; fsck says what one writable open finishes
            assert not s.catalog.writable and s.catalog.backfill_pending and s.tags() == fixture_state("schema_v1_many")[0]
            problems = s.fsck().problems
            assert len(problems) == 60 and all("the store's upgrade is unfinished: one writable open" in p for p in problems)
        for store in ("schema_v3", "current"):
            for args in (["fsck"], ["du"], ["gc", "--dry-run", "--grace", "0"]):
                proc = _cli(*args, "--store", str(ro / store))
                assert proc.returncode == 0, (store, args, proc.stderr)
        with pytest.raises(ckptstore.errors.SchemaVersionError, match="needs a one-time upgrade.*open it writable once"):
            ckptstore.Store(ro / "c26_schema_v1", create=False)
        proc = _cli("tags", "--store", str(ro / "c26_schema_v1"))
        assert proc.returncode == 1 and proc.stdout == ""
        assert proc.stderr.count("\n") == 1 and "needs a one-time upgrade" in proc.stderr and "damaged" not in proc.stderr
    assert sorted(str(p.relative_to(src)) for p in src.rglob("*")) == before


def test_the_demo_without_its_extra_names_it_in_one_line(tmp_path):
    """``ckptstore demo`` with Gymnasium unimportable (a ``gymnasium`` module first on the path
    that raises ImportError): one line naming the extra, exit 1, no store written."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "gymnasium.py").write_text("raise ImportError(\"No module named 'gymnasium'\")\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hide), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, "-m", "ckptstore.cli", "demo", "--store", str(tmp_path / "demo")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "pip install 'ckptstore[demo]'" in proc.stderr, proc.stderr
    assert not (tmp_path / "demo").exists()


def test_the_demo_function_without_its_extra_raises_before_writing(tmp_path, monkeypatch):
    from ckptstore.demo import run

    monkeypatch.setitem(sys.modules, "gymnasium", None)  # (what Python does for a module it must not import)
    with pytest.raises(ckptstore.errors.MissingExtraError, match=r"pip install 'ckptstore\[demo\]'"):
        run(tmp_path / "demo")
    assert not (tmp_path / "demo").exists()


if __name__ == "__main__":
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    seed = random.randrange(1 << 32) if args.seed is None else args.seed
    with tempfile.TemporaryDirectory() as tmp:
        states, violations = kill_loop(Path(tmp), args.trials, seed)
    print("kill states:", dict(sorted(states.items())))
    broken = len({v.split(":")[0] for v in violations})
    print(f"ckptstore {ckptstore.__file__}: {broken} of {args.trials} trials violated invariant 16")
    for v in violations[:20]:
        print("  ", v)
