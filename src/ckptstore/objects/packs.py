"""Blob encoding and pack files.

Blobs live in pack files, as in git and restic, to keep file counts and fsyncs
down: a commit appends its new blobs to one or more packs in ``tmp/``, fsyncs
them, renames them to ``blobs/<id[:2]>/<id>.pack`` and fsyncs the folders
before its catalog transaction (invariant 3). A pack's bytes never change
after the rename.

Pack layout (all integers little-endian)::

    pack header  16 bytes  b"CKPK", u16 format version (1), u16 0, u64 0
    entry        40-byte header + payload, repeated: a blob or a record

    entry header b"CKBL" (blob) or b"CKRC" (record), u8 format version (1),
                 u8 codec (0 raw, 1 zstd), u16 record kind (0 for blobs),
                 u64 raw length, u64 payload length,
                 16 bytes XXH3-128 of the raw bytes

A record is a small JSON document the catalog can be rebuilt from (see
:mod:`ckptstore.objects.records`): a commit record or a ref-move record. Like a blob it
is addressed by the hash of its bytes, so any copy of it can be checked.

A blob is zstandard-compressed (RFC 8878) only when a probe of its start
(1/32 of it, 4 to 32 KiB) shrinks by more than 25 % and the whole blob then does too.

Entries are written by one :class:`EntryWriter` (stage, hash, encode, header, offsets,
rollover, the index of entries) with two sinks: :class:`PackWriter` (pack files, below)
and :class:`~ckptstore.objects.bucketformat.BucketPackWriter` (packs uploaded to object storage).

While a commit is in flight its process holds an exclusive ``flock`` on each
of its pack files; GC never removes a locked pack, and the lock vanishes with
the process, so a pack orphaned by a crash becomes collectable. A pack is
created under its temporary name, locked, and then checked to still be linked
there (a GC may have removed the file between the two): only a locked, linked
file is written to. ``finish`` seals every pack it makes durable: a later
``append`` starts a new pack, so a pack is never written after its rename.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import re
import stat
import struct
import sys
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import xxhash
import zstandard

from ..backends.local import describe_mode, fsync_dir, open_dir, open_regular, own_dir
from ..core.errors import BlobCorruptError, BlobMissingError, CkptStoreError, ResourceLimitError, StoreWriteError
from ..core.layout import address
from ..core.layout import digest as xxh3

PACK_MAGIC = b"CKPK"
PACK_HEADER = struct.Struct("<4sHHQ")
BLOB_MAGIC = b"CKBL"
RECORD_MAGIC = b"CKRC"
BLOB_HEADER = struct.Struct("<4sBBHQQ16s")
FORMAT_VERSION = 1
CODEC_RAW = 0
CODEC_ZSTD = 1
CODECS = {CODEC_RAW: "raw", CODEC_ZSTD: "zstd"}

DEFAULT_PACK_BYTES = 256 << 20
FLUSH_BYTES = 8 << 20  # an open pack's write-back is started each time this many more bytes are in it
_PROBE_BYTES = 32 << 10
_VERIFY_CHUNK = 1 << 20  # bytes decoded at a time when an entry is only verified (check_entry)
#: The most blobs :meth:`PackReader.read_run` reads in one ``preadv`` (two buffers each, and
#: Linux takes at most ``IOV_MAX`` = 1024 buffers a call).
RUN_BLOBS = 512
#: Compress only when it saves more than 25 %: zstd decodes about 1.5 GB/s per core here
#: (docs/performance.md), slower than reading raw bytes from the page cache or an NVMe
#: disk, so a 10 % saving (uniform float32 in [0, 1): 11 %) costs reads far more time
#: than it saves space. Highly compressible data (frames, flags, ids) still is.
_PAYS = 0.75


@dataclass(frozen=True)
class BlobLoc:
    """Where a blob lives and what it must hash to (one catalog ``blobs`` row)."""

    digest: bytes
    raw_len: int
    pack: str
    offset: int
    stored_len: int
    codec: int

    @property
    def address(self) -> str:
        return address(self.digest, self.raw_len)

    @property
    def span(self) -> tuple[int, int]:
        """``(start, end)`` byte offsets of the whole entry (header and payload) in its pack."""
        return self.offset, self.offset + BLOB_HEADER.size + self.stored_len


def pack_path(root: Path, pack_id: str) -> Path:
    """Final path of pack ``pack_id`` under a store's ``blobs/`` folder."""
    return root / "blobs" / pack_id[:2] / f"{pack_id}.pack"


#: The names a local store's root holds (as ``ckptstore.home.base._STORE_NAMES``), and the kind each must be.
_ROOT_NAMES = re.compile(r"^(?:(?P<file>catalog\.sqlite(?:-wal|-shm|-journal|-reserve|\.v\d+\.bak|\.damaged-\d{8}-\d{6}(?:-wal|-shm)?)?|gc\.lock)|(?P<dir>blobs|tmp|leases))$")


