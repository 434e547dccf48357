"""Integrity checks of a store (``ckptstore fsck`` and ``ckptstore verify``), on both homes.

:func:`check` checks a local store (its catalog against its packs); :func:`check_bucket`
a store on object storage (the bucket's own objects, never trusting the local cache).
Both fill the same :class:`FsckReport`. For a local store:

Problems (non-zero exit): a catalog that fails SQLite's integrity or foreign-key
check; a commit whose record does not hash to its id, whose catalog rows
disagree with its record, or that has no copy of its record in a pack (with
``deep``: whose record in the pack is damaged); a tag naming a missing commit; a manifest row inconsistent with its
shards; a pack file missing or shorter than its blobs; with ``deep``, a blob
whose header or content hash is wrong. Each bad blob is mapped to the commits
and tags it hurts.

Orphans are reported but are not problems: pack files without a catalog row
(left by a crashed commit), blob rows no commit references yet, files in
``tmp/``. GC removes them after the grace period.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field

from . import progress
from .catalog import rebuild_record
from .errors import BlobCorruptError, CkptStoreError, IntegrityError, InvalidArgumentError, ObjectNotFoundError, ResourceLimitError
from .layout import ShardPlan, address, itemsize
from .packindex import index_key, pack_key
from .packs import BLOB_HEADER, BLOB_MAGIC, CODEC_RAW, RECORD_MAGIC, BlobLoc, PackReader, check_entry, pack_path
from .records import KIND_COMMIT, KIND_REF, parse_commit
from .remote import MARKER, fetch_record, marker_problem, pack_entries, parse_reflog, read_tag, repair_index, repair_marker


@dataclass
class FsckReport:
    """Result of :func:`check`. ``ok`` is false when ``problems`` is not empty."""

    problems: list[str] = field(default_factory=list)
    missing_blobs: list[str] = field(default_factory=list)
    corrupt_blobs: list[str] = field(default_factory=list)
    damaged_commits: list[str] = field(default_factory=list)
    damaged_tags: list[str] = field(default_factory=list)
    orphan_packs: list[str] = field(default_factory=list)
    orphan_commits: list[str] = field(default_factory=list)  # object storage: records no tag reaches whose blobs are gone (GC drops them)
    damaged_packs: list[str] = field(default_factory=list)  # packs that cannot be read or walked
    damaged_indexes: list[str] = field(default_factory=list)  # object storage: packs whose .idx is damaged (a problem)
    missing_indexes: list[str] = field(default_factory=list)  # object storage: needed packs without .idx (walked instead; not a problem)
    damaged_reflog: list[str] = field(default_factory=list)  # object storage: reflog objects that are not ref-move records
    damaged_marker: bool = False  # object storage: ckptstore.json fails its check
    repaired: list[str] = field(default_factory=list)  # what ``repair`` rebuilt (object keys)
    unreferenced_blobs: int = 0
    tmp_files: int = 0
    commits: int = 0
    blobs_checked: int = 0
    bytes_checked: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems


def check_sample(sample: float) -> float:
    """Validate ``sample`` (0 < sample <= 1), before any read on either home. Raises InvalidArgumentError."""
    if not 0 < sample <= 1:
        raise InvalidArgumentError(f"invalid sample fraction {sample!r}: must be in (0, 1]")
    return sample


def run(store, deep: bool = False, sample: float = 1.0, repair: bool = False) -> FsckReport:
    """``fsck`` on either home: ``sample`` < 1 implies ``deep``, ``repair`` implies it too;
    the home's side (``store.fsck_home()``: :class:`LocalFsck` or :class:`BucketFsck`) checks."""
    check_sample(sample)
    return store.fsck_home().check(deep=deep or sample < 1, sample=sample, repair=repair)


