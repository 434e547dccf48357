"""The bucket home's sides of the maintenance protocols written once in :mod:`ckptstore.protocols.gc`
and :mod:`ckptstore.protocols.fsck`: :class:`BucketFsck` (an :class:`~ckptstore.protocols.fsck.FsckSide`: the
bucket's own objects, never the cache) and :class:`BucketGC` (a
:class:`~ckptstore.protocols.gc.GCSide`: no lock, the server's clock, a mark ``gc/<time>-<uuid>.json``
swept a grace period later). ``BucketHome.fsck_side()`` and ``BucketHome.gc_side()`` hand
them out.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
import uuid
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

from ..core.errors import BlobCorruptError, BlobMissingError, IntegrityError, ObjectNotFoundError
from ..objects.bucketformat import (
    MARKER,
    GCMarks,
    commit_key,
    fetch_record,
    marker_problem,
    pack_entries,
    parse_reflog,
    read_gc_marks,
    read_tag,
    repair_index,
    repair_marker,
)
from ..objects.packindex import INDEX_ENTRY, INDEX_HEADER, index_key, pack_key
from ..objects.packindex import TRAILER as INDEX_TRAILER
from ..objects.packs import BLOB_HEADER, BLOB_MAGIC, BlobLoc, check_entry
from .base import Home  # (a BucketHome: the bucket home's module imports this one)
from .refs import resolve_on_bucket as resolve_remote
from .upkeep import FsckSide, GCReport, GCSide, PackStat, packed

_CID = re.compile(r"[0-9a-f]{32}")


class BucketFsck(FsckSide):
    """The primitives of the fsck protocol (:mod:`ckptstore.protocols.fsck`) on a bucket: the bucket's
    own objects (refs, ``commits/``, packs and their indexes, reflog, marker), never the cache."""

    def __init__(self, home: Home):
        self.home, self.backend, self.requests = home, home.backend, home.requests
        self.url = self.location = home.url

    #: A commit's record is put before its ref moves: a killed commit may leave a record no tag reaches.
    attempts_leave_records = True
    #: Bytes: fsck rereads at most this much of one pack per ranged read (memory stays bounded).
    fsck_batch = 16 << 20

    def start(self, repair: bool) -> None:
        """Before any read: the prefix must hold a store (NotAStoreError); ``repair`` is allowed."""
        self.home._need_store()

    def resolve(self, ref: str) -> str:
        """The commit id ``ref`` (a tag or a full id) names on the bucket; nothing is copied into the cache."""
        cid = ref if type(ref) is str and _CID.fullmatch(ref) else None
        return cid if cid is not None else self.home.refs.read(ref) or resolve_remote(self.backend, ref)[0]

    def snapshot(self):
        """Nothing to hold: the objects are immutable, and the tags are read before the records they name."""
        return contextlib.nullcontext()

    def tags(self, report) -> dict[str, str]:
        """``{tag: commit id}`` from the refs on the bucket; a malformed ref is a damaged tag."""
        def read(name: str):
            try:
                return name, read_tag(self.backend, name)[0]
            except IntegrityError as exc:  # a malformed payload is a damaged tag, not the end of the check
                return name, exc

        out = {}
        for name, cid in self.requests.map(read, self.backend.list_refs()):
            if isinstance(cid, IntegrityError):
                report.damaged_tags.append(name)
                report.problems.append(f"tag {name!r}: {cid}")
            elif cid is not None:
                out[name] = cid
        return out

    def commits(self, report, ids: list[str] | None, deep: bool) -> dict[str, Any]:
        """``{commit id: CommitRecord, or None when damaged}`` of the ``commits/`` objects
        (``ids``, or every one listed), each fetched and checked against its id (without
        ``deep``, a record the cache holds is read from the cache); a damaged one is reported."""
        ids = [o.key.rsplit("/", 1)[1] for o in self.backend.list("commits")] if ids is None else ids

        def load(cid: str):
            try:
                return cid, fetch_record(self.backend, cid) if deep or not self.home.has_cached(cid) else self.home.record(cid)
            except IntegrityError as exc:
                return cid, exc

        out: dict[str, Any] = {}
        for cid, rec in self.requests.map(load, ids):
            out[cid] = None if isinstance(rec, IntegrityError) else rec
            if out[cid] is None:
                report.damaged_commits.append(cid)
                report.problems.append(f"commit {cid}: {rec}")
        return out

    def locate(self, report, keys: list[tuple[bytes, int]], deep: bool, repair: bool) -> dict:
        """``{address: BlobLoc}`` of the blobs of ``keys`` that packs on the bucket hold. With
        ``deep`` from each pack's entries as the bucket holds them: its ``.idx``, checked, or
        the pack walked when that is missing or damaged (``damaged_indexes``: a problem;
        ``missing_indexes`` for a pack ``keys`` need, else ``orphan_packs``: a writer killed
        between its pack and its index leaves that; ``damaged_packs``: neither can be read).
        ``repair`` rebuilds each such index from its walked pack (``repaired``). Without
        ``deep``, from the cache's index brought up to date, for the packs the bucket lists."""
        listed = {o.key: o for o in self.backend.list("blobs")}
        packs = {k.rsplit("/", 1)[1][:-5]: o for k, o in listed.items() if k.endswith(".pack")}
        if not deep:
            self.home.refresh_index()
            report.missing_indexes = sorted(p for p in packs if index_key(p) not in listed)
            return {k: loc for k, loc in self.home.locate(keys).items() if loc.pack in packs}
        needed = set(keys)
        where: dict = {}
        packs = dict(sorted(packs.items(), key=lambda po: po[1].mtime, reverse=True))  # of several copies, the newest (as a new cache)
        found = zip(packs, self.requests.map(lambda p: pack_entries(self.backend, p, packs[p].size, index_key(p) in listed), list(packs)))
        for pid, f in found:
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
                repair_index(self.backend, pid, f.entries)
                report.repaired.append(index_key(pid))
            elif index_key(pid) not in listed:
                # a writer killed between its pack and its index (the pack is whole: PUTs are atomic), or a deleted index:
                # nothing is lost, the pack is walked instead; GC removes it when nothing needs it, or rebuilds the index
                (report.missing_indexes if blobs.keys() & needed else report.orphan_packs).append(pid)
            else:
                report.damaged_indexes.append(pid)
                report.problems.append(f"pack {pid}: {f.index_problem} (its pack is intact: `ckptstore fsck --repair` rebuilds it)")
        return {k: where[k] for k in keys if k in where}

    def read(self, locs: list[BlobLoc], reread: set):
        """``(loc, error)`` for each blob of ``locs`` in ``reread`` (addresses), read from the
        bucket with coalesced ranged reads per pack (at most :attr:`fsck_batch` bytes at a
        time per pack, :data:`~ckptstore.objects.bucketformat.REQUESTS` packs at once) and checked in bounded memory
        (:func:`~ckptstore.objects.packs.check_entry`, never allocating what a header claims):
        ``None`` when intact, a BlobCorruptError, or a BlobMissingError when the pack is
        gone or shorter since listed. The others are in packs listed with their entries."""
        by_pack: dict[str, list[BlobLoc]] = {}
        for loc in locs:
            if (loc.digest, loc.raw_len) in reread:
                by_pack.setdefault(loc.pack, []).append(loc)
        batches: list[list[BlobLoc]] = []
        for group in by_pack.values():
            batch, size = [], 0
            for loc in group:
                if batch and size + BLOB_HEADER.size + loc.stored_len > self.fsck_batch:
                    batches.append(batch)
                    batch, size = [], 0
                batch.append(loc)
                size += BLOB_HEADER.size + loc.stored_len
            batches.append(batch)

        def read(group: list[BlobLoc]):
            pid = group[0].pack
            try:
                bufs = self.backend.get_ranges(pack_key(pid), [loc.span for loc in group])
            except IntegrityError as exc:  # gone since listed, or shorter than its index says
                return [(loc, BlobMissingError(f"blob {loc.address} in pack {pid}: {exc}")) for loc in group]
            out = []
            for loc, buf in zip(group, bufs):
                try:
                    check_entry(buf, loc, f"{self.url}: fsck, pack {pid}")
                    out.append((loc, None))
                except BlobCorruptError as exc:
                    out.append((loc, exc))
            return out

        for results in self.requests.map(read, batches):
            yield from results

    def replace_bad(self, report, locs: list[BlobLoc]):
        """For each bad copy of ``locs``, another copy of its address in a pack on the bucket
        (newest pack first; each pack's entries from its ``.idx``, or the pack walked), read and
        checked; the cache's row of the address is pointed at the first intact one and its mark
        deleted. Yields ``(bad loc, good loc)`` for each one replaced. The bucket keeps the bad
        copy (packs are immutable): a new cache takes the newest pack's copy, a failed read
        marks the other and moves the row (docs/design.md, "What dedup trusts")."""
        want = {(loc.digest, loc.raw_len): loc for loc in locs}
        listed = {o.key: o for o in self.backend.list("blobs")}
        packs = sorted(((k.rsplit("/", 1)[1][:-5], o) for k, o in listed.items() if k.endswith(".pack")), key=lambda po: po[1].mtime, reverse=True)
        for pid, o in packs:
            if not want:
                break
            found = pack_entries(self.backend, pid, o.size, index_key(pid) in listed)
            for e in found.entries or []:
                k = (e.loc.digest, e.loc.raw_len)
                bad = want.get(k)
                if bad is None or e.magic != BLOB_MAGIC or (e.loc.pack, e.loc.offset) == (bad.pack, bad.offset):
                    continue
                try:
                    check_entry(self.backend.get_ranges(pack_key(pid), [e.loc.span])[0], e.loc, f"{self.url}: fsck --repair, pack {pid}")
                except IntegrityError:
                    continue  # a bad copy too (or gone since listed)
                current = self.home.locate([k]).get(k)
                if current is not None and self.home.replace_copy(current, e.loc):
                    del want[k]
                    yield bad, e.loc

    def extra(self, report, ids: list[str], whole: bool, deep: bool, repair: bool) -> None:
        """With ``whole`` and ``deep``: every reflog object is a ref-move record of the tag its
        key names (``damaged_reflog``), and the store marker passes its check
        (``damaged_marker``; ``repair`` rewrites it from its intact copy, ``repaired``)."""
        if not (whole and deep):
            return

        def load(key: str):
            try:
                parse_reflog(self.backend.get(key), key, self.url)
            except ObjectNotFoundError:
                return None  # collected meanwhile
            except IntegrityError:
                return key
            return None

        for key in self.requests.map(load, [o.key for o in self.backend.list("reflog")]):
            if key is not None:
                report.damaged_reflog.append(key)
                report.problems.append(f"{key}: not a ref-move record (damaged); only the tag's history loses this entry")
        problem = marker_problem(self.backend)
        if problem is None:
            return
        if repair:
            try:
                repair_marker(self.backend, self.home)
                report.repaired.append(MARKER)
                return
            except IntegrityError as exc:
                problem = str(exc)
        report.damaged_marker = True
        report.problems.append(problem if repair else f"{problem} (`ckptstore fsck --repair` rewrites it from the intact copy)")


