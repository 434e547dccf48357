"""Figures as people read them: byte counts in binary units, ratios and counted nouns (the command line's and the demo's tables)."""

from __future__ import annotations


def fmt_bytes(n: float | None) -> str:
    """Bytes as a short human string in binary units (``"512 B"``, ``"1.5 MiB"``); ``"-"`` for ``None``."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def ratio(x: float | None) -> str:
    """A ratio as ``"2.5x"``; ``"-"`` for ``None``, ``"inf"`` for infinity."""
    return "-" if x is None else ("inf" if x == float("inf") else f"{x:.1f}x")


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``"1 commit"``, ``"2 commits"``: ``n`` and ``noun``, plural (``noun + "s"`` unless given) unless ``n`` is 1."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def dedup(logical: int, new: int, value: float | None) -> str:
    """A commit's dedup ratio (logical / new bytes, ``value``) as :func:`ratio` prints it;
    ``"all held"`` when it added no new bytes (the store held every shard) instead of ``"inf"``,
    and ``"-"`` for a commit of no tensor bytes at all."""
    if not new:
        return "all held" if logical else "-"
    return ratio(value)
