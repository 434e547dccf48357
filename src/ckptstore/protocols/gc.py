"""Garbage collection: one protocol on both homes, written once here against the primitives
each home provides (:class:`GCSide`: :class:`ckptstore.home.local.LocalGC` for a folder,
:class:`ckptstore.home.bucket_upkeep.BucketGC` for a bucket). One entry (:func:`collect`), one report
(:class:`GCReport`), one set of decisions (:func:`decide`, :func:`due_commits`, :func:`due_packs`, :func:`pending`).

The protocol (``shared/design/ARCHITECTURE.md``, "GC protocol"; docs/design.md, "Garbage collection"):

1. **Lock** (:meth:`GCSide.lock`): locally an exclusive ``flock`` (a second GC fails at once
   with :class:`~ckptstore.core.errors.GCLockedError`); on a bucket none (a second GC is harmless:
   its marks name the same objects).
2. **Roots and keep-set.** "Now" is the home's clock (:meth:`GCSide.now`, invariant 5). The
   roots are every tag plus what retention keeps (:meth:`Collector.retained`: the
   ``keep_last`` newest of each tag's lineage, the lineages of ``keep_tags`` globs, commits
   younger than ``keep_within`` or the grace period), computed in O(n log n) over one
   snapshot of the home's index (:meth:`GCSide.snapshot`). Commits outside them and older
   than the grace period are the *victims*. The keep-set is what the kept commits' records
   need (invariant 4): the home reports per pack its live entries and what dies
   (:meth:`GCSide.packs`, :class:`PackStat`).
3. **Decide** (:func:`decide`, the same code for both homes): a pack older than the grace
   period and not marked is *dead* (no live entry), *half-dead* (live bytes below
   ``repack_below``) or *small* (below ``small_pack_bytes``: merged when at least two packs
   are rewritten), :func:`pack_kind` and :func:`choose_repacks`.
4. **Act**: the victims leave the index (:meth:`GCSide.drop`: locally at once, in
   transactions that re-check the tags; on a bucket their records go into the mark); the
   half-dead and small packs' live entries are copied, verified, into new packs of up to
   ``pack_bytes`` (:meth:`GCSide.copy`, batches of :func:`batches`); the dead and copied
   packs (and, on a bucket, the victims' records) are **marked** (:meth:`GCSide.mark`:
   ``retired_at`` in the catalog; ``gc/<run>.json`` on a bucket).
5. **Sweep** (:func:`due_commits`, :func:`due_packs`): what has been marked for the grace period (this run's
   own marks with a grace period of 0) and is still outside the keep-set is deleted: the
   state is read again, and the deletion (:meth:`GCSide.delete`) starts over if a ref moved
   meanwhile. Stale temporary files and leftovers go too (:meth:`GCSide.leftovers`).

A dry run follows the same steps over the same state without acting, and reports what the
real run does; ``*_pending`` is a dry run at a grace period of 0 over the same state (before
anything changes), less this run (:func:`pending`).
"""

from __future__ import annotations

import fnmatch
import heapq
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..core.errors import InvalidArgumentError
from ..core.layout import RANDOM
from ..home.upkeep import DEFAULT_GRACE, GCReport, GCSide, PackStat, gc_lock, packed, unlocked  # noqa: F401 (the homes' side, declared below them; importable here too)

if TYPE_CHECKING:
    from ..home.interfaces import GCRepository

