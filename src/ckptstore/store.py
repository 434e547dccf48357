"""The store: the facade that builds a home from a path or URL and delegates.

The home (:attr:`Store.home`: :class:`ckptstore.home.local.LocalHome` in a folder,
:class:`ckptstore.home.bucket.BucketHome` on object storage) owns what differs between homes and
what is the index's: the objects, the refs, the catalog connection, the settings and the
queries (``resolve``, ``tags``, ``log``, ``record``, ``manifest``, ``locate``...: see
:class:`ckptstore.home.base.Home`). What is written once above the homes is in the protocol
modules: :mod:`ckptstore.protocols.commit` (its index step is the home's: one ``BEGIN IMMEDIATE``
catalog transaction locally), :mod:`ckptstore.protocols.checkout`, :mod:`ckptstore.protocols.diff`,
:mod:`ckptstore.protocols.gc`, :mod:`ckptstore.protocols.fsck`, :mod:`ckptstore.protocols.recover`,
:mod:`ckptstore.protocols.transfer`, :mod:`ckptstore.protocols.remote`. This module only builds the home and
hands each call to the one that answers it. A crash before the index step commits leaves
only orphan pack files, which GC removes.
"""

from __future__ import annotations

import functools
import os
import uuid
import weakref
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .backends import as_backend, is_url
from .core.collector import paused_gc
from .core.errors import CkptStoreError, ForkedStoreError, InvalidArgumentError
from .core.threads import fail_inherited
from .home.base import Home
from .home.catalog import Catalog
from .home.local import LocalHome
from .objects.packs import IOStats, PackWriter
from .objects.records import check_tag  # validates a tag name: public here for integrations that take tags before they commit
from .protocols.commit import CommitInfo, Committer
from .protocols.diff import DiffReport, diff_commits
from .protocols.fsck import FsckReport
from .protocols.fsck import run as run_fsck
from .protocols.fsck import verify as verify_commit
from .protocols.gc import SMALL_PACK_BYTES, GCReport, collect
from .protocols.recover import RecoverReport, recover, recover_bucket

if TYPE_CHECKING:  # the adapters (and torch) load on first commit or checkout: catalog-only use never imports torch
    from concurrent.futures import Future

    from .adapters import Registry
    from .backends import Backend
    from .protocols.transfer import TransferReport


def _home(name: str):
    """A method of :class:`Store` that is the home's method ``name`` (its signature and docstring)."""
    wrapped = getattr(Home, name)

    @functools.wraps(wrapped)
    def call(self, *args, **kwargs):
        return getattr(self.home, name)(*args, **kwargs)

    return call


