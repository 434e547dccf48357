"""GC and fsck of a store on object storage (docs/design.md, "GC on object storage").

GC has no lock: any number of writers, and other GCs, may run beside it on any machine.
It never deletes in the run that decided to, except with a grace period of 0 (which may
so delete what a commit in flight has uploaded: for when no writer runs).

1. **Mark.** Read every ref; the roots and the retention policy (as locally:
   :meth:`ckptstore.gc.Collector.retained`, over the cache mirrored from the bucket) and
   every commit a tag names give the retained commits, and their records the live blob
   addresses; so do the records of every other commit this mark leaves on the bucket (a
   pack goes only with the last record that needs it). Liveness comes from records only
   (invariant 4): a pack's entries come from its ``.idx`` or, where that is missing or
   damaged, from walking the pack (the run then rebuilds the index); a pack that cannot
   be read is never garbage, and while a tag names a commit whose record cannot be read
   no pack is (``GCReport.withheld``). Ages are on the server's clock
   (:meth:`~ckptstore.backends.Backend.now`, whole seconds: :data:`MTIME_STEP`), never
   this machine's (invariant 5). A pack older than the grace period is *dead* if none of
   its blobs is live, *half-dead* if its live bytes are below ``repack_below`` of its
   size; the live blobs of a half-dead pack are copied (each verified) into a new pack
   and ``.idx`` first. A commit record older than the grace period and not retained, an
   ``.idx`` without pack, and a reflog object whose commits are both dropped, each older
   than the grace period, are dead too. The dead objects are written in a mark,
   ``gc/<run id>.json`` = ``{"packs", "commits", "objects", "reflog"}`` (create-only).
2. **Sweep**, of every mark older than the grace period (this run's own mark too
   when the grace period is 0): recompute the retained commits and live addresses from
   the refs and records read now; delete each marked commit record still not retained, and each
   marked pack none of whose live blobs is held only there; re-read the refs and, if
   any moved meanwhile, start the sweep of that mark again; then delete the mark.

Writers check the marks after their record is on the bucket and before their ref CAS,
and write again any blob they rely on (new or reused) in a marked or missing pack
(:meth:`ckptstore.bucket.BucketStore.index_commit`, invariant 6), so a sweep a grace
period after its mark removes nothing a commit landing meanwhile needs.

:func:`check` is fsck: it reads the bucket's own objects, never trusting the cache.
"""

from __future__ import annotations

import json
import random
import time
import uuid
from dataclasses import dataclass

from .errors import BlobCorruptError, IntegrityError, ObjectNotFoundError
from .fsck import FsckReport
from .gc import REPACK_BELOW, Collector, GCReport, parse_duration
from .layout import RANDOM, address
from .packindex import encode_index, index_key, pack_key
from .packs import BLOB_HEADER, BLOB_MAGIC, check_entry
from .recover import RecoverReport, install
from .remote import MARKER, commit_key, fetch_record, marker_problem, pack_entries, parse_reflog, read_tag, repair_marker

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
    entries: dict  # pack id -> [Entry] (from its .idx, or from walking the pack; a pack neither gives is absent: never garbage)
    bad_indexes: dict  # pack id -> why its .idx is missing or damaged (the pack was walked instead)
    objects: dict  # key -> ObjectInfo (everything under blobs/ and commits/)
    needs: dict  # commit id -> blob addresses, for every record on the bucket (a pack stays while a record stays)
    now: float  # the server's clock when the state was read (invariant 5)
    blind: list  # commits a tag names whose record cannot be read: what they need is unknown, so no pack goes