def walk_store(root: Path) -> Iterator[tuple[str, str, os.stat_result]]:
    """Every entry of a store folder that ckptstore acts on or must report, found without
    following a symbolic link (``root`` itself may be one) and without opening a file:
    ``(kind, path relative to root, its lstat)``, kind

    * ``"pack"``: a regular file ``blobs/<folder>/<name>.pack``;
    * ``"tmp"``: a regular file in ``tmp/``;
    * ``"foreign"``: what ckptstore did not make there: a symbolic link, FIFO, socket or
      device anywhere, a file or folder of another name at the root or in ``blobs/``, a
      file not named ``*.pack`` in a pack folder, a folder where a file belongs or the
      reverse. Nothing walks into a foreign entry; GC and recover leave them alone
      (invariant 13), fsck names each one.

    Folders missing or vanishing meanwhile are skipped. Raises OSError only when ``root``
    cannot be listed.
    """

    def entries(rel: str) -> list[tuple[str, os.stat_result]]:
        try:
            fd = open_dir(root, root / rel) if rel else os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            return []
        try:
            out = []
            with os.scandir(fd) as it:
                for e in it:
                    with suppress(FileNotFoundError):
                        out.append((e.name, os.stat(e.name, dir_fd=fd, follow_symlinks=False)))
            return sorted(out, key=lambda x: x[0])
        finally:
            os.close(fd)

    for name, st in entries(""):
        m = _ROOT_NAMES.match(name)
        want = None if m is None else stat.S_ISREG if m["file"] else stat.S_ISDIR
        if want is None or not want(st.st_mode):
            yield "foreign", name, st
            continue
        if name not in ("blobs", "tmp", "leases"):
            continue
        for sub, sst in _guarded(entries, name):
            rel = f"{name}/{sub}"
            if name == "tmp":
                if stat.S_ISREG(sst.st_mode):
                    yield "tmp", rel, sst
                elif not stat.S_ISDIR(sst.st_mode):  # (folders in tmp/: a recover's or a cache's work)
                    yield "foreign", rel, sst
            elif name == "leases":
                if not stat.S_ISREG(sst.st_mode) and not stat.S_ISDIR(sst.st_mode):
                    yield "foreign", rel, sst
            elif not stat.S_ISDIR(sst.st_mode):
                yield "foreign", rel, sst
            else:
                for leaf, lst in _guarded(entries, rel):
                    yield ("pack" if stat.S_ISREG(lst.st_mode) and leaf.endswith(".pack") else "foreign"), f"{rel}/{leaf}", lst


def _guarded(entries, rel: str) -> list:
    """``entries(rel)``, or none when the folder was replaced (by a link or a file) since it was looked at."""
    try:
        return entries(rel)
    except OSError:
        return []


_local = threading.local()

#: ``(path, st_dev, st_ino)`` of the ``blobs/<xx>`` folders whose name this process has seen
#: made durable (``blobs/`` fsynced while they existed): a pack renamed into one of them
#: needs only that folder fsynced, not ``blobs/`` again. Nothing in ckptstore removes them;
#: the first time a process finds one it does not know, it creates all 256 (empty ones are
#: harmless: packs are found as ``blobs/*/*.pack``), so a commit fsyncs ``blobs/`` once per
#: store and process, not once per new folder.
_DURABLE_DIRS: set[tuple[str, int, int]] = set()


def _writeback_starter() -> Callable[[int], None]:
    """Linux's ``sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE)`` (man 2
    sync_file_range): start writing every dirty page of a file back to the disk and
    return without waiting. Durability still comes from ``fsync``; this only lets the
    disk work while the commit writes on. Elsewhere (no such call), nothing."""
    call = getattr(ctypes.CDLL(None), "sync_file_range", None) if sys.platform == "linux" else None
    if call is None:
        return lambda fd: None
    call.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    return lambda fd: call(fd, 0, 0, 2)  # 2 = SYNC_FILE_RANGE_WRITE; a failure only means no early start


_start_writeback = _writeback_starter()


