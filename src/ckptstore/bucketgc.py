"""GC and fsck of a store on object storage (docs/design.md, "GC on object storage").

GC has no lock: any number of writers, and other GCs, may run beside it on any machine.
It never deletes in the run that decided to, except with a grace period of 0 (which may
so delete what a commit in flight has uploaded: for when no writer runs).

1. **Mark.** Read every ref; the roots and the retention policy (as locally:
   :meth:`ckptstore.gc.Collector.retained`, over the cache mirrored from the bucket)
   give the retained commits, and their manifests the live blob addresses; so do the
   manifests of every other record this mark leaves on the bucket (a pack goes only with
   the last record that needs it). Every ``.idx`` is read. A pack older than the grace
   period (the server's clock, whose whole seconds count one more: :data:`MTIME_STEP`) is
   *dead* if none of its blobs is live, *half-dead* if its live bytes are below
   ``repack_below`` of its size; the live blobs of a half-dead pack are copied (each
   verified) into a new pack and ``.idx`` first. A commit record older than the grace
   period and not retained, a pack without ``.idx`` and an ``.idx`` without pack, each
   older than the grace period, are dead too. The dead objects are written in a mark,
   ``gc/<run id>.json`` = ``{"packs": [...], "commits": [...], "objects": [...]}``
   (create-only).
2. **Sweep**, of every mark older than the grace period (this run's own mark too
   when the grace period is 0): recompute the retained commits and live addresses from
   the refs and records read now; delete each marked commit record still not retained, and each
   marked pack none of whose live blobs is held only there; re-read the refs and, if
   any moved meanwhile, start the sweep of that mark again; then delete the mark.

Writers read the marks before their ref CAS and write again any blob they would reuse
from a marked or missing pack (:meth:`ckptstore.bucket.BucketStore.index_commit`), so
a sweep a grace period after its mark removes nothing a commit landing meanwhile needs.
"""

from __future__ import annotations

import json
import random
import time
import uuid
from dataclasses import dataclass

from .errors import BlobCorruptError, CkptStoreError, IntegrityError, ObjectNotFoundError
from .fsck import FsckReport
from .gc import REPACK_BELOW, Collector, GCReport, parse_duration
from .layout import RANDOM, address
from .packindex import decode_index, index_key, pack_key
from .packs import BLOB_HEADER, BLOB_MAGIC, check_entry
from .remote import commit_key, fetch_record, read_tag

DEFAULT_GRACE = 86400.0
SWEEP_ATTEMPTS = 5
#: Seconds: S3 (and moto) give object times in whole seconds, so an object may be this much younger than
#: its time says; a grace period above 0 waits this much longer, or a just-written pack or mark looks old.
MTIME_STEP = 1.0


@dataclass
class _State:
    """What the bucket holds now: refs, retained commits, live addresses, packs and their entries."""

    refs: dict
    retained: set
    live: set
    packs: dict  # pack id -> ObjectInfo
    entries: dict  # pack id -> [Entry] (packs with a readable .idx)
    objects: dict  # key -> ObjectInfo (everything under blobs/ and commits/)
    needs: dict  # commit id -> blob addresses, for every record on the bucket (a pack stays while a record stays)


def _state(store, c: Collector) -> _State:
    """Mirror the bucket into the cache and compute liveness (reads every ref, record and ``.idx``)."""
    backend = store.backend
    refs = store.read_refs()
    store.log()  # mirrors the tags, caches every commit record, forgets the ones the bucket lost
    c.now = time.time()
    retained = c.retained()
    live = {k for cid in retained if store.has_cached(cid) for leaf in store.record(cid).leaves for k in leaf.keys}
    objects = {o.key: o for o in backend.list("blobs")}
    objects.update({o.key: o for o in backend.list("commits")})
    packs = {k.rsplit("/", 1)[1][:-5]: o for k, o in objects.items() if k.endswith(".pack")}

    def load(pid):
        if index_key(pid) not in objects:
            return pid, None
        try:
            return pid, decode_index(backend.get(index_key(pid)), pid, packs[pid].size, f"{backend.url}: {index_key(pid)}")
        except (BlobCorruptError, ObjectNotFoundError):
            return pid, None

    entries = {pid: es for pid, es in store.requests.map(load, list(packs)) if es is not None}
    ids = [k.rsplit("/", 1)[1] for k in objects if k.startswith("commits/")]
    needs = {cid: {k for leaf in store.record(cid).leaves for k in leaf.keys} for cid in ids if store.has_cached(cid)}

    def needed(cid):  # a record written since the cache was brought up to date
        try:
            return cid, {k for leaf in fetch_record(backend, cid).leaves for k in leaf.keys}
        except CkptStoreError:
            return cid, set()  # gone, or damaged (fsck reports it)

    needs.update(store.requests.map(needed, [c for c in ids if c not in needs]))
    return _State(refs, retained, live, packs, entries, objects, needs)