def _state(store, c: Collector) -> _State:
    """Mirror the bucket into the cache and compute liveness (reads every ref, record and ``.idx``).

    Liveness comes from the records alone (invariant 4): a pack's entries come from its
    ``.idx`` or, where that is missing or damaged, from the pack itself; a pack that
    cannot be read at all is kept. Ages use the server's clock (``backend.now()``)."""
    backend = store.backend
    refs = store.refs.read_all()
    store.log()  # mirrors the tags, caches every commit record, forgets the ones the bucket lost
    now = backend.now()
    # retention by age compares records' own times; the server's whole-second clock may be a second behind. (Young
    # records are kept by their objects' times, below, whatever this says.)
    c.now = now + MTIME_STEP
    with store.catalog.read():  # one snapshot: a writer sharing this cache folder may add commits meanwhile
        retained = c.retained()
    live = {k for cid in retained if store.has_cached(cid) for leaf in store.record(cid).leaves for k in leaf.keys}
    objects = {o.key: o for o in backend.list("blobs")}
    objects.update({o.key: o for o in backend.list("commits")})
    packs = {k.rsplit("/", 1)[1][:-5]: o for k, o in objects.items() if k.endswith(".pack")}
    found = dict(zip(packs, store.requests.map(lambda pid: pack_entries(backend, pid, packs[pid].size, index_key(pid) in objects), list(packs))))
    entries = {pid: f.entries for pid, f in found.items() if f.entries is not None}
    bad_indexes = {pid: f.index_problem for pid, f in found.items() if f.index_problem is not None}
    ids = [k.rsplit("/", 1)[1] for k in objects if k.startswith("commits/")]
    needs = {cid: {k for leaf in store.record(cid).leaves for k in leaf.keys} for cid in ids if store.has_cached(cid)}

    def needed(cid):  # a record written since the cache was brought up to date
        try:
            return cid, {k for leaf in fetch_record(backend, cid).leaves for k in leaf.keys}
        except IntegrityError:
            return cid, None  # gone, or damaged (fsck reports it); a failing server raises

    named = {c for c in refs.values() if c}
    needs.update(store.requests.map(needed, [c for c in set(ids) | named if c not in needs]))
    # A tag keeps its commit whatever the cache could copy of it; one whose record cannot be read leaves the
    # blobs it needs unknown: no pack is garbage then (blind).
    blind = sorted(c for c in named if needs.get(c) is None)
    needs = {c: keys for c, keys in needs.items() if keys is not None}
    retained |= named
    live.update(*(needs[c] for c in named if c in needs))
    return _State(refs, retained, live, packs, entries, bad_indexes, objects, needs, now, blind)


def repair_index(backend, pid: str, entries) -> None:
    """Replace pack ``pid``'s missing or damaged ``.idx`` by one encoded from ``entries``
    (walked from the pack itself). Indexes are derived data: the damaged copy is deleted
    and the rebuilt one written create-only."""
    backend.delete(index_key(pid))
    backend.put_new(index_key(pid), encode_index(entries))


