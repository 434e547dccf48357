"""Commands that check, clean and repair a store: ``gc``, ``fsck``, ``verify`` and ``recover``."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Annotated

import typer
from rich.text import Text

from ..core.units import counted, fmt_bytes
from ..store import Store
from .common import AsJson, StdoutClosed, StorePath, bars, emit_json, err, open_store, say, store_path


def gc(
    store: StorePath = None,
    keep_last: Annotated[int, typer.Option(help="Keep the N newest commits of each tag's lineage (the tagged commit counts).")] = 1,
    keep_tag: Annotated[list[str] | None, typer.Option(help="Keep the whole lineage of tags matching this glob (repeatable).")] = None,
    keep_within: Annotated[str | None, typer.Option(help="Keep commits younger than this (30m, 12h, 7d).")] = None,
    grace: Annotated[str | None, typer.Option(help="Never free blobs, packs or files younger than this (default 1h; 24h on object storage).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", metavar="", help="Report what would be freed; change nothing.")] = False,
    as_json: AsJson = False,
) -> None:
    """Free what no tag or retained commit needs. Exit 0 done, 1 error, 3 another GC holds the store."""
    with open_store(store) as s, bars():
        extra = {} if grace is None else {"grace": grace}
        report = s.gc(keep_last=keep_last, keep_tags=keep_tag or (), keep_within=keep_within, dry_run=dry_run, **extra)
    if as_json:
        emit_json(report)
        return
    verb = "would free" if report.dry_run else "freed"
    say(
        f"gc {verb}: {counted(report.commits_dropped, 'commit')}, {counted(report.blobs_deleted, 'blob')} ({fmt_bytes(report.blob_bytes)} in packs), "
        f"{counted(report.packs_deleted, 'pack')} deleted, {report.packs_repacked} repacked, {report.packs_consolidated} consolidated, "
        f"{counted(report.orphans_removed, 'orphan pack')}, {counted(report.tmp_removed, 'tmp file')}; {fmt_bytes(report.bytes_freed)} freed "
        f"on disk (net of the packs written); pending the grace period: "
        f"{counted(report.commits_pending, 'commit')}, {counted(report.blobs_pending, 'blob')}, {fmt_bytes(report.bytes_pending)}"
    )
    say("phases: " + ", ".join(f"{k} {v:.3f} s" for k, v in report.seconds.items()))
    for why in report.withheld:
        say(Text.assemble(("withheld", "yellow"), f": {why}"))


def _print_fsck(report, as_json: bool) -> None:
    with contextlib.suppress(StdoutClosed):  # the reader left (| head): the exit status still says what was found
        if as_json:
            emit_json({**dataclasses.asdict(report), "ok": report.ok})
        else:
            for problem in report.problems:
                say(Text.assemble(("problem", "red"), f": {problem}"))
            if report.damaged_commits:
                say(f"damaged commits: {', '.join(c[:12] for c in report.damaged_commits)}")
            if report.damaged_tags:
                say(f"damaged tags: {', '.join(report.damaged_tags)}")
            for key in report.repaired:
                say(f"repaired: {key}")
            for blob in report.replaced_blobs:
                say(f"replaced: blob {blob} (the index points at a good copy found in a pack)")
            if report.marked_bad:
                say(f"marked bad: {counted(report.marked_bad, 'blob')} (never reused; the next commit of their bytes writes a good copy)")
            for line in report.foreign:
                say(Text.assemble(("foreign", "yellow"), f": {line} (left alone)"))
            if report.missing_indexes:
                say(f"packs without .idx (walked instead; GC rebuilds or removes them): {len(report.missing_indexes)}")
            say(
                f"{'ok' if report.ok else 'NOT OK'}: {counted(report.commits, 'commit')}, {counted(report.blobs_checked, 'blob')} rehashed "
                f"({fmt_bytes(report.bytes_checked)}); orphans: {counted(len(report.orphan_packs), 'pack')}, "
                f"{counted(report.unreferenced_blobs, 'unreferenced blob')}, {counted(report.tmp_files, 'tmp file')}"
            )
    if not report.ok:
        raise SystemExit(1)


def fsck(
    store: StorePath = None,
    deep: Annotated[bool, typer.Option("--deep", metavar="", help="Reread blobs and check their hashes.")] = False,
    sample: Annotated[float, typer.Option(help="Reread this fraction of the blobs (implies --deep).")] = 1.0,
    repair: Annotated[bool, typer.Option("--repair", metavar="", help="Replace bad blob copies by good ones found in packs; object storage: also rebuild damaged pack indexes and marker (implies --deep).")] = False,
    as_json: AsJson = False,
) -> None:
    """Check the catalog and the blobs; exit 1 when anything is wrong (orphans are reported, not errors)."""
    with open_store(store) as s, bars():
        report = s.fsck(deep=deep, sample=sample, repair=repair)
    _print_fsck(report, as_json)


def verify(ref: Annotated[str, typer.Argument(help="Tag or commit.")], store: StorePath = None, as_json: AsJson = False) -> None:
    """Reread and rehash every blob of one commit; exit 1 when one is missing or corrupt."""
    with open_store(store) as s, bars():
        report = s.verify(ref)
    _print_fsck(report, as_json)


def recover(
    store: StorePath = None,
    force: Annotated[bool, typer.Option("--force", metavar="", help="Rebuild even a catalog that opens and passes SQLite's check, and replace it even with a rebuild that lacks what could not be read.")] = False,
    as_json: AsJson = False,
) -> None:
    """Rebuild a lost or damaged catalog from the packs alone (s3://…: this machine's cache from the bucket); run it while nothing else uses the store.

    Exit 1 when it could not restore everything the packs hold (each tag, commit, pack and
    record is named, with why); an existing catalog is then replaced only with --force."""
    report = Store.recover(store_path(store), force=force)
    with contextlib.suppress(StdoutClosed):  # the reader left (| head): a failure is still reported below
        if as_json:
            emit_json({**dataclasses.asdict(report), "ok": report.ok})
        else:
            say(
                f"recovered {counted(report.commits, 'commit')}, {counted(len(report.tags), 'tag')}, {counted(report.blobs, 'blob')} "
                f"from {counted(report.packs, 'pack')} "
                f"in {report.seconds:.2f} s"
            )
            for t, cid in report.tags.items():
                say(f"  {t} -> {cid}")
            if report.moved_aside:
                say(f"the damaged catalog was moved to {report.moved_aside}")
            if report.repaired:
                say(f"rebuilt from their packs and rewritten on the bucket ({len(report.repaired)}):")
                for key in report.repaired:
                    say(f"  {key}")
            lost = report.lost()
            if lost:
                say(f"NOT restored ({len(report.dropped_tags)} tags, {len(report.dropped_commits)} commits, {len(report.problems)} unreadable packs or records):")
                for line in lost:
                    say(f"  {line}")
            say("next: ckptstore fsck --deep")
    if not report.ok:
        err.print(
            f"error: recover could not restore {len(report.dropped_tags)} tag(s) and {len(report.dropped_commits)} commit(s) "
            f"the packs hold ({len(report.problems)} unreadable pack(s) or record(s)); see the list above",
            soft_wrap=True, markup=False,
        )
        raise SystemExit(1)
