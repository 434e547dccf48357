"""Push and pull: copying a commit and its lineage from one store to another.

Either store may live in a folder or on object storage (``Store("s3://…")``): the
source's blobs are read through its :meth:`~ckptstore.store.Store.pack_reader`, the
commits recreated through the destination's own commit protocol, the tag moved by the
destination's compare-and-swap (:meth:`~ckptstore.store.Store.tag` with ``expect=``).

A transfer of ``ref`` copies the commit it names and every ancestor the destination
lacks, oldest first, keeping their ids: each is recreated from its verified record
through :meth:`Store.commit_manifest` (``origin=``), which checks that the rebuilt
record hashes to the same id. Only blobs the destination lacks are copied, as they
are stored (no re-encoding), each verified by hash when it is read. When ``ref`` is a
tag of the source, the destination's tag then moves to the copied commit with a
compare-and-swap: it must still name what it named when the transfer began, and
that commit must be the copied one or one of its ancestors (a fast-forward), unless
``force``. A transfer that dies half-way leaves complete commits (each is one
transaction) without a tag, which the destination's GC drops after the grace
period; running it again copies only what is still missing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..core.errors import BlobMissingError, RefConflictError
from ..core.layout import address
from ..objects.packs import BLOB_HEADER, BlobLoc, PackWriter
from ..objects.records import recreate

if TYPE_CHECKING:
    from ..home.interfaces import SourceRepository, TargetRepository


@dataclass
class TransferReport:
    """What a push or pull did.

    Attributes:
        commit: the id of the commit ``ref`` named (in both stores afterwards).
        tag: the tag moved in the destination, or ``None`` (``ref`` was a commit id).
        previous: the commit the destination's tag named before, or ``None``.
        commits_copied: ids of the commits the destination lacked, oldest first.
        blobs_copied: blobs written to the destination.
        bytes_copied: their stored (possibly compressed) bytes.
        seconds: wall time of the transfer.
        objects_written: objects a push to an ``s3://`` URL or Backend uploaded, the ref included
            (:mod:`ckptstore.protocols.remote`); 0 for every other copy (a destination ``Store``, on either home).
        bytes_written: their bytes, the ref's excluded (0 likewise).
    """

    commit: str
    tag: str | None
    previous: str | None
    commits_copied: list[str] = field(default_factory=list)
    blobs_copied: int = 0
    bytes_copied: int = 0
    seconds: float = 0.0
    objects_written: int = 0
    bytes_written: int = 0


def missing_lineage(cid: str, parents_of: Callable[[str], list[str] | None], have: Callable[[str], bool]) -> list[str]:
    """Commits of ``cid``'s lineage that the destination lacks (``have(c)`` false),
    parents before children. ``parents_of(c)`` gives ``c``'s parents in the source, or
    ``None`` when the source lacks ``c`` (a GC dropped it: the lineage ends there)."""
    order: list[str] = []
    seen: set[str] = set()
    stack = [(cid, False)]
    while stack:
        c, expanded = stack.pop()
        if expanded:
            order.append(c)
            continue
        if c in seen or have(c):
            continue
        parents = parents_of(c)
        if parents is None:
            continue
        seen.add(c)
        stack.append((c, True))
        stack.extend((p, False) for p in reversed(parents) if p not in seen)
    return order


def _ancestors(store: SourceRepository, cid: str) -> set[str]:
    return {c.id for c in store.log(cid)}


def transfer(src: SourceRepository, dst: TargetRepository, ref: str, force: bool = False) -> TransferReport:
    """Copy ``ref`` (a tag, commit id or unique prefix of ``src``) into ``dst``; see the module docstring.

    Raises:
        RefNotFoundError / AmbiguousRefError: ``ref`` names nothing in ``src``.
        RefConflictError: the destination's tag names a commit that is not an
            ancestor of the copied one (both named; ``force=True`` moves it anyway),
            or it moved while the transfer ran; nothing of the tag changes.
        IntegrityError: a blob or record of ``src`` is missing or corrupt; what was
            copied before stays as complete, untagged commits.
        StoreWriteError: ``dst`` cannot be written.
    """
    t0 = time.perf_counter()
    cid = src.resolve(ref)
    tag = ref if ref in src.tags() else None
    previous = dst.tags().get(tag) if tag is not None else None
    if previous is not None and previous != cid and not force and previous not in _ancestors(src, cid):
        raise RefConflictError(
            f"{dst.location}: tag {tag!r} names commit {previous}, which is not an ancestor of {cid}: "
            "the two lineages diverged (pass force=True / --force to move the tag anyway)"
        )
    report = TransferReport(cid, tag, previous)
    reader = src.pack_reader(sparse=True)
    counted = threading.Lock()  # write() runs on the destination's worker threads
    try:
        for c in missing_lineage(cid, lambda c: src.record(c).parents if src.has_commit(c) else None, dst.has_commit):
            rec = src.record(c)
            components, leaves = recreate(rec)
            keys = [k for leaf in leaves for k in leaf.keys]
            located = src.locate(list(dict.fromkeys(keys)))

            def write(writer: PackWriter, key: tuple[bytes, int], located: dict = located, c: str = c) -> BlobLoc:
                loc = located.get(key)
                if loc is None:
                    raise BlobMissingError(f"{src.location}: commit {c}, blob {address(*key)} is not in the catalog")
                entry = reader.stored(loc, f"commit {c}, blob {loc.address}")  # verified: header and hash
                with counted:
                    report.blobs_copied += 1
                    report.bytes_copied += loc.stored_len
                return writer.append_encoded(loc.digest, loc.raw_len, loc.codec, entry[BLOB_HEADER.size :])

            dst.commit_manifest(
                components, leaves, keys, write, [], rec.message, rec.metadata, None, time.perf_counter(),
                origin=(c, rec.parents, rec.created_at),
            )
            report.commits_copied.append(c)
    finally:
        reader.close()
    if tag is not None and previous != cid:  # nothing missing and the tag in place: nothing at all is written
        dst.tag(tag, cid, expect=previous)
    report.seconds = time.perf_counter() - t0
    return report


__all__ = ["TransferReport", "missing_lineage", "transfer"]