REPACK_BELOW = 0.5
#: Packs smaller than this (bytes) are merged into large ones by GC (at most half the store's ``pack_bytes``).
SMALL_PACK_BYTES = 4 << 20
#: Times a sweep decides again when a ref moves while it decides.
SWEEP_ATTEMPTS = 5
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str | float) -> float:
    """Seconds from ``"90s"``, ``"15m"``, ``"1h"``, ``"2d"``, ``"1w"``, ``"0"`` or a number.

    Raises:
        InvalidArgumentError: anything else, or a negative value.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text < 0:
            raise InvalidArgumentError(f"invalid duration {text!r}: must not be negative")
        return float(text)
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", str(text))
    if not m:
        raise InvalidArgumentError(f"invalid duration {text!r}: use a number with s, m, h, d or w (e.g. 30m, 1h, 7d)")
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


def check_glob(pattern: str) -> str:
    """Validate a tag glob (fnmatch syntax). Raises InvalidArgumentError."""
    if type(pattern) is not str or not pattern.strip() or any(c in pattern for c in "\x00\n\r"):
        raise InvalidArgumentError(f"invalid tag glob {pattern!r}")
    if pattern.count("[") != pattern.count("]"):
        raise InvalidArgumentError(f"invalid tag glob {pattern!r}: unbalanced brackets")
    return pattern


def pack_kind(size: int, live: int, n: int, repack_below: float, small_pack_bytes: int) -> str | None:
    """What a GC does with a pack older than the grace period, on either home: ``"dead"`` (no
    live entry: deleted), ``"half"`` (live bytes below ``repack_below`` of ``size``: its live
    entries are copied out, then it goes), ``"small"`` (below ``small_pack_bytes``: merged into
    large ones, if :func:`choose_repacks` takes it) or None (kept). Sizes in bytes."""
    if n <= 0:
        return "dead"
    if live < repack_below * size:
        return "half"
    if size < small_pack_bytes:
        return "small"
    return None


def choose_repacks(half: list, small: list) -> tuple[list, list]:
    """``(half-dead, small)`` packs to rewrite: the small ones only when there are at least two
    packs to rewrite (one alone would gain nothing)."""
    return half, small if len(half) + len(small) >= 2 else []


class Collector:
    """One GC run over ``store`` (see the module docstring)."""

    def __init__(self, store: GCRepository, keep_last: int, keep_tags: list[str], keep_within: float | None, grace: float,
                 repack_below: float, small_pack_bytes: int = SMALL_PACK_BYTES):
        if type(keep_last) is not int or keep_last < 1:
            raise InvalidArgumentError(f"invalid keep-last {keep_last!r}: must be a whole number >= 1 (a tag always keeps the commit it points to)")
        if not 0 <= repack_below <= 1:
            raise InvalidArgumentError(f"invalid repack threshold {repack_below!r}: must be within [0, 1]")
        if type(small_pack_bytes) is not int or small_pack_bytes < 0:
            raise InvalidArgumentError(f"invalid small-pack size {small_pack_bytes!r}: must be a whole number of bytes >= 0")
        self.store = store
        self.cat = store.catalog
        self.options = (keep_last, keep_tags, keep_within, repack_below, small_pack_bytes)
        # a merged pack of up to pack_bytes must not count as small again (or every run rewrites it)
        self.small_pack_bytes = min(small_pack_bytes, store.pack_bytes // 2)
        self.keep_last = keep_last
        self.keep_tags = [check_glob(g) for g in keep_tags]
        self.keep_within = 0.0 if keep_within is None else parse_duration(keep_within)
        self.grace = parse_duration(grace)
        self.repack_below = repack_below
        self.pack_bytes = store.pack_bytes
        self.now = 0.0  # the home's clock, set by each step of the run (:meth:`GCSide.now`)

    def at_grace_0(self) -> Collector:
        """The same run with a grace period of 0 (what :func:`pending` compares with)."""
        keep_last, keep_tags, keep_within, repack_below, small_pack_bytes = self.options
        return Collector(self.store, keep_last, keep_tags, keep_within, 0.0, repack_below, small_pack_bytes)

    def retained(self) -> set[str]:
        """Commit ids the roots and the retention policy keep, from the home's index (run inside
        one snapshot of it: :meth:`GCSide.snapshot`), ages as of :attr:`now`.

        O(n log n) in the number of commits n (plus ``keep_last`` steps per tag): the
        ``keep_last`` newest commits of a lineage are found by a best-first walk from
        the tag, newest first, that stops as soon as no older step can hold a newer one.
        """
        rows = self.cat.rows("SELECT id, created_at FROM commits ORDER BY created_at, id", raw=True)
        created = {c: rank for rank, (c, _) in enumerate(rows)}  # newer: higher rank (ties by id)
        parents: dict[str, list[str]] = {}
        for c, p in self.cat.rows("SELECT commit_id, parent_id FROM parents ORDER BY commit_id, position", raw=True):
            if p in created and c in created:  # (rows of a commit made after the read above, by a caller outside one snapshot)
                parents.setdefault(c, []).append(p)
        newest = self._newest_ancestor(created, parents)
        tags = self.cat.rows("SELECT name, commit_id FROM tags", raw=True)
        keep: set[str] = set()
        whole: set[str] = set()  # the lineages of keep_tags matches, walked once for all of them
        for name, cid in tags:
            keep.add(cid)
            if cid not in created:
                continue
            if any(fnmatch.fnmatchcase(name, g) for g in self.keep_tags):
                frontier = [cid]
                while frontier:
                    c = frontier.pop()
                    if c not in whole:
                        whole.add(c)
                        frontier += parents.get(c, ())
            else:
                keep.update(self._newest_of_lineage(cid, created, parents, newest))
        keep |= whole
        young = self.now - max(self.keep_within, self.grace)
        keep.update(c for c, t in rows if t > young)
        return keep

    @staticmethod
    def _newest_ancestor(created: dict, parents: dict) -> dict:
        """``{commit: the highest rank (newest) of it and its ancestors}``. Commits are made
        after their parents, so that is the commit itself (one pass over the edges); a store
        with a parent newer than its child (a clock stepped back) gets a full walk."""
        if all(created[p] <= created[c] for c, ps in parents.items() for p in ps):
            return created
        best: dict = {}
        for root in created:
            stack = [(root, False)]
            while stack:
                c, done = stack.pop()
                if c in best:
                    continue
                if done:
                    best[c] = max([created[c], *(best[p] for p in parents.get(c, ()))])
                    continue
                stack.append((c, True))
                stack += [(p, False) for p in parents.get(c, ()) if p not in best]
        return best

    def _newest_of_lineage(self, cid: str, created: dict, parents: dict, newest: dict) -> list[str]:
        """The ``keep_last`` newest commits of ``cid``'s lineage (itself and its ancestors)."""
        found: list[tuple[int, str]] = []  # min-heap of the keep_last newest (rank, id) seen
        heap = [(-newest[cid], cid)]  # to walk, newest ancestor first
        seen = {cid}
        while heap:
            if len(found) == self.keep_last and -heap[0][0] <= found[0][0]:
                break  # nothing left to walk is newer than the keep_last found
            _, c = heapq.heappop(heap)
            if len(found) < self.keep_last:
                heapq.heappush(found, (created[c], c))
            elif created[c] > found[0][0]:
                heapq.heapreplace(found, (created[c], c))
            for p in parents.get(c, ()):
                if p not in seen:
                    seen.add(p)
                    heapq.heappush(heap, (-newest[p], p))
        return [c for _, c in found]


