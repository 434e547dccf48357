"""Leaf-by-leaf comparison of two commits (``store.diff``, ``ckptstore diff``).

A leaf is *added* (only in B), *removed* (only in A), *changed* (dtype, shape,
JSON value or any shard differs) or *unchanged*. For tensors, ``shards_changed``
counts the shard positions of B whose blob differs from A's at the same
position, and ``new_bytes`` the raw bytes of B's blobs that commit A does not
reference anywhere: what B costs on top of A. Nothing is read from the packs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..core import jsonvalue

if TYPE_CHECKING:
    from ..home.interfaces import DiffRepository


@dataclass
class LeafDiff:
    """One leaf's change from A to B; byte counts in bytes."""

    path: str
    status: str  # "added" | "removed" | "changed" | "unchanged"
    kind: str
    dtype: str | None
    shape: list | None
    shards: int = 0
    shards_changed: int = 0
    new_bytes: int = 0


@dataclass
class DiffReport:
    """All leaf differences of ``b`` against ``a``, and their totals."""

    a: str
    b: str
    leaves: list[LeafDiff] = field(default_factory=list)
    new_bytes: int = 0  # raw bytes of B's blobs that A does not reference, each blob once

    def count(self, status: str) -> int:
        """Number of leaves with this status."""
        return sum(1 for leaf in self.leaves if leaf.status == status)


def _leaves(store: DiffRepository, cid: str) -> dict[str, dict]:
    rows = store.catalog.rows("SELECT path, kind, dtype, shape, stride, value FROM commit_leaves WHERE commit_id = ?", (cid,))
    out = {r["path"]: {**dict(r), "blobs": []} for r in rows}
    for r in store.catalog.rows(
        "SELECT l.path, s.blob_id, b.raw_len FROM commit_leaves l JOIN shards s ON s.leaf_id = l.id JOIN blobs b ON b.id = s.blob_id "
        "WHERE l.commit_id = ? ORDER BY l.path, s.seq",
        (cid,),
    ):
        out[r["path"]]["blobs"].append((r["blob_id"], r["raw_len"]))
    return out


def diff_commits(store: DiffRepository, a: str, b: str) -> DiffReport:
    """Compare commit ids ``a`` and ``b`` (see the module docstring)."""
    with store.catalog.read():
        left, right = _leaves(store, a), _leaves(store, b)
    in_a = {blob for leaf in left.values() for blob, _ in leaf["blobs"]}
    counted: set[int] = set()
    report = DiffReport(a, b)
    for path in sorted(set(left) | set(right)):
        old, new = left.get(path), right.get(path)
        leaf = new or old
        shape = None if leaf["shape"] is None else jsonvalue.loads(leaf["shape"])
        d = LeafDiff(path, "", leaf["kind"], leaf["dtype"], shape, len(leaf["blobs"]))
        if new is not None:
            fresh = [(blob, n) for blob, n in new["blobs"] if blob not in in_a]
            d.new_bytes = sum(n for blob, n in dict(fresh).items() if blob not in counted)
            counted.update(blob for blob, _ in fresh)
        if old is None:
            d.status, d.shards_changed = "added", len(new["blobs"])
        elif new is None:
            d.status = "removed"
        else:
            same_meta = all(old[k] == new[k] for k in ("kind", "dtype", "shape", "stride", "value"))
            d.shards_changed = sum(
                1 for i, (blob, _) in enumerate(new["blobs"]) if i >= len(old["blobs"]) or old["blobs"][i][0] != blob
            )
            d.status = "unchanged" if same_meta and d.shards_changed == 0 and len(old["blobs"]) == len(new["blobs"]) else "changed"
        report.leaves.append(d)
    report.new_bytes = sum(leaf.new_bytes for leaf in report.leaves)
    return report
