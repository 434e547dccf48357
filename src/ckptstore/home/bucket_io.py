"""Reading and writing blobs on object storage: :class:`BucketReader`, the
:class:`~ckptstore.objects.packs.PackReader` of a store on a bucket (coalesced, parallel ranged
reads, each entry checked and rehashed), and :class:`DetachedPackWriter`, the
:class:`~ckptstore.objects.bucketformat.BucketPackWriter` of a process that writes blobs of a
commit without opening the store (a DCP rank).
"""

from __future__ import annotations

import threading
from typing import Any

from ..backends import open_backend
from ..core.errors import BlobCorruptError, BlobMissingError, ObjectNotFoundError
from ..core.threads import Pool
from ..objects.bucketformat import UPLOADS, BucketPackWriter
from ..objects.packindex import pack_key
from ..objects.packs import BLOB_HEADER, BLOB_MAGIC, BlobLoc, check_entry, decode_entry
from .base import Home  # (a BucketHome: the bucket home's module imports this one)
from .bucket_cache import UNLOCATED


class BucketReader:
    """:class:`~ckptstore.objects.packs.PackReader`'s interface for object storage.

    :meth:`prefetch` fetches the announced blobs with one coalesced, parallel ranged read
    per pack (:meth:`~ckptstore.backends.Backend.get_ranges`); each read then checks the
    entry header against the catalog's location, decodes and rehashes (invariant 5). A
    blob whose pack is gone (a GC swept it after repacking), or that the cache has not
    located yet (:data:`UNLOCATED`: once per reader), is looked up again after the cache
    has been refreshed from the bucket.
    """

    def __init__(self, home: Home):
        self.home, self.backend = home, home.backend
        self._got: dict[tuple[str, int], Any] = {}
        self._lock = threading.Lock()
        self._refreshed = False  # this reader brought the cache's index up to date for an unlocated blob
        self.blobs_read = 0
        self.bytes_read = 0

    def prefetch(self, locs: list[BlobLoc]) -> None:
        by_pack: dict[str, list[BlobLoc]] = {}
        for loc in locs:
            if loc.pack != UNLOCATED:  # located when read (_found)
                by_pack.setdefault(loc.pack, []).append(loc)

        def fetch(item: tuple[str, list[BlobLoc]]) -> None:
            pid, group = item
            try:
                bufs = self.backend.get_ranges(pack_key(pid), [loc.span for loc in group])
            except ObjectNotFoundError:
                return  # read_into finds the blob elsewhere, or reports it
            with self._lock:
                for loc, buf in zip(group, bufs):
                    self._got[(pid, loc.offset)] = buf

        list(self.home.requests.map(fetch, by_pack.items()))

    def _entry(self, loc: BlobLoc, where: str):
        with self._lock:
            buf = self._got.pop((loc.pack, loc.offset), None)
        if buf is None and loc.pack == UNLOCATED:
            raise BlobMissingError(f"{where}: no pack index of {self.backend.url} that the cache has read holds it")
        if buf is None:
            try:
                buf = self.backend.get_ranges(pack_key(loc.pack), [loc.span])[0]
            except ObjectNotFoundError:
                raise BlobMissingError(f"{where}: pack {loc.pack} is not on {self.backend.url}") from None
        with self._lock:
            self.blobs_read += 1
            self.bytes_read += len(buf)
        return memoryview(buf).cast("B")

    def _read(self, loc: BlobLoc, dest: memoryview, where: str, verify: bool, magic: bytes) -> None:
        where = f"{where}, blob {loc.address}"
        if len(dest) != loc.raw_len:
            raise BlobCorruptError(f"{where}: destination holds {len(dest)} bytes, blob {loc.raw_len}")
        view = self._entry(loc, where)
        decode_entry(view[: BLOB_HEADER.size], view[BLOB_HEADER.size :], loc, dest, where, verify, magic)

    def _found(self, loc: BlobLoc, read) -> tuple[BlobLoc, Any]:
        """``(where, read(where))``: ``loc``, or where the blob is now when its pack is gone."""
        try:
            return loc, read(loc)
        except BlobMissingError:
            if loc.pack != UNLOCATED or not self._refreshed:  # an unlocated blob: every new .idx read once per reader
                self.home.refresh_index()
                self._refreshed = True
            moved = self.home.relocate(loc)
            if moved is None or moved == loc:
                raise
            return moved, read(moved)

    def read_into(self, loc: BlobLoc, dest: memoryview, where: str, verify: bool = True, magic: bytes = BLOB_MAGIC) -> BlobLoc:
        """Read blob ``loc`` into ``dest``; returns where it was read (see :class:`~ckptstore.objects.packs.PackReader`)."""
        return self._found(loc, lambda at: self._read(at, dest, where, verify, magic))[0]

    def stored(self, loc: BlobLoc, where: str) -> bytes:
        """The entry of blob ``loc`` as stored (header and payload), after checking its
        header and rehashing it (:func:`~ckptstore.objects.packs.check_entry`): what push, pull and
        export copy.

        Raises:
            BlobMissingError: its pack is gone and no other pack holds it.
            BlobCorruptError: its header or bytes do not match.
        """
        where = f"{self.backend.url}: {where}"
        at, view = self._found(loc, lambda at: self._entry(at, where))
        check_entry(view, at, where)
        return bytes(view)

    def read(self, loc: BlobLoc, where: str, verify: bool = True, magic: bytes = BLOB_MAGIC) -> bytearray:
        out = bytearray(loc.raw_len)
        self.read_into(loc, memoryview(out), where, verify, magic)
        return out

    def close(self) -> None:
        with self._lock:
            self._got.clear()


class DetachedPackWriter(BucketPackWriter):
    """A :class:`~ckptstore.protocols.remote.BucketPackWriter` into ``s3://bucket/prefix`` with its
    own client and upload threads (:data:`UPLOADS` at a time), for a process that writes
    blobs of a commit another process makes and never opens the store (a DCP rank,
    :func:`ckptstore.store.pack_writer_at`). :meth:`close` releases the client and threads.
    Its ``append`` copies each blob and hashes the copy, as the base class's: a rank's
    tensors may change before its packs are uploaded.

    Raises:
        NotAStoreError / BackendError: (from the uploads) a missing bucket, an unreachable server.
    """

    def __init__(self, url: str, level: int, pack_bytes: int):
        super().__init__(open_backend(url), level, pack_bytes, Pool(UPLOADS, thread_name_prefix="ckptstore-upload"))

    def close(self) -> None:
        super().close()
        self._uploads.shutdown()
        self.backend.close()


__all__ = ["BucketReader", "DetachedPackWriter"]