class LocalFsck:
    """A local store's side of fsck: its catalog against its packs (:func:`check`)."""

    def __init__(self, store):
        self.store = store

    def check(self, deep: bool, sample: float, repair: bool) -> FsckReport:
        if repair:
            raise InvalidArgumentError(f"{self.store.root}: a local store has no pack indexes to repair; its index is the catalog, "
                                       "rebuilt from the packs by `ckptstore recover`")
        return check(self.store, deep=deep, sample=sample)

    def verify(self, ref: str) -> FsckReport:
        return check(self.store, deep=True, commit=self.store.resolve(ref))


class BucketFsck:
    """A bucket store's side of fsck: the bucket's own objects, never the cache (:func:`check_bucket`);
    ``verify`` resolves the ref on the bucket (a tag, or a full id), copying nothing into the cache."""

    def __init__(self, store, resolve):
        self.store, self.resolve = store, resolve

    def check(self, deep: bool, sample: float, repair: bool) -> FsckReport:
        return check_bucket(self.store, deep=deep, sample=sample, repair=repair)

    def verify(self, ref: str) -> FsckReport:
        return check_bucket(self.store, deep=True, commit=self.resolve(ref))


def _loc(r) -> BlobLoc:
    return BlobLoc(bytes(r["hash"]), r["raw_len"], r["pack"], r["offset"], r["stored_len"], r["codec"])


def _record_loc(r) -> BlobLoc:
    return BlobLoc(bytes(r["digest"]), r["raw_len"], r["pack"], r["offset"], r["stored_len"], CODEC_RAW)