# --- the GC primitives of a bucket (ckptstore.protocols.gc.GCSide) -------------------------------------

#: Seconds: S3 (and moto) give object times in whole seconds, so an object may be this much younger than
#: its time says; a grace period above 0 waits this much longer, or a just-written pack or mark looks old.
MTIME_STEP = 1.0
#: The grace period's default on a bucket (seconds): a reader that resolved a tag before a mark has this long.
BUCKET_GRACE = 86400.0


@dataclass
class _GCState:
    """What the bucket holds at one read: refs, objects, pack entries, records' needs, marks."""

    refs: dict
    now: float  # the server's clock (invariant 5)
    objects: dict  # key -> ObjectInfo (everything under blobs/ and commits/)
    packs: dict  # pack id -> ObjectInfo
    entries: dict  # pack id -> [Entry] (its .idx, or the pack walked; a pack neither gives is absent: never garbage)
    bad_indexes: dict  # pack id -> why its .idx is missing or damaged (walked instead)
    needs: dict  # commit id -> blob addresses, for every record on the bucket and every commit a tag names
    blind: list  # commits a tag names whose record cannot be read: what they need is unknown, so no pack goes
    marks: list  # (mtime, key, mark dict) of every readable gc/*.json
    unreadable_marks: list  # keys of marks that cannot be read (deleted by the sweep; writers reuse no pack made no later: GCMarks)


