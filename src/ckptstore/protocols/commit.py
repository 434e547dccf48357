"""The commit protocol (docs/design.md, "Commit"), written once for both homes: from the
captured state to the manifest, its shards hashed and the new ones written.

1. adapters turn the object into components (state trees);
2. each tensor is cut into row-aligned shards and hashed (XXH3-128), in threads; a tensor
   whose fingerprint says it did not change takes its hashes and blob ids from the digest
   cache (:mod:`ckptstore.protocols.digests`), once a random sample of its shards rehashes to them;
3. shards the index already knows are reused, the others are written to new packs through
   the home's pack writer (:meth:`ckptstore.home.base.Home.pack_writer`);
4. the home's index step (:meth:`ckptstore.home.base.Home.index_commit`: one catalog transaction
   locally; :meth:`ckptstore.home.bucket.BucketHome.index_commit`, the record's PUT and the tags'
   compare-and-swap, on object storage) checks that every reused
   blob still exists (:class:`ReusedBlobsGone` otherwise: the blobs a GC's repack copied are
   looked up, the others written again, and the step retried), indexes the commit and moves
   the tags.

:class:`Committer` does steps 1 to 3 and calls the home for step 4, with Python's collector
paused (:func:`ckptstore.core.collector.paused_gc`). It is an object the store owns (``Store._committer``;
the store's ``commit``, ``commit_async``, ``commit_components``, ``commit_manifest`` and
``prepare_shared_commit`` delegate to it), constructed with the repository it commits to,
typed as what it needs of it (:class:`ckptstore.home.interfaces.CommitRepository`).
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..core import jsonvalue, progress
from ..core.collector import paused_gc
from ..core.errors import AdapterError, IntegrityError, StoreWriteError, UnsupportedTypeError
from ..core.layout import address, digest, sample_unchanged, shard_count
from ..core.threads import Pool
from ..home.index_step import ReusedBlobsGone, given_stored, ints_json  # noqa: F401 (declared in the home layer, whose index step raises and reads them)
from ..objects import records
from ..objects.packs import BlobLoc, PackWriter
from ..objects.records import CommitInfo, LeafRecord, check_message, check_tag
from .digests import DigestCache, Entry, Same, reusable
from .reuse import Prehashed as _Prehashed
from .reuse import Reused, as_reused, keep_components, logical_bytes

if TYPE_CHECKING:
    import torch

    from ..adapters import Registry
    from ..adapters.base import Captured
    from ..home.interfaces import CommitRepository

_INLINE_HASH_BYTES = 4 << 20  # below this, hashing in threads costs more than it saves


class _Redo(Exception):
    """A blob of a :class:`Reused` component must be written again (a GC freed it, and the
    rows that held it, meanwhile): the commit is made again from the captured state."""


_background = threading.local()  # .active: this thread runs an asynchronous commit


class Committer:
    """Steps 1 to 3 of the commit protocol for one repository (a :class:`ckptstore.store.Store`),
    with what they keep between commits: the threads (``workers``, :attr:`pool`, the
    asynchronous commits' thread), the adapter :attr:`registry` and the digest cache
    (``reuse_hashes``, :mod:`ckptstore.protocols.digests`). What it needs of the repository (its
    ``shard_bytes``, catalog, pack writer, dedup lookup and the home's index step) is
    :class:`ckptstore.home.interfaces.CommitRepository`. It holds the repository weakly (the
    repository owns it: no reference cycle, so a store dropped without ``close`` still frees
    its catalog connection at once); an asynchronous commit keeps it alive until it ran."""

    def __init__(self, repo: CommitRepository, workers: int | None, registry: Registry | None, reuse_hashes: bool):
        """``repo``: the repository committed to; ``workers`` threads (default: CPU count), the
        adapter ``registry`` (default: the global one), ``reuse_hashes``: as
        :class:`ckptstore.store.Store` takes them."""
        self._repo_ref = weakref.ref(repo)
        self.workers = workers or os.cpu_count() or 1
        self._registry = registry
        self.reuse_hashes = reuse_hashes
        #: The digest cache (:mod:`ckptstore.protocols.digests`): shard hashes and blob ids of live objects this repository committed.
        self.digests = DigestCache()
        self._pool: ThreadPoolExecutor | None = None
        self._async: ThreadPoolExecutor | None = None  # runs asynchronous commits, one at a time
        self._pending: Future | None = None
        self._snapshots: dict[str, torch.Tensor] = {}
        self._last_paths: tuple[str, tuple[str, ...]] = ("", ())  # the last commit's id and component paths (its leaf paths checked)

    @property
    def _repo(self) -> CommitRepository:
        """The repository committed to (held weakly)."""
        return self._repo_ref()

    @property
    def registry(self) -> Registry:
        """The adapter registry (imports the adapters, and torch, on first use)."""
        if self._registry is None:
            from ..adapters import REGISTRY

            self._registry = REGISTRY
        return self._registry

    @property
    def pool(self) -> ThreadPoolExecutor:
        """The store's threads for hashing, compression and I/O (``workers`` of them), started on first use."""
        if self._pool is None:
            self._pool = Pool(self.workers, thread_name_prefix="ckptstore")
        return self._pool

    def stop(self) -> None:
        """Wait for asynchronous commits, then release the threads (the store's ``close``)."""
        if self._async is not None:
            self._async.shutdown(wait=True)
            self._async = None
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def forget_hashes(self) -> None:
        """Drop the digest cache (:meth:`ckptstore.store.Store.forget_hashes`)."""
        self.digests.clear()

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

        Objects another thread writes during the call (a collector's ``rb.extend``,
        in-place ops): each shard is stored as one copy of its bytes, hashed as copied,
        so the commit always checks out as stored; but it is a torn snapshot (each
        shard as it was when read, shards at different instants). For a consistent
        one, keep the writers out during the call (pause them, or hold the lock they
        take), or use :meth:`commit_async`, which needs that only during its call.

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

        from ..adapters import capture

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

        The snapshot is taken during the call: a thread writing the objects during the
        call gives a torn snapshot as :meth:`commit` does (each shard one copy of its
        bytes, always read back as stored); writes after the call returns are not in
        it. Keep writers out during the call for a consistent one.

        Returns:
            A ``concurrent.futures.Future`` resolving to the :class:`CommitInfo`
            once the commit is durable, or raising what :meth:`commit` would.

        Raises (at once): UnsupportedTypeError / InvalidNameError for state that
        cannot be stored, as :meth:`commit`.
        """
        t0 = time.perf_counter()
        with paused_gc():
            components = self._snapshot(self._capture(obj))
        if self._async is None:
            self._async = Pool(1, thread_name_prefix="ckptstore-commit")  # (a Pool: a forked child fails its futures)
        # (the repository is an argument so that the queued commit keeps it alive until it ran)
        future = self._async.submit(self._commit_paused, self._repo, components, tag, message, metadata, parents, t0)
        self._pending = future
        return future

    def _commit_paused(self, repo, components, tag, message, metadata, parents, t0) -> CommitInfo:
        _background.active = True  # hash and write in this thread only (see _map)
        try:
            with paused_gc():
                return self.commit_components(components, tag, message, metadata, parents, t0=t0, reuse_checked=True)
        finally:
            _background.active = False

    def _snapshot(self, components: list[Captured]) -> list[Captured]:
        """Copies of the leaves that may change after an asynchronous commit returns."""
        import torch

        from ..adapters.base import Captured
        from ..core.shards import check_tensor, dense_order, physical, plan, tensor_bytes

        free = self._pending is None or self._pending.done()  # the last snapshot's buffers are reusable
        buffers = self._snapshots if free else {}
        out = []
        stale: set[str] = set()
        for comp in components:
            reused = as_reused(self.digests, comp, self._repo.shard_bytes) if self.reuse_hashes else None
            if reused is not None:  # unchanged as a whole: its rows are shared (its records and blob ids taken now)
                out.append(reused)
                continue
            leaves = {}
            for path, value in comp.leaves.items():
                if not isinstance(value, torch.Tensor):
                    leaves[path] = jsonvalue.loads(jsonvalue.dumps(value, path))
                    continue
                token = comp.fingerprints.get(path)
                if token is not None:
                    phys, _ = physical(value, path)
                    p = plan(tuple(phys.shape), value.dtype, self._repo.shard_bytes)
                    entry = self._cached(comp.owner, path, token)
                    if entry is not None and entry[0] == token and len(entry[1]) == p.count:
                        if sample_unchanged([d for d, _ in entry[1]], tensor_bytes(phys, path), p, path):
                            # unchanged: its hashes and blob ids are taken now (the cache may change
                            # before the background commit runs); its bytes are only reread if a GC
                            # removed the blobs meanwhile, and rehashed then
                            leaves[path] = self._prehash(comp.path, path, value, entry[1], dict(enumerate(entry[1])))
                            continue
                        stale.add(path)  # the token lies: the background commit hashes the copy, the next one all of it
                        self.digests.drop(comp.owner, path, token, self._repo.shard_bytes)
                    elif entry is not None:
                        reuse = reusable(entry, token, value, p)
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
        few shards instead of whole columns. With ``known`` (``{index: (hash, blob id)}``, from
        :func:`ckptstore.protocols.digests.reusable`), the other shards hold the rows written since the
        last commit: they are copied, and hashed by the commit in the background. Without it,
        every shard is hashed now (in threads; about twice as fast as copying here) and
        only those whose hash differs from the one at the same index in ``last`` (its
        previous commit's) are copied."""
        from ..core.shards import dtype_name, physical, plan, tensor_bytes

        phys, stride = physical(value, path)
        p = plan(tuple(phys.shape), value.dtype, self._repo.shard_bytes)
        mv = tensor_bytes(phys, path)
        views = [mv[a : a + p.shard_bytes] for a in range(0, p.nbytes, p.shard_bytes)] or [mv]
        record = LeafRecord(path, component, "tensor", dtype_name(value.dtype, path), tuple(value.shape), p.nbytes, p.shard_bytes, stride=stride)
        if known is not None:
            shards = [(known[i][0], view) if i in known else (b"", memoryview(bytearray(view))) for i, view in enumerate(views)]
            return _Prehashed(record, shards, {i: blob for i, (_, blob) in known.items()}, last)
        hashed = self.map(digest, views) if p.nbytes > _INLINE_HASH_BYTES else [digest(v) for v in views]
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
        share: bool = True,
    ) -> CommitInfo:
        """Commit components already captured (by :func:`ckptstore.adapters.capture`
        or built by an importer); same arguments, result and errors as :meth:`commit`.
        ``reuse_checked``: the shard hashes reused by fingerprint were sample-checked
        already (:meth:`commit_async` checks them when it snapshots the state).
        A component unchanged since this store's last commit of it (digest cache) shares
        that commit's catalog rows (:class:`Reused`); not with ``share`` false."""
        t0 = time.perf_counter() if t0 is None else t0
        tags = [] if tag is None else list(tag) if isinstance(tag, (list, tuple)) else [tag]
        tags = list(dict.fromkeys(check_tag(t) for t in tags))
        metadata = check_message(message, metadata)
        parents = [parents] if isinstance(parents, str) else parents
        explicit_parents = None if parents is None else [self._repo.resolve(p) for p in parents]
        captured = components
        for c in components:
            if type(c) is not Reused and records.ESCAPED in c.meta:
                raise AdapterError(f"{c.path or '<root>'}: adapter {c.adapter} returned meta key {records.ESCAPED!r}, which ckptstore reserves")
        if share and self.reuse_hashes and not reuse_checked:
            components = [(as_reused(self.digests, c, self._repo.shard_bytes) or c) if type(c) is not Reused else c for c in components]
        # paths in today's key encoding
        components = [c if type(c) is Reused else replace(c, meta={**c.meta, records.ESCAPED: True}) for c in components]
        slow = [c for c in components if type(c) is not Reused]
        own, views, tokens, prior, from_cache, unchanged = self._leaves(slow, reuse_checked)
        own_keys = [(d, len(mv)) for shard_views in views for d, mv in shard_views]
        retaken = False  # retake ran: some shards' addresses are not the ones hashed first

        def manifest_keys() -> list[tuple[bytes, int]]:
            """Every shard's address in manifest (component) order: the reused components' keys in their places."""
            if len(slow) == len(components):
                return own_keys
            keys, i, k = [], 0, 0  # the next captured leaf and key
            for c in components:
                if type(c) is Reused:
                    keys += c.keys
                else:
                    n = len(c.leaves)
                    nk = sum(map(len, views[i : i + n]))
                    keys += own_keys[k : k + nk]
                    i, k = i + n, k + nk
            return keys

        keys = manifest_keys()
        if len(slow) == len(components):
            leaves = own
        else:  # the manifest in component order: the reused components' records in their places
            leaves, i = [], 0
            for c in components:
                if type(c) is Reused:
                    leaves += c.records
                    prior.update(c.blobs)
                else:
                    leaves += own[i : i + len(c.leaves)]
                    i += len(c.leaves)
        unique: dict[tuple[bytes, int], memoryview] = {}
        for shard_views in views:
            for d, mv in shard_views:
                unique.setdefault((d, len(mv)), mv)

        def write(writer: PackWriter, key: tuple[bytes, int]) -> BlobLoc:
            data = unique.get(key)
            if data is None:  # a blob of a Reused component: not at hand (see _Redo)
                raise _Redo()
            if key in from_cache:  # a hash kept from an earlier commit whose blob a GC freed since: live memory,
                data = bytes(data)  # read once here (the writer hashes and writes these bytes as they are)
            # The writer copies the shard once and hashes, encodes and writes that copy: the
            # location it returns names the bytes written (see retake when they differ from key).
            loc = writer.append(data, key[0])
            if key in from_cache and (loc.digest, loc.raw_len) != key:
                # The kept hash's bytes moved on: the content this commit took is gone.
                self.forget_hashes()  # the next commit rehashes instead of failing the same way
                raise StoreWriteError(
                    f"blob {address(*key)} this commit reused was freed by a GC (another process or Store) while the commit "
                    "ran, and its tensor has changed since, so its content at the commit is gone; commit again"
                )
            return loc

        def retake(writer: PackWriter, torn: list[tuple[bytes, int]], known: dict, written: dict) -> list[tuple[bytes, int]]:
            """Another thread changed shards between their hash (taken for dedup) and their
            write: the blobs of ``torn`` (addresses) were written under the hashes of the bytes
            the writer copied. File each under that true address; every other shard that named
            a torn address is copied, hashed and written (or deduplicated) under its own; the
            manifest's addresses and ``views`` (what the digest cache keeps) follow. The commit
            is then a torn but self-consistent snapshot: each shard as one copy read it."""
            nonlocal keys, own_keys, retaken
            retaken = True
            stale = set(torn)
            if any(k in stale for c in components if type(c) is Reused for k in c.keys):
                raise _Redo()  # (a reused component names one too, rewritten after a GC: the commit is made again unshared)
            true_of: dict[int, tuple[bytes, int]] = {}  # id of the view a torn blob was written from -> what it holds
            locs = {k: (written.pop(k), unique.pop(k)) for k in torn}
            for loc, mv in locs.values():
                true = (loc.digest, loc.raw_len)
                written.setdefault(true, loc)  # (an address held already keeps its row: this copy is GC's)
                true_of[id(mv)] = true
                unique.setdefault(true, mv)
            for shard_views in views:
                for s, (d, mv) in enumerate(shard_views):
                    if (d, len(mv)) not in stale:
                        continue
                    key = true_of.get(id(mv))
                    if key is None:  # one copy at a time: memory stays one shard
                        copy = bytes(mv)
                        key = (digest(copy), len(copy))
                        if key not in known and key not in written:
                            known.update(self._repo._lookup([key]))
                            if key not in known:
                                written[key] = writer.append(copy, key[0])
                        unique.setdefault(key, mv)
                    shard_views[s] = (key[0], mv)
            own_keys = [(d, len(mv)) for shard_views in views for d, mv in shard_views]
            keys = manifest_keys()
            return keys

        paths = tuple(c.path for c in components)
        # every component as this store's last commit held it, which checked their paths: not checked again
        checked = all(type(c) is Reused and c.last == self._last_paths[0] for c in components) and paths == self._last_paths[1]
        try:
            info, ids = self.commit_manifest(components, leaves, keys, write, tags, message, metadata, explicit_parents, t0, prior,
                                             paths_checked=checked, prior_complete=not slow, retake=retake)
        except _Redo:
            self.digests.components.clear()
            captured = [self._unshared(c) if type(c) is Reused else c for c in captured]  # (an asynchronous commit's snapshot)
            return self.commit_components(captured, tags, message, metadata, parents, t0=t0, reuse_checked=reuse_checked, share=False)
        if unchanged and (retaken or any(ids[k] != b for k, b in prior.items())):  # blobs written again (a GC freed them): new ids
            unchanged = set()
        if own:  # (a commit of Reused components only has nothing new to keep)
            self.digests.remember(own, views, tokens, ids, self._repo.shard_bytes, unchanged)
        if self.reuse_hashes:
            keep_components(self.digests, components, leaves, keys, ids, info.id, self._repo.shard_bytes)
        self._last_paths = (info.id, paths)
        return info

    def _unshared(self, c: Reused) -> Captured:
        """A :class:`Reused` component that an asynchronous commit took when it snapshotted
        the state, as that snapshot would have been without sharing: each tensor a
        :class:`_Prehashed` of the live tensor with every shard's hash and blob id (a blob
        written again is read once from live memory and rehashed, as for any such leaf), each
        JSON value as committed."""
        from ..adapters.base import Captured

        src, leaves, k = c.source, {}, 0
        for r in c.records:
            if r.kind != "tensor":
                leaves[r.path] = jsonvalue.loads(r.value)
                continue
            m = shard_count(r.nbytes, r.shard_bytes)
            mine = [(d, c.blobs[(d, n)]) for d, n in c.keys[k : k + m]]
            k += m
            leaves[r.path] = self._prehash(c.path, r.path, src.leaves[r.path], mine, dict(enumerate(mine)))
        return Captured(c.path, c.adapter, c.version, src.meta, leaves, dict(src.fingerprints), src.owner)

    def commit_manifest(
        self, components, leaves, keys, write, tags, message, metadata, explicit_parents, t0, prior=None, origin=None, written=None,
        paths_checked=False, prior_complete=False, retake=None,
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
        ``paths_checked``: the leaves' paths are those of a commit this store checked them for.
        ``prior_complete``: ``prior`` holds every address of ``keys`` (a commit of
        :class:`Reused` components only), so none is looked up.
        ``retake(writer, torn, known, written)``: called when blobs were written under
        another address than their key (``write`` returned a location whose digest is not
        the key's: the bytes changed after they were hashed); it files them under their true
        addresses and returns the manifest's new ``keys``. Without it such a write raises
        :class:`~ckptstore.core.errors.IntegrityError`.
        Returns the CommitInfo and every address's blob id.
        """
        self._repo.home.before_commit()
        self._open_for_commit()
        meta_json = jsonvalue.dumps(metadata, "metadata")
        records.check_checkable(components, leaves, paths_checked)  # a store never accepts a commit it cannot check out
        known = dict(prior or {})
        unknown = [] if prior_complete else [k for k in dict.fromkeys(keys) if k not in known]
        known.update(self._repo._lookup(unknown))
        given, given_packs = written or ({}, [])
        with self._repo.pack_writer() as writer:
            written = {k: loc for k, loc in given.items() if k not in known}
            todo = [k for k in unknown if k not in known and k not in written]
            relocated: set[tuple[bytes, int]] = set()
            while True:
                with progress.task("commit: write new shards", sum(n for _, n in todo)) as advance:
                    def write_one(key: tuple[bytes, int]) -> BlobLoc:
                        loc = write(writer, key)
                        advance(key[1])
                        return loc

                    for key, loc in zip(todo, self.map(write_one, todo)):
                        written[key] = loc
                torn = [k for k in todo if (written[k].digest, written[k].raw_len) != k]
                if torn:  # bytes changed between their hash and their write (another thread)
                    if retake is None:
                        raise IntegrityError(f"blob {address(*torn[0])} changed while it was written: its bytes hash to "
                                             f"{written[torn[0]].address}; nothing was committed")
                    keys = retake(writer, torn, known, written)
                writer.finish()
                try:
                    created_at = time.time() if origin is None else origin[2]
                    cid, parent_ids, seconds, ids = self._repo.home.index_commit(
                        components, leaves, keys, known, written, writer, tags, message, meta_json,
                        explicit_parents if origin is None else list(origin[1]), created_at, t0, None if origin is None else origin[0],
                        given_packs,
                    )
                    break
                except ReusedBlobsGone as gone:  # a GC removed them meanwhile: find the copies its repack made, write the rest again
                    for k in gone.keys:
                        known.pop(k, None)
                        written.pop(k, None)
                    again = self._repo.home.relocate_reused([k for k in gone.keys if k not in relocated])  # once per blob: then written
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
            logical_bytes=logical_bytes(components, leaves),
            new_bytes=sum(n for _, n in written),
            stored_bytes=writer.stored_bytes + given_stored(written, given_packs),
            shards_total=len(keys),
            shards_new=len(written),
            seconds=seconds,
        )
        return self._repo.home.dated(info), ids

    def prepare_shared_commit(self) -> None:
        """Ready the store for a commit whose blobs other processes write first (the ranks
        of a :mod:`ckptstore.dcp` save, through :func:`ckptstore.store.pack_writer_at`):
        create it if missing, so that their packs land in a store, and bring the index up to
        date, so that :meth:`leaf_blobs` and the commit's dedup see every blob the store holds.

        Raises:
            StoreWriteError: the store cannot be committed to here (read-only mount,
                permissions, a full disk).
        """
        self._open_for_commit()
        self._repo.home.prepare_shared_commit()

    def _open_for_commit(self) -> None:
        """Open the store for a commit, creating it if missing; StoreWriteError if it cannot be written here."""
        if not self._repo._open(create=True).writable:
            raise StoreWriteError(f"{self._repo.root} is read-only here (mount, permissions or a full disk): "
                                  "it can be read, not committed to")

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

        from ..core.shards import dtype_name, flat_bytes, physical, plan, tensor_bytes

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
                    kept = Same.of(entry, token, value, comp.path)
                    stale = False
                    if kept is not None:
                        # Unchanged since the last commit (equal fingerprint, same layout): its record,
                        # hashes and blob ids are taken whole, once a sample of its shards rehashes to them.
                        rec, hashes = kept.record, entry[1]
                        mv = flat_bytes(value if rec.stride is None else physical(value, path)[0], path)
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
                    p = plan(tuple(phys.shape), value.dtype, self._repo.shard_bytes)
                    rec = LeafRecord(path, comp.path, "tensor", dtype_name(value.dtype, path), tuple(value.shape), p.nbytes, p.shard_bytes, stride=stride)
                    mv = tensor_bytes(phys, path)
                    known: dict[int, tuple[bytes, int]] = {}
                    if entry is not None:
                        same = entry[0] == token and len(entry[1]) == p.count
                        known = dict(enumerate(entry[1])) if same else reusable(entry, token, value, p) or {}
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
        digests = self.map(hash_one, todo) if total > _INLINE_HASH_BYTES else [hash_one(item) for item in todo]
        for (i, s), d in zip(todo, digests):
            views[i][s] = (d, views[i][s][1])
        for i, last in previous.items():
            for (d, mv), (last_d, blob) in zip(views[i], last):
                if d == last_d:
                    prior[(d, len(mv))] = blob
        return recs, views, tokens, prior, from_cache, unchanged

    def _cached(self, owner: Any, path: str, token: Any) -> Entry | None:
        """The digest cache's entry of leaf ``path`` of ``owner`` at the current target shard
        size (:meth:`ckptstore.protocols.digests.DigestCache.get`); ``None`` without ``reuse_hashes``."""
        if token is None or not self.reuse_hashes:
            return None
        return self.digests.get(owner, path, token, self._repo.shard_bytes)

    def map(self, fn, items: list) -> list:
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


__all__ = ["CommitInfo", "Committer", "ReusedBlobsGone", "given_stored", "ints_json", "paused_gc"]
