"""Measurement helpers that run inside the child process of one operation (Linux only).

- Wall time: ``time.perf_counter`` around the operation.
- Peak RSS: the child's ``VmHWM`` (``/proc/self/status``), reset with
  ``/proc/self/clear_refs`` (``5``) right before the operation, so it is the highest
  resident set size (anonymous + file-backed pages mapped, e.g. mmap'd checkpoint
  files) reached *during* the operation. ``rss_before`` is ``VmRSS`` just before it.
  Where the reset is not permitted: ``getrusage(RUSAGE_SELF).ru_maxrss`` (the child's
  lifetime peak) and ``peak_rss_lifetime = 1``.
- Bytes read/written by the process: ``/proc/self/io`` deltas. ``read_bytes`` counts
  what the process made the block layer read (page-cache misses, including mmap page
  faults), ``rchar`` what went through read()/pread() syscalls (cache hits included,
  mmap not), ``write_bytes`` what it dirtied for the storage layer (mmap writes included).
- Peak RSS over the state: ``peak_rss_over_state`` = peak RSS - ``rss_baseline`` (the
  child's ``VmRSS`` right after its imports, before it built any state:
  ``set_rss_baseline``, called first thing in the child) - the logical bytes of the state:
  the memory the operation needed beyond the state itself.
- Bytes on disk: allocated blocks (``st_blocks * 512``, like ``du``) of a folder.
- Physical floors: ``write_raw`` (buffers as raw bytes into one file, fsynced with its
  folder) and ``read_raw_into`` (``os.preadv`` of such a file into given buffers).
"""

from __future__ import annotations

import gc
import os
import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

PAGE = 4096
IO_CHUNK = 64 << 20  # bytes per write/preadv call of the floors (a single call is capped at ~2 GiB)

_BASELINE: dict[str, int] = {}


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:", "RssFile:")):
                out[line.split(":")[0]] = int(line.split()[1]) * 1024
    return out


def set_rss_baseline() -> int:
    """Record the child's RSS now: right after its imports, before it builds any state.
    ``measure`` subtracts it (and the state's logical bytes) from the peak."""
    _BASELINE.clear()
    _BASELINE.update(_status())
    return _BASELINE["VmRSS"]


def proc_io() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {line.split(":")[0]: int(line.split()[1]) for line in f if ":" in line}


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0). False where not permitted."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def disk_usage(path: str | os.PathLike) -> int:
    """Allocated bytes of a file or folder tree (what ``du -s --bytes``-ish reports: blocks * 512)."""
    p = Path(path)
    if not p.exists():
        return 0
    if p.is_file():
        return p.stat().st_blocks * 512
    total = p.stat().st_blocks * 512
    for root, dirs, files in os.walk(p):
        for name in dirs + files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def apparent_size(path: str | os.PathLike) -> int:
    p = Path(path)
    if not p.exists():
        return 0
    if p.is_file():
        return p.stat().st_size
    return sum(os.lstat(os.path.join(r, n)).st_size for r, _, fs in os.walk(p) for n in fs)


def _fsync_path(path: str, directory: bool) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str | os.PathLike) -> None:
    """Make a peer's save durable: fsync every file under ``path``, every folder
    (deepest first), ``path`` itself and its parent folder (which holds its name)."""
    p = Path(path)
    if p.is_file():
        _fsync_path(str(p), False)
    else:
        for root, dirs, files in os.walk(p, topdown=False):
            for name in files:
                full = os.path.join(root, name)
                if not os.path.islink(full):
                    _fsync_path(full, False)
            _fsync_path(root, True)
    _fsync_path(str(p.parent), True)


def write_raw(path: str | os.PathLike, buffers) -> int:
    """The least a durable save does: write ``buffers`` (bytes-like, e.g. memoryviews of
    tensors) back to back into one new file, fsync it and its folder. Returns the bytes written."""
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    total = 0
    try:
        for buf in buffers:
            mv = memoryview(buf).cast("B")
            pos = 0
            while pos < len(mv):
                pos += os.write(fd, mv[pos: pos + IO_CHUNK])
            total += pos
        os.fsync(fd)
    finally:
        os.close(fd)
    _fsync_path(str(path.parent), True)
    return total


def read_raw_into(path: str | os.PathLike, buffers) -> int:
    """Read a ``write_raw`` file back into ``buffers`` (writable bytes-like, in the order
    written) with ``os.preadv``. Returns the bytes read."""
    fd = os.open(path, os.O_RDONLY)
    offset = 0
    try:
        for buf in buffers:
            mv = memoryview(buf).cast("B")
            pos = 0
            while pos < len(mv):
                n = os.preadv(fd, [mv[pos: pos + IO_CHUNK]], offset + pos)
                if n <= 0:
                    raise EOFError(f"{path}: short read at {offset + pos}")
                pos += n
            offset += pos
    finally:
        os.close(fd)
    return offset


