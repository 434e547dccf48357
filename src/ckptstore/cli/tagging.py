"""Commands on tags: ``tags`` (list), ``tag`` (create or move), ``delete-tag`` and ``reflog`` (their history)."""

from __future__ import annotations

import re
from typing import Annotated

import typer

from .common import AsJson, StorePath, emit_json, fmt_time, open_store, say, table, terminal, visible


def natural_key(name: str) -> tuple:
    """Sort key that orders the digit runs of ``name`` as numbers: ``step-500`` before
    ``step-1000``, ``a2`` before ``a10``; names equal as numbers (``a01``, ``a1``) by their text."""
    parts = re.split(r"(\d+)", name)
    return (tuple(int(p) if i % 2 else p for i, p in enumerate(parts)), name)


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
    terminal().file.write("\n".join(lines) + "\n")


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


def delete_tag_cmd(name: Annotated[str, typer.Argument(help="Tag to delete.")], store: StorePath = None, as_json: AsJson = False) -> None:
    """Delete tag NAME; its commits stay until a GC no longer keeps them."""
    with open_store(store) as s:
        cid = s.delete_tag(name)
    emit_json({"deleted": name, "commit": cid}) if as_json else say(f"deleted {name} (was {cid})")


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
    terminal().print(out)
