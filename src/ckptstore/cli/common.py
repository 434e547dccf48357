"""What every ``ckptstore`` command shares: the typer ``app``, :func:`main`, the one-line
error handling (:func:`invoke`), the options (``--store``, ``--json``) and the output helpers
(rich tables, sizes, times). The commands are in the sibling modules, registered by the
package (:mod:`ckptstore.cli`)."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..core import layout, progress
from ..core.errors import CkptStoreError, GCLockedError
from ..core.units import dedup, fmt_bytes
from ..store import CommitInfo, Store

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
    """Show the library's progress reports (ckptstore.core.progress) as rich bars on stderr
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


NARROW = 120  # below this many columns, tables drop their least needed columns


def hidden(every: list[str], shown: list[str]) -> str | None:
    """The caption that names the columns a narrow terminal drops (None when all are shown)."""
    left_out = [c for c in every if c not in shown]
    if not left_out:
        return None
    return f"not shown at {console.width} columns: {', '.join(left_out)} ({NARROW} columns or --json show them)"


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
    wide = console.width >= NARROW
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


def terminal() -> Console:
    """The console commands print to: :data:`console`, looked up at each call (a test or a
    benchmark may replace ``ckptstore.cli.common.console``)."""
    return console


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
