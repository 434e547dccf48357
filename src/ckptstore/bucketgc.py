"""The bucket's side of the GC protocol (:func:`ckptstore.gc.collect`): mark and sweep on object storage
(docs/design.md, "GC on object storage").

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
(:meth:`ckptstore.bucket.BucketHome.index_commit`, invariant 6), so a sweep a grace
period after its mark removes nothing a commit landing meanwhile needs.

fsck and recover of a bucket store are in :mod:`ckptstore.fsck` and :mod:`ckptstore.recover`.
"""

from __future__ import annotations

import json
import time
import uuid
from contextlib import nullcontext
from dataclasses import dataclass

from .errors import IntegrityError, ObjectNotFoundError
from .gc import Collector, GCReport, choose_repacks, pack_kind
from .layout import RANDOM
from .packindex import index_key, pack_key
from .packs import BLOB_HEADER, BLOB_MAGIC, check_entry
from .remote import commit_key, fetch_record, pack_entries, parse_reflog, repair_index

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
    retained_at_grace_0: set  # what a grace period of 0 retains (for what is pending)
    live_at_grace_0: set


def _state(store, c: Collector, at_grace_0: bool = False) -> _State:
    """Mirror the bucket into the cache and compute liveness (reads every ref, record and ``.idx``);
    ``at_grace_0``: also what a grace period of 0 retains (``retained_at_grace_0``, ``live_at_grace_0``).

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
        if at_grace_0 and c.grace > 0:
            zero = c.at_grace_0()
            zero.now = c.now
            retained0 = zero.retained()
        else:
            retained0 = set(retained)
    keys_of = lambda commits: {k for cid in commits if store.has_cached(cid) for leaf in store.record(cid).leaves for k in leaf.keys}
    live = keys_of(retained)
    live0 = keys_of(retained0) if retained0 != retained else set(live)
    objects = {o.key: o for o in backend.list("blobs")}
    objects.update({o.key: o for o in backend.list("commits")})
    packs = {k.rsplit("/", 1)[1][:-5]: o for k, o in objects.items() if k.endswith(".pack")}
    found = dict(zip(packs, store.home.requests.map(lambda pid: pack_entries(backend, pid, packs[pid].size, index_key(pid) in objects), list(packs))))
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
    needs.update(store.home.requests.map(needed, [c for c in set(ids) | named if c not in needs]))
    # A tag keeps its commit whatever the cache could copy of it; one whose record cannot be read leaves the
    # blobs it needs unknown: no pack is garbage then (blind).
    blind = sorted(c for c in named if needs.get(c) is None)
    needs = {c: keys for c, keys in needs.items() if keys is not None}
    for keep, keys in ((retained, live), (retained0, live0)):
        keep |= named
        keys.update(*(needs[c] for c in named if c in needs))
    return _State(refs, retained, live, packs, entries, bad_indexes, objects, needs, now, blind, retained0, live0)


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

    return [r for r in store.home.requests.map(load, todo) if r is not None and r[1] not in st.retained and r[2] not in st.retained]


def _blob_keys(entries) -> set:
    return {(e.loc.digest, e.loc.raw_len) for e in entries if e.magic == BLOB_MAGIC}


@dataclass
class _Plan:
    """What a mark with the grace period's ``cutoff`` takes (and a sweep of it then deletes)."""

    commits: list  # commit records not retained
    dead: list  # packs with no live blob
    repack: list  # (pack id, live entries): half-dead packs
    small: list  # (pack id, live entries): small packs merged into large ones
    orphans: list  # an .idx without its pack
    blobs: int = 0  # blobs of the marked packs that nothing needs
    blob_bytes: int = 0
    bytes: int = 0  # of every object the sweep deletes: records, packs and their .idx, orphans

    @property
    def packs(self) -> list:
        return self.dead + [p for p, _ in self.repack + self.small]


def _plan(st: _State, cutoff: float, repack_below: float, small_pack_bytes: int, at_grace_0: bool = False) -> _Plan:
    """The mark's decision over ``st``: objects older than ``cutoff`` (server time) that are garbage,
    and the half-dead and small packs whose live blobs are copied first (:func:`ckptstore.gc.choose_repacks`);
    ``at_grace_0``: with what a grace period of 0 retains (what would go if nothing waited)."""
    old = lambda key: key in st.objects and st.objects[key].mtime <= cutoff  # both times in the server's whole seconds
    retained, live = (st.retained_at_grace_0, st.live_at_grace_0) if at_grace_0 else (st.retained, st.live)
    commits = sorted(k.rsplit("/", 1)[1] for k in st.objects if k.startswith("commits/") and old(k)
                     and k.rsplit("/", 1)[1] not in retained)
    # live: the retained commits' blobs, and those of every record this mark leaves on the bucket
    dropping = set(commits)
    live_now = live.union(*(keys for cid, keys in st.needs.items() if cid not in dropping))
    dead, half, small = [], [], []
    for pid, info in sorted(st.packs.items(), key=lambda kv: (kv[1].mtime, kv[0])):
        if st.blind or not old(pack_key(pid)) or pid not in st.entries:
            continue  # young, or unreadable: never garbage on an index's (or a failed read's) word
        live = [e for e in st.entries[pid] if e.magic == BLOB_MAGIC and (e.loc.digest, e.loc.raw_len) in live_now]
        kind = pack_kind(info.size, sum(BLOB_HEADER.size + e.loc.stored_len for e in live), len(live), repack_below, small_pack_bytes)
        if kind == "dead":
            dead.append(pid)
        elif kind is not None:
            (half if kind == "half" else small).append((pid, live))
    half, small = choose_repacks(half, small)
    orphans = [k for k in st.objects if k.endswith(".idx") and old(k) and k.rsplit("/", 1)[1][:-4] not in st.packs]
    plan = _Plan(commits, dead, half, small, orphans)
    size = lambda key: st.objects[key].size if key in st.objects else 0
    for pid in plan.packs:
        gone = [e for e in st.entries[pid] if e.magic == BLOB_MAGIC and (e.loc.digest, e.loc.raw_len) not in live_now]
        plan.blobs += len(gone)
        plan.blob_bytes += sum(BLOB_HEADER.size + e.loc.stored_len for e in gone)
        plan.bytes += size(pack_key(pid)) + size(index_key(pid))
    plan.bytes += sum(size(commit_key(c)) for c in commits) + sum(size(k) for k in orphans)
    return plan