def evict_tree(path: str | os.PathLike) -> None:
    """Drop a tree's (clean, fsynced) pages from the page cache: posix_fadvise DONTNEED.

    Unprivileged and per file; pages that are dirty or mapped elsewhere stay.
    """
    p = Path(path)
    files = [p] if p.is_file() else [Path(r) / n for r, _, fs in os.walk(p) for n in fs]
    for f in files:
        try:
            fd = os.open(f, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_fraction(path: str | os.PathLike) -> float | None:
    """Fraction of a tree's file pages in the page cache (mincore), or None if unknown.
    A store's ``catalog.sqlite-reserve`` (room kept for a GC on a full disk, never read) is not counted."""
    try:
        import ctypes
        import mmap

        import numpy as np

        libc = ctypes.CDLL(None, use_errno=True)
    except (ImportError, OSError):
        return None
    p = Path(path)
    files = [p] if p.is_file() else [Path(r) / n for r, _, fs in os.walk(p) for n in fs if not n.endswith("-reserve")]
    total = resident = 0
    for f in files:
        size = f.stat().st_size
        if size == 0:
            continue
        pages = (size + PAGE - 1) // PAGE
        total += pages
        with open(f, "rb") as fh:
            m = mmap.mmap(fh.fileno(), size, prot=mmap.PROT_READ)
            try:
                a = np.frombuffer(m, dtype=np.uint8)
                vec = (ctypes.c_ubyte * pages)()
                if libc.mincore(ctypes.c_void_p(a.ctypes.data), ctypes.c_size_t(size), vec) != 0:
                    return None
                resident += int((np.frombuffer(vec, dtype=np.uint8) & 1).sum())
                del a
            finally:
                m.close()
    return resident / total if total else 0.0


def touch(obj: Any) -> int:
    """Read one byte per 4 KiB page of every tensor in ``obj`` (nested dicts, lists,
    TensorDicts, optimizers' state dicts). Forces lazy/mmap loaders to actually read
    their data; costs next to nothing for tensors already in memory."""
    import torch

    seen: set[int] = set()
    acc = 0

    def visit(x: Any) -> None:
        nonlocal acc
        if isinstance(x, torch.Tensor):
            if id(x) in seen or x.numel() == 0:
                return
            seen.add(id(x))
            t = x.detach()
            if not t.is_contiguous():
                t = t.contiguous()
            b = t.reshape(-1).view(torch.uint8)
            acc += int(b[::PAGE].sum()) + int(b[-1])
            return
        if hasattr(x, "items") and callable(x.items):
            try:
                items = list(x.items(include_nested=True, leaves_only=True))  # TensorDict
            except TypeError:
                items = list(x.items())
            for _, v in items:
                visit(v)
            return
        if isinstance(x, (list, tuple)):
            for v in x:
                visit(v)

    visit(obj)
    return acc


def measure(fn: Callable[[], Any], *, logical_bytes: int, disk_path: str | os.PathLike | None = None, keep: bool = False):
    """Run ``fn`` once and measure it. Returns ``(result or None, metrics)``.

    ``disk_path``: a folder whose allocated size is taken before and after
    (``bytes_written``: its growth). ``keep``: return fn's result (else it is dropped
    inside the measured window's end, after the peak was read).
    """
    gc.collect()
    du0 = disk_usage(disk_path) if disk_path is not None else None
    peak_ok = reset_peak_rss()
    st0 = _status()
    io0 = proc_io()
    t0 = time.perf_counter()
    result = fn()
    wall = time.perf_counter() - t0
    io1 = proc_io()
    st1 = _status()
    m: dict[str, float] = {
        "wall_s": wall,
        "logical_bytes": logical_bytes,
        "throughput_gbps": logical_bytes / wall / 1e9 if wall > 0 else 0.0,
        "rss_before": st0["VmRSS"],
        "io_write_bytes": io1.get("write_bytes", 0) - io0.get("write_bytes", 0),
        "io_read_bytes": io1.get("read_bytes", 0) - io0.get("read_bytes", 0),
        "rchar": io1.get("rchar", 0) - io0.get("rchar", 0),
    }
    if peak_ok:
        m["peak_rss"] = st1["VmHWM"]
        m["peak_rss_delta"] = st1["VmHWM"] - st0["VmRSS"]
    else:  # no clear_refs: the child's lifetime peak (state building included)
        m["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        m["peak_rss_lifetime"] = 1
    if _BASELINE:
        m["rss_baseline"] = _BASELINE["VmRSS"]
        m["peak_rss_over_state"] = m["peak_rss"] - _BASELINE["VmRSS"] - logical_bytes
        if "RssFile" in _BASELINE and "RssFile" in st0:
            m["rss_file_growth_before"] = st0["RssFile"] - _BASELINE["RssFile"]
    if du0 is not None:
        m["bytes_written"] = disk_usage(disk_path) - du0
    return (result if keep else None), m
