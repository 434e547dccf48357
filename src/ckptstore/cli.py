"""The ``ckptstore`` command line (typer + rich).

Every command takes ``--store PATH`` (or the ``CKPTSTORE_PATH`` environment
variable) and ``--json`` for machine-readable output. Errors print one line,
``error: <message>``, on stderr and exit with status 1; usage errors exit 2;
``gc`` exits 3 when another GC holds the store; ``fsck`` and ``verify`` exit 1
when they find a problem.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from .errors import CkptStoreError, GCLockedError
from .store import CommitInfo, Store

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Content-addressed, versioned checkpoints for PyTorch and TorchRL training state.",
)
console = Console(highlight=False)
err = Console(stderr=True, highlight=False)

StorePath = Annotated[Path, typer.Option("--store", "-s", envvar="CKPTSTORE_PATH", help="Store folder (or $CKPTSTORE_PATH).")]
AsJson = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]


def fmt_bytes(n: float | None) -> str:
    """Bytes as a short human string (binary units)."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def fmt_time(t: float) -> str:
    return datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


def ratio(x: float | None) -> str:
    return "-" if x is None else ("inf" if x == float("inf") else f"{x:.1f}x")


def open_store(path: Path) -> Store:
    return Store(path, create=False)


def emit_json(data: Any) -> None:
    def default(o: Any) -> Any:
        if dataclasses.is_dataclass(o):
            return dataclasses.asdict(o)
        if isinstance(o, (tuple, set)):
            return list(o)
        return str(o)

    sys.stdout.write(json.dumps(data, default=default, indent=2) + "\n")


def commit_table(infos: list[CommitInfo], title: str | None = None) -> Table:
    """A rich table of commits: id, tags, parents, time, bytes, seconds."""
    table = Table(title=title)
    for col in ("commit", "tags", "parents", "time", "message", "logical", "new", "stored", "dedup", "seconds"):
        table.add_column(col, justify="right" if col in ("logical", "new", "stored", "dedup", "seconds") else "left")
    for c in infos:
        table.add_row(
            c.id[:12], ", ".join(c.tags), ", ".join(p[:12] for p in c.parents), fmt_time(c.created_at), c.message,
            fmt_bytes(c.logical_bytes), fmt_bytes(c.new_bytes), fmt_bytes(c.stored_bytes), ratio(c.dedup_ratio), f"{c.seconds:.3f}",
        )
    return table


@app.command()
def log(
    ref: Annotated[str | None, typer.Argument(help="Tag or commit; all commits when omitted.")] = None,
    store: StorePath = Path("."),
    limit: Annotated[int | None, typer.Option(min=1, help="Show at most this many commits.")] = None,
    as_json: AsJson = False,
) -> None:
    """Lineage of REF (the commit and its ancestors), newest first."""
    with open_store(store) as s:
        infos = s.log(ref, limit=limit)
    if as_json:
        emit_json(infos)
    else:
        console.print(commit_table(infos))


@app.command()
def tags(store: StorePath = Path("."), as_json: AsJson = False) -> None:
    """Tags and the commits they point to."""
    with open_store(store) as s:
        named = s.tags()
        infos = s._infos(list(set(named.values())))
    if as_json:
        emit_json({name: cid for name, cid in named.items()})
        return
    table = Table()
    for col in ("tag", "commit", "time", "message"):
        table.add_column(col)
    for name, cid in named.items():
        table.add_row(name, cid[:12], fmt_time(infos[cid].created_at), infos[cid].message)
    console.print(table)


@app.command()
def reflog(tag: Annotated[str | None, typer.Argument(help="Only this tag.")] = None, store: StorePath = Path("."), as_json: AsJson = False) -> None:
    """Every tag move (commit, tag, delete), newest first."""
    with open_store(store) as s:
        rows = s.reflog(tag)
    if as_json:
        emit_json(rows)
        return
    table = Table()
    for col in ("time", "tag", "action", "from", "to"):
        table.add_column(col)
    for r in rows:
        table.add_row(fmt_time(r["at"]), r["tag"], r["action"], (r["old_commit"] or "-")[:12], (r["new_commit"] or "-")[:12])
    console.print(table)


