"""The store: the facade of a home, its refs, queries and maintenance entry points.

A local store is one folder::

    catalog.sqlite   the catalog (commits, manifests, lineage, tags, reflog, blobs)
    blobs/           pack files of content-addressed blobs, fanned out by id prefix
    tmp/             files being written

On object storage the same class runs on another home (:mod:`ckptstore.bucket`). What
differs between homes (objects, refs, the index and its queries) is the home's
(:attr:`Store.home`, :mod:`ckptstore.home`); what is the same is here (opening the catalog,
settings, ``resolve``, tags and reflog through the refs, records and manifests) or in the
protocol modules: commit :mod:`ckptstore.commit` (its index step is the home's: one
``BEGIN IMMEDIATE`` catalog transaction locally), checkout :mod:`ckptstore.checkout`, GC
:mod:`ckptstore.gc`, fsck :mod:`ckptstore.fsck`. A crash before the index step commits
leaves only orphan pack files, which GC removes.
"""

from __future__ import annotations

import os
import shutil
import re
import threading
import time
import uuid
import weakref
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import jsonvalue, records
from .catalog import Catalog, CatalogMissing, keep_reserve, release_reserve
from .diff import DiffReport, diff_commits
from .errors import (
    BlobMissingError,
    CatalogCorruptError,
    CkptStoreError,
    InvalidArgumentError,
    NotAStoreError,
    RefNotFoundError,
    StoreWriteError,
)
from .commit import CommitEngine, CommitInfo, paused_gc
from .fsck import FsckReport, LocalFsck
from .fsck import run as run_fsck
from .gc import SMALL_PACK_BYTES, GCReport, GCSide, collect
from .layout import DEFAULT_SHARD_BYTES, address, under
from .packs import BlobLoc, PackReader, PackWriter
from .records import LeafRecord, check_tag
from .recover import RecoverReport, recover
from .home import CATALOG, Home, LocalHome
from .refs import Refs
from .threads import Pool

if TYPE_CHECKING:  # torch, TensorDict and the adapters load on first commit or checkout: catalog-only use never imports torch
    import torch

    from .adapters import Registry
    from .backends import Backend
    from .transfer import TransferReport

_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]+:/")  # a URL scheme (s3:/ once a path mangled s3://), not a folder
_STORE_NAMES = re.compile(r"^(catalog\.sqlite(-wal|-shm|-journal|-reserve|\.v\d+\.bak)?|blobs|tmp|gc\.lock|leases)$")  # leases: ckptstore.run


@dataclass
class IOStats:
    """Cumulative read counters of a :class:`Store` (blobs and bytes read from packs)."""

    blobs_read: int = 0
    bytes_read: int = 0


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


def _as_backend(remote: Any) -> Backend | None:
    """``remote`` as a backend when it is object storage (an ``s3://`` URL or a Backend), else ``None``."""
    from .backends import Backend, open_backend

    if isinstance(remote, Backend):
        return remote
    if isinstance(remote, str) and remote.startswith("s3://"):
        return open_backend(remote)
    return None


