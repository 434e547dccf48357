"""Rebuilding a store's index from its objects alone (``ckptstore recover``), on both homes.

:func:`recover` rebuilds a local store's catalog from its packs; :func:`recover_bucket`
the local cache of a store on object storage from the bucket. Both fill the same
:class:`RecoverReport`. For a local store:

Every commit writes its commit record, and every tag move its ref-move record,
into a pack before the catalog transaction that makes them true
(:mod:`ckptstore.objects.records`); GC keeps each kept commit's record and each tag's
newest move. So when ``catalog.sqlite`` is deleted or damaged beyond what
SQLite repairs, the packs still say everything a checkout needs:

1. every pack under ``blobs/`` is walked entry by entry (headers only; a pack
   with a damaged entry is used up to it); blob entries give the blob index;
2. every record entry is read and checked against its hash; a commit record is
   also checked against its commit id, and kept only if every blob its
   manifest names was found (otherwise it is reported as incomplete);
3. each tag is set as of its newest move (highest ``seq``, then time), unless
   that move deleted it or names a commit that was not kept (the tag is then
   reported as dropped, with the reason: it is never set to an older move);
4. the new catalog is built in ``tmp/`` by SQLite and copied over the old one
   with SQLite's backup API. A rebuild that lost anything (a pack or record it
   could not read, a commit or tag it could not restore) replaces an existing
   catalog only with ``force``; where the catalog is lost (missing or empty) it
   is installed, and the report names what it lacks (``ok`` is false). Only
   when SQLite cannot open the old file at all
   (it is not a database, or damaged beyond use) is it renamed aside, with its
   ``-wal`` and ``-shm``, to ``catalog.sqlite.damaged-<time>``: the one place
   ckptstore renames catalog files, which is why recovery must run while no
   other process has the store open.

A catalog whose migration was killed before the records of its commits and tags
reached the packs (:func:`ckptstore.home.catalog.backfill_records`) has them written
first, while it can still be read, so the rebuild keeps every commit and tag.

Recovered commits keep their ids, parents, messages, metadata and manifests;
their ``new_bytes``, ``stored_bytes``, ``shards_new`` and ``seconds`` are not
in the records and read 0. Store settings (shard size, compression level) go
back to their defaults. A commit whose transaction was killed after its records
were made durable but before it committed may reappear, complete. Blob hashes
are not re-read here: run ``fsck --deep`` afterwards.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..backends.local import describe_mode, own_dir
from ..core import jsonvalue
from ..core.errors import (
    CatalogBusyError,
    CatalogCorruptError,
    CkptStoreError,
    IntegrityError,
    InvalidArgumentError,
    NotAStoreError,
    ObjectNotFoundError,
    ResourceLimitError,
    StoreWriteError,
)
from ..core.layout import address
from ..home.catalog import Catalog, CatalogMissing, backfill_records
from ..objects.bucketformat import fetch_record, parse_reflog, read_tag, repair_index
from ..objects.packindex import index_key
from ..objects.packs import CODEC_RAW, DEFAULT_PACK_BYTES, RECORD_MAGIC, PackReader, scan, walk_store
from ..objects.records import KIND_COMMIT, KIND_REF, CommitRecord, commit_id, parse_commit, parse_ref
from .gc import gc_lock

if TYPE_CHECKING:
    from ..home.interfaces import RecoverRepository

CATALOG = "catalog.sqlite"


@dataclass
class RecoverReport:
    """What :func:`recover` found and rebuilt.

    ``damaged_packs`` maps a pack id to the problem that stopped its walk;
    ``incomplete_commits`` lists commit records found whose blobs are not all
    present; ``bad_records`` counts records that failed their hash or format.
    ``dropped_commits`` and ``dropped_tags`` map each commit (id) and tag the packs
    hold but the rebuilt catalog lacks to the reason; ``problems`` names every
    pack and record that could not be read. ``ok`` is false when any of these
    is not empty: the rebuild is not the whole store. ``repaired`` lists the keys of
    derived objects rewritten from what they derive from: the missing or damaged pack
    indexes (``.idx``) of a store on object storage, rebuilt from their packs (a local
    store has none: always empty). ``seconds``: wall time.
    """

    packs: int = 0
    blobs: int = 0
    commits: int = 0
    tags: dict[str, str] = field(default_factory=dict)
    reflog: int = 0
    incomplete_commits: list[str] = field(default_factory=list)
    bad_records: int = 0
    damaged_packs: dict[str, str] = field(default_factory=dict)
    dropped_commits: dict[str, str] = field(default_factory=dict)
    dropped_tags: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    installed: bool = False
    moved_aside: str | None = None
    repaired: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """Every pack and record was read and every commit and tag they hold restored."""
        return not (self.damaged_packs or self.bad_records or self.dropped_commits or self.dropped_tags or self.problems)

    def lost(self) -> list[str]:
        """One line per tag, commit, pack and record the rebuild could not restore, and why."""
        return (
            [f"tag {t}: {why}" for t, why in self.dropped_tags.items()]
            + [f"commit {c}: {why}" for c, why in self.dropped_commits.items()]
            + self.problems
        )


def recover(root: str | os.PathLike, force: bool = False) -> RecoverReport:
    """Rebuild ``root``'s catalog from its packs (see the module docstring).

    Run it with no other process using the store. It takes the GC lock, so it
    never runs beside a GC. A catalog that opens and passes SQLite's
    ``quick_check`` is rebuilt only with ``force`` (as when ``fsck`` reports rows
    that disagree with their commit records). With ``force`` it works whatever
    bytes the catalog file holds. Open files stay bounded
    (:data:`ckptstore.objects.packs.MAX_OPEN_PACKS`) whatever the number of packs.

    Returns the report; when ``report.ok`` is false the catalog installed (a lost
    one's replacement, or with ``force``) lacks what ``report.lost()`` lists.

    Raises:
        NotAStoreError: ``root`` has no ``blobs/`` folder of packs.
        InvalidArgumentError: the catalog is healthy and ``force`` is false.
        IntegrityError: the rebuild lacks commits or tags the packs hold (or could
            not read a pack or record) and an existing catalog would be replaced:
            nothing was changed; ``force`` installs it anyway.
        ResourceLimitError: the process ran out of file descriptors (nothing changed).
        GCLockedError: a GC is running.
    """
    t0 = time.perf_counter()
    root = Path(root)
    try:
        blobs_mode = os.lstat(root / "blobs").st_mode
    except OSError:
        blobs_mode = None
    if blobs_mode is None or not stat.S_ISDIR(blobs_mode):  # a link is not followed (invariant 13)
        why = "has no blobs/ folder" if blobs_mode is None else f"has no blobs/ folder (blobs is {describe_mode(blobs_mode)}, not made by ckptstore)"
        raise NotAStoreError(f"{root} {why}: nothing to recover from")
    state, old_ids = _inspect(root / CATALOG)
    if not force and state == "healthy":
        raise InvalidArgumentError(
            f"{root / CATALOG} opens and passes SQLite's check: nothing to recover. Run `ckptstore fsck`; "
            "to rebuild it from the packs anyway (fsck names rows that disagree with their records), pass --force (force=True)"
        )
    report = RecoverReport()
    with gc_lock(root):
        built = root / "tmp" / f"recover-{uuid.uuid4().hex}.sqlite"
        try:
            own_dir(root, built.parent)  # never built through a link out of the store (invariant 13)
        except OSError as exc:
            raise StoreWriteError(f"{root}: cannot build the catalog in tmp/: {exc.strerror or exc}") from None
        try:
            new = Catalog(built, create=True)
            try:
                kept = _rebuild(root, new, report)
                for cid in sorted(old_ids - kept):
                    report.dropped_commits.setdefault(cid, "in the old catalog, but no record of it was found in the packs")
                if not report.ok and state != "missing" and not force:
                    lost = report.lost()
                    raise IntegrityError(
                        f"{root}: the rebuilt catalog would lack {len(lost)} thing(s) the store holds ({'; '.join(lost[:3])}"
                        f"{'; ...' if len(lost) > 3 else ''}); the existing catalog was left as it is. "
                        "`ckptstore recover --force` installs the rebuild anyway and lists everything it lacks"
                    )
                install(root, new, report)
                report.installed = True
            finally:
                new.close()
        finally:
            for suffix in ("", "-wal", "-shm", "-journal"):
                Path(f"{built}{suffix}").unlink(missing_ok=True)
    report.seconds = time.perf_counter() - t0
    return report


def _inspect(path: Path) -> tuple[str, set[str]]:
    """``("missing" | "damaged" | "healthy", commit ids the catalog lists where it can be read)``."""
    try:
        cat = Catalog(path, create=False)
    except CatalogMissing:
        return "missing", set()
    except CkptStoreError:
        return "damaged", set()
    try:
        if cat.writable and cat.backfill_pending:  # a migration killed before its records reached the packs: finish it first
            try:
                backfill_records(cat, path.parent, DEFAULT_PACK_BYTES)
            except CkptStoreError:
                pass  # (a damaged catalog: the rebuild keeps what the packs hold)
        healthy = [r[0] for r in cat.rows("PRAGMA quick_check")] == ["ok"]
        # only rows whose record hashes to their id: a damaged row names no commit
        ids = {cid for cid, text in cat.rows("SELECT id, record FROM commits", raw=True) if type(text) is str and commit_id(text) == cid}
        return ("healthy" if healthy else "damaged"), ids
    except CkptStoreError:
        return "damaged", set()
    finally:
        cat.close()


def _rebuild(root: Path, cat: Catalog, report: RecoverReport) -> set[str]:
    """Build ``cat`` from the packs; returns the ids of the commits it holds."""
    blobs: dict[tuple[bytes, int], tuple] = {}
    bad_commit_records: dict[str, str] = {}
    commits: dict[str, CommitRecord] = {}
    refs: list[dict] = []
    rec_rows: list[tuple] = []
    packs: list[tuple[str, int, float]] = []
    seen: set[tuple[int, bytes]] = set()  # (kind, digest) of the records read: a repacked pack not yet unlinked holds copies
    reader = PackReader(root)
    try:
        for _, rel, st in (e for e in walk_store(root) if e[0] == "pack"):  # regular files only, no link followed
            path = root / rel
            pack_id = path.stem
            entries, problem = scan(path, pack_id)
            if problem:
                report.damaged_packs[pack_id] = problem
                report.problems.append(f"pack {pack_id}.pack: {problem}: the entries after it were not read")
            packs.append((pack_id, st.st_size, st.st_mtime))
            for e in entries:
                loc = e.loc
                if e.magic != RECORD_MAGIC:
                    blobs.setdefault((loc.digest, loc.raw_len), (loc.digest, loc.raw_len, pack_id, loc.offset, loc.stored_len, loc.codec, st.st_mtime))
                    continue
                if (e.kind, loc.digest) in seen:
                    continue  # the same record again (its bytes hash to the same digest): one copy is indexed
                what = {KIND_COMMIT: "commit record", KIND_REF: "ref-move record"}.get(e.kind, f"record of unknown kind {e.kind}")
                where = f"the {what} at offset {loc.offset} of pack {pack_id}.pack"
                try:
                    if loc.codec != CODEC_RAW:
                        raise CkptStoreError("compressed record")
                    text = bytes(reader.read(loc, where, magic=RECORD_MAGIC)).decode()
                    if e.kind == KIND_COMMIT:
                        rec = parse_commit(text, loc.digest.hex())
                    elif e.kind == KIND_REF:
                        ref = parse_ref(text)
                        if ref is None:
                            raise CkptStoreError(f"{where}: malformed ref-move record")
                    else:
                        raise CkptStoreError(f"{where}: unknown record kind")
                except ResourceLimitError:
                    raise
                except (CkptStoreError, UnicodeDecodeError) as exc:
                    report.bad_records += 1
                    reason = str(exc) if where in str(exc) else f"{where}: {exc}"
                    if e.kind == KIND_COMMIT:  # a commit record is addressed by its commit id
                        bad_commit_records.setdefault(loc.digest.hex(), reason)
                    else:
                        report.problems.append(f"unreadable record: {reason}")
                    continue
                seen.add((e.kind, loc.digest))
                if e.kind == KIND_COMMIT:
                    commits.setdefault(rec.id, rec)
                    rec_rows.append((KIND_COMMIT, rec.id, None, loc))
                else:
                    refs.append(ref)
                    rec_rows.append((KIND_REF, ref["tag"], ref["seq"], loc))
    finally:
        reader.close()

    kept = {}
    for cid, rec in commits.items():
        missing = [address(*k) for r in rec.leaves for k in r.keys if k not in blobs]
        if not missing:
            kept[cid] = rec
        else:
            report.incomplete_commits.append(cid)
            report.dropped_commits[cid] = f"{len(missing)} of its blobs are in no readable pack (e.g. {missing[0]})"
    for cid, why in bad_commit_records.items():
        if cid in commits:  # another copy of the record verified: the commit is back, the bad copy is reported
            report.problems.append(f"unreadable record: {why}")
        else:
            report.dropped_commits[cid] = f"its record is damaged ({why})"
    refs.sort(key=lambda r: (r["seq"], r["at"]))
    last: dict[str, dict] = {}
    for r in refs:
        last[r["tag"]] = r
    report.tags = {t: r["new"] for t, r in sorted(last.items()) if r["new"] is not None and r["new"] in kept}
    for t, r in sorted(last.items()):
        if r["new"] is not None and r["new"] not in kept:
            why = report.dropped_commits.get(r["new"], "no record of it was found in the packs")
            report.dropped_tags[t] = f"its newest move (seq {r['seq']}) names commit {r['new']}, which could not be restored: {why}"

    with cat.write():
        db = cat.db
        run = cat.conn.executemany
        run("INSERT INTO packs (id, size, created_at) VALUES (?, ?, ?)", packs)
        run("INSERT INTO blobs (hash, raw_len, pack, offset, stored_len, codec, created_at) VALUES (?, ?, ?, ?, ?, ?, ?)", list(blobs.values()))
        ids = {(h, n): i for i, h, n in cat.rows("SELECT id, hash, raw_len FROM blobs", raw=True)}
        for cid, rec in kept.items():
            _insert_commit(cat, db, rec, ids)
        run(
            "INSERT INTO records (kind, name, seq, digest, pack, offset, raw_len, stored_len) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            [(k, n, q, loc.digest, loc.pack, loc.offset, loc.raw_len, loc.stored_len) for k, n, q, loc in rec_rows
             if k == KIND_REF or n in kept],
        )
        # Row ids keep the records' seq (a killed transaction may have left a duplicate: the later
        # one moves up), so every move made after recovery gets a higher seq than any record here.
        rows, prev = [], 0
        for r in refs:
            prev = max(r["seq"], prev + 1)
            rows.append((prev, r["tag"], r["old"], r["new"], r["at"], r["action"]))
        run("INSERT INTO reflog (id, tag, old_commit, new_commit, at, action) VALUES (?, ?, ?, ?, ?, ?)", rows)
        run(
            "INSERT INTO tags (name, commit_id, updated_at) VALUES (?, ?, ?)",
            [(t, cid, last[t]["at"]) for t, cid in report.tags.items()],
        )
    report.packs, report.blobs, report.commits, report.reflog = len(packs), len(blobs), len(kept), len(refs)
    return set(kept)


def _insert_commit(cat: Catalog, db, rec: CommitRecord, ids: dict) -> None:
    """The rows of one commit, exactly as the commit protocol writes them (from the
    record's own JSON text, so that ``fsck`` finds rows and record equal)."""
    _, _, _, meta_json, components, manifest = json.loads(rec.text)
    tensors = [r for r in rec.leaves if r.kind == "tensor"]
    db["commits"].insert({
        "id": rec.id, "created_at": rec.created_at, "message": rec.message, "metadata": meta_json,
        "logical_bytes": sum(r.nbytes for r in tensors), "new_bytes": 0, "stored_bytes": 0,
        "shards_total": sum(len(r.keys) for r in tensors), "shards_new": 0, "seconds": 0.0, "record": rec.text,
    })
    db["parents"].insert_all({"commit_id": rec.id, "position": i, "parent_id": p} for i, p in enumerate(rec.parents))
    db["components"].insert_all(
        {"commit_id": rec.id, "path": p, "adapter": a, "version": v, "meta": m} for p, a, v, m in components
    )
    for r, (path, comp, kind, dtype, shape, stride, value, _) in zip(rec.leaves, manifest):
        leaf_id = cat.conn.execute(
            "INSERT INTO leaves (commit_id, path, component, kind, dtype, shape, stride, nbytes, shard_bytes, value) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (rec.id, path, comp, kind, dtype, None if shape is None else jsonvalue.dumps(shape),
             None if stride is None else jsonvalue.dumps(stride), r.nbytes, r.shard_bytes, value),
        ).lastrowid
        cat.conn.executemany("INSERT INTO shards (leaf_id, seq, blob_id) VALUES (?, ?, ?)", [(leaf_id, i, ids[k]) for i, k in enumerate(r.keys)])


def install(root: Path, new: Catalog, report: RecoverReport) -> None:
    """Copy catalog ``new`` over ``root``'s ``catalog.sqlite`` with SQLite's backup API (a
    file SQLite cannot open at all is first moved aside: ``report.moved_aside``).

    Raises:
        CatalogBusyError: another process holds the catalog's write lock.
    """
    path = root / CATALOG
    try:
        old = Catalog(path, create=True)
    except CatalogBusyError:
        raise
    except (CatalogCorruptError, CatalogMissing, CkptStoreError):
        old = None
    if old is not None:
        try:
            old.replace_with(new)
            return
        except CkptStoreError:
            pass
        finally:
            old.close()
    aside = f"{path}.damaged-{time.strftime('%Y%m%d-%H%M%S')}"
    for suffix in ("", "-wal", "-shm"):
        src = Path(f"{path}{suffix}")
        if src.exists():
            os.rename(src, f"{aside}{suffix}")
    report.moved_aside = aside
    fresh = Catalog(path, create=True)
    try:
        fresh.replace_with(new)
    finally:
        fresh.close()


# --- a store on object storage: its local cache, rebuilt from the bucket ---------------------------------


def recover_bucket(probe: RecoverRepository, folder: Path) -> RecoverReport:
    """Rebuild the local cache (the index) of a store on object storage
    from the bucket's objects alone, as ``recover`` rebuilds a local catalog from its packs.

    A new cache is built beside the old one: every pack is indexed from its ``.idx``, or by
    walking the pack where the index is missing or damaged, and that index is rewritten
    on the bucket (``report.repaired``; the one write, of a derived object, as
    ``fsck --repair`` does); every commit record under ``commits/`` is fetched and checked
    against its id and kept if every blob it names is in a readable pack; every tag is
    read and kept if it names a kept commit; every reflog object is checked. The new
    cache then replaces the old one (SQLite's backup API, :func:`ckptstore.protocols.recover.install`),
    whatever it held: it holds only copies of the bucket's objects. Blob payloads are not
    reread: run ``fsck --deep`` afterwards.

    Returns a :class:`~ckptstore.protocols.recover.RecoverReport` with the local report's fields:
    ``packs``, ``blobs``, ``commits``, ``tags``, ``reflog`` restored; every pack, record,
    commit and tag that could not be restored in ``damaged_packs``, ``bad_records``,
    ``dropped_commits`` (``incomplete_commits``), ``dropped_tags`` and ``problems``
    (``ok`` false, ``lost()`` names each with why).

    ``probe`` is the store opened on an empty scratch cache (:meth:`ckptstore.Store.recover`
    builds it; it is closed and its cache removed here); ``folder`` is the cache folder to replace.

    Raises:
        BackendError: the storage failed (nothing was installed).
        CatalogBusyError: another process holds the cache's write lock.
    """
    t0 = time.perf_counter()
    report = RecoverReport()
    try:
        _rebuild_cache(probe, report)
        folder.mkdir(parents=True, exist_ok=True)
        install(folder, probe.catalog, report)
    finally:
        probe.close()
        shutil.rmtree(probe.root, ignore_errors=True)
    (folder / "refs.json").unlink(missing_ok=True)  # the stamps of refs the old cache read: read them all again
    report.installed = True
    report.seconds = time.perf_counter() - t0
    return report


def _rebuild_cache(store: RecoverRepository, report: RecoverReport) -> None:
    """Fill ``store``'s empty cache from its bucket; record what could not be restored in ``report``."""
    backend = store.backend
    store.refresh_index()
    for pid, found in sorted(store.home.pack_problems.items()):
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
    for cid, rec in zip(ids, store.home.requests.map(load, ids)):
        if isinstance(rec, IntegrityError):
            report.bad_records += 1
            report.dropped_commits[cid] = f"its record is damaged ({rec})"
        else:
            records[cid] = rec
    store.home.index_records(records, located_only=True)
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

    for key, problem in zip(reflog, store.home.requests.map(check_move, reflog)):
        if problem is None:
            report.reflog += 1
        elif problem:
            report.bad_records += 1
            report.problems.append(f"unreadable record: {key}: {problem}")
    report.packs = len({o.key for o in backend.list("blobs") if o.key.endswith(".pack")})
    report.blobs = store.catalog.rows("SELECT COUNT(*) FROM blobs", raw=True)[0][0]
    report.commits = store.catalog.rows("SELECT COUNT(*) FROM commits", raw=True)[0][0]
    report.tags = dict(sorted(report.tags.items()))