@app.command()
def show(ref: Annotated[str, typer.Argument(help="Tag, commit id or unique prefix.")], store: StorePath = Path("."), as_json: AsJson = False) -> None:
    """Components and leaves of a commit: dtypes, shapes, logical vs stored bytes, shards shared with the parent."""
    with open_store(store) as s:
        detail = s.show(ref)
    if as_json:
        emit_json(detail)
        return
    info: CommitInfo = detail["commit"]
    console.print(commit_table([info], title=f"commit {info.id}"))
    if info.metadata:
        console.print(f"metadata: {json.dumps(info.metadata, default=str)}")
    comps = Table(title="components")
    for col in ("component", "adapter", "version", "class"):
        comps.add_column(col)
    for path, c in detail["components"].items():
        comps.add_row(path or "<root>", c["adapter"], str(c["version"]), str(c["meta"].get("class", "")))
    console.print(comps)
    leaves = Table(title="leaves")
    for col in ("leaf", "kind", "dtype", "shape", "logical", "stored", "shards", "shared w/ parent"):
        leaves.add_column(col, justify="right" if col in ("logical", "stored", "shards", "shared w/ parent") else "left")
    for leaf in detail["leaves"]:
        leaves.add_row(
            leaf["path"] or "<root>", leaf["kind"], leaf["dtype"] or "", "" if leaf["shape"] is None else str(leaf["shape"]),
            fmt_bytes(leaf["logical_bytes"]), fmt_bytes(leaf["stored_bytes"]), str(leaf["shards"]), str(leaf["shared_with_parent"]),
        )
    console.print(leaves)


@app.command()
def diff(
    a: Annotated[str, typer.Argument(help="Old commit or tag.")],
    b: Annotated[str, typer.Argument(help="New commit or tag.")],
    store: StorePath = Path("."),
    all_leaves: Annotated[bool, typer.Option("--all", help="Also list unchanged leaves.")] = False,
    as_json: AsJson = False,
) -> None:
    """Leaf by leaf: added, removed, changed or unchanged; shards changed; new bytes."""
    with open_store(store) as s:
        report = s.diff(a, b)
    if as_json:
        emit_json(report)
        return
    table = Table(title=f"{report.a[:12]} -> {report.b[:12]}")
    for col in ("leaf", "status", "dtype", "shape", "shards", "changed", "new bytes"):
        table.add_column(col, justify="right" if col in ("shards", "changed", "new bytes") else "left")
    for leaf in report.leaves:
        if leaf.status != "unchanged" or all_leaves:
            table.add_row(leaf.path or "<root>", leaf.status, leaf.dtype or leaf.kind, "" if leaf.shape is None else str(leaf.shape),
                          str(leaf.shards), str(leaf.shards_changed), fmt_bytes(leaf.new_bytes))
    console.print(table)
    counts = ", ".join(f"{report.count(s)} {s}" for s in ("added", "removed", "changed", "unchanged"))
    console.print(f"{counts}; {fmt_bytes(report.new_bytes)} new in {report.b[:12]}")


