"""A store on a 100 %-full filesystem: ``gc`` (the command that frees space) still runs.

The filesystem is a real one: a tmpfs of 16 MiB mounted for the test (it needs root;
elsewhere the test is skipped, saying why), filled with a file until ``ENOSPC``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import ckptstore

from tests.conftest import assert_bit_equal

RESERVE = 4 << 20  # catalog.sqlite-reserve: docs/operations.md (1/64 of a filesystem under 256 MiB)


@pytest.fixture
def small_fs(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a 16 MiB tmpfs here (needs root): {made.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def fill(folder) -> int:
    """Write zeros into ``folder/fill`` until the filesystem is full; the bytes written."""
    written = 0
    with open(folder / "fill", "wb", buffering=0) as f:
        block = b"\0" * 4096
        try:
            while True:
                written += f.write(block)
        except OSError as exc:
            assert exc.errno == 28  # ENOSPC
    return written


def ckptstore_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptstore.cli", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})


def test_gc_frees_space_on_a_full_disk(small_fs):
    path = small_fs / "s"
    torch.manual_seed(0)
    kept = {"w": torch.randn(1 << 18)}  # 1 MiB of incompressible floats
    with ckptstore.Store(path) as s:
        s.commit({"w": torch.randn(1 << 18)}, tag="old")
        s.commit(kept, tag="keep")
        s.delete_tag("old")
    fill(small_fs)
    assert os.statvfs(small_fs).f_bavail == 0
    with ckptstore.Store(path) as s:
        with pytest.raises(ckptstore.errors.StoreWriteError):  # a commit finds no room: refused, nothing changed
            s.commit({"x": torch.randn(1 << 16)}, tag="more")
    dry = ckptstore_cli("gc", "--store", str(path), "--grace", "0", "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    would = json.loads(dry.stdout)
    assert (would["commits_dropped"], would["blobs_deleted"]) == (1, 64) and would["bytes_freed"] > 1 << 20
    done = ckptstore_cli("gc", "--store", str(path), "--grace", "0", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert (report["commits_dropped"], report["blobs_deleted"], report["bytes_freed"]) == (1, 64, would["bytes_freed"])
    free = os.statvfs(small_fs).f_bavail * os.statvfs(small_fs).f_frsize
    assert free >= report["blob_bytes"]  # the reserve is back, and the dead commit's blobs are free
    fs = os.statvfs(path)
    assert (path / "catalog.sqlite-reserve").stat().st_blocks * 512 == min(RESERVE, fs.f_blocks * fs.f_frsize // 64)  # allocated again, from what the GC freed
    with ckptstore.Store(path) as s:
        assert s.tags() == {"keep": s.resolve("keep")} and len(s.log()) == 1
        assert_bit_equal(s.checkout("keep")["w"], kept["w"])
        assert s.fsck(deep=True).ok