class Store:
    """A content-addressed, versioned checkpoint store in one folder, or on object storage.

    Args:
        path: the store folder; ``"s3://bucket/prefix"`` opens a store on object storage
            instead (the same class, on a :class:`ckptstore.home.bucket.BucketHome`: same API, see
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
        reuse_hashes: skip rehashing a tensor that this store committed before when its
            fingerprint says it did not change, once a random sample of its shards (1 %, at
            least one) rehashes the same; which fingerprints, which writes they miss and how
            the sample catches them: :mod:`ckptstore.protocols.digests`. Shared and file-backed memory
            and CUDA tensors are always hashed. ``False`` always hashes everything.
        cache: (``s3://`` only) the folder of the local index (default
            :func:`ckptstore.home.bucket_cache.cache_folder`).
        backend: (``s3://`` only) the :class:`~ckptstore.backends.Backend` to use instead of
            one opened from ``path`` (the store closes it).

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
        if is_url(path):
            from .home.bucket import BucketHome  # a store on object storage

            home: Home = BucketHome(path, create, cache, backend, shard_bytes, compression_level, pack_bytes)
        elif cache is not None or backend is not None:
            raise InvalidArgumentError("cache and backend are for a store on object storage (s3://bucket/prefix), not a folder")
        else:
            home = LocalHome(Path(path), shard_bytes, compression_level, pack_bytes)
        #: The home (:mod:`ckptstore.home.base`): the store's objects, refs, index, settings and queries.
        self.home = home
        #: The folder of the catalog (locally the store's folder; on object storage its cache).
        self.root = home.root
        _STORES.add(self)  # (refused in a forked child: _after_fork_in_child)
        try:
            home.open(create)
            self._committer = Committer(self, workers, registry, reuse_hashes)  # (ckptstore.protocols.commit: the commits' threads and digest cache)
            self.io = IOStats()
        except BaseException:
            home.close()
            raise

    # --- commits (ckptstore.protocols.commit) ---------------------------------------------------------
    # The commit engine is an object the store owns: each line hands the call to it.

    def commit(self, obj: Any, tag: str | Sequence[str] | None = None, message: str = "", metadata: dict | None = None,
               parents: Sequence[str] | None = None) -> CommitInfo:
        """Commit ``obj`` and move ``tag`` to the new commit (:meth:`ckptstore.protocols.commit.Committer.commit`: arguments, result, errors)."""
        return self._committer.commit(obj, tag, message, metadata, parents)

    def commit_async(self, obj: Any, tag: str | Sequence[str] | None = None, message: str = "", metadata: dict | None = None,
                     parents: Sequence[str] | None = None) -> Future:
        """Snapshot ``obj`` now, commit it in the background (:meth:`ckptstore.protocols.commit.Committer.commit_async`)."""
        return self._committer.commit_async(obj, tag, message, metadata, parents)

    def commit_components(self, components: list, tag: str | Sequence[str] | None = None, message: str = "", metadata: dict | None = None,
                          parents: Sequence[str] | None = None, *, t0: float | None = None, reuse_checked: bool = False,
                          share: bool = True) -> CommitInfo:
        """Commit components already captured (:meth:`ckptstore.protocols.commit.Committer.commit_components`)."""
        return self._committer.commit_components(components, tag, message, metadata, parents, t0=t0, reuse_checked=reuse_checked,
                                                 share=share)

    def commit_manifest(self, components, leaves, keys, write, tags, message, metadata, explicit_parents, t0, prior=None, origin=None,
                        written=None, paths_checked=False, prior_complete=False, retake=None):
        """Steps 3 and 4 of a commit for a manifest already built (:meth:`ckptstore.protocols.commit.Committer.commit_manifest`)."""
        return self._committer.commit_manifest(components, leaves, keys, write, tags, message, metadata, explicit_parents, t0, prior,
                                               origin, written, paths_checked, prior_complete, retake)

    def prepare_shared_commit(self) -> None:
        """Ready the store for a commit whose blobs other processes write (:meth:`ckptstore.protocols.commit.Committer.prepare_shared_commit`)."""
        self._committer.prepare_shared_commit()

    @property
    def registry(self) -> Registry:
        """The adapter registry (imports the adapters, and torch, on first use)."""
        return self._committer.registry

    @property
    def workers(self) -> int:
        """Threads for hashing, compression and I/O."""
        return self._committer.workers

    @property
    def reuse_hashes(self) -> bool:
        """Whether unchanged tensors skip rehashing (``Store(reuse_hashes=)``)."""
        return self._committer.reuse_hashes

    @property
    def _digests(self):  # the digest cache (ckptstore.protocols.digests), the committer's
        return self._committer.digests

    def _map(self, fn, items: list) -> list:  # [fn(x) for x in items] on the store's threads (a checkout's reads)
        return self._committer.map(fn, items)

    def _lookup(self, keys: list[tuple[bytes, int]]) -> dict[tuple[bytes, int], int]:  # dedup's lookup (tests patch it here)
        return self.home.lookup(keys)

    def _stop(self) -> None:  # close(): wait for asynchronous commits, release the threads
        self._committer.stop()

    # --- what the home owns: the index, the refs, the settings -----------------------------

    catalog = property(lambda self: self.home.catalog, doc="The catalog connection (:attr:`ckptstore.home.base.Home.catalog`), opened on "
                       "first use. Raises NotAStoreError: the store does not exist (yet: see ``create``).")
    refs = property(lambda self: self.home.refs, doc="The home's refs (:mod:`ckptstore.home.refs`): every tag read and move goes through them.")
    shard_bytes = property(lambda self: self.home.shard_bytes, doc="Target shard size in bytes of new commits.")
    compression_level = property(lambda self: self.home.compression_level, doc="zstandard level of new blobs (0: none).")
    pack_bytes = property(lambda self: self.home.pack_bytes, doc="Packs roll over past this size in bytes.")
    _records = property(lambda self: self.home._records)  # (verified commit records by id: tests clear it)

    def _open(self, create: bool) -> Catalog | None:
        """The catalog, opened if it is not (:meth:`ckptstore.home.base.Home.open_catalog`)."""
        return self.home.open_catalog(create)

    # --- queries: the home's (:class:`ckptstore.home.base.Home`) --------------------------------

    resolve = _home("resolve")
    tags = _home("tags")
    tagged = _home("tagged")
    tag = _home("tag")
    delete_tag = _home("delete_tag")
    reflog = _home("reflog")
    has_commit = _home("has_commit")
    has_cached = _home("has_cached")
    info = _home("info")
    infos = _home("infos")
    log = _home("log")
    show = _home("show")
    du = _home("du")
    record = _home("record")
    components = _home("components")
    manifest = _home("manifest")
    locate = _home("locate")
    relocate = _home("relocate")
    newest_commit = _home("newest_commit")
    pack_size = _home("pack_size")
    leaf_blobs = _home("leaf_blobs")
    pack_writer = _home("pack_writer")
    pack_reader = _home("pack_reader")
    refresh_index = _home("refresh_index")

    def diff(self, a: str, b: str) -> DiffReport:
        """What changed from commit ``a`` to commit ``b``, leaf by leaf. See :mod:`ckptstore.protocols.diff`."""
        return diff_commits(self, self.resolve(a), self.resolve(b))

    # --- lifecycle -------------------------------------------------------------------

    def close(self) -> None:
        """Wait for asynchronous commits, then release the threads, the catalog connection and the home."""
        self._stop()
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

    # --- transfers ---------------------------------------------------------------------

    def push(self, remote: Store | Backend | str | os.PathLike, ref: str, force: bool = False) -> TransferReport:
        """Copy ``ref`` and the ancestors ``remote`` lacks into ``remote``, keeping commit
        ids; then move the remote tag (when ``ref`` is a tag) if it is a fast-forward.

        ``remote`` is another store (a :class:`Store` or a folder, created if missing:
        :mod:`ckptstore.protocols.transfer`) or object storage (``"s3://bucket/prefix"`` or a
        :class:`~ckptstore.backends.Backend`; an empty prefix becomes a store:
        :mod:`ckptstore.protocols.remote`). Nothing is written when nothing is missing.

        Raises:
            RefConflictError: the remote tag names a commit that is not an ancestor of
                ``ref``'s (naming both; ``force=True`` overrides) or moved meanwhile.
            NotAStoreError: a missing bucket.
            BackendError: object storage failed after retries (the remote tag did not move).
            RefNotFoundError / AmbiguousRefError / IntegrityError / StoreWriteError.
        """
        return self._transfer(remote, ref, force, push=True)

    def pull(self, remote: Store | Backend | str | os.PathLike, ref: str, force: bool = False) -> TransferReport:
        """The reverse of :meth:`push`: copy ``ref`` of ``remote`` into this store (created if
        missing). ``s3://`` remotes: NotAStoreError for a missing bucket or a prefix without
        ``ckptstore.json``; IntegrityError naming any remote record, index or blob that does
        not verify (the local tag then does not move)."""
        return self._transfer(remote, ref, force, push=False)

    def _transfer(self, remote: Store | Backend | str | os.PathLike, ref: str, force: bool, push: bool) -> TransferReport:
        """:meth:`push` (``push``) or :meth:`pull`: :mod:`ckptstore.protocols.remote` or :mod:`ckptstore.protocols.transfer`."""
        backend = as_backend(remote)
        if backend is not None:
            from .protocols import remote as objects

            try:
                return (objects.push if push else objects.pull)(self, backend, ref, force)
            finally:
                if backend is not remote:
                    backend.close()
        from .protocols.transfer import transfer

        other = remote if isinstance(remote, Store) else Store(remote, create=push)
        try:
            if push:
                return transfer(self, other, ref, force)
            self._open(create=True)
            return transfer(other, self, ref, force)
        finally:
            if other is not remote:
                other.close()

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
        are kept (at least 1: the tagged commit counts; the whole lineage for tags
        matching a ``keep_tags`` glob), and
        commits younger than ``keep_within`` or than the grace period. Blobs no
        kept commit references are deleted once older than ``grace`` (seconds or
        ``"30m"``, ``"1h"``, ``"7d"``; default 1 hour, 24 hours on object storage),
        safely beside running commits. Packs smaller than ``small_pack_bytes`` (default
        4 MiB, at most half of ``pack_bytes``) and older than ``grace`` are merged into
        large ones, blobs and records alike (0 turns that off). The report's
        ``*_pending`` fields count what waits for the grace period. One protocol on
        both homes: see :func:`ckptstore.protocols.gc.collect`.

        Raises:
            GCLockedError: another GC is running on this (local) store.
            InvalidArgumentError: a duration, glob, count or size that does not parse
                (``keep_last`` below 1 among them).
            BackendError: object storage failed (what was deleted stays deleted; run again).
        """
        if not dry_run:
            self.home.spend_reserve()  # a full disk: with the reserve's room, the catalog opens for writing
        try:
            report = collect(self, keep_last=keep_last, keep_tags=keep_tags, keep_within=keep_within, grace=grace, dry_run=dry_run,
                             small_pack_bytes=small_pack_bytes)
        finally:
            if not dry_run:
                self.home.keep_reserve()  # back, from the room the GC freed
        self.forget_hashes()
        return report

    def forget_hashes(self) -> None:
        """Drop the shard hashes and blob ids kept from this store's last commits of live
        objects (``reuse_hashes``): after a GC they may name freed blobs, which an
        asynchronous commit could only write again from live memory that has moved on."""
        self._digests.clear()

    def fsck(self, deep: bool = False, sample: float = 1.0, repair: bool = False) -> FsckReport:
        """Check the store; ``deep`` rereads and rehashes blobs. ``sample`` < 1 rereads that
        fraction of them (and implies ``deep``). One protocol and one :class:`FsckReport` on
        both homes (:func:`ckptstore.protocols.fsck.run`, over the home's ``fsck_*`` primitives).
        Blobs found missing or damaged are marked bad in the index (never reused by dedup;
        ``report.marked_bad``). ``repair`` (implies ``deep``) points each bad blob's row at a
        good copy found in a pack (``report.replaced_blobs``) and, on object storage,
        rebuilds damaged pack indexes and the marker.

        Raises:
            InvalidArgumentError: ``sample`` outside (0, 1].
            StoreWriteError: ``repair`` on a store that cannot be written here.
        """
        return run_fsck(self, deep=deep, sample=sample, repair=repair)

    def verify(self, ref: str) -> FsckReport:
        """Reread and rehash every blob of one commit; ``report.ok`` tells (:func:`ckptstore.protocols.fsck.verify`)."""
        return verify_commit(self, ref)

    @staticmethod
    def recover(path: str | os.PathLike, force: bool = False) -> RecoverReport:
        """Rebuild the catalog of the store at ``path`` from its packs alone: every commit whose
        blobs are present, its lineage, and every tag as of its last move come back
        (:func:`ckptstore.protocols.recover.recover`: what is lost, what ``force`` replaces). Run it
        while no other process uses the store. What it could not restore is in the report
        (``report.ok`` false, ``report.lost()``). ``path`` may be ``s3://bucket/prefix``: the
        local cache is rebuilt from the bucket's objects (:func:`ckptstore.protocols.recover.recover_bucket`;
        the same report; ``force`` changes nothing there: the cache holds only copies).

        Raises:
            NotAStoreError: no ``blobs/`` folder at ``path``.
            InvalidArgumentError: the catalog is healthy and ``force`` is false.
            IntegrityError: the rebuild lacks something and would replace an existing
                catalog without ``force`` (nothing changed).
            ResourceLimitError: out of file descriptors (nothing changed).
            GCLockedError: a GC is running on the store.
        """
        if not is_url(path):
            return recover(path, force)
        from .home.bucket_cache import cache_folder  # object storage: the cache holds only copies, so force changes nothing

        scratch = cache_folder(path)  # rebuilt on a scratch cache, then installed in place of the cache
        probe = Store(path, create=False, cache=scratch.with_name(f"{scratch.name}.recover-{uuid.uuid4().hex[:8]}"))
        return recover_bucket(probe, cache_folder(probe.location))

    # --- containers --------------------------------------------------------------------

    def export(self, ref: str, dest: str | os.PathLike) -> Path:
        """Export commit ``ref`` to a ZIP archive (``dest`` ends in ``.zip``) or a folder
        (:func:`ckptstore.protocols.archive.export_commit`)."""
        from .protocols.archive import export_commit

        return export_commit(self, ref, dest)

    def import_from(self, src: str | os.PathLike, tag: str | None = None) -> CommitInfo:
        """Import an export (ZIP archive or folder) as a new commit; moves ``tag``. Every entry
        is validated before anything is written (:func:`ckptstore.protocols.archive.import_commit`).
        Raises ContainerError."""
        from .protocols.archive import import_commit

        return import_commit(self, src, tag)

    def import_torchrl(self, src: str | os.PathLike, tag: str | None = None):
        """Import a TorchRL ``ReplayBuffer.dumps`` folder or a ``torchrl.checkpoint`` folder or
        ZIP as one commit, never unpickling anything; returns ``(CommitInfo, ImportReport)``
        (:mod:`ckptstore.protocols.torchrl_import`). Raises ContainerError naming the file that is
        malformed or holds pickled state."""
        from .protocols.torchrl_import import import_torchrl

        return import_torchrl(self, src, tag=tag)

    # --- objects and checkout ----------------------------------------------------------

    def checkout(
        self, ref: str, partial: Iterable[str] | str | None = None, into: Any = None, verify: bool = True, map_location: Any = None
    ) -> Any:
        """Read a commit back, whole or in part.

        Args:
            ref: a tag, a full commit id or a unique id prefix.
            partial: path prefixes (``"sampler"``, ``"rb/storage/data/obs"``),
                or tuples of keys (``("td", "x/y")``); only their leaves' blobs are
                read. A path joins keys with ``/``; a key holding ``/`` or ``%`` is
                written escaped (``"td/x%2Fy"``, :func:`ckptstore.core.layout.keypath`).
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
        from .protocols.checkout import checkout_ref  # torch loads on first checkout

        with paused_gc():
            return checkout_ref(self, self.home.checkout_target(ref), partial, into, verify, map_location)


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
    if is_url(location):
        from .home.bucket_io import DetachedPackWriter

        return DetachedPackWriter(location, compression_level, pack_bytes)
    return PackWriter(Path(location), compression_level, pack_bytes)


# --- fork ---------------------------------------------------------------------------------
# A Store does not cross fork(): its catalog connection (closed or set aside in the child by
# ckptstore.home.catalog), its threads (not in the child), its object storage client (whose
# connections the parent shares) and its leases are the parent's. In a forked child every
# Store opened by the parent refuses at once with ForkedStoreError, except close() (which
# then releases nothing: it is the parent's) and location; the child opens its own Store.
# What they held stays referenced for the child's life, so that nothing of the parent's is
# closed by the child's garbage collection.

_STORES: weakref.WeakSet[Store] = weakref.WeakSet()  # every Store of this process
_INHERITED: list[dict] = []  # (forked child) the state of the parent's stores: kept, never closed here
_FORKED_ALLOWED = frozenset({"close", "location", "root"})
_forked_classes: dict[type, type] = {}


class _ForkedStore:
    """Mixed into the class of a parent's Store in a forked child (see above)."""

    def __getattribute__(self, name: str) -> Any:
        if name[:1] == "_" or name in _FORKED_ALLOWED:
            return object.__getattribute__(self, name)
        raise ForkedStoreError(object.__getattribute__(self, "_forked_message"))

    @property
    def location(self) -> str:
        return object.__getattribute__(self, "_forked_location")

    def close(self) -> None:
        """In a forked child: nothing to release (the catalog, threads and client are the parent's)."""


def _after_fork_in_child() -> None:
    parent = os.getppid()
    for store in list(_STORES):
        if isinstance(store, _ForkedStore):
            continue
        state = dict(store.__dict__)
        _INHERITED.append(state)
        home = state.get("home")
        location = getattr(home, "location", None) or str(state.get("root"))
        store._forked_location = location
        store._forked_message = (
            f"{location}: this Store was opened in process {parent}, and this process is a fork of it: a Store "
            "does not cross fork (its catalog connection, threads and leases are the parent's). "
            f"Open a new ckptstore.Store({location!r}) in this process"
        )
        cls = type(store)
        forked = _forked_classes.get(cls)
        if forked is None:
            forked = _forked_classes[cls] = type(f"Forked{cls.__name__}", (_ForkedStore, cls), {"__module__": cls.__module__})
        store.__class__ = forked
    fail_inherited(lambda: ForkedStoreError(
        f"this process was forked from process {parent} while this asynchronous commit (or pooled work) was running there: "
        "its result is the parent's; open a new ckptstore.Store(...) in this process"
    ))


os.register_at_fork(after_in_child=_after_fork_in_child)


__all__ = ["CkptStoreError", "CommitInfo", "IOStats", "Store", "check_tag", "pack_writer_at"]