def _blob_keys(entries) -> set:
    return {(e.loc.digest, e.loc.raw_len) for e in entries if e.magic == BLOB_MAGIC}


def collect(store, *, keep_last: int = 1, keep_tags=(), keep_within=None, grace=DEFAULT_GRACE, dry_run: bool = False,
            repack_below: float = REPACK_BELOW) -> GCReport:
    """One GC run over a :class:`~ckptstore.bucket.BucketStore` (see the module docstring).

    Returns:
        A :class:`~ckptstore.gc.GCReport`: ``commits_dropped`` (records deleted, or marked
        in a dry run: ``dropped`` names them), ``packs_repacked``, ``packs_deleted``,
        ``orphans_removed`` (objects without their pair), ``bytes_freed`` (bytes deleted
        from the bucket) and ``bytes_pending`` (bytes marked, deleted a grace period later).

    Raises:
        InvalidArgumentError: a bad count, glob, duration or threshold.
        BackendError: the storage failed (what was deleted stays deleted; run again).
    """
    c = Collector(store, keep_last, list(keep_tags), keep_within, grace, repack_below)
    grace = parse_duration(grace)
    report = GCReport(dry_run=dry_run)
    backend = store.backend
    t0 = time.perf_counter()
    st = _state(store, c)
    cutoff = time.time() - grace - (MTIME_STEP if grace > 0 else 0.0)
    old = lambda key: key in st.objects and st.objects[key].mtime < cutoff
    dead_commits = sorted(k.rsplit("/", 1)[1] for k in st.objects if k.startswith("commits/") and old(k)
                          and k.rsplit("/", 1)[1] not in st.retained)
    # live: the retained commits' blobs, and those of every record this mark leaves on the bucket
    dropping = set(dead_commits)
    live_now = st.live.union(*(keys for cid, keys in st.needs.items() if cid not in dropping))
    dead_packs, repack, orphans = [], [], []
    for pid, info in st.packs.items():
        if not old(pack_key(pid)):
            continue
        es = st.entries.get(pid)
        if es is None:
            orphans.append(pack_key(pid))  # no readable .idx: a pack whose writer died, never used
            continue
        live = [e for e in es if e.magic == BLOB_MAGIC and (e.loc.digest, e.loc.raw_len) in live_now]
        if not live:
            dead_packs.append(pid)
        elif sum(BLOB_HEADER.size + e.loc.stored_len for e in live) < repack_below * info.size:
            repack.append((pid, live))
    orphans += [k for k in st.objects if k.endswith(".idx") and old(k) and k.rsplit("/", 1)[1][:-4] not in st.packs]
    report.seconds["mark"] = time.perf_counter() - t0
    if dry_run:
        report.dropped = dead_commits
        report.commits_dropped = len(dead_commits)
        report.packs_deleted = len(dead_packs) + len(repack)
        report.packs_repacked = len(repack)
        report.bytes_pending = sum(st.packs[p].size for p in dead_packs) + sum(st.packs[p].size for p, _ in repack)
        return report
    t0 = time.perf_counter()
    if repack:
        writer = store.pack_writer()
        with writer:
            for pid, live in repack:
                bufs = backend.get_ranges(pack_key(pid), [(e.loc.offset, e.loc.offset + BLOB_HEADER.size + e.loc.stored_len) for e in live])
                for e, buf in zip(live, bufs):
                    payload = check_entry(buf, e.loc, f"{backend.url}: pack {pid}")
                    writer.append_encoded(e.loc.digest, e.loc.raw_len, e.loc.codec, bytes(payload))
            writer.finish()
        report.packs_repacked = len(repack)
        store.refresh_index()
    marked = dead_packs + [p for p, _ in repack]
    if marked or dead_commits or orphans:
        mark = {"at": time.time(), "commits": dead_commits, "objects": orphans, "packs": marked}
        backend.put_new(f"gc/{time.time_ns():020d}-{uuid.uuid4().hex}.json", json.dumps(mark, sort_keys=True).encode())
        report.bytes_pending = sum(st.packs[p].size for p in marked)
    report.seconds["repack"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    _sweep(store, c, grace, report)
    report.seconds["sweep"] = time.perf_counter() - t0
    return report


def _sweep(store, c: Collector, grace: float, report: GCReport) -> None:
    backend = store.backend
    marks = [o for o in backend.list("gc") if o.mtime + (MTIME_STEP if grace > 0 else 0.0) <= time.time() - grace]
    if not marks:
        return
    for o in marks:
        try:
            mark = json.loads(backend.get(o.key))
            packs = [p for p in mark["packs"] if type(p) is str]
            commits = [x for x in mark["commits"] if type(x) is str]
            objects = [x for x in mark.get("objects", []) if type(x) is str]
        except ObjectNotFoundError:
            continue  # another GC swept it
        except (ValueError, KeyError, TypeError):
            backend.delete(o.key)  # unreadable: writers treat every pack as marked until it goes
            continue
        for _ in range(SWEEP_ATTEMPTS):
            st = _state(store, c)
            doomed = [p for p in packs if p in st.packs]
            keep = set(st.packs) - set(doomed)
            covered = set().union(*(_blob_keys(st.entries.get(p, ())) for p in keep)) if keep else set()
            victims = [x for x in commits if x not in st.retained]
            going = set(victims)
            live = st.live.union(*(keys for cid, keys in st.needs.items() if cid not in going))  # records that stay keep their packs
            deletable = [p for p in doomed if not ((_blob_keys(st.entries.get(p, ())) & live) - covered)]
            if store.read_refs() != st.refs:
                time.sleep(RANDOM.uniform(0.01, 0.1))
                continue  # a ref moved while we decided: decide again
            for x in victims:
                if commit_key(x) in st.objects:
                    backend.delete(commit_key(x))
                    report.bytes_freed += st.objects[commit_key(x)].size
                    report.dropped.append(x)
            for p in deletable:
                backend.delete(pack_key(p))
                backend.delete(index_key(p))
                report.bytes_freed += st.packs[p].size + (st.objects[index_key(p)].size if index_key(p) in st.objects else 0)
                report.packs_deleted += 1
            for key in objects:
                if key in st.objects:
                    backend.delete(key)
                    report.bytes_freed += st.objects[key].size
                    report.orphans_removed += 1
            store.forget(victims)
            backend.delete(o.key)
            break
    report.commits_dropped = len(report.dropped)
    report.bytes_pending = max(0, report.bytes_pending - report.bytes_freed)
    store.refresh_index()


def check(store, deep: bool = False, sample: float = 1.0, commit: str | None = None, seed: int | None = None) -> FsckReport:
    """Check a :class:`~ckptstore.bucket.BucketStore`: every tag names a commit whose
    record is on the bucket and hashes to its id; every blob of every commit (or of
    ``commit``) is listed in the ``.idx`` of a pack the bucket holds; with ``deep``,
    each (or a ``sample`` fraction, at least one per commit) is read and rehashed.
    Packs without ``.idx`` are reported as orphans (GC removes them)."""
    report = FsckReport()
    backend = store.backend
    rng = random.Random(seed)
    if commit is None:
        ids = []
        for name in backend.list_refs():
            try:
                cid = read_tag(backend, name)[0]  # a malformed payload is a damaged tag, not the end of the check
                if cid is None:
                    continue
                store.resolve(cid)
            except CkptStoreError as exc:
                report.damaged_tags.append(name)
                report.problems.append(f"tag {name!r}: {exc}")
        for o in backend.list("commits"):
            cid = o.key.rsplit("/", 1)[1]
            try:
                store.resolve(cid)
                ids.append(cid)
            except CkptStoreError as exc:
                report.damaged_commits.append(cid)
                report.problems.append(f"commit {cid}: {exc}")
    else:
        ids = [commit]
    store.refresh_index()
    listed = {o.key: o for o in backend.list("blobs")}
    report.orphan_packs = sorted(k.rsplit("/", 1)[1][:-5] for k in listed if k.endswith(".pack") and k[:-5] + ".idx" not in listed)
    reader = store.pack_reader()
    try:
        for cid in ids:
            report.commits += 1
            keys = list(dict.fromkeys(k for leaf in store.record(cid).leaves for k in leaf.keys))
            where = store.locate(keys)
            missing = [k for k in keys if k not in where or pack_key(where[k].pack) not in listed]
            for k in missing:
                report.missing_blobs.append(address(*k))
                report.problems.append(f"commit {cid}: blob {address(*k)} is in no pack on {backend.url}")
            if missing:
                report.damaged_commits.append(cid)
            if not deep:
                continue
            todo = [k for k in keys if k not in missing]
            if sample < 1 and todo:
                todo = rng.sample(todo, max(1, round(len(todo) * sample)))
            locs = [where[k] for k in todo]
            reader.prefetch(locs)
            for loc in locs:
                try:
                    reader.read(loc, f"commit {cid}")
                    report.blobs_checked += 1
                    report.bytes_checked += loc.raw_len
                except (BlobCorruptError, IntegrityError, CkptStoreError) as exc:
                    report.corrupt_blobs.append(loc.address)
                    report.problems.append(str(exc))
                    if cid not in report.damaged_commits:
                        report.damaged_commits.append(cid)
    finally:
        reader.close()
    return report
