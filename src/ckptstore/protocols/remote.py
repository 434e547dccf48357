"""The object-storage side of push and pull (docs/design.md, "Object storage"): the
transfer protocol between a store and a remote store, :func:`push`, :func:`pull`, and
:func:`resolve` (a ref on the remote).

A remote store is a :class:`~ckptstore.backends.Backend` (``s3://bucket/prefix``, or a
folder through :class:`~ckptstore.backends.LocalBackend`) holding the key layout of the
design, whose objects and bytes are :mod:`ckptstore.objects.bucketformat`'s. This module knows
only that interface: no path, no S3 client.

The local side is any :class:`~ckptstore.store.Store`, in a folder or itself on object
storage (a bucket-to-bucket copy): it is read and written only through the facade
(``pack_reader()``, ``locate``, ``record``, ``commit_manifest``, ``tag``).

**Push** (:func:`push`) of ``ref`` of a store: read the remote tag; refuse
(``RefConflictError`` naming both commits) unless it names the pushed commit or one of
its ancestors, or ``force``; find the commits of the lineage the remote lacks (``head``
of their records, stopping at the first one present: records are written parents
first); list the remote's ``.idx`` objects to learn which blobs it holds (blobs in packs
named by a GC mark are not reused); write the missing blobs as stored (verified as they
are read), followed by the commits' records, into new packs of at most 64 MiB, each
``put_new`` whole and then its ``.idx``; then ``commits/<xx>/<cid>`` oldest first; then
the tag's compare-and-swap (a lost race is re-read: still a fast-forward, it is retried;
else ``RefConflictError``); then a reflog object. Nothing at all is written when the
remote has the commit and its tag names it.

**Pull** (:func:`pull`): the reverse. Commit records are fetched and checked against
their ids (:func:`ckptstore.objects.records.parse_commit`), every needed blob is located through
the remote ``.idx`` objects (each checked by :func:`ckptstore.objects.packindex.decode_index`),
fetched with coalesced ranged GETs, checked against its entry header and rehashed, and
the commits are recreated locally with their ids, oldest first; then the local tag moves
by compare-and-swap, as between local stores (:mod:`ckptstore.protocols.transfer`).

There is no local cache of remote indexes yet: each push or pull that copies something
lists ``blobs/`` and reads every ``.idx`` (one GET each).
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING

from ..backends import Backend
from ..backends.base import ref_segment
from ..core.errors import (
    BlobMissingError,
    NotAStoreError,
    RefBusyError,
    RefConflictError,
)
from ..core.layout import address
from ..core.threads import Pool
from ..home.refs import resolve_on_bucket as resolve  # (the refs of a store on object storage: the home layer's)
from ..objects.bucketformat import (
    MARKER,
    PACK_BYTES,
    UPLOADS,
    BucketPackWriter,
    RemoteIndex,
    commit_key,
    ensure_marker,
    fetch_record,
    marker_bytes,
    read_marker,
    read_tag,
    ref_payload,
    reflog_bytes,
)
from ..objects.packs import BLOB_HEADER
from ..objects.records import KIND_COMMIT, CommitRecord, recreate
from .transfer import TransferReport, missing_lineage

if TYPE_CHECKING:
    from ..home.interfaces import RemoteRepository

CAS_ATTEMPTS = 20


def _diverged(where: str, tag: str, theirs: str, ours: str) -> RefConflictError:
    return RefConflictError(
        f"{where}: tag {tag!r} names commit {theirs}, which is not an ancestor of {ours}: "
        "the two lineages diverged (pass force=True / --force to move the tag anyway)"
    )


def push(local: RemoteRepository, backend: Backend, ref: str, force: bool = False, pack_bytes: int = PACK_BYTES) -> TransferReport:
    """Copy ``ref`` of ``local`` (tag, commit id or unique prefix) and the ancestors the
    remote lacks to ``backend``, then move the remote tag (see the module docstring).

    Args:
        pack_bytes: new packs roll over past this size in bytes.

    Returns:
        A :class:`~ckptstore.protocols.transfer.TransferReport`; ``objects_written`` and
        ``bytes_written`` count every object uploaded (0 for a push with nothing missing).

    Raises:
        RefNotFoundError / AmbiguousRefError: ``ref`` names nothing locally.
        RefConflictError: the remote tag names a commit that is not an ancestor of the
            pushed one (both named; ``force=True`` moves it anyway); the tag is unchanged.
        RefBusyError: the remote tag kept moving (fast-forwards by others) for every attempt.
        NotAStoreError: a missing bucket, or a prefix holding another ``ckptstore.json``.
        IntegrityError: a local blob or record is missing or corrupt, or a remote index is.
        BackendError: the storage failed after retries; what was written stays as
            unreferenced objects (GC removes them) and the tag is unchanged.
    """
    t0 = time.perf_counter()
    cid = local.resolve(ref)
    tag = ref if ref in local.tags() else None
    marker = read_marker(backend)
    previous, version = read_tag(backend, tag) if tag is not None else (None, None)
    ancestors: set[str] | None = None

    def is_ancestor(c: str) -> bool:
        nonlocal ancestors
        if ancestors is None:
            ancestors = {i.id for i in local.log(cid)}
        return c in ancestors

    if previous is not None and previous != cid and not force and not is_ancestor(previous):
        raise _diverged(backend.url, tag, previous, cid)
    report = TransferReport(cid, tag, previous)
    missing = missing_lineage(  # commits of cid's lineage the remote has no record of
        cid, lambda c: local.record(c).parents if local.has_commit(c) else None, lambda c: backend.head(commit_key(c)) is not None
    )
    if missing:
        if marker is None:
            n = ensure_marker(backend, local)
            report.objects_written += n // len(marker_bytes(local.shard_bytes, local.compression_level))  # the marker, its copy
            report.bytes_written += n
        index = RemoteIndex(backend).refresh()
        uploads = Pool(UPLOADS, thread_name_prefix="ckptstore-push")
        packs = BucketPackWriter(backend, 0, pack_bytes, uploads)
        reader = local.pack_reader(sparse=True)
        sent: set[tuple[bytes, int]] = set()
        reused: dict[tuple[bytes, int], str] = {}
        texts = []

        def send(key: tuple[bytes, int], located: dict, c: str) -> None:
            loc = located.get(key)
            if loc is None:
                raise BlobMissingError(f"{local.location}: commit {c}, blob {address(*key)} is not in the catalog")
            stored = reader.stored(loc, f"{local.location}: commit {c}")  # verified: its header is loc's
            packs.append_encoded(loc.digest, loc.raw_len, loc.codec, memoryview(stored)[BLOB_HEADER.size :])
            sent.add(key)
            reused.pop(key, None)
            report.blobs_copied += 1
            report.bytes_copied += loc.stored_len

        try:
            for c in missing:
                rec = local.record(c)
                keys = list(dict.fromkeys(k for leaf in rec.leaves for k in leaf.keys))
                located = local.locate(keys)
                for key in keys:
                    if key in sent or key in reused:
                        continue
                    there = index.reusable(key)
                    if there is not None:
                        reused[key] = there.pack
                    else:
                        send(key, located, c)
                text = rec.text.encode()
                packs.append_record(KIND_COMMIT, text)
                texts.append((c, text))
            packs.finish()
            # A GC may have marked a pack we reuse since we listed: write those blobs again (design: "Writers").
            marked = index.read_marks()
            again = [k for k, pid in reused.items() if index.all_marked or pid in marked]
            if again:
                located = local.locate(again)
                for key in again:
                    send(key, located, cid)
                packs.finish()
        finally:
            packs.close()
            uploads.shutdown()
            reader.close()
        report.objects_written += packs.objects_uploaded
        report.bytes_written += packs.bytes_uploaded
        for c, text in texts:
            if backend.put_new(commit_key(c), text):
                report.objects_written += 1
                report.bytes_written += len(text)
            report.commits_copied.append(c)
    if tag is not None and previous != cid:
        for _ in range(CAS_ATTEMPTS):
            at = time.time()
            try:
                backend.cas_ref(tag, ref_payload(cid, previous, "push", at), version)
                report.objects_written += 1
                break
            except RefConflictError:
                now, version = read_tag(backend, tag)
                if now == cid:  # another pusher moved it to the same commit
                    report.previous = previous = now
                    break
                if now is not None and not force and not is_ancestor(now):
                    raise _diverged(backend.url, tag, now, cid) from None
                report.previous = previous = now
        else:
            raise RefBusyError(f"{backend.url}: tag {tag!r} kept moving: {CAS_ATTEMPTS} attempts to move it all lost a race")
        if previous != cid:
            move = reflog_bytes(tag, previous, cid, "push", at)
            backend.put_new(f"reflog/{ref_segment(tag)}/{time.time_ns():020d}-{uuid.uuid4().hex}", move)
            report.objects_written += 1
            report.bytes_written += len(move)
    report.seconds = time.perf_counter() - t0
    return report


# --- pull -----------------------------------------------------------------------------------


def pull(local: RemoteRepository, backend: Backend, ref: str, force: bool = False) -> TransferReport:
    """Copy ``ref`` of the remote ``backend`` and the ancestors ``local`` lacks into
    ``local`` (created if missing), then move the local tag (see the module docstring).

    Raises:
        NotAStoreError: a missing bucket, or no ``ckptstore.json`` under the prefix.
        RefNotFoundError / AmbiguousRefError: ``ref`` names nothing on the remote.
        RefConflictError: the local tag names a commit that is not an ancestor of the
            pulled one (both named; ``force=True`` overrides); nothing is written.
        IntegrityError: a remote record, index or blob is missing or does not verify
            (named); nothing of that commit is written, the local tag does not move.
        BackendError: the storage failed after retries.
    """
    t0 = time.perf_counter()
    if read_marker(backend) is None:
        raise NotAStoreError(f"{backend.url} is not a ckptstore store (no {MARKER}; a first push creates one)")
    cid, tag = resolve(backend, ref)
    try:
        previous = local.tags().get(tag) if tag is not None else None
    except NotAStoreError:
        previous = None
    records: dict[str, CommitRecord] = {}

    def parents_of(c: str) -> list[str] | None:
        if c != cid and backend.head(commit_key(c)) is None:
            return None  # a GC of the pushing store dropped it before the push: the lineage ends here, as locally
        why = f" (named by tag {tag!r})" if c == cid and tag else f" (an ancestor of {cid})"
        records[c] = fetch_record(backend, c, why)
        return records[c].parents

    order = missing_lineage(cid, parents_of, local.has_commit)
    if previous is not None and previous != cid and not force:
        ancestors = set(order)
        for c in [cid, *(p for r in records.values() for p in r.parents)]:
            if c not in records and local.has_commit(c):
                ancestors.update(i.id for i in local.log(c))
        if previous not in ancestors:
            raise _diverged(local.location, tag, previous, cid)
    report = TransferReport(cid, tag, previous)
    if order:
        index = RemoteIndex(backend).refresh()
        for c in order:
            rec = records[c]
            components, leaves = recreate(rec)
            keys = [k for leaf in leaves for k in leaf.keys]
            unique = list(dict.fromkeys(keys))
            try:
                if c == order[0]:
                    local.refresh_index()  # a store on object storage: its cache learns every blob the bucket holds
                have = local.locate(unique)
            except NotAStoreError:
                have = {}
            where = f"commit {c}"
            fetched = index.fetch([k for k in unique if k not in have], where)

            def write(writer, key, fetched=fetched, where=where):
                got = fetched.get(key) or index.fetch([key], where)[key]
                report.blobs_copied += 1
                report.bytes_copied += got[0].stored_len
                return writer.append_encoded(got[0].digest, got[0].raw_len, got[0].codec, got[1])

            local.commit_manifest(
                components, leaves, keys, write, [], rec.message, rec.metadata, None, time.perf_counter(),
                origin=(c, rec.parents, rec.created_at),
            )
            report.commits_copied.append(c)
    if tag is not None and previous != cid:
        local.tag(tag, cid, expect=previous)
    report.seconds = time.perf_counter() - t0
    return report


__all__ = ["pull", "push", "resolve"]