def encode_blob(raw: memoryview, level: int) -> tuple[int, bytes | memoryview]:
    """Choose the codec for ``raw`` and return ``(codec, payload)``."""
    if len(raw) < 64 or level <= 0:
        return CODEC_RAW, raw
    cctx = getattr(_local, "cctx", None)
    if cctx is None or _local.level != level:
        cctx = _local.cctx = zstandard.ZstdCompressor(level=level)
        _local.level = level
    probe = min(_PROBE_BYTES, max(4096, len(raw) // 32))  # about 3 % of the blob
    if len(raw) > 2 * probe and len(cctx.compress(raw[:probe])) > _PAYS * probe:
        return CODEC_RAW, raw
    packed = cctx.compress(raw)
    if len(packed) > _PAYS * len(raw):
        return CODEC_RAW, raw
    return CODEC_ZSTD, packed


#: A thread keeps its staging buffer (:func:`stage`) for blobs up to this size (a few shards
#: at the default shard size); a larger blob gets a buffer of its own, freed with it.
_STAGING_KEPT = 4 << 20


def stage(raw) -> memoryview:
    """``raw`` (bytes-like) copied once into the calling thread's staging buffer: a private
    snapshot to hash, encode and write, valid until this thread's next call. One buffer per
    thread, so a commit holds one staging copy per write in flight, never copies of all its
    shards. ``bytes`` (immutable) are not copied. The copy runs without the GIL, so it is one
    read of each byte but not atomic against other threads' writes (a row written meanwhile
    may be copied half old, half new)."""
    if isinstance(raw, bytes):
        return memoryview(raw)
    src = memoryview(raw)
    if src.format != "B" or src.ndim != 1:
        src = src.cast("B")
    n = len(src)
    buf = getattr(_local, "staging", None)
    if buf is None or len(buf) < n:
        buf = bytearray(n)
        if n <= _STAGING_KEPT:
            _local.staging = buf
    view = memoryview(buf)[:n]
    if src.readonly or not n:  # (ctypes takes no empty buffer)
        view[:] = src
    else:  # ctypes' memmove releases the GIL: the threads of a commit copy in parallel
        ctypes.memmove(ctypes.addressof(ctypes.c_char.from_buffer(view)), ctypes.addressof(ctypes.c_char.from_buffer(src)), n)
    return view


class OpenPack:
    """One pack an :class:`EntryWriter` fills: its ``id`` (32 hex), ``size`` (the bytes reserved
    in it so far, its 16-byte header included), ``entries`` (what its index lists, in order)
    and ``sealed`` (a newer pack took over, or it was made durable: no entry goes in any more)."""

    def __init__(self, pack_id: str):
        self.id = pack_id
        self.size = PACK_HEADER.size
        self.entries: list[Entry] = []
        self.sealed = False


class EntryWriter:
    """The one writer of pack entries; thread-safe. It stages and hashes a blob
    (:func:`stage`, XXH3-128), encodes it (:func:`encode_blob`: zstandard when that pays),
    builds its 40-byte entry header, reserves its offset in the open pack under a lock
    (rolling over to a new pack past ``pack_bytes``, a pack holding at least one entry)
    and keeps every pack's index of entries. Where the bytes go is its sink's, a subclass:
    :class:`PackWriter` (pack files under ``blobs/``) or
    :class:`~ckptstore.objects.bucketformat.BucketPackWriter` (packs uploaded to object storage).

    The sink's interface (called by this class; the ones marked *locked* under its lock):

    * ``_new_pack()`` *locked*: a new :class:`OpenPack` whose header is written or held;
    * ``_place(pack, header, payload)`` *locked*: an entry was just reserved at the end of
      ``pack`` (``pack.size`` already counts it);
    * ``_write(pack, offset, header, payload)``: write the entry's bytes at ``offset``
      (outside the lock: entries of one pack are written in parallel);
    * ``_seal(pack)`` *locked*: ``pack`` is full, a newer one takes over;
    * ``_stage(raw)``: the private copy of a blob to hash and encode (default :func:`stage`,
      the thread's staging buffer, valid until the thread's next append);
    * ``finish``, ``discard``, ``close``: make the packs durable, undo, release.
    """

    def __init__(self, level: int, pack_bytes: int):
        self.level = level
        self.pack_bytes = pack_bytes
        self._lock = threading.Lock()
        self._packs: list[OpenPack] = []
        self.stored_bytes = 0

    def _stage(self, raw) -> memoryview:
        return stage(raw)

    def append(self, raw: memoryview, digest: bytes | None = None) -> BlobLoc:
        """Write one blob and return its location: ``raw`` (bytes-like, typically a view of a
        live tensor's memory) is copied once (:meth:`_stage`), and that copy is hashed,
        encoded and written, so the entry always hashes to the address recorded with it
        (invariant 14), whatever other threads write into ``raw`` meanwhile.

        ``digest``: the hash the caller took of ``raw`` earlier (for dedup). The returned
        location's ``digest`` is the hash of the bytes written: it differs from ``digest``
        when ``raw`` changed in between, and the caller must then file the blob under the
        returned address (:meth:`ckptstore.protocols.commit.Committer.commit_components` does).
        """
        staged = self._stage(raw)
        codec, payload = encode_blob(staged, self.level)
        return self.append_encoded(xxh3(staged), len(staged), codec, payload)

    def append_record(self, kind: int, raw: bytes) -> BlobLoc:
        """Write one record (``kind``, JSON bytes) and return its location; see :mod:`ckptstore.objects.records`."""
        return self.append_encoded(xxh3(raw), len(raw), CODEC_RAW, raw, RECORD_MAGIC, kind)

    def append_encoded(self, digest: bytes, raw_len: int, codec: int, payload, magic: bytes = BLOB_MAGIC, kind: int = 0) -> BlobLoc:
        """Write an entry already encoded (verified by the caller) as it is; returns its location."""
        header = entry_header(digest, raw_len, codec, len(payload), magic, kind)
        need = len(header) + len(payload)
        with self._lock:
            pack = self._packs[-1] if self._packs else None
            if pack is None or pack.sealed or (pack.entries and pack.size + need > self.pack_bytes):
                if pack is not None and not pack.sealed:
                    pack.sealed = True
                    self._seal(pack)
                pack = self._new_pack()
                self._packs.append(pack)
            loc = BlobLoc(digest, raw_len, pack.id, pack.size, len(payload), codec)
            pack.entries.append(Entry(loc, kind, magic))
            pack.size += need
            self.stored_bytes += need
            self._place(pack, header, payload)
        self._write(pack, loc.offset, header, payload)
        return loc

    @property
    def pack_ids(self) -> list[tuple[str, int]]:
        """``(pack id, size in bytes)`` of every pack written so far."""
        with self._lock:
            return [(p.id, p.size) for p in self._packs]

    def _new_pack(self) -> OpenPack:
        raise NotImplementedError

    def _place(self, pack: OpenPack, header: bytes, payload) -> None:
        pass

    def _write(self, pack: OpenPack, offset: int, header: bytes, payload) -> None:
        pass

    def _seal(self, pack: OpenPack) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        raise NotImplementedError


class _FilePack(OpenPack):
    def __init__(self, root: Path):
        own_dir(root, root / "tmp")  # a link or file named tmp is not written through (invariant 13)
        while True:
            super().__init__(uuid.uuid4().hex)
            self.tmp = root / "tmp" / f"{self.id}.pack.tmp"
            self.final = pack_path(root, self.id)
            self.fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            fcntl.flock(self.fd, fcntl.LOCK_EX)
            if os.fstat(self.fd).st_nlink:  # a GC may unlink it between create and lock: then take a new name
                break
            os.close(self.fd)
        os.pwrite(self.fd, pack_header(), 0)
        self.renamed = False
        self.writing = 0  # entry writes reserved in this pack and not yet done
        self.flushing = False  # its early flush has started
        self.flushed = 0  # its size when its write-back was last started


def _pwrite_all(fd: int, parts: list, offset: int) -> None:
    """``pwritev`` until every byte is written; a full disk then raises ENOSPC."""
    parts = [memoryview(p).cast("B") for p in parts]
    while parts:
        n = os.pwritev(fd, parts, offset)
        if n == 0:
            raise OSError(errno.ENOSPC, "no progress writing")
        offset += n
        while parts and n >= len(parts[0]):
            n -= len(parts[0])
            parts.pop(0)
        if parts:
            parts[0] = parts[0][n:]


class PackWriter(EntryWriter):
    """The :class:`EntryWriter` into pack files: appends new blobs of one commit to packs in
    ``root/tmp/``; thread-safe.

    ``append`` may be called from many threads: offsets are reserved under a
    lock and the bytes written with ``pwritev`` outside it. ``finish`` makes
    every pack durable under its final name; ``close`` releases the locks and,
    if ``finish`` never ran, deletes the temporary files.

    Raises:
        StoreWriteError: any ``OSError`` while writing (``ENOSPC`` included).
    """

    def __init__(self, root: Path, level: int = 3, pack_bytes: int = DEFAULT_PACK_BYTES):
        super().__init__(level, pack_bytes)
        self.root = root

    def _failed(self, exc: OSError) -> StoreWriteError:
        return StoreWriteError(f"writing a blob to {self.root / 'tmp'} failed: {exc}")

    def _new_pack(self) -> _FilePack:
        try:
            return _FilePack(self.root)
        except OSError as exc:
            raise self._failed(exc) from exc

    def _place(self, pack: _FilePack, header: bytes, payload) -> None:
        pack.writing += 1

    def _write(self, pack: _FilePack, offset: int, header: bytes, payload) -> None:
        try:
            try:
                _pwrite_all(pack.fd, [header, payload], offset)
            finally:
                with self._lock:
                    pack.writing -= 1
                    ready = [p for p in self._packs if p.sealed and not p.flushing and p.writing == 0]
                    for p in ready:
                        p.flushing = True
                    early = not pack.sealed and pack.size - pack.flushed >= FLUSH_BYTES
                    if early:
                        pack.flushed = pack.size
            # Let the disk write what is written while the commit writes on: the kernel would
            # otherwise keep every dirty page until finish(), flushing after writing. Full
            # packs are made durable now; the open one's write-back is started every FLUSH_BYTES.
            for p in ready:
                os.fdatasync(p.fd)
            if early:
                _start_writeback(pack.fd)
        except OSError as exc:
            raise self._failed(exc) from exc

    def finish(self) -> None:
        """fsync each pack, rename it into ``blobs/``, fsync the folders."""
        try:
            dirs = set()
            for pack in self._packs:
                if pack.renamed:
                    continue
                with self._lock:
                    pack.sealed = pack.flushing = True  # durable under its final name from here: never written again
                os.fsync(pack.fd)
                own_dir(self.root, pack.final.parent)  # never renamed through a link out of the store
                os.rename(pack.tmp, pack.final)
                pack.renamed = True
                dirs.add(pack.final.parent)
            unknown = False
            for d in dirs:
                fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    os.fsync(fd)
                    st = os.fstat(fd)
                finally:
                    os.close(fd)
                unknown = unknown or (str(d), st.st_dev, st.st_ino) not in _DURABLE_DIRS
            if unknown:  # once per store and process: then every pack folder exists, named durably
                blobs = self.root / "blobs"
                for i in range(256):
                    (blobs / f"{i:02x}").mkdir(exist_ok=True)
                present = [(e.path, st.st_dev, st.st_ino) for e in os.scandir(blobs) if e.is_dir(follow_symlinks=False) for st in [e.stat(follow_symlinks=False)]]
                fsync_dir(blobs)
                _DURABLE_DIRS.update(present)
        except OSError as exc:
            raise StoreWriteError(f"making packs durable in {self.root / 'blobs'} failed: {exc}") from exc

    def discard(self) -> None:
        """Remove every pack of this writer, renamed or not (its transaction did not commit)."""
        for pack in self._packs:
            for path in (pack.tmp, pack.final):
                try:
                    os.unlink(path)
                except OSError:
                    pass

    def close(self) -> None:
        """Unlock every pack; remove the ones never renamed."""
        for pack in self._packs:
            if not pack.renamed:
                try:
                    os.unlink(pack.tmp)
                except OSError:
                    pass
            os.close(pack.fd)
        self._packs = []


Locate = Callable[[BlobLoc], "BlobLoc | None"]


#: Default bound on the pack files one :class:`PackReader` keeps open (an LRU cache of
#: descriptors): a store has two packs per commit, so a reader over all of them (fsck,
#: recover, a checkout of blobs spread over thousands of packs) must not hold one each.
MAX_OPEN_PACKS = 64


class _Handle:
    __slots__ = ("fd", "size", "users", "evicted")

    def __init__(self, fd: int, size: int):
        self.fd, self.size, self.users, self.evicted = fd, size, 0, False


@dataclass
class IOStats:
    """Cumulative read counters of a store (``Store.io``): blobs and bytes read from packs."""

    blobs_read: int = 0
    bytes_read: int = 0


class PackReader:
    """Reads blobs and records out of pack files, checking everything before use.

    Each read checks the location's numbers against the pack's size before
    allocating, the entry header against the expected location (magic, version,
    codec, lengths, digest), decompresses with the raw length as a hard limit,
    and rehashes the raw bytes (invariant 5). File descriptors are cached per
    pack, at most ``max_open`` of them (least recently used closed first; one a
    read is using is closed when that read ends, so the bound is ``max_open`` plus
    the reads in flight); ``pread`` makes concurrent reads from threads safe.

    Args:
        root: the store folder.
        sparse: reading a few blobs: no readahead past them.
        locate: asked for a blob's current location when its pack is gone (a
            GC repacked it and, with a grace period shorter than this read,
            already unlinked the old pack); the read is retried there.
        max_open: the most pack files kept open between reads (at least 1).
    """

    def __init__(self, root: Path, sparse: bool = False, locate: Locate | None = None, max_open: int = MAX_OPEN_PACKS):
        self.root = root
        self.sparse = sparse
        self.locate = locate
        self.max_open = max(1, max_open)
        self._fds: OrderedDict[str, _Handle] = OrderedDict()
        self._lock = threading.Lock()
        self.blobs_read = 0
        self.bytes_read = 0

    def _open(self, pack: str, where: str) -> int:
        path = pack_path(self.root, pack)
        for attempt in range(2):
            try:  # a link, FIFO, socket or device in its place is not the pack (invariant 13): never followed, never opened
                return open_regular(self.root, path)
            except FileNotFoundError:
                raise BlobMissingError(f"{where}: pack file {pack}.pack is missing") from None
            except OSError as exc:
                if exc.errno not in (errno.EMFILE, errno.ENFILE):
                    raise BlobMissingError(f"{where}: pack file {pack}.pack cannot be opened: {exc}") from None
                if attempt:  # not the pack's fault: never reported as a damaged pack
                    raise ResourceLimitError(
                        f"{where}: opening pack file {pack}.pack: {exc.strerror} (this reader holds {len(self._fds)} "
                        "open packs; raise `ulimit -n`)"
                    ) from None
                self._close_idle()  # the process is out of descriptors: give back the ones kept idle

    def _close_idle(self) -> None:
        for pack, h in list(self._fds.items()):
            if h.users == 0:
                del self._fds[pack]
                os.close(h.fd)

    @contextmanager
    def _handle(self, pack: str, where: str) -> Iterator[_Handle]:
        """The open pack ``pack`` (opened, or taken from the cache), held for one read."""
        with self._lock:
            h = self._fds.get(pack)
            if h is None:
                fd = self._open(pack, where)
                if self.sparse:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
                h = self._fds[pack] = _Handle(fd, os.fstat(fd).st_size)
                while len(self._fds) > self.max_open:
                    _, old = self._fds.popitem(last=False)
                    old.evicted = True
                    if old.users == 0:
                        os.close(old.fd)
            else:
                self._fds.move_to_end(pack)
            h.users += 1
        try:
            yield h
        finally:
            with self._lock:
                h.users -= 1
                if h.evicted and h.users == 0:
                    os.close(h.fd)

    @property
    def open_packs(self) -> int:
        """Pack files this reader holds open now."""
        with self._lock:
            return len(self._fds)

    def prefetch(self, locs: list[BlobLoc]) -> None:
        """Announce the blobs about to be read (nothing to do for files; object storage fetches them together)."""

    def read_into(self, loc: BlobLoc, dest: memoryview, where: str, verify: bool = True, magic: bytes = BLOB_MAGIC) -> BlobLoc:
        """Read blob ``loc`` into ``dest`` (exactly ``loc.raw_len`` bytes); returns where it was read.

        ``where`` names the leaf, commit and so on for error messages.

        Raises:
            BlobMissingError: the pack file is gone (and ``locate`` knows no other place).
            BlobCorruptError: bad location numbers, short read, bad header, bad codec payload or hash.
        """
        try:
            self._read_into(loc, dest, where, verify, magic)
            return loc
        except BlobMissingError:
            moved = self.locate(loc) if self.locate is not None else None
            if moved is None or moved == loc:
                raise
            self._read_into(moved, dest, where, verify, magic)
            return moved

    def _read_into(self, loc: BlobLoc, dest: memoryview, where: str, verify: bool, magic: bytes) -> None:
        where = f"{where}, blob {loc.address}"
        if len(dest) != loc.raw_len:
            raise BlobCorruptError(f"{where}: destination holds {len(dest)} bytes, blob {loc.raw_len}")
        if loc.codec not in CODECS:
            raise BlobCorruptError(f"{where}: unknown codec {loc.codec} in the catalog")
        with self._handle(loc.pack, where) as h:
            self._read_open(h.fd, h.size, loc, dest, where, verify, magic)

    def _read_open(self, fd: int, size: int, loc: BlobLoc, dest: memoryview, where: str, verify: bool, magic: bytes) -> None:
        if loc.offset < PACK_HEADER.size or not 0 <= loc.stored_len <= loc.raw_len:
            raise BlobCorruptError(f"{where}: invalid location in the catalog (offset {loc.offset}, {loc.stored_len} stored bytes)")
        if loc.offset + BLOB_HEADER.size + loc.stored_len > size:
            raise BlobCorruptError(
                f"{where}: pack {loc.pack}.pack is truncated ({size} bytes; the entry ends at byte {loc.offset + BLOB_HEADER.size + loc.stored_len})"
            )
        if loc.codec == CODEC_RAW and loc.stored_len != loc.raw_len:
            raise BlobCorruptError(f"{where}: raw blob with payload length {loc.stored_len}")
        header = bytearray(BLOB_HEADER.size)
        payload = dest if loc.codec == CODEC_RAW else bytearray(loc.stored_len)
        try:
            got = os.preadv(fd, [header, payload], loc.offset)
        except OSError as exc:
            raise BlobCorruptError(f"{where}: reading pack {loc.pack}.pack failed: {exc}") from None
        with self._lock:
            self.blobs_read += 1
            self.bytes_read += got
        if got != BLOB_HEADER.size + loc.stored_len:
            raise BlobCorruptError(f"{where}: pack {loc.pack}.pack is truncated ({got} of {BLOB_HEADER.size + loc.stored_len} bytes)")
        decode_entry(header, payload, loc, dest, where, verify, magic)

    def read_run(self, locs: list[BlobLoc], dests: list[memoryview], verify: bool = True) -> bool:
        """Read a run of raw blobs that lie back to back in one pack (each entry starts
        where the one before ends) into ``dests`` with one ``preadv``: their headers and
        payloads in one call, the payloads straight into their destinations, then each
        header compared and, with ``verify``, each payload rehashed.

        Returns ``True`` when every blob was read whole, its header is the one its
        location implies and its bytes hash to its address (counted as ``len(locs)``
        blobs read). Returns ``False``, counting nothing, on anything else (a location
        that is not such a run, a missing pack, a short read, a header or hash that
        differs): the caller then reads each blob with :meth:`read_into`, which relocates
        moved blobs and raises the error naming what is wrong. ``dests`` may hold part
        of the bytes either way.
        """
        if not locs or len(locs) > RUN_BLOBS or len(dests) != len(locs):
            return False
        start = at = locs[0].offset
        for loc, dest in zip(locs, dests):
            if loc.pack != locs[0].pack or loc.offset != at or loc.codec != CODEC_RAW or loc.stored_len != loc.raw_len or len(dest) != loc.raw_len:
                return False
            at += BLOB_HEADER.size + loc.raw_len
        if start < PACK_HEADER.size:
            return False
        headers = [bytearray(BLOB_HEADER.size) for _ in locs]
        try:
            with self._handle(locs[0].pack, f"pack {locs[0].pack}") as h:
                if at > h.size:
                    return False
                got = os.preadv(h.fd, [x for pair in zip(headers, dests) for x in pair], start)
        except (CkptStoreError, OSError):
            return False
        if got != at - start:
            return False
        for loc, header, dest in zip(locs, headers, dests):
            if header != BLOB_HEADER.pack(BLOB_MAGIC, FORMAT_VERSION, CODEC_RAW, 0, loc.raw_len, loc.raw_len, loc.digest):
                return False
            if verify and xxh3(dest) != loc.digest:
                return False
        with self._lock:
            self.blobs_read += len(locs)
            self.bytes_read += got
        return True

    def read(self, loc: BlobLoc, where: str, verify: bool = True, magic: bytes = BLOB_MAGIC) -> bytearray:
        """Read blob (or, with ``magic=RECORD_MAGIC``, record) ``loc`` into a new ``bytearray``
        (see :meth:`read_into`)."""
        out = bytearray(loc.raw_len)
        self.read_into(loc, memoryview(out), where, verify, magic)
        return out

    def stored(self, loc: BlobLoc, where: str) -> bytes:
        """The entry at ``loc`` as stored (header and payload), after verifying it."""
        loc = self.read_into(loc, memoryview(bytearray(loc.raw_len)), where)
        with self._handle(loc.pack, where) as h:
            return os.pread(h.fd, BLOB_HEADER.size + loc.stored_len, loc.offset)

    def close(self) -> None:
        with self._lock:
            for h in self._fds.values():
                h.evicted = True
                if h.users == 0:
                    os.close(h.fd)
            self._fds.clear()


def decode_entry(header, payload, loc: BlobLoc, dest: memoryview, where: str, verify: bool = True, magic: bytes = BLOB_MAGIC) -> None:
    """Check an entry's 40-byte ``header`` against ``loc``, decode its ``payload`` (as stored)
    into ``dest`` (``loc.raw_len`` bytes; a raw payload that already is ``dest`` is not
    copied) and, with ``verify``, rehash it. ``where`` names the blob for messages.

    Raises:
        BlobCorruptError: a header field, the codec payload or the hash does not match.
    """
    check_header(bytes(header), loc, where, magic)
    if loc.codec == CODEC_ZSTD:
        try:
            raw = zstandard.ZstdDecompressor().decompress(payload, max_output_size=loc.raw_len)
        except zstandard.ZstdError as exc:
            raise BlobCorruptError(f"{where}: zstd payload does not decode: {exc}") from None
        if len(raw) != loc.raw_len:
            raise BlobCorruptError(f"{where}: decodes to {len(raw)} bytes, expected {loc.raw_len}")
        dest[:] = raw
    elif payload is not dest:
        if len(payload) != loc.raw_len:
            raise BlobCorruptError(f"{where}: raw payload of {len(payload)} bytes, expected {loc.raw_len}")
        dest[:] = payload
    if verify and xxh3(dest) != loc.digest:
        raise BlobCorruptError(f"{where}: content hash mismatch: the bytes hash to {xxh3(dest).hex()}, not to the address")


def check_header(header: bytes, loc: BlobLoc, where: str, want_magic: bytes = BLOB_MAGIC) -> None:
    """Check a 40-byte entry header against the expected location record.

    Raises:
        BlobCorruptError: naming each field that differs.
    """
    magic, version, codec, _, raw_len, stored_len, dig = BLOB_HEADER.unpack(header)
    if magic != want_magic:
        raise BlobCorruptError(f"{where}: bad entry header magic {magic!r} (expected {want_magic!r})")
    if version != FORMAT_VERSION:
        raise BlobCorruptError(f"{where}: unknown blob format version {version}")
    diffs = [
        f"{name} {got} in the pack, {want} in the catalog"
        for name, got, want in (("codec", codec, loc.codec), ("raw length", raw_len, loc.raw_len), ("stored length", stored_len, loc.stored_len))
        if got != want
    ]
    if dig != loc.digest:
        diffs.append(f"hash {dig.hex()} in the pack, {loc.digest.hex()} in the catalog")
    if diffs:
        raise BlobCorruptError(f"{where}: the entry header does not match the catalog: {'; '.join(diffs)}")


@dataclass(frozen=True)
class Entry:
    """One entry found by :func:`scan`: a blob, or a record (``kind`` > 0)."""

    loc: BlobLoc
    kind: int
    magic: bytes


def scan(path: Path, pack_id: str) -> tuple[list[Entry], str | None]:
    """Walk a pack file's entry headers (no payload is read).

    Returns the entries whose headers are well formed and lie inside the file,
    and a description of the first problem that stopped the walk (``None`` if
    the walk reached the end cleanly). Payload hashes are not checked here.

    Raises:
        ResourceLimitError: the process has no file descriptor left to open it.
    """
    entries: list[Entry] = []
    try:  # never follows a link nor opens a FIFO, socket or device (invariant 13): the caller reached ``path`` without a link
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode):
            return entries, f"{path.name} is {describe_mode(st.st_mode)}, not made by ckptstore"
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return entries, f"{path.name} is not a regular file"
    except OSError as exc:
        if exc.errno in (errno.EMFILE, errno.ENFILE):  # the process's fault, not the pack's
            raise ResourceLimitError(f"opening pack file {path}: {exc.strerror} (raise `ulimit -n`)") from None
        return entries, f"cannot open: {exc}"
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, PACK_HEADER.size, 0)
        if len(head) != PACK_HEADER.size or PACK_HEADER.unpack(head)[:2] != (PACK_MAGIC, FORMAT_VERSION):
            return entries, "bad pack header"
        offset = PACK_HEADER.size
        while offset < size:
            header = os.pread(fd, BLOB_HEADER.size, offset)
            if len(header) != BLOB_HEADER.size:
                return entries, f"truncated entry header at offset {offset}"
            magic, version, codec, kind, raw_len, stored_len, dig = BLOB_HEADER.unpack(header)
            end = offset + BLOB_HEADER.size + stored_len
            if magic not in (BLOB_MAGIC, RECORD_MAGIC) or version != FORMAT_VERSION or codec not in CODECS or end > size:
                return entries, f"bad entry header at offset {offset}"
            entries.append(Entry(BlobLoc(dig, raw_len, pack_id, offset, stored_len, codec), kind, magic))
            offset = end
        return entries, None
    finally:
        os.close(fd)


