"""Integrity checks of a store (``ckptstore fsck`` and ``ckptstore verify``): one protocol
for both homes, written against small per-home primitives (:class:`FsckSide`: the home's
``fsck_side()``, :class:`ckptstore.home.local.LocalFsck` for a folder,
:class:`ckptstore.home.bucket_upkeep.BucketFsck` for a bucket).

:func:`check` (entered through :func:`run` and :func:`verify`) asks the home's side for
what it holds and checks it the same way on both homes:

1. in one snapshot of the home's index (``snapshot``): the tags (``tags``: name
   -> commit id; a malformed ref is reported), the commits with their records
   (``commits``: locally the catalog's rows against each record, and a copy of it in
   a pack; on a bucket the ``commits/`` objects, fetched and checked against their ids
   when ``deep``), and where each blob those records need is (``locate``: locally the
   catalog's rows; on a bucket each pack's ``.idx``, or the pack walked when its index is
   missing or damaged, which ``repair`` rebuilds);
2. what is particular to the home (``extra``): locally SQLite's integrity and
   foreign-key checks, the orphans (pack files without a catalog row, unreferenced blob
   rows, files in ``tmp/``) and, with ``deep``, every record copy in the packs reread; on
   a bucket, with ``deep``, the reflog objects and the store marker (``repair`` rewrites a
   damaged marker from its copy);
3. every blob a commit needs is in its pack (``read``: locally the pack file is
   there and long enough), and, with ``deep``, reread and rehashed in bounded memory
   (each blob once, however many commits share it; ``sample`` < 1: that fraction of each
   commit's blobs, at least one);
4. a blob that is missing or corrupt is marked bad in the home's index (never reused by
   dedup, invariant 14: :meth:`ckptstore.home.base.Home.mark_bad`; not where the index cannot
   be written) and, with ``repair``, the index is pointed at a good copy of its address:
   one this run reread intact (``where``), or one the side finds in its packs
   (``replace_bad``);
5. one mapping: a blob missing or corrupt damages every commit that needs it, and a
   damaged commit every tag that names it. A tag naming a commit the home does not hold
   is damaged too. On a home whose commit records exist before their ref moves
   (``attempts_leave_records``: a bucket), a record no tag's lineage reaches whose blobs
   are gone is an orphan (a commit killed before its ref move, swept by a GC), not damage.

Problems (``report.problems``, non-zero exit) are what is damaged; orphans are reported
but are not problems (GC removes them after the grace period), and neither are a folder's
foreign entries (``report.foreign``: links, FIFOs, sockets, devices, stray files that
ckptstore did not make, one line each; never followed, left alone by GC: invariant 13). Open files stay bounded
(:data:`ckptstore.objects.packs.MAX_OPEN_PACKS`) whatever the number of packs.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from ..core import progress
from ..core.collector import paused_gc
from ..core.errors import BlobMissingError, InvalidArgumentError
from ..core.layout import address
from ..home.upkeep import FsckReport, FsckSide  # noqa: F401 (the homes' side, declared below them; importable here too)

if TYPE_CHECKING:
    from ..home.interfaces import FsckRepository


def check_sample(sample: float) -> float:
    """Validate ``sample`` (0 < sample <= 1), before any read on either home. Raises InvalidArgumentError."""
    if not 0 < sample <= 1:
        raise InvalidArgumentError(f"invalid sample fraction {sample!r}: must be in (0, 1]")
    return sample


def run(store: FsckRepository, deep: bool = False, sample: float = 1.0, repair: bool = False) -> FsckReport:
    """``fsck`` on either home: ``sample`` < 1 implies ``deep``, ``repair`` implies it too.

    Raises:
        InvalidArgumentError: ``sample`` outside (0, 1].
        StoreWriteError: ``repair`` on a local store that cannot be written here.
        NotAStoreError: a bucket prefix that holds no store.
    """
    check_sample(sample)
    store.home.fsck_side().start(repair)
    with paused_gc():  # it holds every commit's record: a full collection would walk them again and again
        return check(store, deep=deep or sample < 1 or repair, sample=sample, repair=repair)


def verify(store: FsckRepository, ref: str) -> FsckReport:
    """Check one commit (a tag or a commit id, resolved by the home's ``resolve``)
    and reread every blob of it; ``report.ok`` tells."""
    side = store.home.fsck_side()
    side.start(False)
    with paused_gc():
        return check(store, deep=True, commit=side.resolve(ref))


def check(store: FsckRepository, deep: bool = False, sample: float = 1.0, commit: str | None = None, seed: int | None = None,
          repair: bool = False) -> FsckReport:
    """Check ``store`` (or only commit id ``commit``, for ``verify``) on its side (the module's docstring).

    Args:
        deep: reread blobs and check headers and hashes (on a bucket also every record,
            index, reflog object and the marker, trusting nothing in the cache).
        sample: with ``deep``, the fraction of each commit's blobs to reread (0 < sample <= 1).
        commit: restrict every check to one commit's record and blobs.
        seed: the sample's random seed.
        repair: let the side rebuild what it can (bad blob copies replaced by good ones
            found in packs; a bucket's pack indexes and marker).

    Raises:
        InvalidArgumentError: ``sample`` outside (0, 1].
        ResourceLimitError: the process ran out of file descriptors (never reported as damage).
        BackendError: the storage failed (never reported as damage).
    """
    check_sample(sample)
    side, rep, whole = store.home.fsck_side(), FsckReport(), commit is None
    with side.snapshot():
        tags = side.tags(rep) if whole else None
        records = side.commits(rep, None if whole else [commit], deep)
        keys_of = {cid: list(dict.fromkeys(k for leaf in rec.leaves for k in leaf.keys)) for cid, rec in records.items() if rec is not None}
        where = side.locate(rep, list(dict.fromkeys(k for keys in keys_of.values() for k in keys)), deep, repair)
    side.extra(rep, list(records), whole, deep, repair)
    rep.commits = len(records)
    bad_tags = set(rep.damaged_tags)
    for name, cid in (tags or {}).items():
        if cid not in records:
            rep.problems.append(f"tag {name!r} names commit {cid}, which {side.location} does not hold")
            bad_tags.add(name)

    reach = lineage(records, set(tags.values())) if whole and side.attempts_leave_records else records
    rng = random.Random(seed)
    users: dict[tuple[bytes, int], list[str]] = {}  # blob address -> the commits that need it
    reread: set[tuple[bytes, int]] = set()
    for cid, keys in keys_of.items():
        present = [k for k in keys if k in where]
        if len(present) < len(keys) and cid not in reach:
            # no tag reaches it: a commit killed between its record and its ref move, whose packs a GC swept
            # meanwhile, leaves this (it never returned); GC drops the record. Not a problem.
            rep.orphan_commits.append(cid)
            continue
        for k in keys:
            users.setdefault(k, []).append(cid)
        if deep and present:
            reread.update(present if sample >= 1 else rng.sample(present, max(1, round(len(present) * sample))))

    bad: dict[tuple[bytes, int], str] = {}  # blob address -> its problem
    for k in users:
        if k not in where:
            rep.missing_blobs.append(address(*k))
            bad[k] = f"blob {address(*k)} is in no pack of {side.location}"
    failed: list = []  # (location, why) of the copies that failed: marked bad, so that dedup never reuses them
    with progress.task("fsck --deep", sum(n for _, n in reread)) as advance:
        for loc, err in side.read([loc for k, loc in where.items() if k in users], reread):  # in the side's order (locally: as written)
            k = (loc.digest, loc.raw_len)
            if err is not None:
                failed.append((loc, str(err)))
            if isinstance(err, BlobMissingError):
                rep.missing_blobs.append(loc.address)
            else:
                rep.blobs_checked += 1
                rep.bytes_checked += loc.raw_len
                advance(loc.raw_len)
                if err is not None:
                    rep.corrupt_blobs.append(loc.address)
            if err is not None:
                bad[k] = str(err)
    if repair:  # the index's rows marked bad whose address this run reread intact elsewhere (a newer pack on a bucket) point there
        for loc in store.home.marked():
            k = (loc.digest, loc.raw_len)
            good = where.get(k)
            if k in reread and k not in bad and good is not None and (good.pack, good.offset) != (loc.pack, loc.offset):
                if store.home.replace_copy(loc, good):
                    rep.replaced_blobs.append(loc.address)
    if failed:
        rep.marked_bad = store.home.mark_bad(failed)  # (not on a store that cannot be written here)
        if repair:  # another good copy of the address in the store's packs replaces the bad one
            for loc, _good in side.replace_bad(rep, [loc for loc, _ in failed]):
                k = (loc.digest, loc.raw_len)
                rep.replaced_blobs.append(loc.address)
                for lst in (rep.corrupt_blobs, rep.missing_blobs):
                    if loc.address in lst:
                        lst.remove(loc.address)
                bad.pop(k, None)
    rep.problems += bad.values()

    damaged = set(rep.damaged_commits) | {c for k in bad for c in users[k]}
    rep.damaged_commits = sorted(damaged)
    if damaged and tags is None:  # verify: the tags only to name those the damage hurts
        tags = side.tags(FsckReport())
    rep.damaged_tags = sorted(bad_tags | {name for name, cid in (tags or {}).items() if cid in damaged})
    return rep


def lineage(records: dict, heads: set) -> set:
    """The commits of ``records`` (id -> CommitRecord, or ``None`` when damaged) on the lineage of ``heads``."""
    seen, stack = set(), list(heads)
    while stack:
        c = stack.pop()
        if c in seen or records.get(c) is None:
            continue
        seen.add(c)
        stack += records[c].parents
    return seen
