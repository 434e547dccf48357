"""Commands that read a store: ``log``, ``runs``, ``show``, ``diff`` and ``du``."""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated

import typer

from ..core.units import fmt_bytes, ratio
from ..store import CommitInfo
from .common import (
    NARROW,
    AsJson,
    StorePath,
    commit_table,
    emit_json,
    fitted,
    folded,
    hidden,
    open_store,
    say,
    shown_path,
    table,
    terminal,
    visible,
)


def log(
    ref: Annotated[str | None, typer.Argument(help="Tag or commit; all commits when omitted.")] = None,
    store: StorePath = None,
    limit: Annotated[int | None, typer.Option(min=1, help="Show at most this many commits.")] = None,
    as_json: AsJson = False,
) -> None:
    """Lineage of REF (the commit and its ancestors), newest first."""
    with open_store(store) as s:
        infos = s.log(ref, limit=limit)
    if as_json:
        emit_json(infos)
    else:
        terminal().print(commit_table(infos))


def runs_cmd(store: StorePath = None, as_json: AsJson = False) -> None:
    """Runs (Checkpointer(run=...)) with their latest step, commit count and bytes."""
    from ..run import DEFAULT_RUN, runs

    with open_store(store) as s:
        found = runs(s)
    if as_json:
        emit_json([dataclasses.asdict(r) for r in found])
        return
    if not found:
        say("no runs: no commit here was made by a Checkpointer (Checkpointer(store, objects, run=NAME) starts one)")
        return
    out = table("run", "latest step", "commit", "commits", "bytes", numeric=("latest step", "commits", "bytes"), whole=("commit",))
    for r in found:
        out.add_row(DEFAULT_RUN if r.name is None else r.name, str(r.latest_step), r.latest_commit[:12], str(r.commits), fmt_bytes(r.bytes))
    terminal().print(out)


def show(ref: Annotated[str, typer.Argument(help="Tag, commit id or unique prefix.")], store: StorePath = None, as_json: AsJson = False) -> None:
    """Components and leaves of a commit: dtypes, shapes, logical vs stored bytes, shards shared with the parent."""
    with open_store(store) as s:
        detail = s.show(ref)
    if as_json:
        emit_json(detail)
        return
    info: CommitInfo = detail["commit"]
    terminal().print(commit_table([info], title=f"commit {info.id}"))
    if info.metadata:
        say(f"metadata: {json.dumps(info.metadata, default=str)}")
    comps = table("component", "adapter", "version", "class", title="components", whole=("version",))
    for path, c in detail["components"].items():
        comps.add_row(shown_path(path), c["adapter"], str(c["version"]), str(c["meta"].get("class", "")))
    terminal().print(comps)
    every = ["leaf", "kind", "dtype", "shape", "logical", "stored", "shards", "shared w/ parent"]
    cols = every if terminal().width >= NARROW else ["leaf", "dtype", "shape", "logical", "stored"]
    rows = [[
        {
            "leaf": visible(shown_path(leaf["path"])), "kind": leaf["kind"], "dtype": leaf["dtype"] or leaf["kind"],
            "shape": "" if leaf["shape"] is None else str(leaf["shape"]), "logical": fmt_bytes(leaf["logical_bytes"]),
            "stored": fmt_bytes(leaf["stored_bytes"]), "shards": str(leaf["shards"]), "shared w/ parent": str(leaf["shared_with_parent"]),
        }[c] for c in cols] for leaf in detail["leaves"]]
    width = fitted(rows, cols, 0)
    leaves = table(*cols, title="leaves", numeric=("logical", "stored", "shards", "shared w/ parent"), min_width={"leaf": width})
    leaves.caption = hidden(every, cols)
    for name, *row in rows:
        leaves.add_row(folded(name, width), *row)
    terminal().print(leaves)
    for c in detail["components"].values():
        if c["adapter"] == "dcp" and isinstance(c["meta"].get("items"), dict):
            terminal().print(_dcp_ranks(c["meta"]["items"], detail["leaves"]))


