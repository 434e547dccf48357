"""The ``ckptstore`` command line (typer + rich).

Every command takes ``--store PATH`` (or the ``CKPTSTORE_PATH`` environment
variable) and ``--json`` for machine-readable output. Errors print one line,
``error: <message>``, on stderr and exit with status 1; usage errors exit 2;
``gc`` exits 3 when another GC holds the store; ``fsck`` and ``verify`` exit 1
when they find a problem.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import re
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from . import layout, progress
from .units import counted, dedup, fmt_bytes, ratio
from .errors import CkptStoreError, GCLockedError, MissingExtraError
from .store import CommitInfo, Store

app = typer.Typer(
    add_completion=True,
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
    pretty_exceptions_enable=False,
    help="Content-addressed, versioned checkpoints for PyTorch and TorchRL training state.",
)
# Piped output (not a terminal, no $COLUMNS) gets room for every column of show/diff/log
# instead of rich's 80-column default, which drops columns.
console = Console(highlight=False, width=None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 200)
err = Console(stderr=True, highlight=False)

StorePath = Annotated[str | None, typer.Option("--store", "-s", help="Store folder or s3://bucket/prefix (default: the global --store, $CKPTSTORE_PATH, or .).")]
AsJson = Annotated[bool, typer.Option("--json", metavar="", help="Print JSON for scripts.")]


_global: dict[str, str | None] = {"store": None}  # the options given before the command


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        say(f"ckptstore {version('ckptstore')}")
        raise typer.Exit()


@app.callback()
def _options(
    store: Annotated[str | None, typer.Option("--store", "-s", envvar="CKPTSTORE_PATH", help="Store folder or s3://bucket/prefix for every command (or $CKPTSTORE_PATH).")] = None,
    version: Annotated[bool, typer.Option("--version", metavar="", callback=_version, is_eager=True, help="Print the version and exit.")] = False,
) -> None:
    """Content-addressed, versioned checkpoints for PyTorch and TorchRL training state."""
    _global["store"] = store


def fmt_time(t: float, short: bool = False) -> str:
    return datetime.datetime.fromtimestamp(t).strftime("%m-%d %H:%M" if short else "%Y-%m-%d %H:%M:%S")


@contextlib.contextmanager
def bars() -> Iterator[None]:
    """Show the library's progress reports (ckptstore.progress) as rich bars on stderr
    (drawn only on a terminal; removed when done)."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    if not err.is_terminal:
        yield
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True), TimeRemainingColumn(),
                  console=err, transient=True) as shown:

        @contextlib.contextmanager
        def reporter(description: str, total: int) -> Iterator[progress.Advance]:
            task = shown.add_task(description, total=total)
            try:
                yield lambda n: shown.advance(task, n)
            finally:
                shown.remove_task(task)

        with progress.reporting(reporter):
            yield


def store_path(path: str | None) -> str | Path:
    """The command's ``--store``, else the global one (given before the command), else
    ``$CKPTSTORE_PATH``, else the current folder: a folder's path, or an ``s3://`` URL as given."""
    value = path or _global["store"] or os.environ.get("CKPTSTORE_PATH") or "."
    return value if "://" in value else Path(value)  # a URL stays a URL: Store refuses what it cannot open


def open_store(path: str | None) -> Store:
    return Store(store_path(path), create=False)


class StdoutClosed(Exception):
    """The program reading the output exited before it was all written (``ckptstore log | head -1``)."""