@dataclass
class Plan:
    """What one run decides (:func:`decide`): ``victims`` (commit ids), and the packs that are
    ``dead``, ``half`` (half-dead: copied out) and ``small`` (merged), as :class:`PackStat`."""

    victims: list
    dead: list
    half: list
    small: list

    @property
    def marked(self) -> list:
        """The packs this run marks: the dead ones and those it copies out."""
        return self.dead + self.half + self.small


def decide(c: Collector, commits: dict, keep: set, stats: list[PackStat], cutoff: float, busy) -> Plan:
    """This run's decision, the same on both homes: the victims (commits not kept, older than
    ``cutoff``, not marked yet) and, among the packs older than ``cutoff``, not marked and not
    kept, the dead, half-dead and small ones (those to copy not ``busy``)."""
    victims = sorted(cid for cid, (t, marked, _) in commits.items() if cid not in keep and marked is None and t <= cutoff)
    dead, half, small = [], [], []
    for p in sorted(stats, key=lambda p: (p.created, p.id)):
        if p.keep or p.marked is not None or p.created > cutoff:
            continue
        kind = pack_kind(p.size, p.live, p.n, c.repack_below, c.small_pack_bytes)
        if kind == "dead":
            dead.append(p)
        elif kind is not None and not busy(p.id):
            (half if kind == "half" else small).append(p)
    half, small = choose_repacks(half, small)
    return Plan(victims, dead, half, small)


def due_commits(commits: dict, keep: set, cutoff: float) -> list[str]:
    """The commits a sweep deletes: marked before ``cutoff`` and still not kept."""
    return sorted(cid for cid, (_, marked, _) in commits.items() if marked is not None and marked <= cutoff and cid not in keep)


def due_packs(stats: list[PackStat], cutoff: float) -> list[PackStat]:
    """The packs a sweep deletes: marked before ``cutoff`` and still holding no live entry."""
    return [p for p in stats if p.marked is not None and p.marked <= cutoff and p.n == 0 and not p.keep]


def batches(packs: list[PackStat], pack_bytes: int) -> list[list[PackStat]]:
    """The packs to copy, in batches of at least ``pack_bytes`` live bytes (the last one less)."""
    out, batch, live = [], [], 0
    for p in packs:
        batch.append(p)
        live += p.live
        if live >= pack_bytes:
            out.append(batch)
            batch, live = [], 0
    return out + [batch] if batch else out


def pending(report: GCReport, at_grace_0: GCReport) -> None:
    """Fill ``report``'s ``*_pending`` fields: what ``at_grace_0`` (a dry run with a grace
    period of 0 over the same state) drops beyond what ``report`` does."""
    report.commits_pending = max(0, at_grace_0.commits_dropped - report.commits_dropped)
    report.blobs_pending = max(0, at_grace_0.blobs_deleted - report.blobs_deleted)
    report.bytes_pending = max(0, at_grace_0.bytes_freed - report.bytes_freed)