class Store(CommitEngine):
    """A content-addressed, versioned checkpoint store in one folder, or on object storage.

    Args:
        path: the store folder; ``"s3://bucket/prefix"`` opens a store on object storage
            instead (the same class, on a :class:`ckptstore.bucket.BucketHome`: same API, see
            its docstring for the differences).
        create: ``None`` (default): open the store if it exists; if it does not,
            reading raises NotAStoreError and the first commit (or tag move)
            creates it, so a mistyped path never turns into an empty store.
            ``True``: create it now if missing. ``False``: it must exist now
            (NotAStoreError otherwise).
        shard_bytes: target shard size in bytes for new commits (default 256 KiB);
            saved in the catalog when the store is created, overridden per
            session when given.
        compression_level: zstandard level for compressible shards (0 disables).
        pack_bytes: pack files roll over past this size in bytes (default: the home's,
            256 MiB in a folder, 64 MiB on object storage).
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
        cache: (``s3://`` only) the folder of the local index (default
            :func:`ckptstore.bucket.cache_folder`).
        backend: (``s3://`` only) the :class:`~ckptstore.backends.Backend` to use instead of
            one opened from ``path`` (the store closes it).

    The store is a facade over its **home** (:attr:`home`, :mod:`ckptstore.home`): its
    objects, refs and index; the protocols (:mod:`ckptstore.commit`, :mod:`ckptstore.checkout`,
    :mod:`ckptstore.gc`, :mod:`ckptstore.fsck`, :mod:`ckptstore.recover`,
    :mod:`ckptstore.transfer`, :mod:`ckptstore.remote`, :mod:`ckptstore.diff`) run against it
    the same way in both homes.

    Raises:
        InvalidArgumentError: ``cache`` or ``backend`` for a folder; a setting out of range.
        NotAStoreError: the folder holds other files and no catalog.
        CatalogCorruptError: the catalog is not a ckptstore SQLite catalog.
        SchemaVersionError: the catalog is newer than this library.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        create: bool | None = None,
        shard_bytes: int | None = None,
        compression_level: int | None = None,
        pack_bytes: int | None = None,
        workers: int | None = None,
        registry: Registry | None = None,
        reuse_hashes: bool = True,
        cache: str | os.PathLike | None = None,
        backend: Backend | None = None,
    ):
        if _is_url(path):
            from .bucket import BucketHome  # a store on object storage

            home: Home = BucketHome(self, path, create, cache, backend)
        elif cache is not None or backend is not None:
            raise InvalidArgumentError("cache and backend are for a store on object storage (s3://bucket/prefix), not a folder")
        else:
            home = LocalHome(self, Path(path))
        #: The home (:mod:`ckptstore.home`): the store's objects, refs and index.
        self.home = home
        try:
            self._setup(create, shard_bytes, compression_level, pack_bytes, workers, registry, reuse_hashes)
        except BaseException:
            home.close()
            raise

    def _setup(self, create, shard_bytes, compression_level, pack_bytes, workers, registry, reuse_hashes) -> None:
        home = self.home
        self.root = home.root
        shard_bytes, compression_level = home.settings(shard_bytes, compression_level)
        shard_bytes = _setting("shard_bytes", shard_bytes, 1, 1 << 34)
        compression_level = _setting("compression_level", compression_level, 0, 22)
        self._asked = (shard_bytes, compression_level)
        self.shard_bytes = DEFAULT_SHARD_BYTES if shard_bytes is None else shard_bytes
        self.compression_level = 3 if compression_level is None else compression_level
        self.pack_bytes = home.pack_bytes if pack_bytes is None else pack_bytes
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
        self.refs: Refs = home.make_refs()
        try:
            opened = self._open(create=home.create_index(create))
        except CatalogCorruptError:
            if not home.disposable_index:
                raise
            home.discard_index()  # it held only copies: moved aside, a new one is built
            opened = self._open(create=True)
        if opened is None and create is False:
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
        self.home.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Store({self.location!r})"

    @property
    def location(self) -> str:
        """Where the store lives, as ``Store(location)`` opens it: its folder, or (a store
        on object storage) its ``s3://bucket/prefix`` URL."""
        return self.home.location

    @property
    def backend(self) -> Backend:
        """The object storage a store on ``s3://`` lives on (:mod:`ckptstore.backends`).

        Raises:
            AttributeError: a store in a folder (its objects are files, not a backend).
        """
        return self.home.backend

    def refresh_index(self, only: list[str] | None = None) -> int:
        """Bring the index up to date with the objects before a lookup that must see every
        blob the store holds; returns the packs read (:meth:`ckptstore.home.Home.refresh_index`:
        0 locally, where every commit updates the catalog; on object storage the cache reads
        the pack indexes it has not seen)."""
        return self.home.refresh_index(only)

    # --- commit ----------------------------------------------------------------------

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
        return self.home.held(cid) if cid is not None else self.home.find_commit(ref)

    def tags(self) -> dict[str, str]:
        """``{tag name: commit id}``, sorted by name (on object storage: the refs as on the
        bucket now, never the commits they name)."""
        return self.refs.list()

    def tagged(self) -> dict[str, CommitInfo]:
        """``{tag name: CommitInfo of the commit it names}``, sorted by name, read in one
        snapshot (a concurrent GC cannot drop a tagged commit in between). On object storage
        a tag whose commit record is missing or damaged is listed all the same, its info
        saying so (``created_at`` 0, no parents, zero counts)."""
        return self.home.tagged()

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
        return self.home.has_commit(cid)

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
        return self.home.info(ref)

    def infos(self, ids: list[str]) -> dict[str, CommitInfo]:
        """``{commit id: CommitInfo}`` of the full commit ids ``ids`` the store holds (others are
        left out; on object storage the records the cache lacks are copied from the bucket first).

        Raises:
            BackendError: the storage failed.
        """
        return self.home.infos(ids)

    def log(self, ref: str | None = None, limit: int | None = None) -> list[CommitInfo]:
        """Lineage of ``ref`` (itself and all its ancestors), newest first.

        Without ``ref``, every commit in the store, newest first. ``limit``
        (>= 1) keeps the newest ones. Raises InvalidArgumentError for a bad limit.
        """
        return self.home.log(ref, limit)

    # --- inspection --------------------------------------------------------------------

    def show(self, ref: str) -> dict:
        """What one commit holds, for ``ckptstore show``.

        Returns ``{"commit": CommitInfo, "components": {path: {...}}, "leaves": [...]}``
        where each leaf has ``path``, ``component``, ``kind``, ``dtype``, ``shape``,
        ``logical_bytes``, ``stored_bytes`` (its blobs in packs, headers included),
        ``shards`` and ``shared_with_parent`` (shards whose blob the first parent
        also references).
        """
        return self.home.show(ref)

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
        return self.home.du()

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
        self.home.prepare_shared_commit()

    def pack_size(self, pack: str) -> int | None:
        """Bytes of pack ``pack`` (an id) as the store holds it now, or ``None`` if it holds no such pack."""
        return self.home.pack_size(pack)

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

    def gc_home(self) -> GCSide:
        """This home's primitives of the GC protocol (:class:`ckptstore.gc.GCSide`, used by :func:`ckptstore.gc.collect`)."""
        return self.home.gc_home()

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
        return self.home.fsck_home()

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
        if not _is_url(path):
            return recover(path, force)
        from .bucket import cache_folder  # object storage: the cache holds only copies, so force changes nothing
        from .recover import recover_bucket

        scratch = cache_folder(path)
        probe = Store(path, create=False, cache=scratch.with_name(f"{scratch.name}.recover-{uuid.uuid4().hex[:8]}"))
        try:  # rebuilt on a scratch cache, then installed in place of the cache (recover_bucket)
            return recover_bucket(probe, cache_folder(probe.location))
        finally:
            probe.close()
            shutil.rmtree(probe.root, ignore_errors=True)

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
        return self.home.pack_writer()

    def pack_reader(self, sparse: bool = False) -> PackReader:
        """A reader of this store's packs (:class:`ckptstore.packs.PackReader`'s interface);
        ``sparse``: a few blobs will be read, no readahead."""
        return self.home.pack_reader(sparse)

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
            return checkout_ref(self, self.home.checkout_target(ref), partial, into, verify, map_location)


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