class _Stdout:
    """``sys.stdout`` while :func:`main` runs: a write or flush that finds the reader gone
    raises :class:`StdoutClosed` (not an ``OSError``: click would turn a broken pipe into a
    silent exit 1), so a closed output is told apart from a broken connection to a bucket."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.reader_gone = False

    def _closed(self) -> StdoutClosed:
        self.reader_gone = True
        return StdoutClosed()

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            raise self._closed() from None

    def flush(self) -> None:
        try:
            self.stream.flush()
        except BrokenPipeError:
            raise self._closed() from None

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding...: the stream's
        return getattr(self.stream, name)


def emit_json(data: Any) -> None:
    def default(o: Any) -> Any:
        if dataclasses.is_dataclass(o):
            return dataclasses.asdict(o)
        if isinstance(o, (tuple, set)):
            return list(o)
        return str(o)

    sys.stdout.write(json.dumps(data, default=default) + "\n")  # one document per line: appends to a .jsonl


_NARROW = 120  # below this many columns, tables drop their least needed columns


def hidden(every: list[str], shown: list[str]) -> str | None:
    """The caption that names the columns a narrow terminal drops (None when all are shown)."""
    left_out = [c for c in every if c not in shown]
    if not left_out:
        return None
    return f"not shown at {console.width} columns: {', '.join(left_out)} ({_NARROW} columns or --json show them)"


def say(text: str | Text) -> None:
    """Print a one-line message as one line at any console width (a script's or cron's log
    gets whole lines, not lines cut at 80 or 200 columns), its text as written (no rich markup)."""
    console.print(text, soft_wrap=True, markup=False)


def shown_path(path: str) -> str:
    """A stored path (its keys escaped, joined by ``/``: :func:`layout.keypath`) as the user
    wrote the keys: ``rb/storage/x``; a key that holds ``/``, is empty, starts with ``"`` or
    is ``<root>`` in double quotes (``enc/"a/b"``) so that no two paths print alike.
    The root path ``""`` is ``<root>``."""
    if not path:
        return "<root>"

    def key(k: str) -> str:
        return json.dumps(k, ensure_ascii=False) if not k or "/" in k or k.startswith('"') or k == "<root>" else k

    return "/".join(key(k) for k in layout.split(path))


def folded(name: str, width: int) -> Text:
    """``name`` (a :func:`shown_path`, made :func:`visible`) in lines of at most ``width``
    characters (rich breaks only at spaces: it would cut a long name mid-word): each key on
    the line of the one before while it fits, else on the next; a key longer than a line
    broken after its ``_``, ``.`` or ``-``, and a word longer than a line cut where it ends."""
    lines = [""]
    for key in re.findall(r"[^/]*/|[^/]+$", name):  # each key with the "/" after it
        if lines[-1] and len(lines[-1]) + len(key) > width:
            lines.append("")
        for word in re.findall(r"[^_.-]*[_.-]|[^_.-]+$", key) if len(key) > width else [key]:
            if lines[-1] and len(lines[-1]) + len(word) > width:
                lines.append("")
            lines[-1] += word
            while len(lines[-1]) > width:
                lines[-1:] = [lines[-1][:width], lines[-1][width:]]
    return Text("\n".join(lines))


def fitted(rows: list[list[str]], headers: list[str], flexible: int) -> int:
    """The width the ``flexible`` column (index) can have so that every other column of a
    table of ``rows`` fits on the console whole (at least 12 characters, at most its longest cell)."""
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    others = sum(w + 3 for i, w in enumerate(widths) if i != flexible) + 4  # padding and borders
    return max(12, min(widths[flexible], console.width - others))


def visible(text: str) -> str:
    """``text`` with characters a terminal would act on or cannot print (control
    characters, escape sequences, lone surrogates) written as Python escapes, so keys
    such as ``"x"`` and ``"x\\n"`` print differently and a stored key cannot drive the terminal."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


class _Table(Table):
    """Cells are plain text (no rich markup), made :func:`visible`."""

    def add_row(self, *cells, **kwargs) -> None:
        super().add_row(*(Text(visible(c)) if isinstance(c, str) else c for c in cells), **kwargs)


def table(*columns: str, title: str | None = None, numeric: tuple[str, ...] = (), whole: tuple[str, ...] = (),
          min_width: dict[str, int] | None = None) -> Table:
    """A rich table whose ``whole`` columns (ids, times) never wrap or shrink, whose
    ``numeric`` columns are right-aligned, and whose other columns wrap at spaces
    (``min_width`` keeps a column at least that wide: one tag never breaks)."""
    t = _Table(title=title)
    for col in columns:
        keep = col in whole or col in numeric
        t.add_column(col, justify="right" if col in numeric else "left", no_wrap=keep, overflow="fold", min_width=(min_width or {}).get(col))
    return t


def commit_table(infos: list[CommitInfo], title: str | None = None) -> Table:
    """A rich table of commits: id, tags, (parents), time, message, bytes, (dedup, seconds)."""
    longest = max((len(t) + 1 for c in infos for t in c.tags), default=4)
    wide = console.width >= _NARROW
    sizes = ["logical", "new"] if wide or 70 + longest <= console.width else []  # drop what does not fit
    cols = ["commit", "tags", *(["parents"] if wide else []), "time", "message", *sizes, *(["stored", "dedup", "seconds"] if wide else [])]
    t = table(*cols, title=title, numeric=("logical", "new", "stored", "dedup", "seconds"), whole=("commit", "parents", "time"),
              min_width={"tags": longest})
    t.caption = hidden(["commit", "tags", "parents", "time", "message", "logical", "new", "stored", "dedup", "seconds"], cols)
    for c in infos:
        row = {
            "commit": c.id[:12], "tags": ", ".join(c.tags), "parents": ", ".join(p[:12] for p in c.parents) or "-",
            "time": fmt_time(c.created_at, short=not wide), "message": c.message, "logical": fmt_bytes(c.logical_bytes), "new": fmt_bytes(c.new_bytes),
            "stored": fmt_bytes(c.stored_bytes), "dedup": dedup(c.logical_bytes, c.new_bytes, c.dedup_ratio), "seconds": f"{c.seconds:.3f}",
        }
        t.add_row(*(row[col] for col in cols))
    return t