@app.command()
def du(store: StorePath = Path("."), as_json: AsJson = False) -> None:
    """Logical vs physical bytes and the dedup ratio."""
    with open_store(store) as s:
        usage = s.du()
    if as_json:
        emit_json(usage)
        return
    table = Table(show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    for key in ("commits", "tags", "blobs", "packs"):
        table.add_row(key, str(usage[key]))
    for key in ("logical_bytes", "unique_bytes", "stored_bytes", "pack_bytes", "catalog_bytes", "tmp_bytes"):
        table.add_row(key.replace("_", " "), fmt_bytes(usage[key]))
    table.add_row("dedup ratio (logical / unique)", ratio(usage["dedup_ratio"]))
    table.add_row("compression ratio (unique / stored)", ratio(usage["compression_ratio"]))
    console.print(table)


@app.command()
def gc(
    store: StorePath = Path("."),
    keep_last: Annotated[int, typer.Option(help="Keep the N newest commits of each tag's lineage (the tagged commit counts).")] = 1,
    keep_tag: Annotated[list[str] | None, typer.Option(help="Keep the whole lineage of tags matching this glob (repeatable).")] = None,
    keep_within: Annotated[str | None, typer.Option(help="Keep commits younger than this (30m, 12h, 7d).")] = None,
    grace: Annotated[str, typer.Option(help="Never free blobs, packs or files younger than this.")] = "1h",
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Report what would be freed; change nothing.")] = False,
    as_json: AsJson = False,
) -> None:
    """Free what no tag or retained commit needs. Exit 0 done, 1 error, 3 another GC holds the store."""
    with open_store(store) as s:
        report = s.gc(keep_last=keep_last, keep_tags=keep_tag or (), keep_within=keep_within, grace=grace, dry_run=dry_run)
    if as_json:
        emit_json(report)
        return
    verb = "would free" if report.dry_run else "freed"
    console.print(
        f"gc {verb}: {report.commits_dropped} commits, {report.blobs_deleted} blobs ({fmt_bytes(report.blob_bytes)} in packs), "
        f"{report.packs_deleted} packs deleted, {report.packs_repacked} repacked, {report.orphans_removed} orphan packs, "
        f"{report.tmp_removed} tmp files; {fmt_bytes(report.bytes_freed)} freed on disk, {fmt_bytes(report.bytes_pending)} "
        "pending the grace period"
    )
    console.print("phases: " + ", ".join(f"{k} {v:.3f} s" for k, v in report.seconds.items()))


def _print_fsck(report, as_json: bool) -> None:
    if as_json:
        emit_json({**dataclasses.asdict(report), "ok": report.ok})
    else:
        for problem in report.problems:
            console.print(f"[red]problem[/red]: {problem}")
        if report.damaged_commits:
            console.print(f"damaged commits: {', '.join(c[:12] for c in report.damaged_commits)}")
        if report.damaged_tags:
            console.print(f"damaged tags: {', '.join(report.damaged_tags)}")
        console.print(
            f"{'ok' if report.ok else 'NOT OK'}: {report.commits} commits, {report.blobs_checked} blobs rehashed "
            f"({fmt_bytes(report.bytes_checked)}); orphans: {len(report.orphan_packs)} packs, "
            f"{report.unreferenced_blobs} unreferenced blobs, {report.tmp_files} tmp files"
        )
    if not report.ok:
        raise SystemExit(1)


@app.command()
def fsck(
    store: StorePath = Path("."),
    deep: Annotated[bool, typer.Option("--deep", help="Reread blobs and check their hashes.")] = False,
    sample: Annotated[float, typer.Option(help="Reread this fraction of the blobs (implies --deep).")] = 1.0,
    as_json: AsJson = False,
) -> None:
    """Check the catalog and the blobs; exit 1 when anything is wrong (orphans are reported, not errors)."""
    with open_store(store) as s:
        report = s.fsck(deep=deep, sample=sample)
    _print_fsck(report, as_json)


@app.command()
def verify(ref: Annotated[str, typer.Argument(help="Tag or commit.")], store: StorePath = Path("."), as_json: AsJson = False) -> None:
    """Reread and rehash every blob of one commit; exit 1 when one is missing or corrupt."""
    with open_store(store) as s:
        report = s.verify(ref)
    _print_fsck(report, as_json)


@app.command()
def recover(store: StorePath = Path("."), as_json: AsJson = False) -> None:
    """Rebuild a lost or damaged catalog from the packs alone; run it while nothing else uses the store."""
    report = Store.recover(store)
    if as_json:
        emit_json(report)
        return
    console.print(
        f"recovered {report.commits} commits, {len(report.tags)} tags, {report.blobs} blobs from {report.packs} packs "
        f"in {report.seconds:.2f} s"
    )
    for t, cid in report.tags.items():
        console.print(f"  {t} -> {cid}")
    if report.moved_aside:
        console.print(f"the damaged catalog was moved to {report.moved_aside}")
    for what, items in (("incomplete commits (blobs missing)", report.incomplete_commits), ("damaged packs", list(report.damaged_packs))):
        if items:
            console.print(f"{what}: {', '.join(items[:10])}")
    console.print("next: ckptstore fsck --deep")


@app.command("export")
def export_cmd(
    ref: Annotated[str, typer.Argument(help="Tag or commit.")],
    dest: Annotated[Path, typer.Argument(help="A .zip file or a new folder.")],
    store: StorePath = Path("."),
    as_json: AsJson = False,
) -> None:
    """Export one commit to a ZIP archive or a folder."""
    with open_store(store) as s:
        out = s.export(ref, dest)
    emit_json({"exported": str(out)}) if as_json else console.print(f"exported {ref} to {out}")


@app.command("import")
def import_cmd(
    src: Annotated[Path, typer.Argument(help="A .zip archive or folder made by export.")],
    tag: Annotated[str | None, typer.Option(help="Tag to point at the imported commit.")] = None,
    store: StorePath = Path("."),
    as_json: AsJson = False,
) -> None:
    """Import an exported commit; every entry is verified before anything is written."""
    from .adapters import REGISTRY
    from .container import check_export

    check_export(src, REGISTRY)  # before a missing store folder is created
    with Store(store) as s:
        info = s.import_from(src, tag=tag)
    emit_json(info) if as_json else console.print(commit_table([info], title="imported"))


@app.command("import-torchrl")
def import_torchrl_cmd(
    src: Annotated[Path, typer.Argument(help="A ReplayBuffer.dumps folder, or a torchrl.checkpoint folder or .zip.")],
    tag: Annotated[str | None, typer.Option(help="Tag to point at the imported commit.")] = None,
    store: StorePath = Path("."),
    as_json: AsJson = False,
) -> None:
    """Import a TorchRL dump or checkpoint; pickled files are never unpickled (settings-only ones are skipped)."""
    with Store(store) as s:
        info, report = s.import_torchrl(src, tag=tag)
    if as_json:
        emit_json({"commit": info, "report": report})
        return
    console.print(commit_table([info], title=f"imported {report.format}"))
    console.print(f"components: {', '.join(c or '<root>' for c in report.components)}")
    for name, reason in report.skipped:
        console.print(f"skipped {name}: {reason}")


@app.command()
def demo(
    store: Annotated[Path, typer.Option("--store", "-s", help="Store folder (not $CKPTSTORE_PATH: the demo never writes into your store).")] = Path(
        "runs/demo-store"
    ),
    frames: Annotated[int, typer.Option(min=250, help="Environment frames to collect (a multiple of 250).")] = 3000,
    every: Annotated[int, typer.Option(min=250, help="Commit every this many frames (a multiple of 250).")] = 500,
    seed: Annotated[int, typer.Option(help="Random seed.")] = 0,
) -> None:
    """The main job: collect CartPole with TorchRL, train DQN, commit every N frames, restore and check."""
    from .demo import PER_BATCH, run

    if frames % PER_BATCH or every % PER_BATCH:
        raise typer.BadParameter(f"--frames and --every must be multiples of {PER_BATCH}")
    run(store, frames=frames, every=every, seed=seed, console=console)


def main() -> None:
    """Entry point: one-line errors, non-zero exit (2 for usage errors, as click)."""
    try:
        code = app(standalone_mode=False)  # click's own usage errors come here, not as a boxed message
    except typer.TyperException as exc:  # click's errors, vendored by typer
        if exc.format_message():  # empty when the help was printed instead (no arguments)
            err.print(f"error: {exc.format_message()} (see ckptstore --help)", soft_wrap=True, markup=False)
        raise SystemExit(exc.exit_code) from None
    except typer.Abort:
        err.print("error: aborted", soft_wrap=True)
        raise SystemExit(1) from None
    except GCLockedError as exc:
        err.print(f"error: {exc}", soft_wrap=True, markup=False)
        raise SystemExit(3) from None
    except CkptStoreError as exc:
        err.print(f"error: {exc}", soft_wrap=True, markup=False)
        raise SystemExit(1) from None
    except OSError as exc:
        err.print(f"error: {exc}", soft_wrap=True, markup=False)
        raise SystemExit(1) from None
    raise SystemExit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
