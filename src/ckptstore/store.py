"""The store: commit, checkout, refs and lineage.

A store is one folder::

    catalog.sqlite   the catalog (commits, manifests, lineage, tags, reflog, blobs)
    blobs/           pack files of content-addressed blobs, fanned out by id prefix
    tmp/             files being written

Commit protocol (docs/design.md has the details):

1. adapters turn the object into components (state trees);
2. each tensor is cut into row-aligned shards and hashed (XXH3-128), in threads;
3. shards the catalog already knows are reused, the others are written to new
   pack files, which are fsynced and renamed into ``blobs/``;
4. one ``BEGIN IMMEDIATE`` transaction checks that every reused blob still has
   its row (a GC may have removed it meanwhile: then it is rewritten and the
   transaction retried), inserts the blob rows, the commit, its parents,
   components, leaves and shards, moves the tags and appends to the reflog.

A crash before step 4 commits leaves only orphan pack files, which GC removes.
"""

from __future__ import annotations

import gc
import json
import os
import re
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import jsonvalue, progress, records
from .catalog import Catalog, CatalogMissing, damaged, keep_reserve, release_reserve
from .diff import DiffReport, diff_commits
from .errors import (
    AdapterError,
    AmbiguousRefError,
    BlobMissingError,
    CatalogCorruptError,
    CkptStoreError,
    IntegrityError,
    InvalidArgumentError,
    InvalidNameError,
    NotAStoreError,
    RefNotFoundError,
    StoreWriteError,
    UnsupportedTypeError,
)
from .fsck import FsckReport, LocalFsck
from .fsck import run as run_fsck
from .gc import SMALL_PACK_BYTES, GCReport, LocalGC, collect
from .layout import (
    DEFAULT_SHARD_BYTES,
    ShardPlan,
    address,
    check_shape,
    digest,
    itemsize,
    sample_unchanged,
    under,
)
from .packs import BLOB_HEADER, DEFAULT_PACK_BYTES, BlobLoc, PackReader, PackWriter, pack_path
from .records import LeafRecord, check_message, check_tag
from .recover import RecoverReport, recover
from .refs import ANY, CatalogRefs, Refs
from .threads import Pool

if TYPE_CHECKING:  # torch, TensorDict and the adapters load on first commit or checkout: catalog-only use never imports torch
    import torch

    from .adapters import Registry
    from .adapters.base import Captured
    from .backends import Backend
    from .transfer import TransferReport

CATALOG = "catalog.sqlite"
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]+:/")  # a URL scheme (s3:/ once a path mangled s3://), not a folder
_STORE_NAMES = re.compile(r"^(catalog\.sqlite(-wal|-shm|-journal|-reserve|\.v\d+\.bak)?|blobs|tmp|gc\.lock|leases)$")  # leases: ckptstore.run
_INLINE_HASH_BYTES = 4 << 20  # below this, hashing in threads costs more than it saves


@dataclass(frozen=True)
class CommitInfo:
    """One commit, as returned by :meth:`Store.commit` and :meth:`Store.log`.

    Attributes:
        id: 32 hex digits (XXH3-128 of the commit record).
        tags: tags that pointed to it when returned (for ``commit``: the tags it moved).
        parents: parent commit ids (lineage), first parent first.
        created_at: seconds since the epoch.
        logical_bytes: bytes of all tensors in the state.
        new_bytes: raw bytes of shards the store did not hold before.
        stored_bytes: bytes written to pack files (after compression, with headers).
        shards_total: shard references in the manifest.
        shards_new: blobs written by this commit.
        seconds: wall time of the commit call.
    """

    id: str
    tags: tuple[str, ...]
    parents: tuple[str, ...]
    created_at: float
    message: str
    metadata: dict
    logical_bytes: int
    new_bytes: int
    stored_bytes: int
    shards_total: int
    shards_new: int
    seconds: float

    @property
    def tag(self) -> str | None:
        """The first tag, or ``None``."""
        return self.tags[0] if self.tags else None

    @property
    def dedup_ratio(self) -> float:
        """``logical_bytes / new_bytes`` (``inf`` when nothing was new)."""
        return self.logical_bytes / self.new_bytes if self.new_bytes else float("inf")


@dataclass
class IOStats:
    """Cumulative read counters of a :class:`Store` (blobs and bytes read from packs)."""

    blobs_read: int = 0
    bytes_read: int = 0


@dataclass
class _Prehashed:
    """A changed tensor leaf of an asynchronous commit, split when it was snapshotted:
    its record, each shard's ``(digest, bytes)`` (copies of the shards that changed since
    the last commit, views of the live tensor for the others, only read if their blob
    must be written again, after a rehash; a copy's digest is ``b""`` until the commit
    hashes it), the blob ids of the unchanged ones, and the last commit's
    ``(digest, blob id)`` per shard."""

    record: LeafRecord
    shards: list[tuple[bytes, memoryview]]
    reused: dict[int, int]  # shard index -> blob id
    last: list[tuple[bytes, int]]


def _storage_identity() -> type:
    global _STORAGE_IDENTITY
    if _STORAGE_IDENTITY is None:
        from .adapters.base import StorageIdentity  # lazily: the adapters import torch

        _STORAGE_IDENTITY = StorageIdentity
    return _STORAGE_IDENTITY


_STORAGE_IDENTITY: type | None = None


def _ints_json(values: Sequence[int]) -> str:
    """``jsonvalue.dumps(list(values))`` of a shape or strides (Python ints), the short way."""
    return "[" + ",".join(map(str, values)) + "]" if all(type(v) is int for v in values) else jsonvalue.dumps(list(values))


def _flat_bytes(t: Any, path: str) -> memoryview:
    """:func:`ckptstore.shards.tensor_bytes` of a CPU tensor in memory order: the
    short way (through numpy) where it applies, else that function."""
    from .shards import tensor_bytes

    if t.is_contiguous() and t.numel():
        try:
            return memoryview(t.detach().numpy()).cast("B")
        except (TypeError, RuntimeError, ValueError):  # no numpy dtype (bfloat16...), conjugate or negative bit, a subclass
            pass
    return tensor_bytes(t, path)


class _Same:
    """What the digest cache keeps of a tensor leaf beside its shard hashes, so that a
    commit of it unchanged skips its per-shard work: its manifest record, its layout
    (dtype, shape, strides) and ``{address: blob id}`` of its shards."""

    __slots__ = ("record", "dtype", "shape", "stride", "blobs")

    def __init__(self, record: LeafRecord, value: Any, blobs: dict[tuple[bytes, int], int]):
        self.record, self.dtype, self.shape, self.stride, self.blobs = record, value.dtype, value.shape, value.stride(), blobs

    @staticmethod
    def of(entry: tuple | None, token: Any, value: Any, component: str) -> _Same | None:
        """``entry[3]`` if ``entry`` (the digest cache's) says tensor ``value`` of ``component`` is unchanged."""
        if entry is None or entry[3] is None or entry[0] != token:
            return None
        same = entry[3]
        if same.record.component != component or value.dtype != same.dtype or value.shape != same.shape or value.stride() != same.stride:
            return None
        return same


class ReusedBlobsGone(Exception):
    """Raised by :meth:`Store.index_commit`: blobs the commit reuses are gone (a GC); ``keys`` must be written again."""

    def __init__(self, keys: list[tuple[bytes, int]]):
        self.keys = keys


def _given_stored(written: dict[tuple[bytes, int], BlobLoc], given_packs) -> int:
    """Bytes (headers included) of the blobs in ``written`` that other processes wrote to ``given_packs``."""
    ids = {pid for pid, _ in given_packs}
    return sum(loc.stored_len + BLOB_HEADER.size for loc in written.values() if loc.pack in ids) if ids else 0


_background = threading.local()  # .active: this thread runs an asynchronous commit

_gc_pause = threading.Lock()
_gc_paused: list[bool] = []  # one entry per pause in progress, in any thread: whether the collector was enabled before the first


@contextmanager
def paused_gc():
    """Pause Python's cyclic garbage collector around a commit, a snapshot or a checkout.

    They allocate a few small objects per shard; with the many objects torch
    and TorchRL keep alive, that can trigger a full collection costing a
    quarter of a second in the middle of a commit (in a background commit, holding
    the GIL the training loop needs). Pauses may overlap across threads; the
    collector resumes when the last one ends, if it was enabled before the first.
    """
    with _gc_pause:
        _gc_paused.append(gc.isenabled() if not _gc_paused else _gc_paused[0])
        gc.disable()
    try:
        yield
    finally:
        with _gc_pause:
            enabled = _gc_paused.pop()
            if not _gc_paused and enabled:
                gc.enable()


def _setting(name: str, value: Any, low: int, high: int) -> Any:
    """Validate an integer setting (None passes through). Raises InvalidArgumentError."""
    if value is None:
        return None
    if type(value) is not int or not low <= value <= high:
        raise InvalidArgumentError(f"invalid {name} {value!r}: must be an integer in [{low}, {high}]")
    return value


_FULL_ID = re.compile(r"[0-9a-f]{32}")


def _is_url(path: Any) -> bool:
    """Is ``path`` a store on object storage (``s3://…``) rather than a folder?

    Raises:
        InvalidArgumentError: a URL of another scheme.
    """
    if not (isinstance(path, str) and _URL.match(path)):
        return False
    if not path.startswith("s3://"):
        raise InvalidArgumentError(f"unsupported store location {path!r}: a folder, or s3://bucket/prefix for S3-compatible object storage")
    return True


def weakly(owner: Any, *names: str) -> list:
    """Callables returning ``owner.<name>`` (called, for a method) that do not keep ``owner``
    alive: the store owns its refs, not the reverse (no reference cycle, so a store
    dropped without ``close`` still frees its catalog connection at once)."""
    me = weakref.ref(owner)

    def one(name: str):
        if callable(getattr(type(owner), name, None)):
            return lambda *args: getattr(me(), name)(*args)
        return lambda: getattr(me(), name)

    return [one(n) for n in names]


def _as_backend(remote: Any) -> Backend | None:
    """``remote`` as a backend when it is object storage (an ``s3://`` URL or a Backend), else ``None``."""
    from .backends import Backend, open_backend

    if isinstance(remote, Backend):
        return remote
    if isinstance(remote, str) and remote.startswith("s3://"):
        return open_backend(remote)
    return None