@app.command()
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
        console.print(commit_table(infos))


def natural_key(name: str) -> tuple:
    """Sort key that orders the digit runs of ``name`` as numbers: ``step-500`` before
    ``step-1000``, ``a2`` before ``a10``; names equal as numbers (``a01``, ``a1``) by their text."""
    parts = re.split(r"(\d+)", name)
    return (tuple(int(p) if i % 2 else p for i, p in enumerate(parts)), name)


@app.command()
def tags(store: StorePath = None, as_json: AsJson = False) -> None:
    """Tags and the commits they point to, in natural order (step-500 before step-1000)."""
    with open_store(store) as s:
        named = s.tagged()
    names = sorted(named, key=natural_key)
    if as_json:
        emit_json({name: named[name].id for name in names})
        return
    # Plain aligned text, not a rich table: rendering 10 000 rows through rich took seconds.
    shown = [visible(n) for n in names]
    width = max([3, *map(len, shown)])
    lines = [f"{'tag':<{width}}  {'commit':<12}  {'time':<19}  message"]
    for name, text in zip(names, shown):
        info = named[name]
        message = visible(info.message.replace("\n", " "))
        lines.append(f"{text:<{width}}  {info.id[:12]}  {fmt_time(info.created_at):<19}  {message}".rstrip())
    console.file.write("\n".join(lines) + "\n")


@app.command("runs")
def runs_cmd(store: StorePath = None, as_json: AsJson = False) -> None:
    """Runs (Checkpointer(run=...)) with their latest step, commit count and bytes."""
    from .run import DEFAULT_RUN, runs

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
    console.print(out)


@app.command("tag")
def tag_cmd(
    name: Annotated[str, typer.Argument(help="Tag to create or move.")],
    ref: Annotated[str, typer.Argument(help="Tag, commit id or unique prefix it should point to.")],
    store: StorePath = None,
    as_json: AsJson = False,
) -> None:
    """Create or move tag NAME to the commit REF names (atomic; logged in the reflog)."""
    with open_store(store) as s:
        cid = s.tag(name, ref)
    emit_json({"tag": name, "commit": cid}) if as_json else say(f"{name} -> {cid}")


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


@app.command()
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


@app.command()
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


@app.command("delete-tag")
def delete_tag_cmd(name: Annotated[str, typer.Argument(help="Tag to delete.")], store: StorePath = None, as_json: AsJson = False) -> None:
    """Delete tag NAME; its commits stay until a GC no longer keeps them."""
    with open_store(store) as s:
        cid = s.delete_tag(name)
    emit_json({"deleted": name, "commit": cid}) if as_json else say(f"deleted {name} (was {cid})")


@app.command()
def reflog(tag: Annotated[str | None, typer.Argument(help="Only this tag.")] = None, store: StorePath = None, as_json: AsJson = False) -> None:
    """Every tag move (commit, tag, delete), newest first."""
    with open_store(store) as s:
        rows = s.reflog(tag)
    if as_json:
        emit_json(rows)
        return
    out = table("time", "tag", "action", "from", "to", whole=("time", "tag", "from", "to"))
    for r in rows:
        out.add_row(fmt_time(r["at"]), r["tag"], r["action"], (r["old_commit"] or "-")[:12], (r["new_commit"] or "-")[:12])
    console.print(out)


@app.command()
def show(ref: Annotated[str, typer.Argument(help="Tag, commit id or unique prefix.")], store: StorePath = None, as_json: AsJson = False) -> None:
    """Components and leaves of a commit: dtypes, shapes, logical vs stored bytes, shards shared with the parent."""
    with open_store(store) as s:
        detail = s.show(ref)
    if as_json:
        emit_json(detail)
        return
    info: CommitInfo = detail["commit"]
    console.print(commit_table([info], title=f"commit {info.id}"))
    if info.metadata:
        say(f"metadata: {json.dumps(info.metadata, default=str)}")
    comps = table("component", "adapter", "version", "class", title="components", whole=("version",))
    for path, c in detail["components"].items():
        comps.add_row(shown_path(path), c["adapter"], str(c["version"]), str(c["meta"].get("class", "")))
    console.print(comps)
    every = ["leaf", "kind", "dtype", "shape", "logical", "stored", "shards", "shared w/ parent"]
    cols = every if console.width >= _NARROW else ["leaf", "dtype", "shape", "logical", "stored"]
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
    console.print(leaves)
    for c in detail["components"].values():
        if c["adapter"] == "dcp" and isinstance(c["meta"].get("items"), dict):
            console.print(_dcp_ranks(c["meta"]["items"], detail["leaves"]))


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


@app.command()
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
    console.print(out)
    counts = ", ".join(f"{report.count(s)} {s}" for s in statuses)
    say(f"{counts}; {fmt_bytes(report.new_bytes)} new in {report.b[:12]}")