def check(store, deep: bool = False, sample: float = 1.0, commit: str | None = None, seed: int | None = None) -> FsckReport:
    """Check ``store`` (or only commit id ``commit``, for ``verify``).

    Args:
        deep: reread blobs and check headers and hashes.
        sample: with ``deep``, the fraction of blobs to reread (0 < sample <= 1).
        commit: restrict every check to one commit's blobs and rows.

    Open files stay bounded (:data:`ckptstore.packs.MAX_OPEN_PACKS`) whatever the
    number of packs.

    Raises:
        InvalidArgumentError: ``sample`` outside (0, 1].
        ResourceLimitError: the process ran out of file descriptors (never reported
            as damage).
    """
    check_sample(sample)
    cat = store.catalog
    rep = FsckReport()
    where, params = ("WHERE commit_id = ?", (commit,)) if commit else ("", ())
    with cat.read():
        if commit is None:
            status = [r[0] for r in cat.rows("PRAGMA integrity_check")]
            if status != ["ok"]:
                rep.problems += [f"catalog: {s}" for s in status[:20]]
            for r in cat.rows("PRAGMA foreign_key_check"):
                rep.problems.append(f"catalog: row {r[1]} of table {r[0]} references a missing {r[2]} row")
            for r in cat.rows("SELECT name, commit_id FROM tags WHERE commit_id NOT IN (SELECT id FROM commits)"):
                rep.problems.append(f"tag {r['name']} names commit {r['commit_id']}, which does not exist")
                rep.damaged_tags.append(r["name"])
        rep.commits = 1 if commit else cat.rows("SELECT COUNT(*) FROM commits")[0][0]
        leaves = cat.rows(f"SELECT commit_id, path, dtype, shape, nbytes, shard_bytes, kind FROM leaves {where}", params)
        shards: dict[tuple[str, str], list] = {}
        for r in cat.rows(
            f"SELECT l.commit_id, l.path, s.seq, b.* FROM leaves l JOIN shards s ON s.leaf_id = l.id JOIN blobs b ON b.id = s.blob_id "
            f"{where.replace('commit_id', 'l.commit_id')} ORDER BY l.commit_id, l.path, s.seq",
            params,
        ):
            shards.setdefault((r["commit_id"], r["path"]), []).append(r)
        blob_rows = (
            cat.rows("SELECT * FROM blobs WHERE id IN (SELECT s.blob_id FROM shards s JOIN leaves l ON l.id = s.leaf_id WHERE l.commit_id = ?)", params)
            if commit else cat.rows("SELECT * FROM blobs")
        )
        packs = {r["id"]: r for r in cat.rows("SELECT * FROM packs")}
        commit_ids = [commit] if commit else [r[0] for r in cat.rows("SELECT id FROM commits")]
        texts = {r[0]: r[1] for r in cat.chunked("SELECT id, record FROM commits WHERE id IN ({})", commit_ids, raw=True)}
        rebuilt = {cid: rebuild_record(cat.conn, cid) for cid in commit_ids}
        rec_rows = cat.chunked(f"SELECT * FROM records WHERE kind = {KIND_COMMIT} AND name IN ({{}})", commit_ids)
        if commit is None:
            rec_rows += cat.rows(f"SELECT * FROM records WHERE kind = {KIND_REF}")
        if commit is None:
            rep.unreferenced_blobs = cat.rows("SELECT COUNT(*) FROM blobs b WHERE NOT EXISTS (SELECT 1 FROM shards s WHERE s.blob_id = b.id)")[0][0]

    bad_commits: set[str] = set()
    in_packs = {r["name"] for r in rec_rows if r["kind"] == KIND_COMMIT}
    for cid in commit_ids:  # the manifest against the commit id, the rows against the manifest
        try:
            parse_commit(texts.get(cid), cid)
        except IntegrityError as exc:
            rep.problems.append(str(exc))
            bad_commits.add(cid)
            continue
        if rebuilt[cid] != texts[cid]:
            rep.problems.append(f"commit {cid}: the catalog's rows (leaves, shards, components, parents or message) disagree with its record")
            bad_commits.add(cid)
        if cid not in in_packs:
            rep.problems.append(f"commit {cid}: no copy of its record in a pack (recover could not rebuild it)")
    for r in leaves:
        if r["kind"] != "tensor":
            continue
        got = shards.get((r["commit_id"], r["path"]), [])
        size = itemsize(r["dtype"])
        try:
            nbytes = math.prod(json.loads(r["shape"])) * size
            plan = ShardPlan(r["nbytes"], r["shard_bytes"])
            lengths_ok = nbytes == r["nbytes"] and len(got) == plan.count and all(
                s["raw_len"] == plan.bounds(i)[1] - plan.bounds(i)[0] for i, s in enumerate(got)
            )
        except (TypeError, ValueError, AttributeError):
            lengths_ok = False
        if not lengths_ok:
            rep.problems.append(f"commit {r['commit_id']}, leaf {r['path']}: manifest and shard rows disagree (shape, dtype, sizes or count)")
            bad_commits.add(r["commit_id"])

    # A GC running beside fsck may move (repack) or free a blob after the snapshot above:
    # a blob that looks missing or bad is looked up again, and only reported if it still is.
    reader = PackReader(store.root, locate=store.relocate)
    sizes: dict[str, int | None] = {}

    def size_of(pack: str) -> int | None:
        if pack not in sizes:
            try:
                sizes[pack] = pack_path(store.root, pack).stat().st_size
            except FileNotFoundError:
                sizes[pack] = None
        return sizes[pack]

    def in_place(loc: BlobLoc) -> bool:
        size = size_of(loc.pack)
        return size is not None and loc.offset + BLOB_HEADER.size + loc.stored_len <= size

    def still_bad(loc: BlobLoc, read: bool) -> bool:
        now = store.relocate(loc)
        if now is None:
            return False  # freed meanwhile: no kept commit references it
        sizes.pop(now.pack, None)
        if not in_place(now):
            return True
        try:
            if read:
                reader.read(now, "fsck")
        except ResourceLimitError:
            raise
        except CkptStoreError:
            return True
        return False

    bad_blobs: set[int] = set()
    missing_packs: set[str] = set()
    for r in blob_rows:
        if not in_place(_loc(r)) and still_bad(_loc(r), read=False):
            rep.missing_blobs.append(address(bytes(r["hash"]), r["raw_len"]))
            bad_blobs.add(r["id"])
            if size_of(r["pack"]) is None:
                missing_packs.add(r["pack"])
    for p in sorted(missing_packs):
        rep.problems.append(f"pack {p}.pack is missing")
    if rep.missing_blobs:
        rep.problems.append(f"{len(rep.missing_blobs)} blob(s) missing or truncated: {', '.join(rep.missing_blobs[:5])}")

    if deep:
        rng = random.Random(seed)
        with progress.task("fsck --deep", sum(r["raw_len"] for r in blob_rows)) as advance:
            for r in blob_rows:
                if r["id"] in bad_blobs or (sample < 1 and rng.random() >= sample):
                    continue
                try:
                    reader.read(_loc(r), "fsck")
                except ResourceLimitError:
                    raise
                except CkptStoreError:
                    if still_bad(_loc(r), read=True):
                        rep.corrupt_blobs.append(address(bytes(r["hash"]), r["raw_len"]))
                        bad_blobs.add(r["id"])
                rep.blobs_checked += 1
                rep.bytes_checked += r["raw_len"]
                advance(r["raw_len"])
        for r in rec_rows:
            try:
                text = bytes(reader.read(_record_loc(r), "fsck", magic=RECORD_MAGIC))
            except ResourceLimitError:
                raise
            except CkptStoreError as exc:
                now = cat.rows("SELECT * FROM records WHERE id = ?", (r["id"],))  # a GC may have dropped or moved it meanwhile
                if not now:
                    continue
                try:
                    r = now[0]
                    text = bytes(reader.read(_record_loc(r), "fsck", magic=RECORD_MAGIC))
                except ResourceLimitError:
                    raise
                except CkptStoreError:
                    rep.problems.append(f"record of {r['name']} in pack {r['pack']}: {exc}")
                    if r["kind"] == KIND_COMMIT:
                        bad_commits.add(r["name"])
                    continue
            if r["kind"] == KIND_COMMIT and text.decode(errors="replace") != texts.get(r["name"]):
                rep.problems.append(f"commit {r['name']}: its record in pack {r['pack']} differs from the catalog's")
        if rep.corrupt_blobs:
            rep.problems.append(f"{len(rep.corrupt_blobs)} corrupt blob(s): {', '.join(rep.corrupt_blobs[:5])}")
    reader.close()

    if bad_blobs:
        for (cid, _), rows in shards.items():
            if any(s["id"] in bad_blobs for s in rows):
                bad_commits.add(cid)
    rep.damaged_commits = sorted(bad_commits)
    if bad_commits:
        rep.damaged_tags = sorted(set(rep.damaged_tags) | {
            r["name"] for r in cat.chunked("SELECT name FROM tags WHERE commit_id IN ({})", rep.damaged_commits)
        })
    if commit is None:
        blobs_dir = store.root / "blobs"
        rep.orphan_packs = sorted(f.stem for f in blobs_dir.glob("*/*.pack") if f.stem not in packs)
        rep.tmp_files = sum(1 for f in (store.root / "tmp").iterdir() if f.is_file())
    return rep


# --- a store on object storage: the bucket's own objects, never the cache ------------------------------


def check_bucket(store, deep: bool = False, sample: float = 1.0, commit: str | None = None, seed: int | None = None,
                 repair: bool = False) -> FsckReport:
    """Check a store on object storage (:class:`~ckptstore.bucket.BucketHome`) against the bucket's own objects.

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

    for cid, rec in store.home.requests.map(load, records):
        if isinstance(rec, IntegrityError):
            report.damaged_commits.append(cid)
            report.problems.append(f"commit {cid}: {rec}")
        else:
            recs[cid] = rec
    listed = {o.key: o for o in backend.list("blobs")}
    packs = {k.rsplit("/", 1)[1][:-5]: o for k, o in listed.items() if k.endswith(".pack")}
    needed = {k for rec in recs.values() for leaf in rec.leaves for k in leaf.keys}
    if deep:
        found = dict(zip(packs, store.home.requests.map(lambda p: pack_entries(backend, p, packs[p].size, index_key(p) in listed), list(packs))))
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

    return [r for rs in store.home.requests.map(read, list(by_pack.items())) for r in rs]


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

    for key in store.home.requests.map(load, [o.key for o in backend.list("reflog")]):
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
