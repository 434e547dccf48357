"""Integrity checks of a store (``ckptstore fsck`` and ``ckptstore verify``).

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
from .errors import CkptStoreError, IntegrityError, InvalidArgumentError, ResourceLimitError
from .layout import ShardPlan, address, itemsize
from .packs import BLOB_HEADER, CODEC_RAW, RECORD_MAGIC, BlobLoc, PackReader, pack_path
from .records import KIND_COMMIT, KIND_REF, parse_commit


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
    if not 0 < sample <= 1:
        raise InvalidArgumentError(f"invalid sample fraction {sample!r}: must be in (0, 1]")
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
