"""Commands that copy commits between a store and another store or a file: ``push``,
``pull``, ``export``, ``import`` and ``import-torchrl``."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Annotated

import typer

from ..core.units import counted, fmt_bytes
from ..store import Store
from .common import AsJson, StorePath, bars, commit_table, emit_json, err, open_store, say, shown_path, store_path, terminal

Force = Annotated[bool, typer.Option("--force", metavar="", help="Move the tag even when its commit is not an ancestor of REF's.")]


def _transfer_done(report, as_json: bool, direction: str) -> None:
    if as_json:
        emit_json(report)
        return
    moved = f"; {report.tag} -> {report.commit}" if report.tag else ""
    say(
        f"{direction} {report.commit[:12]}: {counted(len(report.commits_copied), 'commit')}, {counted(report.blobs_copied, 'blob')}, "
        f"{fmt_bytes(report.bytes_copied)} copied{moved}"
    )


def push(
    remote: Annotated[str, typer.Argument(help="The other store: a folder (created if missing) or s3://bucket/prefix (an empty prefix becomes a store).")],
    ref: Annotated[str, typer.Argument(help="Tag, commit id or unique prefix to copy; a tag also moves there.")],
    store: StorePath = None,
    force: Force = False,
    as_json: AsJson = False,
) -> None:
    """Copy REF and the ancestors REMOTE lacks into REMOTE (commit ids kept, only missing blobs
    copied), then move REMOTE's tag if that is a fast-forward."""
    with open_store(store) as s:
        report = s.push(remote, ref, force=force)
    _transfer_done(report, as_json, "pushed")


def pull(
    remote: Annotated[str, typer.Argument(help="The other store: a folder or s3://bucket/prefix.")],
    ref: Annotated[str, typer.Argument(help="Tag, commit id or unique prefix of REMOTE to copy; a tag also moves there.")],
    store: StorePath = None,
    force: Force = False,
    as_json: AsJson = False,
) -> None:
    """Copy REF of REMOTE and the ancestors this store lacks into this store (created if missing)."""
    with Store(store_path(store)) as s:  # created by the pull, only once there is something to copy
        report = s.pull(remote, ref, force=force)
    _transfer_done(report, as_json, "pulled")


def export_cmd(
    ref: Annotated[str, typer.Argument(help="Tag or commit.")],
    dest: Annotated[Path, typer.Argument(help="A .zip file or a new folder.")],
    store: StorePath = None,
    as_json: AsJson = False,
) -> None:
    """Export one commit to a ZIP archive or a folder."""
    with open_store(store) as s, bars():
        out = s.export(ref, dest)
    emit_json({"exported": str(out)}) if as_json else say(f"exported {ref} to {out}")


def import_cmd(
    src: Annotated[Path, typer.Argument(help="A .zip archive or folder made by export.")],
    tag: Annotated[str | None, typer.Option(help="Tag to point at the imported commit.")] = None,
    store: StorePath = None,
    as_json: AsJson = False,
) -> None:
    """Import an exported commit; every entry is verified before anything is written."""
    from ..adapters import REGISTRY
    from ..protocols.archive import check_export

    with bars():
        check_export(src, REGISTRY)  # before a missing store folder is created
    with Store(store_path(store)) as s, warnings.catch_warnings(record=True) as caught, bars():
        warnings.simplefilter("always")
        info = s.import_from(src, tag=tag)
    for w in caught:
        err.print(f"warning: {w.message}", soft_wrap=True, markup=False)
    emit_json(info) if as_json else terminal().print(commit_table([info], title="imported"))


def import_torchrl_cmd(
    src: Annotated[Path, typer.Argument(help="A ReplayBuffer.dumps folder, or a torchrl.checkpoint folder or .zip.")],
    tag: Annotated[str | None, typer.Option(help="Tag to point at the imported commit.")] = None,
    store: StorePath = None,
    as_json: AsJson = False,
) -> None:
    """Import a TorchRL dump or checkpoint; pickled files are never unpickled (settings-only ones are skipped)."""
    with Store(store_path(store)) as s:
        info, report = s.import_torchrl(src, tag=tag)
    if as_json:
        emit_json({"commit": info, "report": report})
        return
    terminal().print(commit_table([info], title=f"imported {report.format}"))
    say(f"components: {', '.join(shown_path(c) for c in report.components)}")
    for name, reason in report.skipped:
        say(f"skipped {name}: {reason}")