def collect(store: GCRepository, *, keep_last: int = 1, keep_tags: list[str] | tuple[str, ...] = (), keep_within: str | float | None = None,
            grace: str | float | None = None, dry_run: bool = False, repack_below: float = REPACK_BELOW,
            small_pack_bytes: int = SMALL_PACK_BYTES) -> GCReport:
    """Run one GC over ``store``, on either home (the module docstring; :meth:`Store.gc`).

    Raises:
        GCLockedError: another GC holds the home's lock.
        InvalidArgumentError: a duration, glob, count or size that does not parse.
        StoreWriteError: the store cannot be written (a dry run goes on).
        BackendError: object storage failed (what was deleted stays deleted; run again).
    """
    side = store.home.gc_side()
    c = Collector(store, keep_last, list(keep_tags), keep_within, side.default_grace if grace is None else grace, repack_below,
                  small_pack_bytes)
    report = GCReport(dry_run=dry_run)
    with side.lock(dry_run):
        at_grace_0 = _run(side, c.at_grace_0(), GCReport(dry_run=True)) if c.grace > 0 else None
        _run(side, c, report)
    if at_grace_0 is not None:
        pending(report, at_grace_0)
    return report


def _cutoff(side: GCSide, c: Collector, fresh: bool) -> float:
    """Set ``c.now`` from the home's clock; returns the grace period's cutoff on that clock."""
    now = side.now(fresh)
    c.now = now + side.clock_step  # retention by age reads records' own times, which may run a step ahead
    return now - c.grace - (side.clock_step if c.grace > 0 else 0.0)


def _run(side: GCSide, c: Collector, report: GCReport) -> GCReport:
    """One run of the protocol (the module docstring), or with ``report.dry_run`` its count."""
    dry = report.dry_run
    with _timed(report, "commits"):
        cutoff = _cutoff(side, c, fresh=False)
        with side.snapshot():
            keep = c.retained()
        commits = side.commits(keep)
        victims = decide(c, commits, keep, [], cutoff, side.busy).victims
        gone = due_commits(commits, keep, cutoff)
        side.drop(c, victims, cutoff, report)  # what leaves the index at once (a dry run: counted)
        now_dropped = set(report.dropped)
    with _timed(report, "decide"):
        stats = side.packs(keep, victims + gone, cutoff)
        plan = decide(c, commits, keep, stats, cutoff, side.busy)
        plan.victims = victims
        report.withheld += side.withheld()
        report.blobs_deleted += sum(p.dies_now for p in stats)
        report.blob_bytes += sum(p.dies_now_bytes for p in stats)
    copies = plan.half + plan.small
    need, free = sum(p.live for p in copies), side.room()
    if copies and free is not None and free < need + (1 << 20):  # copies are written before the old packs go: a full disk first frees
        report.withheld.append(f"repacking {len(copies)} packs needs {need} bytes of room and the disk has {free}: left for a later GC")
        plan.half, plan.small = [], []
    with _timed(report, "repack"):
        for batch in batches(plan.half + plan.small, c.pack_bytes):
            report.bytes_freed -= side.copy_size(batch) if dry else side.copy(batch, report)
        report.packs_repacked, report.packs_consolidated = len(plan.half), len(plan.small)
        if not dry:
            side.mark(plan, report)
    with _timed(report, "sweep"):
        if dry:  # what the sweep below finds: the marks due, and this run's own with a grace period of 0
            own = c.grace == 0
            _count_sweep(report, gone + [v for v in victims if own and v not in now_dropped],
                         due_packs(stats, cutoff) + (plan.marked if own else []), commits)
        for _ in range(0 if dry or not (c.grace == 0 or side.anything_due(cutoff)) else SWEEP_ATTEMPTS):
            cutoff = _cutoff(side, c, fresh=True)
            token = side.refs_token()
            with side.snapshot():
                keep = c.retained()
            commits = side.commits(keep)
            gone = due_commits(commits, keep, cutoff)
            swept = due_packs(side.packs(keep, gone, cutoff), cutoff)
            deleted = side.delete(gone, swept, token, report)
            if deleted is not None:
                _count_sweep(report, *deleted, commits)
                break
            time.sleep(RANDOM.uniform(0.01, 0.1))  # a ref moved while we decided: decide again
    with _timed(report, "leftovers"):
        side.leftovers(cutoff, c.grace == 0, report)
    report.commits_dropped = len(report.dropped)
    return report


def _count_sweep(report: GCReport, gone: list[str], swept: list[PackStat], commits: dict) -> None:
    """Count into ``report`` what a sweep of the ``gone`` commits and the ``swept`` packs deletes."""
    report.dropped += gone
    report.packs_deleted += len(swept)
    report.blobs_deleted += sum(p.dies_with for p in swept)
    report.blob_bytes += sum(p.dies_with_bytes for p in swept)
    report.bytes_freed += sum(p.freed for p in swept) + sum(commits[cid][2] for cid in gone)


@contextmanager
def _timed(report: GCReport, phase: str):
    """Add the seconds the block takes to ``report.seconds[phase]``."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        report.seconds[phase] = report.seconds.get(phase, 0.0) + time.perf_counter() - t0