class Store:
    """A content-addressed, versioned checkpoint store in one folder, or on object storage.

    Args:
        path: the store folder; ``"s3://bucket/prefix"`` opens a store on object storage
            instead (a :class:`ckptstore.bucket.BucketStore`: same API, see its docstring).
        create: ``None`` (default): open the store if it exists; if it does not,
            reading raises NotAStoreError and the first commit (or tag move)
            creates it, so a mistyped path never turns into an empty store.
            ``True``: create it now if missing. ``False``: it must exist now
            (NotAStoreError otherwise).
        shard_bytes: target shard size in bytes for new commits (default 256 KiB);
            saved in the catalog when the store is created, overridden per
            session when given.
        compression_level: zstandard level for compressible shards (0 disables).
        pack_bytes: pack files roll over past this size in bytes.
        workers: threads for hashing, compression and I/O (default: CPU count).
        registry: the adapter registry (default: the global one, ``ckptstore.adapters.REGISTRY``).
        reuse_hashes: skip rehashing a tensor that this store committed before
            when its fingerprint says it did not change: for plain tensors (module
            parameters and buffers, optimizer moments, TensorDict and dict leaves)
            the storage, address, layout and torch's version counter
            (:func:`ckptstore.adapters.base.plain_token`); for a TorchRL storage its
            mutation revision too (``Adapter.fingerprints``), and, when it changed, only
            the shards holding rows written through the storage's ``set`` since are
            rehashed (:class:`ckptstore.adapters.torchrl.WriteLog`). Writes torch does not
            count (through ``.data``, numpy views, another process's memory) keep the
            fingerprint, so every commit also rehashes a random sample of each such
            tensor's shards (1 %, at least one): a write to every element, like
            TorchRL's target-network updates through ``.data``, is always caught, a
            sparse one with the sample's odds; a catch rehashes the tensor in full and
            warns (``StaleFingerprintWarning``). Shared and file-backed memory and CUDA
            tensors are always hashed. ``False`` always hashes everything.

    Raises:
        NotAStoreError: the folder holds other files and no catalog.
        CatalogCorruptError: the catalog is not a ckptstore SQLite catalog.
        SchemaVersionError: the catalog is newer than this library.
    """

    def __new__(cls, path: str | os.PathLike = "", *args: Any, **kwargs: Any) -> Store:
        if cls is Store and _is_url(path):
            from .bucket import BucketStore  # a store on object storage

            return super().__new__(BucketStore)
        return super().__new__(cls)

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        create: bool | None = None,
        shard_bytes: int | None = None,
        compression_level: int | None = None,
        pack_bytes: int = DEFAULT_PACK_BYTES,
        workers: int | None = None,
        registry: Registry | None = None,
        reuse_hashes: bool = True,
    ):
        self.root = Path(path)
        shard_bytes = _setting("shard_bytes", shard_bytes, 1, 1 << 34)
        compression_level = _setting("compression_level", compression_level, 0, 22)
        self._asked = (shard_bytes, compression_level)
        self.shard_bytes = DEFAULT_SHARD_BYTES if shard_bytes is None else shard_bytes
        self.compression_level = 3 if compression_level is None else compression_level
        self.pack_bytes = pack_bytes
        self.workers = workers or os.cpu_count() or 1
        self._registry = registry
        self.io = IOStats()
        self._pool: ThreadPoolExecutor | None = None
        self._digest_cache: dict[int, tuple[weakref.ref, dict]] = {}  # id(owner) -> (owner, {token: shard hashes})
        self.reuse_hashes = reuse_hashes
        self._committer: ThreadPoolExecutor | None = None  # runs asynchronous commits, one at a time
        self._pending: Future | None = None
        self._snapshots: dict[str, torch.Tensor] = {}
        self._records: dict[str, records.CommitRecord] = {}  # verified commit records by id (immutable)
        self._catalog: Catalog | None = None
        self._catalog_lock = threading.Lock()
        #: The home's refs (:mod:`ckptstore.refs`): every tag read and move goes through them.
        self.refs: Refs = CatalogRefs(*weakly(self, "catalog", "_write"), str(self.root))
        if self._open(create=bool(create)) is None and create is False:
            what = self._missing()
            raise NotAStoreError(f"{self.root} {what}")

    @property
    def registry(self) -> Registry:
        """The adapter registry (imports the adapters, and torch, on first use)."""
        if self._registry is None:
            from .adapters import REGISTRY

            self._registry = REGISTRY
        return self._registry

    @property
    def catalog(self) -> Catalog:
        """The catalog connection, opened on first use.

        Raises:
            NotAStoreError: the store does not exist (yet: see ``create``).
        """
        cat = self._catalog if self._catalog is not None else self._open(create=False)
        if cat is None:
            what = self._missing()
            raise NotAStoreError(f"{self.root} {what}; a first commit creates a store there")
        return cat

    def _missing(self) -> str:
        """Why there is no store at :attr:`root` (for NotAStoreError)."""
        if not self.root.exists():
            return "does not exist"
        catalog = self.root / CATALOG
        if catalog.exists():
            return f"is not a ckptstore store yet ({CATALOG} was never initialised: its creation was interrupted)"
        return f"is not a ckptstore store (no {CATALOG})"

    def _open(self, create: bool) -> Catalog | None:
        """Open the catalog, then load the stored settings; ``None`` if there is no
        store and ``create`` is false (with ``create``: create it)."""
        with self._catalog_lock:
            if self._catalog is not None:
                return self._catalog
            cat = self._open_catalog(create)
            if cat is None:
                return None
            try:
                self._load_settings(cat)
            except BaseException:
                cat.close()
                raise
            self._catalog = cat
        if cat.writable:
            keep_reserve(self.root / CATALOG)  # room for the journal when the disk fills up
        if cat.migrated_from is not None and cat.writable:
            self._backfill_records()
        return cat

    def _load_settings(self, cat: Catalog) -> None:
        """The first open of a new store saves its settings; later opens read them (arguments win)."""
        shard_bytes, level = self._asked
        rows = {r["key"]: jsonvalue.loads(r["value"]) for r in cat.rows("SELECT key, value FROM settings")}
        missing = {k: v for k, v in (("shard_bytes", self.shard_bytes), ("compression_level", self.compression_level)) if k not in rows}
        if missing and cat.writable:
            with cat.write():
                db = cat.db
                db["settings"].insert_all(({"key": k, "value": jsonvalue.dumps(v)} for k, v in missing.items()), ignore=True)
        rows = {**missing, **rows}
        try:  # the arguments were checked above; the stored values are checked here
            self.shard_bytes = shard_bytes or _setting("shard_bytes", rows["shard_bytes"], 1, 1 << 34)
            self.compression_level = level if level is not None else _setting("compression_level", rows["compression_level"], 0, 22)
        except InvalidArgumentError as exc:
            raise CatalogCorruptError(f"{self.root / CATALOG}: stored setting is invalid: {exc}") from None

    # --- lifecycle -------------------------------------------------------------------

    def _open_catalog(self, create: bool) -> Catalog | None:
        """Open the catalog (``None``: no store here and not ``create``); only SQLite
        looks at the catalog file (invariant 6)."""
        catalog = self.root / CATALOG
        if self.root.exists() and not self.root.is_dir():
            raise NotAStoreError(f"{self.root} is a file, not a ckptstore store")
        for attempt in range(2):
            try:
                return Catalog(catalog, create=False)
            except CatalogMissing:
                pass
            except (CatalogCorruptError, StoreWriteError) as exc:
                if "ckptstore recover" in str(exc):
                    raise
                raise type(exc)(f"{exc}; if the catalog is lost or damaged, `ckptstore recover --store {self.root}` rebuilds it from the packs") from None
            packs = next(iter(self.root.glob("blobs/*/*.pack")), None)
            if packs is None:
                break
            if attempt:  # packs and no catalog: the catalog was deleted
                raise CatalogCorruptError(
                    f"{catalog} is missing or empty but {self.root / 'blobs'} holds packs: the catalog was lost; "
                    f"`ckptstore recover --store {self.root}` rebuilds it from the packs"
                )
            time.sleep(0.05)  # or a concurrent creator has just made its first commit: look again
        self._foreign_files()
        if not create:
            return None
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            cat = Catalog(catalog, create=True)
        except OSError as exc:
            raise NotAStoreError(f"cannot create a store at {self.root}: {exc}") from None
        except CatalogMissing:
            raise StoreWriteError(f"cannot create a store at {self.root}: the folder cannot be written") from None
        for sub in ("blobs", "tmp"):
            (self.root / sub).mkdir(exist_ok=True)
        return cat

    def _foreign_files(self) -> None:
        """Refuse a folder that holds other things than a store's files."""
        others = sorted(p.name for p in self.root.iterdir() if not _STORE_NAMES.match(p.name)) if self.root.is_dir() else []
        if others:
            raise NotAStoreError(f"{self.root} is not a ckptstore store (no {CATALOG}) and is not empty: {', '.join(others[:5])}")

    def _backfill_records(self) -> None:
        """Write the records a store migrated from schema 1 lacks: each commit's, and each tag's last move."""
        with self._write() as batch:
            for cid, text in self.catalog.rows(
                f"SELECT id, record FROM commits WHERE record IS NOT NULL AND id NOT IN (SELECT name FROM records WHERE kind = {records.KIND_COMMIT})"
            ):
                batch.append((records.KIND_COMMIT, cid, None, text))
            for seq, tag, old, new, at, action in self.catalog.rows(
                "SELECT id, tag, old_commit, new_commit, at, action FROM reflog WHERE id IN (SELECT MAX(id) FROM reflog GROUP BY tag) "
                f"AND tag NOT IN (SELECT name FROM records WHERE kind = {records.KIND_REF})"
            ):
                batch.append((records.KIND_REF, tag, seq, records.ref_text(seq, tag, old, new, at, action)))

    @property
    def pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = Pool(self.workers, thread_name_prefix="ckptstore")
        return self._pool

    def close(self) -> None:
        """Wait for asynchronous commits, then release the threads and the catalog connection."""
        if self._committer is not None:
            self._committer.shutdown(wait=True)
            self._committer = None
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        if self._catalog is not None:
            self._catalog.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Store({str(self.root)!r})"

    @property
    def location(self) -> str:
        """Where the store lives, as ``Store(location)`` opens it: its folder, or (a store
        on object storage) its ``s3://bucket/prefix`` URL."""
        return str(self.root)

    def relocate_reused(self, keys: list[tuple[bytes, int]]) -> dict[tuple[bytes, int], int]:
        """Blob ids of those of ``keys`` (addresses a commit meant to reuse, which a GC
        removed meanwhile) that the store holds elsewhere. A local GC updates the catalog
        in its own transaction, so a blob it moved is found by the next lookup; {} here
        means every one is written again."""
        return {}

    def refresh_index(self, only: list[str] | None = None) -> int:
        """Bring the index up to date with the objects before a lookup that must see every
        blob the store holds; returns the packs read. A local store's catalog is updated by
        every commit in its own transaction: nothing to do (0). On object storage the cache
        reads the pack indexes it has not seen (:meth:`ckptstore.bucket.BucketStore.refresh_index`)."""
        return 0

    # --- commit ----------------------------------------------------------------------

    def commit(
        self,
        obj: Any,
        tag: str | Sequence[str] | None = None,
        message: str = "",
        metadata: dict | None = None,
        parents: Sequence[str] | None = None,
    ) -> CommitInfo:
        """Commit ``obj`` and move ``tag`` (one name or several) to the new commit.

        ``obj`` is anything with an adapter: a TorchRL replay buffer, module,
        optimizer, :class:`~ckptstore.RNGState`, TensorDict, tensor, JSON value,
        or a dict of them. Parents default to the commits the tags pointed to
        (read inside the commit transaction); pass ``parents`` (refs) to override.

        Returns:
            CommitInfo with byte counts (bytes) and ``seconds``.

        Raises:
            UnsupportedTypeError: a value that cannot be stored without pickle
                (names its path and type).
            InvalidNameError: a bad tag name or state-tree key.
            RefNotFoundError: a ``parents`` ref that does not exist.
            StoreWriteError: writing failed (disk full...); nothing committed changes.
            CatalogBusyError: the catalog stayed locked.
        """
        t0 = time.perf_counter()
        with paused_gc():
            return self.commit_components(self._capture(obj), tag, message, metadata, parents, t0=t0)

    def _capture(self, obj: Any) -> list[Captured]:
        import torch

        from .adapters import capture

        try:
            with torch.no_grad():
                return capture(obj, self.registry)
        except RecursionError:
            raise UnsupportedTypeError("the state is nested too deeply or refers to itself (a cycle)") from None

    def commit_async(
        self,
        obj: Any,
        tag: str | Sequence[str] | None = None,
        message: str = "",
        metadata: dict | None = None,
        parents: Sequence[str] | None = None,
    ) -> Future:
        """Start a commit and return once the state is snapshotted; the rest runs in the background.

        The call copies every tensor that may have changed since this store last
        committed it (unchanged tensors, told by their fingerprints, are not copied;
        of a TorchRL storage column only the shards holding rows written since are)
        into snapshot buffers reused from earlier asynchronous commits, and freezes
        JSON values. Training may then modify
        the live objects. Asynchronous commits run one at a time, in call order, in
        one background thread that also does their hashing and writing (not the
        store's thread pool), so a training loop keeps the other cores.
        One still running when the script ends finishes before the interpreter
        exits (:meth:`close` also waits for it); only its future reports its errors.

        Returns:
            A ``concurrent.futures.Future`` resolving to the :class:`CommitInfo`
            once the commit is durable, or raising what :meth:`commit` would.

        Raises (at once): UnsupportedTypeError / InvalidNameError for state that
        cannot be stored, as :meth:`commit`.
        """
        t0 = time.perf_counter()
        with paused_gc():
            components = self._snapshot(self._capture(obj))
        if self._committer is None:
            self._committer = ThreadPoolExecutor(1, thread_name_prefix="ckptstore-commit")
        future = self._committer.submit(self._commit_paused, components, tag, message, metadata, parents, t0)
        self._pending = future
        return future

    def _commit_paused(self, components, tag, message, metadata, parents, t0) -> CommitInfo:
        _background.active = True  # hash and write in this thread only (see _map)
        try:
            with paused_gc():
                return self.commit_components(components, tag, message, metadata, parents, t0=t0, reuse_checked=True)
        finally:
            _background.active = False

    def _snapshot(self, components: list[Captured]) -> list[Captured]:
        """Copies of the leaves that may change after an asynchronous commit returns."""
        import torch

        from .adapters.base import Captured
        from .shards import check_tensor, dense_order, physical, plan, tensor_bytes

        free = self._pending is None or self._pending.done()  # the last snapshot's buffers are reusable
        buffers = self._snapshots if free else {}
        out = []
        stale: set[str] = set()
        for comp in components:
            leaves = {}
            for path, value in comp.leaves.items():
                if not isinstance(value, torch.Tensor):
                    leaves[path] = jsonvalue.loads(jsonvalue.dumps(value, path))
                    continue
                token = comp.fingerprints.get(path)
                if token is not None:
                    phys, _ = physical(value, path)
                    p = plan(tuple(phys.shape), value.dtype, self.shard_bytes)
                    entry = self._cached(comp.owner, path, token)
                    if entry is not None and entry[0] == token and len(entry[1]) == p.count:
                        if sample_unchanged([d for d, _ in entry[1]], tensor_bytes(phys, path), p, path):
                            # unchanged: its hashes and blob ids are taken now (the cache may change
                            # before the background commit runs); its bytes are only reread if a GC
                            # removed the blobs meanwhile, and rehashed then
                            leaves[path] = self._prehash(comp.path, path, value, entry[1], dict(enumerate(entry[1])))
                            continue
                        stale.add(path)  # the token lies: the background commit hashes the copy, the next one all of it
                        self._digest_cache[id(self._keeper(comp.owner, token))][1].pop((path, self.shard_bytes), None)
                    elif entry is not None:
                        reuse = self._reusable(entry, token, value, p)
                        if reuse and not sample_unchanged({i: d for i, (d, _) in reuse.items()}, tensor_bytes(phys, path), p, path):
                            reuse = None
                        if reuse is not None or p.count >= 4:
                            leaves[path] = self._prehash(comp.path, path, value, entry[1], reuse)
                            continue
                check_tensor(value, path)
                buf = buffers.get(path)
                if buf is None or buf.dtype != value.dtype or buf.shape != value.shape or buf.stride() != value.stride():
                    dense = value.is_contiguous() or dense_order(tuple(value.shape), value.stride()) is not None
                    buf = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype) if dense else torch.empty(value.shape, dtype=value.dtype)
                buf.copy_(value.detach())
                leaves[path] = buf
                buffers[path] = buf
            tokens = {k: v for k, v in comp.fingerprints.items() if k not in stale}
            out.append(Captured(comp.path, comp.adapter, comp.version, comp.meta, leaves, tokens, comp.owner))
        self._snapshots = buffers
        return out

    def _prehash(self, component: str, path: str, value: Any, last: list[tuple[bytes, int]], known: dict[int, tuple[bytes, int]] | None) -> _Prehashed:
        """Split a changed tensor into the shards an asynchronous commit must copy now and
        the ones it may read later: for a replay buffer extended by a few rows, a copy of a
        few shards instead of whole columns. With ``known`` (``{index: (hash, blob id)}``,
        from :meth:`_reusable`), the other shards hold the rows written since the last
        commit: they are copied, and hashed by the commit in the background. Without it,
        every shard is hashed now (in threads; about twice as fast as copying here) and
        only those whose hash differs from the one at the same index in ``last`` (its
        previous commit's) are copied."""
        from .shards import dtype_name, physical, plan, tensor_bytes

        phys, stride = physical(value, path)
        p = plan(tuple(phys.shape), value.dtype, self.shard_bytes)
        mv = tensor_bytes(phys, path)
        views = [mv[a : a + p.shard_bytes] for a in range(0, p.nbytes, p.shard_bytes)] or [mv]
        record = LeafRecord(path, component, "tensor", dtype_name(value.dtype, path), tuple(value.shape), p.nbytes, p.shard_bytes, stride=stride)
        if known is not None:
            shards = [(known[i][0], view) if i in known else (b"", memoryview(bytearray(view))) for i, view in enumerate(views)]
            return _Prehashed(record, shards, {i: blob for i, (_, blob) in known.items()}, last)
        hashed = self._map(digest, views) if p.nbytes > _INLINE_HASH_BYTES else [digest(v) for v in views]
        reused, shards = {}, []
        for i, (d, view) in enumerate(zip(hashed, views)):
            if i < len(last) and d == last[i][0]:
                reused[i] = last[i][1]
                shards.append((d, view))
            else:
                shards.append((d, memoryview(bytearray(view))))
        return _Prehashed(record, shards, reused, last)

    def commit_components(
        self,
        components: list[Captured],
        tag: str | Sequence[str] | None = None,
        message: str = "",
        metadata: dict | None = None,
        parents: Sequence[str] | None = None,
        *,
        t0: float | None = None,
        reuse_checked: bool = False,
    ) -> CommitInfo:
        """Commit components already captured (by :func:`ckptstore.adapters.capture`
        or built by an importer); same arguments, result and errors as :meth:`commit`.
        ``reuse_checked``: the shard hashes reused by fingerprint were sample-checked
        already (:meth:`commit_async` checks them when it snapshots the state)."""
        t0 = time.perf_counter() if t0 is None else t0
        tags = [] if tag is None else list(tag) if isinstance(tag, (list, tuple)) else [tag]
        tags = list(dict.fromkeys(check_tag(t) for t in tags))
        metadata = check_message(message, metadata)
        parents = [parents] if isinstance(parents, str) else parents
        explicit_parents = None if parents is None else [self.resolve(p) for p in parents]
        for c in components:
            if records.ESCAPED in c.meta:
                raise AdapterError(f"{c.path or '<root>'}: adapter {c.adapter} returned meta key {records.ESCAPED!r}, which ckptstore reserves")
        components = [replace(c, meta={**c.meta, records.ESCAPED: True}) for c in components]  # paths in today's key encoding
        leaves, views, tokens, prior, from_cache, unchanged = self._leaves(components, reuse_checked)
        keys = [(d, len(mv)) for shard_views in views for d, mv in shard_views]
        unique: dict[tuple[bytes, int], memoryview] = {}
        for shard_views in views:
            for d, mv in shard_views:
                unique.setdefault((d, len(mv)), mv)

        def write(writer: PackWriter, key: tuple[bytes, int]) -> BlobLoc:
            data = unique[key]
            if key in from_cache:
                # A hash kept from an earlier commit whose blob a GC freed since: the bytes are
                # live memory. Copied once, so what is hashed is what is written (training may
                # write between the two); if they moved on, this commit cannot be made.
                data = bytes(data)
                if digest(data) != key[0]:
                    self.forget_hashes()  # the next commit rehashes instead of failing the same way
                    raise StoreWriteError(
                        f"blob {address(*key)} this commit reused was freed by a GC (another process or Store) while the commit "
                        "ran, and its tensor has changed since, so its content at the commit is gone; commit again"
                    )
            return writer.append(data, key[0])

        info, ids = self.commit_manifest(components, leaves, keys, write, tags, message, metadata, explicit_parents, t0, prior)
        if unchanged and any(ids[k] != b for k, b in prior.items()):  # blobs written again (a GC freed them): new ids
            unchanged = set()
        self._remember_digests(leaves, views, tokens, ids, unchanged)
        return info

    def commit_manifest(
        self, components, leaves, keys, write, tags, message, metadata, explicit_parents, t0, prior=None, origin=None, written=None
    ):
        """Steps 3 and 4 of the commit protocol for a manifest already built (commits and
        importers): ``leaves`` are :class:`LeafRecord` s, ``keys`` every tensor shard's
        address in order, and ``write(writer, key)`` writes one new blob to a PackWriter.

        ``prior`` maps addresses to blob ids believed to exist (the transaction
        checks them). ``origin`` = ``(commit id, parents, created_at)`` recreates a
        commit made elsewhere (an import) with its own id, parents and time: the
        rebuilt record must hash to that id (IntegrityError otherwise), and a
        commit the store already has is not written again (only the tags move).
        ``written`` = ``(locations, packs)``: blobs other processes already made
        durable in their own packs (the ranks of a ``torch.distributed.checkpoint``
        save, :mod:`ckptstore.dcp`), ``{address: BlobLoc}`` and ``[(pack id, size)]``;
        they are indexed in this commit's transaction and not written again (an
        address the catalog already holds keeps its row; that copy is left for GC).
        Returns the CommitInfo and every address's blob id.
        """
        if not self._open(create=True).writable:
            raise StoreWriteError(f"{self.root} is read-only here (mount, permissions or a full disk): it can be read, not committed to")
        meta_json = jsonvalue.dumps(metadata, "metadata")
        bad, _ = records.path_problem({c.path: {"meta": c.meta} for c in components}, leaves)  # a store never accepts a commit it cannot check out
        if bad:
            raise InvalidNameError(f"cannot commit: {bad}")
        for r in leaves:
            if r.encoded is not None:  # checked by the commit that encoded it
                continue
            try:
                if r.kind == "tensor":
                    size = itemsize(r.dtype)
                    if size is None:
                        raise ValueError(f"unknown dtype {r.dtype!r}")
                    check_shape(r.shape, size)
            except ValueError as exc:
                raise InvalidArgumentError(f"cannot commit leaf {r.path}: {exc}") from None
        known = dict(prior or {})
        known.update(self._lookup([k for k in dict.fromkeys(keys) if k not in known]))
        given, given_packs = written or ({}, [])
        with self.pack_writer() as writer:
            written = {k: loc for k, loc in given.items() if k not in known}
            todo = [k for k in dict.fromkeys(keys) if k not in known and k not in written]
            relocated: set[tuple[bytes, int]] = set()
            while True:
                with progress.task("commit: write new shards", sum(n for _, n in todo)) as advance:
                    def write_one(key: tuple[bytes, int]) -> BlobLoc:
                        loc = write(writer, key)
                        advance(key[1])
                        return loc

                    for key, loc in zip(todo, self._map(write_one, todo)):
                        written[key] = loc
                writer.finish()
                try:
                    created_at = time.time() if origin is None else origin[2]
                    cid, parent_ids, seconds, ids = self.index_commit(
                        components, leaves, keys, known, written, writer, tags, message, meta_json,
                        explicit_parents if origin is None else list(origin[1]), created_at, t0, None if origin is None else origin[0],
                        given_packs,
                    )
                    break
                except ReusedBlobsGone as gone:  # a GC removed them meanwhile: find the copies its repack made, write the rest again
                    for k in gone.keys:
                        known.pop(k, None)
                        written.pop(k, None)
                    again = self.relocate_reused([k for k in gone.keys if k not in relocated])  # once per blob: then written
                    relocated.update(again)
                    known.update(again)
                    todo = [k for k in gone.keys if k not in again]
        info = CommitInfo(
            id=cid,
            tags=tuple(tags),
            parents=tuple(parent_ids),
            created_at=created_at,
            message=message,
            metadata=metadata,
            logical_bytes=sum(r.nbytes for r in leaves if r.kind == "tensor"),
            new_bytes=sum(n for _, n in written),
            stored_bytes=writer.stored_bytes + _given_stored(written, given_packs),
            shards_total=len(keys),
            shards_new=len(written),
            seconds=seconds,
        )
        return info, ids

    def _leaves(self, components: list[Captured], checked: bool = False):
        """Manifest records; for each tensor leaf its shards' (digest, bytes);
        ``(owner, path, token)`` per leaf whose hashes the digest cache can keep;
        the blob ids the digest cache suggests for addresses (``prior``); and the
        addresses whose hashes came from that cache, unverified (``from_cache``).

        A leaf whose fingerprint is unchanged takes its hashes from the cache once
        a random sample of its shards rehashes to them (unless ``checked``). A
        changed one is hashed, and each shard whose hash equals the one at the same
        position last time takes that blob id: no catalog lookup (the commit's
        transaction checks every such id still holds that address).
        """
        import torch

        from .shards import dtype_name, physical, plan, tensor_bytes

        recs: list[LeafRecord] = []
        views: list[list[tuple[bytes, memoryview]]] = []
        tokens: list[tuple[Any, str, Any] | None] = []
        prior: dict[tuple[bytes, int], int] = {}
        from_cache: set[tuple[bytes, int]] = set()
        previous: dict[int, list[tuple[bytes, int]]] = {}  # leaf index -> last commit's (hash, blob id) per shard
        todo: list[tuple[int, memoryview]] = []
        unchanged: set[int] = set()  # indices of the leaves taken whole from the digest cache
        for comp in components:
            for path, value in comp.leaves.items():
                token = comp.fingerprints.get(path)
                tokens.append(None if token is None else (comp.owner, path, token, value))
                shards: list[tuple[bytes, memoryview]] = []
                if isinstance(value, _Prehashed):
                    rec, shards = value.record, list(value.shards)
                    for i, blob in value.reused.items():
                        key = (shards[i][0], len(shards[i][1]))
                        prior[key] = blob
                        from_cache.add(key)
                    unhashed = [(len(recs), i) for i, (d, _) in enumerate(shards) if not d]
                    if unhashed:
                        todo.extend(unhashed)
                        previous[len(recs)] = value.last
                elif isinstance(value, torch.Tensor):
                    entry = self._cached(comp.owner, path, token)
                    kept = _Same.of(entry, token, value, comp.path)
                    stale = False
                    if kept is not None:
                        # Unchanged since the last commit (equal fingerprint, same layout): its record,
                        # hashes and blob ids are taken whole, once a sample of its shards rehashes to them.
                        rec, hashes = kept.record, entry[1]
                        mv = _flat_bytes(value if rec.stride is None else physical(value, path)[0], path)
                        step = rec.shard_bytes
                        ok = checked or sample_unchanged([hashes[0][0]] if len(hashes) == 1 else [d for d, _ in hashes], mv, entry[2], path)
                        if ok:
                            shards = [(d, mv[a : a + step]) for (d, _), a in zip(hashes, range(0, rec.nbytes, step))] if rec.nbytes else [(hashes[0][0], mv)]
                            prior.update(kept.blobs)
                            from_cache.update(kept.blobs)
                            unchanged.add(len(recs))
                            recs.append(rec)
                            views.append(shards)
                            continue
                        stale = True  # the sample failed (and warned): hash it all
                    phys, stride = physical(value, path)
                    p = plan(tuple(phys.shape), value.dtype, self.shard_bytes)
                    rec = LeafRecord(path, comp.path, "tensor", dtype_name(value.dtype, path), tuple(value.shape), p.nbytes, p.shard_bytes, stride=stride)
                    mv = tensor_bytes(phys, path)
                    known: dict[int, tuple[bytes, int]] = {}
                    if entry is not None:
                        same = entry[0] == token and len(entry[1]) == p.count
                        known = dict(enumerate(entry[1])) if same else self._reusable(entry, token, value, p) or {}
                        if known and (stale or (not checked and not sample_unchanged({i: d for i, (d, _) in known.items()}, mv, p, path))):
                            known = {}
                        if len(known) < p.count:
                            previous[len(recs)] = entry[1]
                    for s in range(p.count):
                        shard = mv[slice(*p.bounds(s))]
                        if s in known:
                            key = (known[s][0], len(shard))
                            prior[key] = known[s][1]
                            from_cache.add(key)
                        else:
                            todo.append((len(recs), s))
                        shards.append((known[s][0] if s in known else b"", shard))
                else:
                    rec = LeafRecord(path, comp.path, "json", None, None, 0, None, jsonvalue.dumps(value, path))
                recs.append(rec)
                views.append(shards)
        total = sum(len(views[i][s][1]) for i, s in todo)
        hash_one = lambda item: digest(views[item[0]][item[1]][1])
        digests = self._map(hash_one, todo) if total > _INLINE_HASH_BYTES else [hash_one(item) for item in todo]
        for (i, s), d in zip(todo, digests):
            views[i][s] = (d, views[i][s][1])
        for i, last in previous.items():
            for (d, mv), (last_d, blob) in zip(views[i], last):
                if d == last_d:
                    prior[(d, len(mv))] = blob
        return recs, views, tokens, prior, from_cache, unchanged

    @staticmethod
    def _keeper(owner: Any, token: Any) -> Any:
        """What a digest-cache entry lives as long as: the tensor's storage for a plain
        token (a dict owner cannot be weakly referenced, and a new dict each commit
        must still find the hashes), else the object the adapter fingerprinted."""
        if type(token) is tuple and token and type(token[0]) is _storage_identity():
            return token[0].ref()
        return owner

    def _cached(self, owner: Any, path: str, token: Any) -> tuple[Any, list[tuple[bytes, int]], ShardPlan] | None:
        """``(fingerprint, [(shard hash, blob id)], shard plan)`` of leaf ``path`` of
        ``owner`` as this store last committed it at the current target shard size."""
        if token is None or not self.reuse_hashes:
            return None
        owner = self._keeper(owner, token)
        cached = self._digest_cache.get(id(owner))
        if cached is None or cached[0]() is not owner:
            return None
        return cached[1].get((path, self.shard_bytes))

    @staticmethod
    def _reusable(entry: tuple, token: Any, value: Any, p: ShardPlan) -> dict[int, tuple[bytes, int]] | None:
        """The shards of tensor ``value`` (cut by ``p``) that its last commit (``entry``
        of the digest cache) stored at the same bounds and that no row written since
        touches, as ``{index: (hash, blob id)}``; ``None`` unless ``token`` is a
        :class:`~ckptstore.adapters.base.RowToken` that can name the rows (indices
        along dim 0) written since that commit's token."""
        import torch

        from .adapters.base import RowToken

        last_token, hashes, last = entry[:3]
        rows = token.changed_rows(last_token) if isinstance(token, RowToken) else None
        if rows is None or last.shard_bytes != p.shard_bytes or value.dim() == 0 or not value.is_contiguous():
            return None
        dirty: set[int] = set()
        if value.shape[0] and p.nbytes:
            row = p.nbytes // value.shape[0]
            rows = rows[: int(torch.searchsorted(rows, value.shape[0]))]  # sorted; rows past the written ones are not in the leaf
            if p.shard_bytes % row == 0:  # whole rows per shard (the plan's rule for rows up to the target)
                dirty = set(torch.unique_consecutive(rows // (p.shard_bytes // row)).tolist())
            else:  # rows cut into several shards
                first, stop = rows * row // p.shard_bytes, ((rows + 1) * row - 1) // p.shard_bytes + 1
                dirty = {i for a, b in zip(first.tolist(), stop.tolist()) for i in range(a, b)}
        same = min(last.count, p.count)  # shards below the last one of either plan are whole in both
        if last.bounds(same - 1) != p.bounds(same - 1):
            same -= 1
        return {i: hashes[i] for i in range(same) if i not in dirty}

    def _remember_digests(self, leaves: list[LeafRecord], views: list, tokens: list, ids: dict[tuple[bytes, int], int], unchanged: set[int] = frozenset()) -> None:
        """Keep each fingerprinted leaf's shard hashes and blob ids for the next commit;
        a leaf of ``unchanged`` (taken whole from the cache, its blob ids confirmed) keeps its entry."""
        import torch

        fresh: dict[int, tuple[Any, dict]] = {}
        for i, (rec, shards, entry) in enumerate(zip(leaves, views, tokens)):
            if entry is not None:
                owner, path, token, value = entry
                owner = self._keeper(owner, token)
                if owner is None:  # its storage is gone already
                    continue
                key = (path, self.shard_bytes)
                old = self._digest_cache.get(id(owner)) if i in unchanged else None
                if old is not None and old[0]() is owner and key in old[1]:
                    kept = old[1][key]
                else:
                    hashes = [(d, ids[(d, len(mv))]) for d, mv in shards]
                    same = _Same(rec, value, {(d, len(mv)): b for (d, mv), (_, b) in zip(shards, hashes)}) if isinstance(value, torch.Tensor) else None
                    kept = (token, hashes, ShardPlan(rec.nbytes, rec.shard_bytes), same)
                fresh.setdefault(id(owner), (weakref.ref(owner), {}))[1][key] = kept
        live = {k: v for k, v in self._digest_cache.items() if v[0]() is not None}  # entries of freed objects go
        live.update(fresh)
        self._digest_cache = live

    def _map(self, fn, items: list) -> list:
        """``[fn(x) for x in items]`` across the thread pool, a few chunks per thread
        (one task per small item costs more in locking than the work). In the thread of
        an asynchronous commit, in that thread alone: the pool's threads would compete
        with the training loop for the cores (and the GIL) to finish the commit sooner,
        which nothing waits for."""
        if len(items) <= 1 or self.workers == 1 or getattr(_background, "active", False):
            return [fn(x) for x in items]
        size = -(-len(items) // (4 * self.workers))
        failed = threading.Event()

        def run(chunk: list) -> list:
            out = []
            for x in chunk:
                if failed.is_set():  # another chunk failed: the result is discarded anyway
                    break
                try:
                    out.append(fn(x))
                except BaseException:
                    failed.set()
                    raise
            return out

        futures = [self.pool.submit(run, items[i : i + size]) for i in range(0, len(items), size)]
        # No task may outlive this call, even on error: callers close the pack files `fn` writes to.
        wait(futures)
        return [y for f in futures for y in f.result()]

    def _lookup(self, keys: list[tuple[bytes, int]]) -> dict[tuple[bytes, int], int]:
        """Blob ids of the addresses the catalog already holds."""
        wanted = set(keys)
        rows = self.catalog.chunked("SELECT hash, raw_len, id FROM blobs WHERE hash IN ({})", list({d for d, _ in keys}), raw=True)
        return {(h, n): i for h, n, i in rows if (h, n) in wanted}

    @contextmanager
    def _write(self):
        """A catalog write transaction that may add records (commit, ref moves).

        Yields a list to append ``(kind, name, seq, text)`` to. Before COMMIT the
        records are written to a new pack, made durable, and indexed, so every
        record the catalog describes exists in a pack (invariant 7); if the
        transaction does not commit, the pack is removed again.
        """
        batch: list[tuple[int, str, int | None, str]] = []
        self._open(create=True)
        with PackWriter(self.root, 0, self.pack_bytes) as writer:
            try:
                with self.catalog.write():
                    yield batch
                    if batch:
                        locs = [writer.append_record(kind, text.encode()) for kind, _, _, text in batch]
                        writer.finish()
                        self.catalog.conn.executemany(
                            "INSERT INTO packs (id, size, created_at) VALUES (?, ?, ?)", [(pid, size, time.time()) for pid, size in writer.pack_ids]
                        )
                        self.catalog.conn.executemany(
                            "INSERT INTO records (kind, name, seq, digest, pack, offset, raw_len, stored_len) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                            [(k, n, q, loc.digest, loc.pack, loc.offset, loc.raw_len, loc.stored_len) for (k, n, q, _), loc in zip(batch, locs)],
                        )
            except BaseException:
                writer.discard()
                raise

    def index_commit(
        self, components, leaves, keys, known, written, writer, tags, message, meta_json, explicit_parents, created_at, t0, expect=None, given_packs=(),
    ):
        """Step 4 of the commit protocol: in one catalog transaction, check that the
        reused blobs (``known``: address -> blob id) still exist (else
        :class:`ReusedBlobsGone`), index the new blobs (``written``) and the commit, and move
        ``tags``. ``expect``: the id the record must hash to (IntegrityError otherwise).
        Returns ``(commit id, parent ids, seconds, {address: blob id})``."""
        with self._write() as batch:
            if known:
                # An id must still hold the same address: GC may have freed it and a new blob taken the id since.
                # The per-shard rows of a commit (thousands for a large buffer, most of them
                # unchanged shards) go to SQLite as one JSON array in one statement, here and for
                # the shards table below: executemany and fetchall release and retake the GIL once
                # per row, and a thread that does that thousands of times starves the others of
                # it (each waits a switch interval, 5 ms, to get it back), the training loop
                # beside an asynchronous commit among them. This one returns only the mismatches.
                reused = list(known.items())
                # First one cheap statement: the addresses the ids hold now, in the ids' order, as one text;
                # only if it differs, the one that names the ids that changed.
                (now,), = self.catalog.rows(
                    "SELECT group_concat(lower(hex(b.hash)) || '-' || b.raw_len, ' ') FROM json_each(?) j LEFT JOIN blobs b ON b.id = j.value",
                    (json.dumps([i for _, i in reused]),), raw=True,
                )
                same = now == " ".join([address(d, n) for (d, n), _ in reused])
                bad = [] if same else self.catalog.rows(
                    "SELECT j.key FROM json_each(?) j LEFT JOIN blobs b ON b.id = json_extract(j.value, '$[0]') "
                    "WHERE b.id IS NULL OR b.raw_len != json_extract(j.value, '$[2]') OR lower(hex(b.hash)) != json_extract(j.value, '$[1]')",
                    (json.dumps([[i, d.hex(), n] for (d, n), i in reused]),), raw=True,
                )
                gone = [reused[k][0] for (k,) in bad]
                if gone:
                    raise ReusedBlobsGone(gone)
            # Plain SQL, not sqlite-utils' tables: these look the schema up (several queries) on every call.
            run_many = self.catalog.conn.executemany
            run_many(
                "INSERT OR IGNORE INTO packs (id, size, created_at) VALUES (?, ?, ?)",
                [(pid, size, created_at) for pid, size in [*writer.pack_ids, *given_packs]],
            )
            run_many(
                "INSERT OR IGNORE INTO blobs (hash, raw_len, pack, offset, stored_len, codec, created_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                [(loc.digest, loc.raw_len, loc.pack, loc.offset, loc.stored_len, loc.codec, created_at) for loc in written.values()],
            )
            ids = dict(known)
            ids.update(self._lookup(list(written)))
            if explicit_parents is not None:
                parents = explicit_parents
            else:
                current = {r["name"]: r["commit_id"] for r in self.catalog.chunked("SELECT name, commit_id FROM tags WHERE name IN ({})", tags)}
                parents = list(dict.fromkeys(current[t] for t in tags if t in current))
            per_leaf = self._keys_per_leaf(leaves, keys)
            for r, keys_of in zip(leaves, per_leaf):
                if r.encoded is None:
                    r.encoded = (records.manifest_entry(r, keys_of), (
                        r.path, r.component, r.kind, r.dtype, None if r.shape is None else _ints_json(r.shape),
                        None if r.stride is None else _ints_json(r.stride), r.nbytes, r.shard_bytes, r.value,
                    ))
            manifest = [r.encoded[0] for r in leaves]
            components_json = [[c.path, c.adapter, c.version, jsonvalue.dumps(c.meta, c.path)] for c in components]
            record = records.commit_text(parents, created_at, message, meta_json, components_json, manifest)
            cid = records.commit_id(record)
            seconds = time.perf_counter() - t0
            if expect is not None and cid != expect:
                raise IntegrityError(f"the commit's content hashes to {cid}, not to its recorded id {expect}")
            if self.catalog.rows("SELECT 1 FROM commits WHERE id = ?", (cid,)):  # imported before: only the tags move
                if tags:
                    self.refs.move(dict.fromkeys(tags, (ANY, cid)), "import", created_at, batch)
                return cid, parents, seconds, ids
            new_bytes = sum(n for _, n in written)
            self.catalog.conn.execute(
                "INSERT INTO commits (id, created_at, message, metadata, logical_bytes, new_bytes, stored_bytes, shards_total, shards_new, "
                "seconds, record) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (cid, created_at, message, meta_json, sum(r.nbytes for r in leaves if r.kind == "tensor"), new_bytes,
                 writer.stored_bytes + _given_stored(written, given_packs), len(keys), len(written), seconds, record),
            )
            batch.append((records.KIND_COMMIT, cid, None, record))
            run_many("INSERT INTO parents (commit_id, position, parent_id) VALUES (?, ?, ?)", [(cid, i, p) for i, p in enumerate(parents)])
            run_many(
                "INSERT INTO components (commit_id, path, adapter, version, meta) VALUES (?, ?, ?, ?, ?)",
                [(cid, c.path, c.adapter, c.version, meta) for c, (_, _, _, meta) in zip(components, components_json)],
            )
            run_many(
                "INSERT INTO leaves (commit_id, path, component, kind, dtype, shape, stride, nbytes, shard_bytes, value) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [(cid, *r.encoded[1]) for r in leaves],
            )
            leaf_ids = dict(self.catalog.rows("SELECT path, id FROM leaves WHERE commit_id = ?", (cid,), raw=True))
            # A leaf's shard rows from one JSON array of blob ids, as the check above; the one row of a
            # one-shard leaf (most of a state of many small leaves) as a plain row: json_each costs more.
            single, multi = [], []
            for r, keys_of in zip(leaves, per_leaf):
                if len(keys_of) == 1:
                    single.append((leaf_ids[r.path], 0, ids[keys_of[0]]))
                elif keys_of:
                    multi.append((leaf_ids[r.path], json.dumps([ids[k] for k in keys_of])))
            run_many("INSERT INTO shards (leaf_id, seq, blob_id) VALUES (?, ?, ?)", single)
            run_many("INSERT INTO shards (leaf_id, seq, blob_id) SELECT ?, key, value FROM json_each(?)", multi)
            if tags:  # in this transaction: the commit's rows and its tag moves are one
                self.refs.move(dict.fromkeys(tags, (ANY, cid)), "commit", created_at, batch)
        return cid, parents, seconds, ids

    @staticmethod
    def _keys_per_leaf(leaves: list[LeafRecord], keys: list[tuple[bytes, int]]) -> list[list[tuple[bytes, int]]]:
        out, i = [], 0
        for r in leaves:
            n = max(1, -(-r.nbytes // r.shard_bytes)) if r.kind == "tensor" else 0  # ShardPlan.count
            out.append(keys[i : i + n])
            i += n
        return out

    # --- refs ------------------------------------------------------------------------

    def resolve(self, ref: str) -> str:
        """The commit id a ref names: a tag, a full commit id, or a unique id prefix of at
        least 4 hex digits (as git: a shorter one is too easily a mistyped tag).

        Raises:
            RefNotFoundError: nothing matches.
            AmbiguousRefError: a prefix matches several commits (they are listed).
            IntegrityError: the tag is damaged (or names a commit the store lacks).
        """
        if type(ref) is not str or not ref or not jsonvalue.is_text(ref):
            raise RefNotFoundError(f"invalid ref {ref!r}")
        if _FULL_ID.fullmatch(ref) and self.has_cached(ref):
            return ref  # a commit the index holds (no tag is named by hex digits: check_tag); records are immutable
        cid = self.refs.read(ref)
        return self._held(cid) if cid is not None else self._find_commit(ref)

    def _held(self, cid: str) -> str:
        """``cid`` (named by a tag), once the index holds its commit: the catalog does
        already (the refs checked it)."""
        return cid

    def _find_commit(self, ref: str) -> str:
        """The commit a full id or unique id prefix ``ref`` names, from the index."""
        ref_l = ref.lower()
        if len(ref_l) >= records.MIN_PREFIX and all(c in "0123456789abcdef" for c in ref_l):
            rows = self.catalog.rows("SELECT id FROM commits WHERE substr(id, 1, ?) = ? LIMIT 10", (len(ref_l), ref_l))
            if len(rows) == 1:
                return rows[0]["id"]
            if len(rows) > 1:
                ids = ", ".join(r["id"][:12] for r in rows)
                raise AmbiguousRefError(f"ref {ref!r} is an ambiguous commit id prefix: matches {ids}")
        raise RefNotFoundError(records.unknown_ref(ref, self.root, [t for t in self.tags() if t.startswith(ref + "/")]))

    def tags(self) -> dict[str, str]:
        """``{tag name: commit id}``, sorted by name (on object storage: the refs as on the
        bucket now, never the commits they name)."""
        return self.refs.list()

    def tagged(self) -> dict[str, CommitInfo]:
        """``{tag name: CommitInfo of the commit it names}``, sorted by name, read in one
        snapshot (a concurrent GC cannot drop a tagged commit in between)."""
        with self.catalog.read():
            named = self.tags()
            infos = self._infos(list(set(named.values())))
        for name, cid in named.items():
            if cid not in infos:
                raise damaged(self.catalog.path, f"tag {name!r} points to commit {cid}, which is not in the catalog")
        return {name: infos[cid] for name, cid in named.items()}

    def tag(self, name: str, ref: str, *, expect: str | None | type[Ellipsis] = ...) -> str:
        """Create or move tag ``name`` to the commit ``ref`` names; returns its id.

        Atomic: one transaction moves the tag and appends a reflog row. With
        ``expect`` (a commit id, or ``None`` for "no such tag yet") it is a
        compare-and-swap: RefConflictError, and nothing changes, when the tag
        names something else at that moment.
        """
        check_tag(name)
        with self.refs.transaction() as txn:  # locally one catalog transaction; on object storage each move is a CAS
            cid = self.resolve(ref)
            self.refs.move({name: (expect, cid)}, "tag", None, txn)
        return cid

    def has_commit(self, cid: str) -> bool:
        """Does the store hold commit ``cid`` (a full id)? ``False`` for a store not created yet."""
        return self.has_cached(cid)

    def has_cached(self, cid: str) -> bool:
        """Does the index hold commit ``cid``'s rows? (Locally the index is the store.)"""
        return self._open(create=False) is not None and bool(self.catalog.rows("SELECT 1 FROM commits WHERE id = ?", (cid,)))

    def push(self, remote: Store | Backend | str | os.PathLike, ref: str, force: bool = False) -> TransferReport:
        """Copy ``ref`` and the ancestors ``remote`` lacks into ``remote``, keeping commit
        ids; then move the remote tag (when ``ref`` is a tag) if it is a fast-forward.

        ``remote`` is another store (a :class:`Store` or a folder, created if missing:
        :mod:`ckptstore.transfer`) or object storage (``"s3://bucket/prefix"`` or a
        :class:`~ckptstore.backends.Backend`; an empty prefix becomes a store:
        :mod:`ckptstore.remote`). Nothing is written when nothing is missing.

        Raises:
            RefConflictError: the remote tag names a commit that is not an ancestor of
                ``ref``'s (naming both; ``force=True`` overrides) or moved meanwhile.
            NotAStoreError: a missing bucket.
            BackendError: object storage failed after retries (the remote tag did not move).
            RefNotFoundError / AmbiguousRefError / IntegrityError / StoreWriteError.
        """
        backend = _as_backend(remote)
        if backend is not None:
            from .remote import push

            try:
                return push(self, backend, ref, force)
            finally:
                if backend is not remote:
                    backend.close()
        from .transfer import transfer

        other = remote if isinstance(remote, Store) else Store(remote, create=True)
        try:
            return transfer(self, other, ref, force)
        finally:
            if other is not remote:
                other.close()

    def pull(self, remote: Store | Backend | str | os.PathLike, ref: str, force: bool = False) -> TransferReport:
        """The reverse of :meth:`push`: copy ``ref`` of ``remote`` into this store (created if
        missing). ``s3://`` remotes: NotAStoreError for a missing bucket or a prefix without
        ``ckptstore.json``; IntegrityError naming any remote record, index or blob that does
        not verify (the local tag then does not move)."""
        backend = _as_backend(remote)
        if backend is not None:
            from .remote import pull

            try:
                return pull(self, backend, ref, force)
            finally:
                if backend is not remote:
                    backend.close()
        from .transfer import transfer

        other = remote if isinstance(remote, Store) else Store(remote, create=False)
        try:
            self._open(create=True)
            return transfer(other, self, ref, force)
        finally:
            if other is not remote:
                other.close()

    def delete_tag(self, name: str) -> str:
        """Delete tag ``name`` (its commits stay until GC); returns the commit it named
        (on object storage ``""`` for a tag whose payload was malformed: it is removed all the same).

        Raises:
            RefNotFoundError: no such tag.
        """
        return self.refs.delete(name)

    def reflog(self, tag: str | None = None) -> list[dict]:
        """Every tag move, newest first: ``{tag, old_commit, new_commit, at, action}``.

        Raises RefNotFoundError for a tag that never existed.
        """
        return self.refs.reflog(tag)

    def info(self, ref: str) -> CommitInfo:
        """The :class:`CommitInfo` of one commit.

        Raises:
            RefNotFoundError / AmbiguousRefError: bad ref.
        """
        with self.catalog.read():  # one snapshot: a GC cannot drop the commit between its ref and its row
            cid = self.resolve(ref)
            found = self._infos([cid]).get(cid)
        if found is None:
            raise RefNotFoundError(f"commit {cid} is not in {self.root}")
        return found

    def infos(self, ids: list[str]) -> dict[str, CommitInfo]:
        """``{commit id: CommitInfo}`` of the full commit ids ``ids`` the store holds (others are left out)."""
        return self._infos(ids)

    def _infos(self, ids: list[str]) -> dict[str, CommitInfo]:
        """:meth:`infos` from the index alone (what the index holds; on object storage, the cache)."""
        rows = self.catalog.chunked("SELECT * FROM commits WHERE id IN ({})", ids)
        parents: dict[str, list[str]] = {}
        for r in self.catalog.chunked("SELECT commit_id, parent_id FROM parents WHERE commit_id IN ({}) ORDER BY position", ids):
            parents.setdefault(r["commit_id"], []).append(r["parent_id"])
        tags: dict[str, list[str]] = {}
        for r in self.catalog.chunked("SELECT name, commit_id FROM tags WHERE commit_id IN ({}) ORDER BY name", ids):
            tags.setdefault(r["commit_id"], []).append(r["name"])
        return {
            r["id"]: CommitInfo(
                id=r["id"], tags=tuple(tags.get(r["id"], ())), parents=tuple(parents.get(r["id"], ())),
                created_at=r["created_at"], message=r["message"], metadata=jsonvalue.loads(r["metadata"]),
                logical_bytes=r["logical_bytes"], new_bytes=r["new_bytes"], stored_bytes=r["stored_bytes"],
                shards_total=r["shards_total"], shards_new=r["shards_new"], seconds=r["seconds"],
            )
            for r in rows
        }

    def log(self, ref: str | None = None, limit: int | None = None) -> list[CommitInfo]:
        """Lineage of ``ref`` (itself and all its ancestors), newest first.

        Without ``ref``, every commit in the store, newest first. ``limit``
        (>= 1) keeps the newest ones. Raises InvalidArgumentError for a bad limit.
        """
        if limit is not None and (type(limit) is not int or limit < 1):
            raise InvalidArgumentError(f"invalid limit {limit!r}: must be an integer >= 1")
        if ref is None:
            ids = [r["id"] for r in self.catalog.rows("SELECT id FROM commits ORDER BY created_at DESC, id")]
        else:
            seen: list[str] = []
            frontier = [self.resolve(ref)]
            known: set[str] = set()
            while frontier:
                known.update(frontier)
                seen += frontier
                rows = self.catalog.chunked("SELECT parent_id FROM parents WHERE commit_id IN ({})", frontier)
                frontier = list(dict.fromkeys(r["parent_id"] for r in rows if r["parent_id"] not in known))
            ids = seen
        infos = self._infos(ids)
        out = sorted((infos[i] for i in ids if i in infos), key=lambda c: (-c.created_at, c.id))
        return out[:limit] if limit else out

    # --- inspection --------------------------------------------------------------------

    def show(self, ref: str) -> dict:
        """What one commit holds, for ``ckptstore show``.

        Returns ``{"commit": CommitInfo, "components": {path: {...}}, "leaves": [...]}``
        where each leaf has ``path``, ``component``, ``kind``, ``dtype``, ``shape``,
        ``logical_bytes``, ``stored_bytes`` (its blobs in packs, headers included),
        ``shards`` and ``shared_with_parent`` (shards whose blob the first parent
        also references).
        """
        info = self.info(ref)
        parent = info.parents[0] if info.parents else ""
        stats = {
            r["path"]: r
            for r in self.catalog.rows(
                "SELECT l.path, COUNT(*) AS shards, SUM(b.stored_len + ?) AS stored, "
                "SUM(s.blob_id IN (SELECT s2.blob_id FROM shards s2 JOIN leaves l2 ON l2.id = s2.leaf_id WHERE l2.commit_id = ?)) AS shared "
                "FROM leaves l JOIN shards s ON s.leaf_id = l.id JOIN blobs b ON b.id = s.blob_id WHERE l.commit_id = ? GROUP BY l.path",
                (BLOB_HEADER.size, parent, info.id),
            )
        }
        leaves = []
        for r in self.catalog.rows("SELECT * FROM leaves WHERE commit_id = ? ORDER BY rowid", (info.id,)):
            st = stats.get(r["path"])
            leaves.append({
                "path": r["path"], "component": r["component"], "kind": r["kind"], "dtype": r["dtype"],
                "shape": None if r["shape"] is None else jsonvalue.loads(r["shape"]),
                "logical_bytes": r["nbytes"], "stored_bytes": st["stored"] if st else 0,
                "shards": st["shards"] if st else 0, "shared_with_parent": st["shared"] if st else 0,
            })
        return {"commit": info, "components": self.components(info.id), "leaves": leaves}

    def diff(self, a: str, b: str) -> DiffReport:
        """What changed from commit ``a`` to commit ``b``, leaf by leaf. See :mod:`ckptstore.diff`."""
        return diff_commits(self, self.resolve(a), self.resolve(b))

    def du(self) -> dict:
        """Space accounting in bytes, for ``ckptstore du``.

        ``logical_bytes``: tensor bytes summed over all commits (what saving
        each commit in full would write); ``unique_bytes``: raw bytes of distinct
        blobs; ``stored_bytes``: bytes of live blobs in packs; ``pack_bytes``:
        pack file sizes on disk (dead blobs included, until GC repacks);
        ``catalog_bytes``; ``dedup_ratio`` = logical / unique;
        ``compression_ratio`` = unique / stored.
        """
        c = self.catalog.rows("SELECT COUNT(*) AS n, COALESCE(SUM(logical_bytes), 0) AS logical FROM commits")[0]
        b = self.catalog.rows(
            "SELECT COUNT(*) AS n, COALESCE(SUM(raw_len), 0) AS raw, COALESCE(SUM(stored_len + ?), 0) AS stored FROM blobs",
            (BLOB_HEADER.size,),
        )[0]
        p = self.catalog.rows("SELECT COUNT(*) AS n, COALESCE(SUM(size), 0) AS size FROM packs")[0]
        catalog = sum(f.stat().st_size for f in self.root.glob(CATALOG + "*") if f.is_file() and not f.name.endswith(".bak"))
        tmp = sum(f.stat().st_size for f in (self.root / "tmp").iterdir() if f.is_file())
        return {
            "commits": c["n"], "tags": len(self.tags()), "blobs": b["n"], "packs": p["n"],
            "logical_bytes": c["logical"], "unique_bytes": b["raw"], "stored_bytes": b["stored"],
            "pack_bytes": p["size"], "catalog_bytes": catalog, "tmp_bytes": tmp,
            "dedup_ratio": c["logical"] / b["raw"] if b["raw"] else None,
            "compression_ratio": b["raw"] / b["stored"] if b["stored"] else None,
        }

    # --- for integrations that write blobs in other processes (ckptstore.dcp) ----------------

    def locate(self, keys: list[tuple[bytes, int]]) -> dict[tuple[bytes, int], BlobLoc]:
        """Where the catalog says each blob (``(XXH3-128 digest, length)`` address) is; absent ones are left out."""
        return self._locate(keys)

    def newest_commit(self, adapter: str) -> str | None:
        """Id of the newest commit holding a component stored by ``adapter``, or ``None``."""
        rows = self.catalog.rows(
            "SELECT c.id FROM commits c JOIN components k ON k.commit_id = c.id WHERE k.adapter = ? ORDER BY c.created_at DESC, c.id LIMIT 1",
            (adapter,),
        )
        return rows[0]["id"] if rows else None

    def prepare_shared_commit(self) -> None:
        """Ready the store for a commit whose blobs other processes write first (the ranks
        of a :mod:`ckptstore.dcp` save, through :func:`pack_writer_at`): create it if
        missing, so that their packs land in a store, and bring the index up to date, so
        that :meth:`leaf_blobs` and the commit's dedup see every blob the store holds.

        Raises:
            StoreWriteError: the store cannot be committed to here (read-only mount,
                permissions, a full disk).
        """
        if not self._open(create=True).writable:
            raise StoreWriteError(f"{self.root} is read-only here (mount, permissions or a full disk): it can be read, not committed to")

    def pack_size(self, pack: str) -> int | None:
        """Bytes of pack ``pack`` (an id) as the store holds it now, or ``None`` if it holds no such pack."""
        try:
            return pack_path(self.root, pack).stat().st_size
        except OSError:
            return None

    def leaf_blobs(self, commits: Sequence[str], paths: Sequence[str]) -> dict[str, dict[tuple[bytes, int], int]]:
        """``{leaf path: {address: blob id}}`` of the shards that leaves ``paths`` of ``commits``
        (commit ids) reference, from the catalog's index. Hints only: a commit that reuses
        these ids passes them as ``prior``, and its transaction rechecks each one."""
        out: dict[str, dict[tuple[bytes, int], int]] = {}
        for cid in dict.fromkeys(commits):
            rows = self.catalog.chunked(
                "SELECT l.path, b.hash, b.raw_len, b.id FROM leaves l JOIN shards s ON s.leaf_id = l.id JOIN blobs b ON b.id = s.blob_id "
                "WHERE l.commit_id = ? AND l.path IN ({})", list(dict.fromkeys(paths)), (cid,), raw=True,
            )
            for path, h, n, i in rows:
                out.setdefault(path, {})[(h, n)] = i
        return out

    # --- maintenance ---------------------------------------------------------------------

    def gc(
        self,
        *,
        keep_last: int = 1,
        keep_tags: Sequence[str] = (),
        keep_within: str | float | None = None,
        grace: str | float | None = None,
        dry_run: bool = False,
        small_pack_bytes: int = SMALL_PACK_BYTES,
    ) -> GCReport:
        """Drop commits outside the roots, then free unreferenced blobs and packs.

        Every tag is kept. Of each tag's lineage the ``keep_last`` newest commits
        are kept (the whole lineage for tags matching a ``keep_tags`` glob), and
        commits younger than ``keep_within`` or than the grace period. Blobs no
        kept commit references are deleted once older than ``grace`` (seconds or
        ``"30m"``, ``"1h"``, ``"7d"``; default 1 hour, 24 hours on object storage),
        safely beside running commits. Packs smaller than ``small_pack_bytes`` (default
        4 MiB, at most half of ``pack_bytes``) and older than ``grace`` are merged into
        large ones, blobs and records alike (0 turns that off). The report's
        ``*_pending`` fields count what waits for the grace period. One protocol on
        both homes: see :func:`ckptstore.gc.collect`.

        Raises:
            GCLockedError: another GC is running on this (local) store.
            InvalidArgumentError: a duration, glob, count or size that does not parse.
            BackendError: object storage failed (what was deleted stays deleted; run again).
        """
        if not dry_run and release_reserve(self.root / CATALOG) and not self.catalog.writable:
            with self._catalog_lock:  # a full disk: with the reserve's room, the catalog opens for writing
                self._catalog.close()
                self._catalog = None
            self._open(create=False)
        try:
            report = collect(self, keep_last=keep_last, keep_tags=keep_tags, keep_within=keep_within, grace=grace, dry_run=dry_run,
                             small_pack_bytes=small_pack_bytes)
        finally:
            if not dry_run and self.catalog.writable:
                keep_reserve(self.root / CATALOG)  # back, from the room the GC freed
        self.forget_hashes()
        return report

    def gc_home(self) -> LocalGC:
        """This home's side of the GC protocol (:func:`ckptstore.gc.collect`)."""
        return LocalGC(self)

    def forget_hashes(self) -> None:
        """Drop the shard hashes and blob ids kept from this store's last commits of live
        objects (``reuse_hashes``): after a GC they may name freed blobs, which an
        asynchronous commit could only write again from live memory that has moved on."""
        self._digest_cache = {}

    def fsck(self, deep: bool = False, sample: float = 1.0, repair: bool = False) -> FsckReport:
        """Check the store; ``deep`` rereads and rehashes blobs. ``sample`` < 1 rereads that
        fraction of them (and implies ``deep``). One protocol and one :class:`FsckReport` on
        both homes (:func:`ckptstore.fsck.run`; a local store: :func:`ckptstore.fsck.check`,
        on object storage :func:`ckptstore.fsck.check_bucket`).

        Raises:
            InvalidArgumentError: ``sample`` outside (0, 1]; ``repair`` on a local store: its
                index is the catalog, rebuilt by :meth:`recover` (``repair`` is for stores on
                object storage, whose pack indexes and marker are objects).
        """
        return run_fsck(self, deep=deep, sample=sample, repair=repair)

    def verify(self, ref: str) -> FsckReport:
        """Reread and rehash every blob of one commit; ``report.ok`` tells."""
        return self.fsck_home().verify(ref)

    def fsck_home(self) -> LocalFsck:
        """This home's side of fsck (:func:`ckptstore.fsck.run`)."""
        return LocalFsck(self)

    @staticmethod
    def recover(path: str | os.PathLike, force: bool = False) -> RecoverReport:
        """Rebuild the catalog of the store at ``path`` from its packs alone.

        ``path`` may be ``s3://bucket/prefix``: the local cache (that store's index) is
        rebuilt from the bucket's objects, every record checked against its id, and damaged
        pack indexes rebuilt from their packs (:func:`ckptstore.recover.recover_bucket`; the same
        report; ``force`` changes nothing there: the cache holds only copies).

        For a store whose ``catalog.sqlite`` was deleted or damaged beyond
        SQLite's repair: every commit whose blobs are present, its lineage, and
        every tag as of its last move come back. Run it while no other process
        uses the store. A healthy catalog is rebuilt only with ``force``. What it
        could not restore is in the report (``report.ok`` false, ``report.lost()``
        names each tag, commit, pack and record and why); such a rebuild replaces
        an existing catalog only with ``force`` (a lost one it replaces always).
        See :mod:`ckptstore.recover`.

        Raises:
            NotAStoreError: no ``blobs/`` folder at ``path``.
            InvalidArgumentError: the catalog is healthy and ``force`` is false.
            IntegrityError: the rebuild lacks something and would replace an existing
                catalog without ``force`` (nothing changed).
            ResourceLimitError: out of file descriptors (nothing changed).
            GCLockedError: a GC is running on the store.
        """
        if _is_url(path):
            from .bucket import recover as recover_bucket

            return recover_bucket(path, force)
        return recover(path, force)

    # --- containers --------------------------------------------------------------------

    def export(self, ref: str, dest: str | os.PathLike) -> Path:
        """Export commit ``ref`` to a ZIP archive (``dest`` ends in ``.zip``) or a folder.

        See :func:`ckptstore.container.export_commit`.
        """
        from .container import export_commit

        return export_commit(self, ref, dest)

    def import_from(self, src: str | os.PathLike, tag: str | None = None) -> CommitInfo:
        """Import an export (ZIP archive or folder) as a new commit; moves ``tag``.

        Every entry is validated before anything is written; see
        :func:`ckptstore.container.import_commit`. Raises ContainerError.
        """
        from .container import import_commit

        return import_commit(self, src, tag)

    def import_torchrl(self, src: str | os.PathLike, tag: str | None = None):
        """Import a TorchRL ``ReplayBuffer.dumps`` folder or a ``torchrl.checkpoint``
        folder or ZIP as one commit, never unpickling anything.

        Returns ``(CommitInfo, ImportReport)``; see :mod:`ckptstore.torchrl_import`.
        Raises ContainerError naming the file that is malformed or holds pickled state.
        """
        from .torchrl_import import import_torchrl

        return import_torchrl(self, src, tag=tag)

    # --- checkout ----------------------------------------------------------------------

    def record(self, ref: str) -> records.CommitRecord:
        """The commit record of ``ref`` (see :mod:`ckptstore.records`), checked against its id.

        Checkout, export, diff and verify read a commit's manifest only from
        here, so a catalog row edited or rotted after the commit is detected
        (IntegrityError naming the commit), never returned.

        Raises:
            RefNotFoundError / AmbiguousRefError: bad ref.
            IntegrityError: the record is missing, damaged or malformed.
        """
        cid = self.resolve(ref)
        cached = self._records.get(cid)
        if cached is None:
            rows = self.catalog.rows("SELECT record FROM commits WHERE id = ?", (cid,))
            cached = records.parse_commit(rows[0]["record"] if rows else None, cid)
            if len(self._records) > 8:
                self._records.clear()
            self._records[cid] = cached
        return cached

    def components(self, ref: str) -> dict[str, dict]:
        """``{component path: {"adapter", "version", "meta"}}`` of a commit."""
        return self.record(ref).components

    def manifest(self, ref: str, prefixes: list[str] | None = None) -> list[LeafRecord]:
        """Leaf records of a commit (under path ``prefixes`` if given), each tensor
        leaf's ``shards`` located in the packs.

        Raises:
            IntegrityError: the record is damaged (see :meth:`record`).
            BlobMissingError: a shard's blob is not in the catalog.
        """
        rec = self.record(ref)
        leaves = [
            LeafRecord(r.path, r.component, r.kind, r.dtype, r.shape, r.nbytes, r.shard_bytes, r.value, r.stride, keys=r.keys)
            for r in rec.leaves
            if prefixes is None or any(under(r.path, p) for p in prefixes)
        ]
        found = self._locate([k for r in leaves for k in r.keys])
        for r in leaves:
            for i, key in enumerate(r.keys):
                loc = found.get(key)
                if loc is None:
                    raise BlobMissingError(f"commit {rec.id}, leaf {r.path}: shard {i} (blob {address(*key)}) is not in the catalog")
                r.shards.append(loc)
        return leaves

    def pack_writer(self) -> PackWriter:
        """A writer of new packs for one commit (:class:`ckptstore.packs.PackWriter`'s interface)."""
        return PackWriter(self.root, self.compression_level, self.pack_bytes)

    def pack_reader(self, sparse: bool = False) -> PackReader:
        """A reader of this store's packs (:class:`ckptstore.packs.PackReader`'s interface);
        ``sparse``: a few blobs will be read, no readahead."""
        return PackReader(self.root, sparse, locate=self.relocate)

    def _locate(self, keys: list[tuple[bytes, int]]) -> dict[tuple[bytes, int], BlobLoc]:
        """Where the catalog says each blob is."""
        wanted = set(keys)
        rows = self.catalog.chunked(
            "SELECT hash, raw_len, pack, offset, stored_len, codec FROM blobs WHERE hash IN ({})", list({d for d, _ in wanted}), raw=True
        )
        return {(h, n): BlobLoc(h, n, p, o, sl, c) for h, n, p, o, sl, c in rows if (h, n) in wanted}

    def relocate(self, loc: BlobLoc) -> BlobLoc | None:
        """The current location of the blob at ``loc`` (a GC may have repacked it), or ``None``."""
        return self._locate([(loc.digest, loc.raw_len)]).get((loc.digest, loc.raw_len))

    def checkout(
        self, ref: str, partial: Iterable[str] | str | None = None, into: Any = None, verify: bool = True, map_location: Any = None
    ) -> Any:
        """Read a commit back, whole or in part.

        Args:
            ref: a tag, a full commit id or a unique id prefix.
            partial: path prefixes (``"sampler"``, ``"rb/storage/data/obs"``),
                or tuples of keys (``("td", "x/y")``); only their leaves' blobs are
                read. A path joins keys with ``/``; a key holding ``/`` or ``%`` is
                written escaped (``"td/x%2Fy"``, :func:`ckptstore.layout.keypath`).
            into: an object, or a dict of objects, to load in place (a replay
                buffer, module, optimizer, RNGState, TensorDict...). Only the
                components under its structure are read.
            verify: rehash every blob read (on by default).
            map_location: without ``into``, the device (``"cpu"``, ``"cuda:1"``,
                a ``torch.device``) the returned tensors and TensorDicts go to, as
                ``torch.load``'s: a commit made from CUDA tensors checks out on a
                machine without CUDA. With ``into``, tensors go where the target's are.

        Returns:
            Without ``into``: a TensorDict (batch size ``[]``) of the selected
            leaves at their paths; tensors as tensors, JSON values as non-tensor
            data (a commit of a single bare value returns that value). With
            ``into``: ``into`` itself (or its replacement, for an immutable value).

        Raises:
            RefNotFoundError / AmbiguousRefError: bad ref.
            PartialPathError: a prefix that matches nothing (lists the components).
            TargetMismatchError: ``into`` does not fit (capacity, layout, shape,
                class); raised before ``into`` is modified.
            IntegrityError: a missing or corrupt blob (names leaf, blob, commit).
            AdapterVersionError: state written by a newer adapter version.
        """
        from .checkout import checkout_ref  # torch loads on first checkout

        with paused_gc():
            return checkout_ref(self, ref, partial, into, verify, map_location)


#: Validate a tag name (returns it); raises InvalidNameError. Public for integrations that
#: take tags before they commit (``ckptstore.dcp.StoreWriter``).


def pack_writer_at(location: str | os.PathLike, compression_level: int, pack_bytes: int):
    """A writer of new packs into the store at ``location`` (a folder, or ``s3://bucket/prefix``)
    that opens neither the catalog nor a cache: for a process that writes blobs of a commit
    another process makes (a rank of a :mod:`ckptstore.dcp` save). Packs roll over past
    ``pack_bytes`` bytes; ``compression_level`` is zstandard's (0: none). On a folder the
    writer holds its packs' locks until closed (GC leaves them alone meanwhile); on object
    storage it has its own client and upload threads, released by ``close()``, and each
    pack goes up whole (create-only PUT), then its ``.idx``, by ``finish()``.

    Raises:
        NotAStoreError / BackendError: a missing bucket, an unreachable server (``s3://``).
        InvalidArgumentError: an unsupported URL scheme.
    """
    if _is_url(location):
        from .bucket import DetachedPackWriter

        return DetachedPackWriter(location, compression_level, pack_bytes)
    return PackWriter(Path(location), compression_level, pack_bytes)


__all__ = ["CkptStoreError", "CommitInfo", "IOStats", "Store", "check_tag", "pack_writer_at"]