class BucketGC(GCSide):
    """The primitives of the GC protocol (:mod:`ckptstore.protocols.gc`) on a bucket: no lock (any
    number of writers and GCs run beside it), the server's clock (``Backend.now()``, whole
    seconds: :data:`MTIME_STEP`; no time of this machine is compared with an object's),
    liveness from the records alone (invariant 4: a pack's entries from its ``.idx``, or the
    pack walked where that is missing or damaged, the index then rebuilt; a pack that cannot
    be read is never garbage, and no pack is while a tag names a commit whose record cannot
    be read). Nothing leaves at once (:meth:`drop` does nothing): the mark is
    ``gc/<time>-<uuid>.json`` = ``{"at", "packs", "commits", "objects", "reflog"}``
    (create-only), naming the dead and copied packs, the victims' records, ``.idx`` objects
    without pack and reflog objects whose commits are both dropped; the sweep of a mark a
    grace period old deletes what is still unneeded and the mark. A pack's live blob held by
    another, unmarked pack (a copy, or a writer's rewrite: invariant 6) does not keep a
    marked pack. A copy's live blobs are read by ranged GETs, verified, and written into new
    packs and ``.idx`` before the old packs are marked.

    ``BackendError``: the storage failed (what was deleted stays deleted; run again).
    """

    default_grace = BUCKET_GRACE
    clock_step = MTIME_STEP

    def __init__(self, home: Home):
        self.home = home
        self.backend = home.backend
        self.st: _GCState | None = None
        self._cutoff = 0.0
        self._keep: set = set()
        self._reflog_seen: dict = {}  # reflog key -> [key, new, old] (None: unreadable)
        self._live_entries: dict = {}

    def lock(self, dry_run: bool):
        return nullcontext()

    def now(self, fresh: bool) -> float:
        if fresh or self.st is None:
            self.st = self._read()
        return self.st.now

    def _read(self) -> _GCState:
        """Mirror the bucket into the cache and read what liveness needs (every ref, record, ``.idx`` and mark)."""
        home, backend, requests = self.home, self.backend, self.home.requests
        home.log()  # mirrors the tags, caches every commit record, forgets the ones the bucket lost
        now = backend.now()
        objects = {o.key: o for o in backend.list("blobs")}
        objects.update({o.key: o for o in backend.list("commits")})
        packs = {k.rsplit("/", 1)[1][:-5]: o for k, o in objects.items() if k.endswith(".pack")}
        found = dict(zip(packs, requests.map(lambda pid: pack_entries(backend, pid, packs[pid].size, index_key(pid) in objects), list(packs))))
        entries = {pid: f.entries for pid, f in found.items() if f.entries is not None}
        bad_indexes = {pid: f.index_problem for pid, f in found.items() if f.index_problem is not None}
        ids = [k.rsplit("/", 1)[1] for k in objects if k.startswith("commits/")]
        needs = {cid: {k for leaf in home.record(cid).leaves for k in leaf.keys} for cid in ids if home.has_cached(cid)}

        def needed(cid):  # a record written since the cache was brought up to date
            try:
                return cid, {k for leaf in fetch_record(backend, cid).leaves for k in leaf.keys}
            except IntegrityError:
                return cid, None  # gone, or damaged (fsck reports it); a failing server raises

        # The refs read after the listings: a commit a ref names now whose record came after them is
        # fetched below (so its blobs are live), and the sweep's check that no ref moved covers only its decision.
        refs = home.refs.read_all()
        named = {c for c in refs.values() if c}
        needs.update(requests.map(needed, [c for c in set(ids) | named if c not in needs]))
        blind = sorted(c for c in named if needs.get(c) is None)
        needs = {c: keys for c, keys in needs.items() if keys is not None}
        marks = read_gc_marks(backend)  # (one listed but gone meanwhile: another GC swept it)
        return _GCState(refs, now, objects, packs, entries, bad_indexes, needs, blind, list(marks.marks), [k for k, _, _ in marks.unreadable])

    def snapshot(self):
        return self.home.catalog.read()  # one snapshot: a writer sharing this cache folder may add commits meanwhile

    def _marked(self, field_: str) -> dict:
        """``{name: time of the oldest mark naming it}`` for one field of the marks."""
        return GCMarks(tuple(self.st.marks)).oldest(field_)

    def commits(self, keep: set) -> dict:
        marked = self._marked("commits")
        return {k.rsplit("/", 1)[1]: (o.mtime, marked.get(k.rsplit("/", 1)[1]), o.size)
                for k, o in self.st.objects.items() if k.startswith("commits/")}

    def packs(self, keep: set, victims: list, cutoff: float) -> list[PackStat]:
        st, home = self.st, self.home
        self._cutoff, self._keep = cutoff, keep
        dropping = set(victims) - keep
        live = set().union(*(keys for c, keys in st.needs.items() if c not in dropping or c in keep))
        live |= {k for c in keep if c not in st.needs and home.has_cached(c) for leaf in home.record(c).leaves for k in leaf.keys}
        marked = self._marked("packs")
        holders: dict = {}  # address -> the unmarked, readable packs holding it
        for pid, entries in st.entries.items():
            if pid not in marked:
                for e in entries:
                    if e.magic == BLOB_MAGIC:
                        holders.setdefault((e.loc.digest, e.loc.raw_len), set()).add(pid)
        out = []
        for pid, info in st.packs.items():
            idx = st.objects.get(index_key(pid))
            freed = info.size + (idx.size if idx is not None else 0)
            if pid not in st.entries:
                out.append(PackStat(pid, info.size, info.mtime, marked.get(pid), 1, info.size, freed, keep=True))
                continue
            blobs = [e for e in st.entries[pid] if e.magic == BLOB_MAGIC]
            alive = [e for e in blobs if (e.loc.digest, e.loc.raw_len) in live]
            only = [e for e in alive if pid not in marked or not holders.get((e.loc.digest, e.loc.raw_len))]
            dead = [e for e in blobs if (e.loc.digest, e.loc.raw_len) not in live]
            self._live_entries[pid] = alive
            size = lambda es: sum(BLOB_HEADER.size + e.loc.stored_len for e in es)
            out.append(PackStat(pid, info.size, info.mtime, marked.get(pid), len(only), size(only), freed,
                                dies_with=len(dead), dies_with_bytes=size(dead), keep=bool(st.blind)))
        return out

    def withheld(self) -> list[str]:
        if not self.st.blind:
            return []
        return [f"no pack is collected while tags name commits whose record is missing or damaged: "
                f"{', '.join(self.st.blind)} (`ckptstore fsck --deep` lists them)"]

    def copy_size(self, batch: list[PackStat]) -> int:
        sizes = [BLOB_HEADER.size + e.loc.stored_len for p in batch for e in self._live_entries[p.id]]
        return sum(size + INDEX_HEADER.size + n * INDEX_ENTRY.size + INDEX_TRAILER for n, size in packed(sizes, self.home.pack_bytes))

    def copy(self, batch: list[PackStat], report: GCReport) -> int:
        backend, writer = self.backend, self.home.pack_writer()
        with writer:
            for p in batch:
                live = self._live_entries[p.id]
                bufs = backend.get_ranges(pack_key(p.id), [e.loc.span for e in live])
                for e, buf in zip(live, bufs):
                    payload = check_entry(buf, e.loc, f"{backend.url}: pack {p.id}")
                    writer.append_encoded(e.loc.digest, e.loc.raw_len, e.loc.codec, bytes(payload))
            writer.finish()
        self.home.refresh_index()
        return writer.bytes_uploaded

    def mark(self, plan, report: GCReport) -> None:
        st, backend = self.st, self.backend
        dead = {p.id for p in plan.dead}
        for pid in st.bad_indexes:
            if pid in st.entries and pid not in dead:
                repair_index(backend, pid, st.entries[pid])
                report.indexes_repaired += 1
        old = lambda key: st.objects[key].mtime <= self._cutoff
        orphans = [k for k in st.objects if k.endswith(".idx") and old(k) and k.rsplit("/", 1)[1][:-4] not in st.packs]
        reflog = self._dead_reflog()
        packs = [p.id for p in plan.marked]
        if packs or plan.victims or orphans or reflog:
            mark = {"at": st.now, "commits": plan.victims, "objects": orphans, "packs": packs, "reflog": reflog}
            backend.put_new(f"gc/{time.time_ns():020d}-{uuid.uuid4().hex}.json", json.dumps(mark, sort_keys=True).encode())

    def _dead_reflog(self) -> list[list]:
        """``[key, new, old]`` of every reflog object older than the cutoff whose commits are
        both outside what retention keeps (retention governs the reflog too); one that cannot
        be read is kept (fsck reports it)."""
        backend, keep, seen = self.backend, self._keep, self._reflog_seen
        todo = [o.key for o in backend.list("reflog") if o.mtime <= self._cutoff]

        def load(key):
            try:
                m = parse_reflog(backend.get(key), key, backend.url)
                return key, [key, m["new"], m["old"]]
            except (ObjectNotFoundError, IntegrityError):
                return key, None

        seen.update(self.home.requests.map(load, [k for k in todo if k not in seen]))  # immutable: read once per run
        return [seen[k] for k in todo if seen[k] is not None and seen[k][1] not in keep and seen[k][2] not in keep]

    def _reflog_due(self, due: list, own: list = ()) -> set:
        """Keys of the reflog objects the marks ``due`` (and this run's ``own`` entries) name that are still on
        the bucket and whose commits are both outside what retention keeps."""
        named = [r for _, mark in due for r in mark["reflog"]] + list(own)
        if not named:
            return set()
        held = {o.key for o in self.backend.list("reflog")}
        return {key for key, new_, old_ in named if key in held and new_ not in self._keep and old_ not in self._keep}

    def refs_token(self) -> dict:
        return self.st.refs  # as the state just read saw them

    def delete(self, commits: list[str], packs: list[PackStat], token, report: GCReport) -> tuple[list, list] | None:
        st, backend = self.st, self.backend
        if self.home.refs.read_all() != token:
            return None
        due = [(key, mark) for mtime, key, mark in st.marks if mtime <= self._cutoff]
        for c in commits:
            backend.delete(commit_key(c))
        for p in packs:
            backend.delete(pack_key(p.id))
            backend.delete(index_key(p.id))
        for key in self._reflog_due(due):  # a ref move whose commits are all dropped has nothing left to tell
            backend.delete(key)
            report.reflog_removed += 1
        for obj in {obj for _, mark in due for obj in mark["objects"] if obj in st.objects}:
            backend.delete(obj)
            report.bytes_freed += st.objects[obj].size
            report.orphans_removed += 1
        self.home.forget(commits)
        for key in [k for k, _ in due] + st.unreadable_marks:
            backend.delete(key)
        self.home.refresh_index()
        return commits, packs

    def anything_due(self, cutoff: float) -> bool:
        return bool(self.st.unreadable_marks) or any(mtime <= cutoff for mtime, _, _ in self.st.marks)

    def leftovers(self, cutoff: float, own_due: bool, report: GCReport) -> None:
        """A dry run's count of the marks' other objects the sweep deletes (a real run's sweep deleted them)."""
        if not report.dry_run:
            return
        st = self.st
        objects = {obj for mtime, _, mark in st.marks if mtime <= cutoff for obj in mark["objects"] if obj in st.objects}
        if own_due:
            objects |= {k for k in st.objects if k.endswith(".idx") and st.objects[k].mtime <= cutoff and k.rsplit("/", 1)[1][:-4] not in st.packs}
        report.orphans_removed += len(objects)
        report.bytes_freed += sum(st.objects[k].size for k in objects)
        due = [(key, mark) for mtime, key, mark in st.marks if mtime <= cutoff]
        report.reflog_removed += len(self._reflog_due(due, self._dead_reflog() if own_due else ()))


__all__ = ["BucketFsck", "BucketGC"]
