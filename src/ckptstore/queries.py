"""The queries of a store, written once for both homes: refs (``resolve``, tags, reflog),
commits (``info``, ``log``, ``show``, ``du``, ``diff``), commit records and manifests, and
where blobs are (docs/design.md, "Modules and layers": the queries row).

:class:`Queries` is the part of :class:`ckptstore.store.Store` that answers them; what reads
the index is the home's (:class:`ckptstore.home.Home`: from the catalog;
:class:`ckptstore.bucket.BucketHome`: the same after copying records into the cache), and
tags are read and moved through the store's ``refs`` (:mod:`ckptstore.refs`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from . import jsonvalue, records
from .diff import DiffReport, diff_commits
from .errors import BlobMissingError, RefNotFoundError
from .layout import address, under
from .packs import BlobLoc
from .records import CommitInfo, LeafRecord, check_tag

_FULL_ID = re.compile(r"[0-9a-f]{32}")


class Queries:
    """Refs, commits, records, manifests and blob locations, as part of
    :class:`ckptstore.store.Store`: the store provides ``catalog``, ``_open``, ``refs``,
    ``home`` and ``_records`` (verified commit records by id)."""

    # --- refs --------------------------------------------------------------------------

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
        ``catalog_bytes``: the catalog's files (the index; on a bucket the local cache);
        ``reserve_bytes``: ``catalog.sqlite-reserve``, the room kept for the catalog's journal
        on a full disk (docs/operations.md); ``dedup_ratio`` = logical / unique;
        ``compression_ratio`` = unique / stored.
        """
        return self.home.du()

    # --- records, manifests and blob locations ------------------------------------------

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
        found = self.locate([k for r in leaves for k in r.keys])
        for r in leaves:
            for i, key in enumerate(r.keys):
                loc = found.get(key)
                if loc is None:
                    raise BlobMissingError(f"commit {rec.id}, leaf {r.path}: shard {i} (blob {address(*key)}) is not in the catalog")
                r.shards.append(loc)
        return leaves

    def locate(self, keys: list[tuple[bytes, int]]) -> dict[tuple[bytes, int], BlobLoc]:
        """Where the catalog says each blob (``(XXH3-128 digest, length)`` address) is; absent ones are left out."""
        wanted = set(keys)
        rows = self.catalog.chunked(
            "SELECT hash, raw_len, pack, offset, stored_len, codec FROM blobs WHERE hash IN ({})", list({d for d, _ in wanted}), raw=True
        )
        return {(h, n): BlobLoc(h, n, p, o, sl, c) for h, n, p, o, sl, c in rows if (h, n) in wanted}

    def relocate(self, loc: BlobLoc) -> BlobLoc | None:
        """The current location of the blob at ``loc`` (a GC may have repacked it), or ``None``."""
        return self.locate([(loc.digest, loc.raw_len)]).get((loc.digest, loc.raw_len))

    def newest_commit(self, adapter: str) -> str | None:
        """Id of the newest commit holding a component stored by ``adapter``, or ``None``."""
        rows = self.catalog.rows(
            "SELECT c.id FROM commits c JOIN components k ON k.commit_id = c.id WHERE k.adapter = ? ORDER BY c.created_at DESC, c.id LIMIT 1",
            (adapter,),
        )
        return rows[0]["id"] if rows else None

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
                "SELECT l.path, b.hash, b.raw_len, b.id FROM commit_leaves l JOIN shards s ON s.leaf_id = l.id JOIN blobs b ON b.id = s.blob_id "
                "WHERE l.commit_id = ? AND l.path IN ({})", list(dict.fromkeys(paths)), (cid,), raw=True,
            )
            for path, h, n, i in rows:
                out.setdefault(path, {})[(h, n)] = i
        return out


__all__ = ["Queries"]