def _dcp_ranks(items: dict, leaves: list[dict]):
    """Per rank, what a torch.distributed.checkpoint commit holds: items, logical and stored bytes."""
    by_path = {leaf["path"]: leaf for leaf in leaves}
    ranks: dict = {}
    for entry in items.values():
        if not isinstance(entry, dict):
            continue
        chunks = [(entry.get("bytes"), entry.get("rank"))] if "bytes" in entry else [(c[2], c[3]) for c in entry.get("chunks", []) if isinstance(c, list) and len(c) == 4]
        for path, rank in chunks:
            leaf = by_path.get(path, {})
            n, logical, stored = ranks.get(rank, (0, 0, 0))
            more = leaf.get("stored_bytes", 0)  # None: not located by this cache yet (object storage), so the sum is unknown too
            ranks[rank] = (n + 1, logical + leaf.get("logical_bytes", 0), None if stored is None or more is None else stored + more)
    out = table("rank", "items", "logical", "stored", title="written by rank (torch.distributed.checkpoint)", numeric=("items", "logical", "stored"))
    for rank, (n, logical, stored) in sorted(ranks.items(), key=lambda kv: (kv[0] is None, kv[0] if isinstance(kv[0], int) else 0)):
        out.add_row(str(rank), str(n), fmt_bytes(logical), fmt_bytes(stored))
    return out


def diff(
    a: Annotated[str, typer.Argument(help="Old commit or tag.")],
    b: Annotated[str, typer.Argument(help="New commit or tag.")],
    store: StorePath = None,
    all_leaves: Annotated[bool, typer.Option("--all", metavar="", help="Also list unchanged leaves (text and --json).")] = False,
    as_json: AsJson = False,
) -> None:
    """Leaf by leaf: added, removed, changed or unchanged; shards changed; new bytes."""
    with open_store(store) as s:
        report = s.diff(a, b)
    statuses = ("added", "removed", "changed", "unchanged")
    listed = [leaf for leaf in report.leaves if leaf.status != "unchanged" or all_leaves]
    if as_json:
        emit_json({**dataclasses.asdict(report), "leaves": listed, "counts": {s: report.count(s) for s in statuses}})
        return
    headers = ["leaf", "status", "dtype", "shape", "shards", "changed", "new bytes"]
    rows = [[visible(shown_path(leaf.path)), leaf.status, leaf.dtype or leaf.kind, "" if leaf.shape is None else str(leaf.shape),
             str(leaf.shards), str(leaf.shards_changed), fmt_bytes(leaf.new_bytes)] for leaf in listed]
    width = fitted(rows, headers, 0)
    out = table(*headers, title=f"{report.a[:12]} -> {report.b[:12]}", numeric=("shards", "changed", "new bytes"),
                min_width={"leaf": width})
    for name, *row in rows:
        out.add_row(folded(name, width), *row)
    terminal().print(out)
    counts = ", ".join(f"{report.count(s)} {s}" for s in statuses)
    say(f"{counts}; {fmt_bytes(report.new_bytes)} new in {report.b[:12]}")


def du(store: StorePath = None, as_json: AsJson = False) -> None:
    """Logical vs physical bytes and the dedup ratio."""
    with open_store(store) as s:
        usage = s.du()
    if as_json:
        emit_json(usage)
        return
    out = table("what", "value", numeric=("value",))
    out.show_header = False
    for key in ("commits", "tags", "blobs", "packs"):
        out.add_row(key, str(usage[key]))
    for key in ("logical_bytes", "unique_bytes", "stored_bytes", "pack_bytes", "catalog_bytes", "reserve_bytes", "tmp_bytes"):
        out.add_row(key.replace("_", " "), fmt_bytes(usage[key]))
    out.add_row("dedup ratio (logical / unique)", ratio(usage["dedup_ratio"]))
    out.add_row("compression ratio (unique / stored)", ratio(usage["compression_ratio"]))
    terminal().print(out)