@app.command()
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
    console.print(out)


@app.command()
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


@app.command()
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


@app.command()
def verify(ref: Annotated[str, typer.Argument(help="Tag or commit.")], store: StorePath = None, as_json: AsJson = False) -> None:
    """Reread and rehash every blob of one commit; exit 1 when one is missing or corrupt."""
    with open_store(store) as s, bars():
        report = s.verify(ref)
    _print_fsck(report, as_json)


@app.command()
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


@app.command("export")
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


@app.command("import")
def import_cmd(
    src: Annotated[Path, typer.Argument(help="A .zip archive or folder made by export.")],
    tag: Annotated[str | None, typer.Option(help="Tag to point at the imported commit.")] = None,
    store: StorePath = None,
    as_json: AsJson = False,
) -> None:
    """Import an exported commit; every entry is verified before anything is written."""
    from .adapters import REGISTRY
    from .container import check_export

    with bars():
        check_export(src, REGISTRY)  # before a missing store folder is created
    with Store(store_path(store)) as s, warnings.catch_warnings(record=True) as caught, bars():
        warnings.simplefilter("always")
        info = s.import_from(src, tag=tag)
    for w in caught:
        err.print(f"warning: {w.message}", soft_wrap=True, markup=False)
    emit_json(info) if as_json else console.print(commit_table([info], title="imported"))


@app.command("import-torchrl")
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
    console.print(commit_table([info], title=f"imported {report.format}"))
    say(f"components: {', '.join(shown_path(c) for c in report.components)}")
    for name, reason in report.skipped:
        say(f"skipped {name}: {reason}")


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
    try:  # the [demo] extra, checked before the demo's own imports (torch, TorchRL: seconds)
        import gymnasium  # noqa: F401
    except ImportError as exc:
        raise MissingExtraError(f"the demo needs Gymnasium ({exc}): pip install 'ckptstore[demo]'") from None
    from .demo import PER_BATCH, run

    if frames % PER_BATCH or every % PER_BATCH:
        raise typer.BadParameter(f"--frames and --every must be multiples of {PER_BATCH}")
    run(store, frames=frames, every=every, seed=seed, console=console)


def command():
    """The click group typer builds from ``app``, its flags (``-h/--help``, ``--install-completion``...)
    shown without a ``<bool>`` type: they take no value."""
    group = typer.main.get_command(app)
    for cmd in (group, *group.commands.values()):
        help_option = cmd.get_help_option(typer.Context(cmd, **app.info.context_settings))
        for option in (*cmd.params, help_option):
            if getattr(option, "is_flag", False):
                option.metavar = ""
    return group


def quiet_torchrl() -> bool:
    """Keep torchrl's log lines (INFO and up by default, on stdout: its logger is set up
    when torchrl is imported, from ``$RL_LOGGING_LEVEL``) out of the CLI's output, unless
    the user chose a level: warnings and errors only. Only while :func:`main` runs (and in
    the processes it starts), never for a program that imports ckptstore. True when it set it."""
    if "RL_LOGGING_LEVEL" in os.environ:
        return False
    os.environ["RL_LOGGING_LEVEL"] = "WARNING"
    return True


def main() -> None:
    """Entry point: :func:`invoke` with stdout that tells a gone reader apart (:class:`_Stdout`)
    and torchrl's log lines left out (:func:`quiet_torchrl`)."""
    out = sys.stdout = _Stdout(sys.stdout)
    quieted = quiet_torchrl()
    try:
        invoke()
    finally:
        sys.stdout = out.stream
        if quieted:
            os.environ.pop("RL_LOGGING_LEVEL", None)
        if out.reader_gone:  # what is still buffered goes nowhere, not into a failed flush at exit
            with contextlib.suppress(OSError, ValueError):  # ValueError: not a file (a test's captured stdout)
                os.dup2(os.open(os.devnull, os.O_WRONLY), out.stream.fileno())


def invoke() -> None:
    """The command line: one-line errors, non-zero exit (2 for usage errors, as click); a
    closed output (``ckptstore log | head -1``) ends a command quietly, with status 0."""
    try:
        code = command()(prog_name="ckptstore", standalone_mode=False)  # click's own usage errors come here, not as a boxed message
        sys.stdout.flush()  # the last buffered output (--json) fails here, not at exit, when the reader is gone
    except StdoutClosed:
        raise SystemExit(0) from None
    except typer.TyperException as exc:  # click's errors, vendored by typer
        if exc.format_message():  # empty when the help was printed instead (no arguments)
            ctx = getattr(exc, "ctx", None)  # a usage error's: the subcommand whose help explains it
            where = ctx.command_path if ctx is not None else "ckptstore"
            err.print(f"error: {exc.format_message()} (see {where} --help)", soft_wrap=True, markup=False)
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