def check_entry(entry, loc: BlobLoc, where: str, want_magic: bytes = BLOB_MAGIC) -> memoryview:
    """Check a whole entry held in memory (``entry``: its 40-byte header and payload, bytes-like)
    against ``loc``: header fields, length, codec payload and the raw bytes' hash.
    Returns the payload as stored (a view of ``entry``).

    Raises:
        BlobCorruptError: naming what is wrong (``where`` names the blob for the message).
    """
    view = memoryview(entry).cast("B")
    where = f"{where}, blob {loc.address}"
    if len(view) != BLOB_HEADER.size + loc.stored_len:
        raise BlobCorruptError(f"{where}: {len(view)} bytes, the entry has {BLOB_HEADER.size + loc.stored_len}")
    check_header(bytes(view[: BLOB_HEADER.size]), loc, where, want_magic)
    payload = view[BLOB_HEADER.size :]
    hasher = xxhash.xxh3_128()
    if loc.codec == CODEC_ZSTD:
        # Streamed in chunks: memory stays bounded whatever raw length a (forged) header claims.
        got = 0
        try:
            with zstandard.ZstdDecompressor().stream_reader(payload, read_across_frames=False) as reader:
                while chunk := reader.read(_VERIFY_CHUNK):
                    got += len(chunk)
                    if got > loc.raw_len:
                        break
                    hasher.update(chunk)
        except zstandard.ZstdError as exc:
            raise BlobCorruptError(f"{where}: zstd payload does not decode: {exc}") from None
    elif loc.codec == CODEC_RAW and loc.stored_len == loc.raw_len:
        got = len(payload)
        hasher.update(payload)
    else:
        raise BlobCorruptError(f"{where}: codec {loc.codec} with {loc.stored_len} of {loc.raw_len} bytes")
    if got != loc.raw_len or hasher.digest() != loc.digest:
        raise BlobCorruptError(f"{where}: content hash mismatch: the bytes do not hash to the address")
    return payload


def pack_header() -> bytes:
    """The 16-byte header every pack starts with."""
    return PACK_HEADER.pack(PACK_MAGIC, FORMAT_VERSION, 0, 0)


def entry_header(digest: bytes, raw_len: int, codec: int, stored_len: int, magic: bytes = BLOB_MAGIC, kind: int = 0) -> bytes:
    """The 40-byte header of an entry (see the module docstring)."""
    return BLOB_HEADER.pack(magic, FORMAT_VERSION, codec, kind, raw_len, stored_len, digest)