class BucketGC:
    """The bucket's side of a GC (the module docstring): no lock, a mark of what is garbage,
    swept a grace period later; what waits for the grace period (:func:`ckptstore.gc.pending`)
    is a second decision over the state the mark read, at a grace period of 0 (no more
    requests). A dry run reports what this run's mark takes as freed (a sweep a grace
    period later deletes it).

    Its report (:class:`~ckptstore.gc.GCReport`, the local fields): ``commits_dropped``
    (records deleted, or marked in a dry run: ``dropped`` names them), ``blobs_deleted`` and
    ``blob_bytes`` (of the packs deleted), ``packs_repacked`` (half-dead), ``packs_consolidated``
    (small packs merged), ``packs_deleted``, ``orphans_removed`` (objects without their pair),
    ``bytes_freed`` (bytes deleted from the bucket) and the ``*_pending`` fields.
    ``BackendError``: the storage failed (what was deleted stays deleted; run again).
    """

    default_grace = DEFAULT_GRACE

    def __init__(self, store):
        self.store = store

    def lock(self, dry_run: bool):
        return nullcontext()  # any number of writers and GCs run beside it

    def run(self, c: Collector, report: GCReport) -> GCReport | None:
        store, grace, dry_run = self.store, c.grace, report.dry_run
        repack_below, backend = c.repack_below, store.backend
        t0 = time.perf_counter()
        st = _state(store, c, at_grace_0=True)
        cutoff = st.now - grace - (MTIME_STEP if grace > 0 else 0.0)  # a grace period above 0 waits out the whole second
        plan = _plan(st, cutoff, repack_below, c.small_pack_bytes)
        at_grace_0 = _plan(st, st.now, repack_below, c.small_pack_bytes, at_grace_0=True) if grace > 0 else plan
        if st.blind:
            report.withheld.append(f"no pack is collected while tags name commits whose record is missing or damaged: "
                                   f"{', '.join(st.blind)} (`ckptstore fsck --deep` lists them)")
        reflog = _dead_reflog(store, st, cutoff)
        report.seconds["mark"] = time.perf_counter() - t0
        if dry_run:
            report.dropped = plan.commits
            report.commits_dropped = len(plan.commits)
            report.packs_deleted = len(plan.packs)
            report.packs_repacked, report.packs_consolidated = len(plan.repack), len(plan.small)
            report.blobs_deleted, report.blob_bytes, report.bytes_freed = plan.blobs, plan.blob_bytes, plan.bytes
            return _as_report(at_grace_0)
        t0 = time.perf_counter()
        dead = set(plan.dead)
        for pid in st.bad_indexes:
            if pid in st.entries and pid not in dead:
                repair_index(backend, pid, st.entries[pid])
                report.indexes_repaired += 1
        if plan.repack or plan.small:
            writer = store.pack_writer()
            with writer:
                for pid, live in plan.repack + plan.small:
                    bufs = backend.get_ranges(pack_key(pid), [(e.loc.offset, e.loc.offset + BLOB_HEADER.size + e.loc.stored_len) for e in live])
                    for e, buf in zip(live, bufs):
                        payload = check_entry(buf, e.loc, f"{backend.url}: pack {pid}")
                        writer.append_encoded(e.loc.digest, e.loc.raw_len, e.loc.codec, bytes(payload))
                writer.finish()
            report.packs_repacked, report.packs_consolidated = len(plan.repack), len(plan.small)
            store.refresh_index()
        if plan.packs or plan.commits or plan.orphans or reflog:
            mark = {"at": st.now, "commits": plan.commits, "objects": plan.orphans, "packs": plan.packs, "reflog": reflog}
            backend.put_new(f"gc/{time.time_ns():020d}-{uuid.uuid4().hex}.json", json.dumps(mark, sort_keys=True).encode())
        report.seconds["repack"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        _sweep(store, c, grace, report)
        report.seconds["sweep"] = time.perf_counter() - t0
        return _as_report(at_grace_0) if grace > 0 else None


def _as_report(plan: _Plan) -> GCReport:
    """A plan as the report of a dry run that would carry it out."""
    return GCReport(dry_run=True, commits_dropped=len(plan.commits), blobs_deleted=plan.blobs, blob_bytes=plan.blob_bytes,
                    bytes_freed=plan.bytes)


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
            store.home.forget(victims)
            backend.delete(o.key)
            break
    report.commits_dropped = len(report.dropped)
    store.refresh_index()


