"""The store's folder is the store's (ARCHITECTURE invariant 13): what else lives in it.

Real symbolic links (``tmp`` and ``blobs/zz`` pointing at a folder outside, a pack name
linked to a file outside, ``catalog.sqlite-reserve`` linked outside), FIFOs (in place of a
committed pack, in ``tmp/``, in ``blobs/``), a Unix socket and a character device (where
the process may make one). Every command runs in its own process under a timeout (a hang
is a failure): ``gc`` (dry run, ``--grace 1s`` and ``0``), ``fsck --deep``, ``verify``,
``recover --force``, ``push``/``pull`` to and from a folder, ``export``/``import``. After
each, every sentinel file outside the store is present and byte-identical, every foreign
entry is still there, unchanged, and fsck names each one in one line. A store whose root
is itself a symbolic link works end to end.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ckptstore
from ckptstore.objects.packs import pack_path

from tests.conftest import assert_bit_equal as _bit_equal

TIMEOUT = 120  # seconds: a command that blocks on a FIFO never ends; this turns the hang into a failure
OLD = time.time() - 7 * 86400  # a week ago: old enough for any grace period
PACK_NAME = "ab" + "1" * 30  # a pack id no commit makes (uuid4 hex): the name a stray file takes


def cli(*args: str, check: int | None = 0) -> subprocess.CompletedProcess:
    """``ckptstore ARGS`` in a fresh process (this worktree's code), under :data:`TIMEOUT`."""
    env = {**os.environ, "COLUMNS": "400", "NO_COLOR": "1", "PYTHONWARNINGS": "ignore"}
    try:
        proc = subprocess.run([sys.executable, "-m", "ckptstore.cli", *args], capture_output=True, text=True, timeout=TIMEOUT, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`ckptstore {' '.join(args)}` did not finish in {TIMEOUT} s (blocked on a foreign entry?)")
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    if check is not None:
        assert proc.returncode == check, f"`ckptstore {' '.join(args)}` exited {proc.returncode}: {proc.stdout}{proc.stderr}"
    return proc


def assert_bit_equal(got, want: dict) -> None:
    """Every tensor of ``want`` checked out bit for bit."""
    assert sorted(got.keys()) == sorted(want), (sorted(got.keys()), sorted(want))
    for k, v in want.items():
        _bit_equal(got[k], v)


def state(i: int) -> dict:
    g = torch.Generator().manual_seed(i)
    return {"w": torch.randn(64, 64, generator=g), "step": torch.tensor([i])}


def sentinels(outside: Path) -> dict[str, bytes]:
    """Files outside the store that a link in it points at (or next to): old, and named like what GC removes."""
    files = {
        "tmpdir/0123456789abcdef0123456789abcdef.pack.tmp": b"not yours " * 100,
        "tmpdir/notes.txt": b"keep me",
        f"packs/{'e' * 32}.pack": b"a foreign pack " * 50,
        f"packs/{PACK_NAME}.pack": b"another foreign pack",
        "file.pack": b"a file outside the store",
        "reserve": b"r" * 10,
    }
    for rel, data in files.items():
        path = outside / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        os.utime(path, (OLD, OLD))
    return files


def snapshot(outside: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``outside``: its bytes and size (a write, truncation or unlink changes this)."""
    return {str(p.relative_to(outside)): (p.read_bytes(), p.stat().st_size) for p in sorted(outside.rglob("*")) if p.is_file()}


def entries(paths: list[Path]) -> list:
    """What each foreign entry is: its type and, for a link, where it points."""
    out = []
    for p in paths:
        st = os.lstat(p)
        out.append((str(p), stat.S_IFMT(st.st_mode), os.readlink(p) if stat.S_ISLNK(st.st_mode) else None))
    return out


def make_store(root: Path) -> tuple[str, str]:
    """A store with tags ``a`` and ``b`` (different data: separate packs); returns their commit ids."""
    with ckptstore.Store(root) as s:
        a = s.commit(state(1), tag="a").id
        b = s.commit(state(2), tag="b").id
    return a, b


def fsck_json(root: Path, check: int) -> dict:
    return json.loads(cli("fsck", "--deep", "--json", "--store", str(root), check=check).stdout)


def test_links_out_of_the_store_are_never_followed(tmp_path):
    """``tmp``, ``blobs/zz``, a pack name and ``catalog.sqlite-reserve`` are links to things
    outside: GC (dry, 1 s, 0), fsck, verify, recover, push, pull, export and import change
    nothing outside, leave the links, and fsck names each in one line. Before: ``gc --grace 1s``
    deleted the files ``tmp`` and ``blobs/zz`` pointed at."""
    root, outside = tmp_path / "store", tmp_path / "outside"
    a, b = make_store(root)
    sentinels(outside)
    os.rename(root / "tmp", tmp_path / "real-tmp")  # (empty between commands)
    links = {
        "tmp": outside / "tmpdir",
        "blobs/zz": outside / "packs",
        f"blobs/ab/{PACK_NAME}.pack": outside / "file.pack",
        "catalog.sqlite-reserve": outside / "reserve",
    }
    (root / "blobs" / "ab").mkdir(exist_ok=True)
    for rel, target in links.items():
        if (root / rel).exists() or (root / rel).is_symlink():
            (root / rel).unlink()
        os.symlink(target, root / rel)
    foreign = [root / rel for rel in links]
    before, kinds = snapshot(outside), entries(foreign)
    expected = sorted(f"{rel} is a symbolic link, not made by ckptstore" for rel in links)

    def unchanged(after: str) -> None:
        assert snapshot(outside) == before, f"after {after}: a file outside the store changed"
        assert entries(foreign) == kinds, f"after {after}: a foreign entry was removed or changed"

    rep = fsck_json(root, check=0)
    assert sorted(rep["foreign"]) == expected and rep["problems"] == [] and rep["tmp_files"] == 0 and rep["orphan_packs"] == []
    text = cli("fsck", "--deep", "--store", str(root)).stdout
    assert [line for line in text.splitlines() if line.startswith("foreign: ")] == [f"foreign: {e} (left alone)" for e in expected]
    unchanged("fsck")
    cli("gc", "--dry-run", "--grace", "0", "--store", str(root))
    unchanged("gc --dry-run")
    for args in (["--grace", "1s"], ["--grace", "0"]):  # its repack writes new packs in tmp/: refused in one line, not written outside
        proc = cli("gc", *args, "--store", str(root), check=1)
        assert "tmp is a symbolic link, not made by ckptstore" in proc.stdout + proc.stderr
        unchanged(f"gc {' '.join(args)}")
    for ref in ("a", "b"):
        assert '"ok": true' in cli("verify", ref, "--json", "--store", str(root)).stdout
    unchanged("verify")
    # recover builds its catalog in tmp/: a link there is refused in one line, nothing written through it
    proc = cli("recover", "--force", "--store", str(root), check=1)
    assert "tmp is a symbolic link, not made by ckptstore" in proc.stdout + proc.stderr
    unchanged("recover --force")
    # push to a folder (reads this store only), pull back into a clean store, export and import there
    remote, clone = tmp_path / "remote", tmp_path / "clone"
    cli("push", str(remote), "b", "--store", str(root))
    cli("pull", str(remote), "b", "--store", str(clone))
    cli("export", "a", str(tmp_path / "a.zip"), "--store", str(root))
    cli("import", str(tmp_path / "a.zip"), "--store", str(clone))
    unchanged("push, pull, export")
    # importing into the store with the linked tmp/: every blob is held already, nothing is written
    assert "all held" in cli("import", str(tmp_path / "a.zip"), "--store", str(root)).stdout
    unchanged("import")
    with ckptstore.Store(clone) as s:
        assert_bit_equal(s.checkout("b"), state(2))
        assert_bit_equal(s.checkout(a), state(1))
    with ckptstore.Store(root) as s:
        assert_bit_equal(s.checkout("a"), state(1))
        assert_bit_equal(s.checkout(b), state(2))
    # the links removed, the store works again as before
    for rel in links:
        (root / rel).unlink()
    os.rename(tmp_path / "real-tmp", root / "tmp")
    with ckptstore.Store(root) as s:
        s.commit(state(3), tag="c")
        assert s.gc(grace=0).commits_dropped == 0
        assert s.fsck(deep=True).ok and s.fsck().foreign == []
    cli("recover", "--force", "--store", str(root))
    assert snapshot(outside) == before


def _fifo(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    return path


def _socket(path: Path, keep: list) -> Path:
    """A Unix socket bound at ``path`` (bound from its folder: socket paths are short)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sock = socket.socket(socket.AF_UNIX)
    here = os.getcwd()
    os.chdir(path.parent)
    try:
        sock.bind(path.name)
    finally:
        os.chdir(here)
    keep.append(sock)
    return path


def test_fifo_socket_device_never_block_nor_count_as_packs(tmp_path):
    """A FIFO in place of tag ``a``'s pack (before: ``fsck --deep`` and ``recover --force``
    blocked forever), FIFOs in ``tmp/`` and ``blobs/``, a socket and a device node named as
    packs: every command ends; ``a`` is reported damaged (its blobs are in no pack), ``b`` is
    intact, GC removes none of them, recover rebuilds ``b`` alone."""
    root, outside = tmp_path / "store", tmp_path / "outside"
    a, b = make_store(root)
    sentinels(outside)
    with ckptstore.Store(root) as s:
        packs_a = {r[0] for r in s.catalog.rows(
            "SELECT DISTINCT b.pack FROM shards sh JOIN commit_leaves l ON l.id = sh.leaf_id JOIN blobs b ON b.id = sh.blob_id "
            "WHERE l.commit_id = ?", (a,), raw=True)}
        packs_b = {r[0] for r in s.catalog.rows(
            "SELECT DISTINCT b.pack FROM shards sh JOIN commit_leaves l ON l.id = sh.leaf_id JOIN blobs b ON b.id = sh.blob_id "
            "WHERE l.commit_id = ?", (b,), raw=True)}
    assert len(packs_a) == 1 and not packs_a & packs_b
    victim = pack_path(root, next(iter(packs_a)))
    victim.unlink()
    keep: list = []
    foreign = {
        str(victim.relative_to(root)): _fifo(victim),
        "tmp/stuck.pack.tmp": _fifo(root / "tmp" / "stuck.pack.tmp"),
        "blobs/fifo": _fifo(root / "blobs" / "fifo"),
        f"blobs/cd/{'c' * 32}.pack": _socket(root / "blobs" / "cd" / f"{'c' * 32}.pack", keep),
        "tmp/s": _socket(root / "tmp" / "s", keep),
    }
    try:
        os.mknod(root / "blobs" / "ef" / f"{'d' * 32}.pack", stat.S_IFCHR | 0o600, os.makedev(1, 3))  # /dev/null's numbers
        foreign[f"blobs/ef/{'d' * 32}.pack"] = root / "blobs" / "ef" / f"{'d' * 32}.pack"
        device = True
    except (PermissionError, OSError):
        device = False  # (an unprivileged process cannot make one: the other kinds still run)
    for p in foreign.values():
        os.utime(p, (OLD, OLD), follow_symlinks=False)
    before, kinds = snapshot(outside), entries(list(foreign.values()))
    def what(p: Path) -> str:
        mode = os.lstat(p).st_mode
        return "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a character device"

    expected = sorted(f"{rel} is {what(p)}, not made by ckptstore" for rel, p in foreign.items())

    def unchanged(after: str) -> None:
        assert snapshot(outside) == before, f"after {after}: a file outside the store changed"
        assert entries(list(foreign.values())) == kinds, f"after {after}: a foreign entry was removed or changed"

    rep = fsck_json(root, check=1)
    assert sorted(rep["foreign"]) == expected
    assert rep["damaged_tags"] == ["a"] and rep["damaged_commits"] == [a] and len(rep["missing_blobs"]) >= 1
    unchanged("fsck --deep")
    assert '"ok": false' in cli("verify", "a", "--json", "--store", str(root), check=1).stdout
    assert '"ok": true' in cli("verify", "b", "--json", "--store", str(root)).stdout
    unchanged("verify")
    for args in (["--dry-run", "--grace", "0"], ["--grace", "1s"], ["--grace", "0"]):
        cli("gc", *args, "--store", str(root))
        unchanged(f"gc {' '.join(args)}")
    remote, clone = tmp_path / "remote", tmp_path / "clone"
    cli("push", str(remote), "b", "--store", str(root))
    cli("pull", str(remote), "b", "--store", str(clone))
    cli("export", "b", str(tmp_path / "b.zip"), "--store", str(root))
    cli("import", str(tmp_path / "b.zip"), "--store", str(root))
    unchanged("push, pull, export, import")
    proc = cli("recover", "--force", "--store", str(root), check=1)  # installed, and says what it could not restore
    assert "tag a: its newest move (seq 1) names commit " + a in proc.stdout and "b -> " + b in proc.stdout
    unchanged("recover --force")
    with ckptstore.Store(root) as s:
        assert s.tags() == {"b": b} or set(s.tags()) <= {"a", "b"}
        assert_bit_equal(s.checkout(b), state(2))
        assert sorted(s.fsck(deep=True).foreign) == expected
    with ckptstore.Store(clone) as s:
        assert_bit_equal(s.checkout("b"), state(2))
    assert device or not (root / "blobs" / "ef" / f"{'d' * 32}.pack").exists()
    for sock in keep:
        sock.close()


def test_folder_remote_with_links_is_not_written_through(tmp_path):
    """Push to a store folder whose ``tmp`` and ``blobs/zz`` are links outside (packs there):
    the push is refused in one line (its packs would land outside), nothing outside changes;
    with the ``tmp`` link gone it succeeds and pulls back exactly, ``blobs/zz`` left alone."""
    root, remote, outside = tmp_path / "store", tmp_path / "remote", tmp_path / "outside"
    make_store(root)
    sentinels(outside)
    remote.mkdir()
    (remote / "blobs").mkdir()
    os.symlink(outside / "tmpdir", remote / "tmp")
    os.symlink(outside / "packs", remote / "blobs" / "zz")
    before = snapshot(outside)
    proc = cli("push", str(remote), "b", "--store", str(root), check=1)
    assert "tmp is a symbolic link, not made by ckptstore" in proc.stdout + proc.stderr
    assert snapshot(outside) == before
    (remote / "tmp").unlink()
    cli("push", str(remote), "b", "--store", str(root))
    cli("pull", str(remote), "b", "--store", str(tmp_path / "clone"))
    assert snapshot(outside) == before and (remote / "blobs" / "zz").is_symlink()
    with ckptstore.Store(tmp_path / "clone") as s:
        assert_bit_equal(s.checkout("b"), state(2))


def test_store_whose_root_is_a_link_works(tmp_path):
    """Only the entries inside are distrusted: a store reached through a link to its folder
    commits, checks out, collects and checks clean, and fsck names nothing foreign."""
    real, link = tmp_path / "real", tmp_path / "link"
    real.mkdir()
    os.symlink(real, link)
    with ckptstore.Store(link) as s:
        ids = [s.commit(state(i), tag="latest").id for i in range(3)]
        (link / "tmp" / "old.pack.tmp").write_bytes(b"x")
        os.utime(link / "tmp" / "old.pack.tmp", (OLD, OLD))
        rep = s.gc(grace=0, keep_last=1)
        assert rep.commits_dropped == 2 and rep.tmp_removed == 1
        assert_bit_equal(s.checkout("latest"), state(2))
        f = s.fsck(deep=True)
        assert f.ok and f.foreign == [] and f.commits == 1
        assert s.resolve("latest") == ids[2]
    cli("fsck", "--deep", "--store", str(link))
    cli("recover", "--force", "--store", str(link))
    with ckptstore.Store(link) as s:
        assert_bit_equal(s.checkout("latest"), state(2))


def test_run_lease_files_are_never_followed_nor_block(tmp_path):
    """``leases/<run>.lock`` linked out of the store, and ``leases/<run>.token`` made a FIFO:
    the Checkpointer refuses the run with one StoreWriteError naming the file, writes nothing
    outside the store, and never blocks; once they are removed the run is leased as usual."""
    from ckptstore.errors import StoreWriteError

    store = ckptstore.Store(tmp_path / "store", create=True)
    store.commit({"w": torch.zeros(4)}, tag="t")
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"not a lease")
    leases = tmp_path / "store" / "leases"
    leases.mkdir()
    os.symlink(outside, leases / "run-exp.lock")
    with pytest.raises(StoreWriteError, match="run-exp.lock is not a lease file made by ckptstore"):
        ckptstore.Checkpointer(store, {"w": torch.ones(4)}, run="exp", on_signal=()).commit()
    assert outside.read_bytes() == b"not a lease"
    (leases / "run-exp.lock").unlink()
    os.mkfifo(leases / "run-exp.token")
    with pytest.raises(StoreWriteError, match="run-exp.token is not a lease file made by ckptstore"):
        ckptstore.Checkpointer(store, {"w": torch.ones(4)}, run="exp", on_signal=()).commit()
    (leases / "run-exp.token").unlink()
    with ckptstore.Checkpointer(store, {"w": torch.ones(4)}, run="exp", on_signal=()) as ck:
        info = ck.commit()
    assert store.resolve("exp/latest") == info.id
    _bit_equal(store.checkout("exp/latest", partial=["w"])["w"], torch.ones(4))
    store.close()