def _dead_reflog(store, st: _State, cutoff: float) -> list[list]:
    """``[key, new, old]`` of every reflog object older than ``cutoff`` (server time) whose
    commits are both outside the retained set: retention governs the reflog too. A record
    that cannot be read is kept (fsck reports it)."""
    backend = store.backend
    todo = [o.key for o in backend.list("reflog") if o.mtime <= cutoff]

    def load(key):
        try:
            m = parse_reflog(backend.get(key), key, backend.url)
            return [key, m["new"], m["old"]]
        except (ObjectNotFoundError, IntegrityError):
            return None  # gone, or damaged: kept for fsck

    return [r for r in store.requests.map(load, todo) if r is not None and r[1] not in st.retained and r[2] not in st.retained]


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
    cutoff = st.now - grace - (MTIME_STEP if grace > 0 else 0.0)
    old = lambda key: key in st.objects and st.objects[key].mtime <= cutoff  # both times in the server's whole seconds
    dead_commits = sorted(k.rsplit("/", 1)[1] for k in st.objects if k.startswith("commits/") and old(k)
                          and k.rsplit("/", 1)[1] not in st.retained)
    # live: the retained commits' blobs, and those of every record this mark leaves on the bucket
    dropping = set(dead_commits)
    live_now = st.live.union(*(keys for cid, keys in st.needs.items() if cid not in dropping))
    dead_packs, repack, orphans = [], [], []
    if st.blind:
        report.withheld.append(f"no pack is collected while tags name commits whose record is missing or damaged: "
                               f"{', '.join(st.blind)} (`ckptstore fsck --deep` lists them)")
    for pid, info in st.packs.items():
        if st.blind or not old(pack_key(pid)) or pid not in st.entries:
            continue  # young, or unreadable: never garbage on an index's (or a failed read's) word
        live = [e for e in st.entries[pid] if e.magic == BLOB_MAGIC and (e.loc.digest, e.loc.raw_len) in live_now]
        if not live:
            dead_packs.append(pid)
        elif sum(BLOB_HEADER.size + e.loc.stored_len for e in live) < repack_below * info.size:
            repack.append((pid, live))
    orphans += [k for k in st.objects if k.endswith(".idx") and old(k) and k.rsplit("/", 1)[1][:-4] not in st.packs]
    reflog = _dead_reflog(store, st, cutoff)
    report.seconds["mark"] = time.perf_counter() - t0
    if dry_run:
        report.dropped = dead_commits
        report.commits_dropped = len(dead_commits)
        report.packs_deleted = len(dead_packs) + len(repack)
        report.packs_repacked = len(repack)
        report.bytes_pending = sum(st.packs[p].size for p in dead_packs) + sum(st.packs[p].size for p, _ in repack)
        return report
    t0 = time.perf_counter()
    dead = set(dead_packs)
    for pid in st.bad_indexes:
        if pid in st.entries and pid not in dead:
            repair_index(backend, pid, st.entries[pid])
            report.indexes_repaired += 1
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
    if marked or dead_commits or orphans or reflog:
        mark = {"at": st.now, "commits": dead_commits, "objects": orphans, "packs": marked, "reflog": reflog}
        backend.put_new(f"gc/{time.time_ns():020d}-{uuid.uuid4().hex}.json", json.dumps(mark, sort_keys=True).encode())
        report.bytes_pending = sum(st.packs[p].size for p in marked)
    report.seconds["repack"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    _sweep(store, c, grace, report)
    report.seconds["sweep"] = time.perf_counter() - t0
    return report


def _sweep(store, c: Collector, grace: float, report: GCReport) -> None:
    backend = store.backend
    marks = backend.list("gc")
    now = backend.now() if marks else 0.0
    marks = [o for o in marks if o.mtime + (MTIME_STEP if grace > 0 else 0.0) <= now - grace]
    if not marks:
        return
    for o in marks:
        try:
            mark = json.loads(backend.get(o.key))
            packs = [p for p in mark["packs"] if type(p) is str]
            commits = [x for x in mark["commits"] if type(x) is str]
            objects = [x for x in mark.get("objects", []) if type(x) is str]
            reflog = [x for x in mark.get("reflog", []) if type(x) is list and len(x) == 3 and type(x[0]) is str and x[0].startswith("reflog/")]
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
            deletable = [p for p in doomed if not st.blind and p in st.entries and not ((_blob_keys(st.entries[p]) & live) - covered)]
            if store.refs.read_all() != st.refs:
                time.sleep(RANDOM.uniform(0.01, 0.1))
                continue  # a ref moved while we decided: decide again
            for x in victims:
                if commit_key(x) in st.objects:
                    backend.delete(commit_key(x))
                    report.bytes_freed += st.objects[commit_key(x)].size
                    report.dropped.append(x)
            for p in deletable:
                blobs = [e for e in st.entries[p] if e.magic == BLOB_MAGIC and (e.loc.digest, e.loc.raw_len) not in live]
                report.blobs_deleted += len(blobs)
                report.blob_bytes += sum(BLOB_HEADER.size + e.loc.stored_len for e in blobs)
                backend.delete(pack_key(p))
                backend.delete(index_key(p))
                report.bytes_freed += st.packs[p].size + (st.objects[index_key(p)].size if index_key(p) in st.objects else 0)
                report.packs_deleted += 1
            for key in objects:
                if key in st.objects:
                    backend.delete(key)
                    report.bytes_freed += st.objects[key].size
                    report.orphans_removed += 1
            for key, new_, old_ in reflog:  # a ref move whose commits are all dropped has nothing left to tell
                if new_ not in st.retained and old_ not in st.retained:
                    backend.delete(key)
                    report.reflog_removed += 1
            store.forget(victims)
            backend.delete(o.key)
            break
    report.commits_dropped = len(report.dropped)
    report.bytes_pending = max(0, report.bytes_pending - report.bytes_freed)
    store.refresh_index()


def check(store, deep: bool = False, sample: float = 1.0, commit: str | None = None, seed: int | None = None,
          repair: bool = False) -> FsckReport:
    """Check a :class:`~ckptstore.bucket.BucketStore` against the bucket's own objects.

    Every tag names a commit whose record is on the bucket and hashes to its id; every
    blob of every commit (or of ``commit``) is in a pack the bucket holds. With ``deep``,
    nothing the cache holds is trusted: every record is fetched and checked against its
    id, every pack's ``.idx`` is read and checked (a pack whose index is missing or damaged
    is walked instead, and reported when a record needs it), the blobs are located
    through those bucket entries and each (or a ``sample`` fraction, at least one per
    commit) is read and rehashed in bounded memory (:func:`~ckptstore.packs.check_entry`);
    the reflog objects and the store marker are checked too. Packs nobody needs without
    ``.idx`` are reported as orphans (GC removes them). ``repair`` rebuilds every damaged
    or missing index whose pack can be walked and rewrites a damaged marker
    (:func:`~ckptstore.remote.repair_marker`), listing what it rewrote in ``repaired``.

    Raises:
        BackendError: the storage failed (nothing is reported as damage for that).
    """
    report = FsckReport()
    backend = store.backend
    rng = random.Random(seed)
    deep = deep or repair
    heads: set[str] = set()
    if commit is None:
        for name in backend.list_refs():
            try:
                cid = read_tag(backend, name)[0]  # a malformed payload is a damaged tag, not the end of the check
                if cid is None:
                    continue
                heads.add(cid)
                if deep or not store.has_cached(cid):
                    fetch_record(backend, cid)
            except IntegrityError as exc:
                report.damaged_tags.append(name)
                report.problems.append(f"tag {name!r}: {exc}")
        records = [o.key.rsplit("/", 1)[1] for o in backend.list("commits")]
    else:
        records = [commit]
    recs = {}

    def load(cid):
        try:
            return cid, fetch_record(backend, cid) if deep or not store.has_cached(cid) else store.record(cid)
        except IntegrityError as exc:
            return cid, exc

    for cid, rec in store.requests.map(load, records):
        if isinstance(rec, IntegrityError):
            report.damaged_commits.append(cid)
            report.problems.append(f"commit {cid}: {rec}")
        else:
            recs[cid] = rec
    listed = {o.key: o for o in backend.list("blobs")}
    packs = {k.rsplit("/", 1)[1][:-5]: o for k, o in listed.items() if k.endswith(".pack")}
    needed = {k for rec in recs.values() for leaf in rec.leaves for k in leaf.keys}
    if deep:
        found = dict(zip(packs, store.requests.map(lambda p: pack_entries(backend, p, packs[p].size, index_key(p) in listed), list(packs))))
    else:
        store.refresh_index()
        found = {}
    where = {}
    for pid, f in found.items():
        if f.entries is None:
            report.damaged_packs.append(pid)
            report.problems.append(f"pack {pid}: {f.pack_problem}" + (f" (and {f.index_problem})" if f.index_problem else ""))
            continue
        blobs = {(e.loc.digest, e.loc.raw_len): e.loc for e in f.entries if e.magic == BLOB_MAGIC}
        for k, loc in blobs.items():
            where.setdefault(k, loc)
        if f.index_problem is None:
            continue
        if repair:
            repair_index(backend, pid, f.entries)
            report.repaired.append(index_key(pid))
        elif index_key(pid) not in listed:
            # a writer killed between its pack and its index (the pack is whole: PUTs are atomic), or a deleted index:
            # nothing is lost, the pack is walked instead; GC removes it when nothing needs it, or rebuilds the index
            (report.missing_indexes if blobs.keys() & needed else report.orphan_packs).append(pid)
        else:
            report.damaged_indexes.append(pid)
            report.problems.append(f"pack {pid}: {f.index_problem} (its pack is intact: `ckptstore fsck --repair` rebuilds it)")
    if not deep:  # packs without .idx: a writer killed in between, or a lost index (deep fsck tells which are needed)
        report.missing_indexes = sorted(p for p in packs if index_key(p) not in listed)
        where = {k: loc for k, loc in store.locate(list(needed)).items() if loc.pack in packs}
    if commit is None and deep:
        _check_reflog(store, report)
        _check_marker(store, report, repair)
    reach = _lineage(recs, heads) if commit is None else set(records)
    reread: dict = {}  # (digest, length) -> None or the problem of the blob, once reread
    for cid, rec in recs.items():
        report.commits += 1
        keys = list(dict.fromkeys(k for leaf in rec.leaves for k in leaf.keys))
        missing = [k for k in keys if k not in where]
        if missing and cid not in reach:
            # no tag reaches it: a commit killed between its record and its ref move, whose packs a GC swept
            # meanwhile, leaves this (it never returned); GC drops the record. Not a problem.
            report.orphan_commits.append(cid)
            continue
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
        for loc, problem in _reread(store, [where[k] for k in todo if k not in reread], f"commit {cid}"):
            reread[(loc.digest, loc.raw_len)] = problem
            if problem is None:  # each blob counted and read once, as a local fsck does, however many commits share it
                report.blobs_checked += 1
                report.bytes_checked += loc.raw_len
            else:
                report.corrupt_blobs.append(loc.address)
                report.problems.append(problem)
        if any(reread.get(k) is not None for k in todo) and cid not in report.damaged_commits:
            report.damaged_commits.append(cid)
    return report


def _lineage(recs: dict, heads: set) -> set:
    """The commits of ``recs`` (id -> record) on the lineage of ``heads``."""
    seen, stack = set(), list(heads)
    while stack:
        c = stack.pop()
        if c in seen or c not in recs:
            continue
        seen.add(c)
        stack += recs[c].parents
    return seen


def _reread(store, locs, where: str):
    """``(loc, None or the problem)`` for each blob, read from the bucket with one coalesced
    ranged read per pack and verified in bounded memory (never allocating what a header claims)."""
    by_pack: dict = {}
    for loc in locs:
        by_pack.setdefault(loc.pack, []).append(loc)

    def read(item):
        pid, group = item
        try:
            bufs = store.backend.get_ranges(pack_key(pid), [(loc.offset, loc.offset + BLOB_HEADER.size + loc.stored_len) for loc in group])
        except IntegrityError as exc:  # gone since listed, or shorter than its index says
            return [(loc, f"{where}: blob {loc.address}: {exc}") for loc in group]
        out = []
        for loc, buf in zip(group, bufs):
            try:
                check_entry(buf, loc, f"{store.backend.url}: {where}, pack {pid}")
                out.append((loc, None))
            except BlobCorruptError as exc:
                out.append((loc, str(exc)))
        return out

    return [r for rs in store.requests.map(read, list(by_pack.items())) for r in rs]


def _check_reflog(store, report: FsckReport) -> None:
    """Every reflog object is a ref-move record of the tag its key names (:func:`~ckptstore.remote.parse_reflog`)."""
    backend = store.backend

    def load(key):
        try:
            parse_reflog(backend.get(key), key, backend.url)
        except ObjectNotFoundError:
            return None  # collected meanwhile
        except IntegrityError:
            return key
        return None

    for key in store.requests.map(load, [o.key for o in backend.list("reflog")]):
        if key is not None:
            report.damaged_reflog.append(key)
            report.problems.append(f"{key}: not a ref-move record (damaged); only the tag's history loses this entry")


def _check_marker(store, report: FsckReport, repair: bool) -> None:
    problem = marker_problem(store.backend)
    if problem is None:
        return
    if repair:
        try:
            repair_marker(store.backend, store)
            report.repaired.append(MARKER)
            return
        except IntegrityError as exc:
            problem = str(exc)
    report.damaged_marker = True
    report.problems.append(f"{problem} (`ckptstore fsck --repair` rewrites it from the intact copy)" if not repair else problem)


def recover(probe, folder) -> RecoverReport:
    """Rebuild the local cache (the index) of a store on object storage
    from the bucket's objects alone, as ``recover`` rebuilds a local catalog from its packs.

    A new cache is built beside the old one: every pack is indexed from its ``.idx``, or by
    walking the pack where the index is missing or damaged, and that index is rewritten
    on the bucket (``report.repaired``; the one write, of a derived object, as
    ``fsck --repair`` does); every commit record under ``commits/`` is fetched and checked
    against its id and kept if every blob it names is in a readable pack; every tag is
    read and kept if it names a kept commit; every reflog object is checked. The new
    cache then replaces the old one (SQLite's backup API, :func:`ckptstore.recover.install`),
    whatever it held: it holds only copies of the bucket's objects. Blob payloads are not
    reread: run ``fsck --deep`` afterwards.

    Returns a :class:`~ckptstore.recover.RecoverReport` with the local report's fields:
    ``packs``, ``blobs``, ``commits``, ``tags``, ``reflog`` restored; every pack, record,
    commit and tag that could not be restored in ``damaged_packs``, ``bad_records``,
    ``dropped_commits`` (``incomplete_commits``), ``dropped_tags`` and ``problems``
    (``ok`` false, ``lost()`` names each with why).

    ``probe`` is the store opened on an empty scratch cache (:func:`ckptstore.bucket.recover`
    builds it and removes it afterwards); ``folder`` is the cache folder to replace.

    Raises:
        BackendError: the storage failed (nothing was installed).
        CatalogBusyError: another process holds the cache's write lock.
    """
    t0 = time.perf_counter()
    report = RecoverReport()
    _rebuild_cache(probe, report)
    folder.mkdir(parents=True, exist_ok=True)
    install(folder, probe.catalog, report)
    (folder / "refs.json").unlink(missing_ok=True)  # the stamps of refs the old cache read: read them all again
    report.installed = True
    report.seconds = time.perf_counter() - t0
    return report


def _rebuild_cache(store, report: RecoverReport) -> None:
    """Fill ``store``'s empty cache from its bucket; record what could not be restored in ``report``."""
    backend = store.backend
    store.refresh_index()
    for pid, found in sorted(store.pack_problems.items()):
        if found.entries is None:
            report.damaged_packs[pid] = found.pack_problem
            also = f" (and {found.index_problem})" if found.index_problem else ""
            report.problems.append(f"pack {pid}.pack: {found.pack_problem}{also}: its blobs were not indexed")
        else:
            repair_index(backend, pid, found.entries)
            report.repaired.append(index_key(pid))
    ids = [o.key.rsplit("/", 1)[1] for o in backend.list("commits")]

    def load(cid: str):
        try:
            return fetch_record(backend, cid)
        except IntegrityError as exc:
            return exc

    records = {}
    for cid, rec in zip(ids, store.requests.map(load, ids)):
        if isinstance(rec, IntegrityError):
            report.bad_records += 1
            report.dropped_commits[cid] = f"its record is damaged ({rec})"
        else:
            records[cid] = rec
    store.index_records(records, lenient=True)
    for cid, rec in records.items():
        if store.has_cached(cid):
            continue
        keys = list(dict.fromkeys(k for leaf in rec.leaves for k in leaf.keys))
        where = store.locate(keys)
        missing = [address(*k) for k in keys if k not in where]
        report.incomplete_commits.append(cid)
        report.dropped_commits[cid] = f"{len(missing)} of its blobs are in no readable pack (e.g. {missing[0] if missing else '?'})"
    refs = store.refs.read_all(strict=False)  # a malformed ref is left out: read again below for its reason
    for name in backend.list_refs():
        if name in refs:
            continue
        try:
            read_tag(backend, name)
            why = "it could not be read"
        except IntegrityError as exc:
            why = f"its ref is damaged ({exc})"
        report.dropped_tags[name] = why
    for name, cid in store.tags().items():
        if store.has_cached(cid):
            report.tags[name] = cid
        else:
            why = report.dropped_commits.get(cid, "no record of it is on the bucket")
            report.dropped_tags[name] = f"it names commit {cid}, which could not be restored: {why}"
    reflog = [o.key for o in backend.list("reflog")]

    def check_move(key: str) -> str | None:
        try:
            parse_reflog(backend.get(key), key, backend.url)
        except ObjectNotFoundError:
            return ""  # collected meanwhile
        except IntegrityError as exc:
            return str(exc)
        return None

    for key, problem in zip(reflog, store.requests.map(check_move, reflog)):
        if problem is None:
            report.reflog += 1
        elif problem:
            report.bad_records += 1
            report.problems.append(f"unreadable record: {key}: {problem}")
    report.packs = len({o.key for o in backend.list("blobs") if o.key.endswith(".pack")})
    report.blobs = store.catalog.rows("SELECT COUNT(*) FROM blobs", raw=True)[0][0]
    report.commits = store.catalog.rows("SELECT COUNT(*) FROM commits", raw=True)[0][0]
    report.tags = dict(sorted(report.tags.items()))
