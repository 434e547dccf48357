"""The commit's index step on a catalog (step 4 of the commit protocol,
``shared/design/ARCHITECTURE.md``), and what the commit protocol hands to it: the new
blobs' and the commit's rows, the reused blobs rechecked, the tags moved, all in one
catalog transaction (:func:`index_commit`, which :meth:`ckptstore.home.base.Home.index_commit`
runs); the components committed unchanged (:class:`Reused`, sharing the rows of an earlier
commit), and :class:`ReusedBlobsGone`, raised when a GC freed a reused blob meanwhile.

In the home layer (``home/index_step`` in the package tree): it imports no protocol;
:mod:`ckptstore.protocols.commit` and :mod:`ckptstore.protocols.reuse` import these names from here.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..core import jsonvalue
from ..core.errors import IntegrityError
from ..core.layout import address, shard_count
from ..objects import records
from ..objects.packs import BLOB_HEADER, BlobLoc
from ..objects.records import LeafRecord
from .refs import ANY


def ints_json(values: Sequence[int]) -> str:
    """``jsonvalue.dumps(list(values))`` of a shape or strides (Python ints), the short way."""
    return "[" + ",".join(map(str, values)) + "]" if all(type(v) is int for v in values) else jsonvalue.dumps(list(values))


class ReusedBlobsGone(Exception):
    """Raised by a home's index step (``index_commit``): blobs the commit reuses are gone (a GC); ``keys`` must be written again."""

    def __init__(self, keys: list[tuple[bytes, int]]):
        self.keys = keys


def given_stored(written: dict[tuple[bytes, int], BlobLoc], given_packs) -> int:
    """Bytes (headers included) of the blobs in ``written`` that other processes wrote to ``given_packs``."""
    ids = {pid for pid, _ in given_packs}
    return sum(loc.stored_len + BLOB_HEADER.size for loc in written.values() if loc.pack in ids) if ids else 0


@dataclass(eq=False)
class Reused:
    """A component committed unchanged since this store's commit ``last`` (every fingerprint
    equal, the sample rehashed equal), in place of its captured form: its manifest
    ``records``, shard addresses (``keys``) and ``{address: blob id}`` (``blobs``) as the
    rows of commit ``owner`` hold them. The index step points the new commit's component
    at those rows once it finds them in its transaction (``owner`` and ``confirmed`` then
    say whose: a GC may have moved them to a sharer), else writes rows of its own."""

    path: str
    adapter: str
    version: int
    meta: dict
    records: list[LeafRecord]
    keys: list[tuple[bytes, int]]
    blobs: dict[tuple[bytes, int], int]
    owner: str
    last: str
    manifest_json: str  # its manifest entries' JSON text (records.manifest_json)
    nbytes: int  # of its tensor leaves
    source: Any = None  # the captured component (live tensors), to commit it without sharing (_unshared)
    confirmed: bool = False


def per_component(components: list, leaves: list[LeafRecord], keys: list | None = None):
    """Each of a commit's ``components`` with its part of the commit's flat ``leaves`` and
    (if given) ``keys`` (shard addresses in leaf order): ``(component, its leaf records,
    its keys or None)``; a :class:`Reused` component's are its own ``records`` and ``keys``."""
    i = k = 0
    for c in components:
        if type(c) is Reused:
            recs, comp_keys = c.records, c.keys
        else:
            recs = leaves[i : i + len(c.leaves)]
            comp_keys = None if keys is None else keys[k : k + sum(shard_count(r.nbytes, r.shard_bytes) for r in recs if r.kind == "tensor")]
        yield c, recs, comp_keys
        i, k = i + len(recs), k + (0 if comp_keys is None else len(comp_keys))


def logical_bytes(components: list, leaves: list[LeafRecord]) -> int:
    """Bytes of the tensor leaves of a commit's manifest (``leaves``, in the order of
    ``components``, whose :class:`Reused` ones know theirs)."""
    if not any(type(c) is Reused for c in components):
        return sum(r.nbytes for r in leaves if r.kind == "tensor")
    return sum(c.nbytes if type(c) is Reused else sum(r.nbytes for r in recs if r.kind == "tensor") for c, recs, _ in per_component(components, leaves))


def index_commit(
    home: Any, components, leaves, keys, known, written, writer, tags, message, meta_json, explicit_parents, created_at, t0, expect=None,
    given_packs=(),
):
    """Step 4 of the commit protocol on ``home`` (a :class:`ckptstore.home.base.Home`: its catalog,
    refs, :meth:`~ckptstore.home.base.Home.write` transaction and bad-blob marks): in one catalog
    transaction, check that the reused blobs (``known``: address -> blob id) still exist
    (else :class:`ReusedBlobsGone`), index the new blobs (``written``) and the commit, and
    move ``tags``. ``expect``: the id the record must hash to (IntegrityError otherwise).
    Returns ``(commit id, parent ids, seconds, {address: blob id})``."""
    with home.write() as batch:
        shared = _shared_rows(home, components)
        if len(shared) == len(components) and not written:  # every blob id is one of those rows' (below): none to check
            check = {}
        elif shared:  # their blob ids are those of rows that exist: not checked again
            confirmed: dict[tuple[bytes, int], int] = {}
            for c in components:
                if c.path in shared:
                    confirmed.update(c.blobs)
            check = {k: known[k] for k in known.keys() - confirmed.keys()}
            known = {**check, **confirmed}
        else:
            check = known
        if check:
            # An id must still hold the same address: GC may have freed it and a new blob taken the id since.
            # The per-shard rows of a commit (thousands for a large buffer, most of them
            # unchanged shards) go to SQLite as one JSON array in one statement, here and for
            # the shards table below: executemany and fetchall release and retake the GIL once
            # per row, and a thread that does that thousands of times starves the others of
            # it (each waits a switch interval, 5 ms, to get it back), the training loop
            # beside an asynchronous commit among them. This one returns only the mismatches.
            reused = list(check.items())
            # First one cheap statement: the addresses the ids hold now, in the ids' order, as one text;
            # only if it differs, the one that names the ids that changed.
            (now,), = home.catalog.rows(
                "SELECT group_concat(lower(hex(b.hash)) || '-' || b.raw_len, ' ') FROM json_each(?) j LEFT JOIN blobs b ON b.id = j.value",
                (json.dumps([i for _, i in reused]),), raw=True,
            )
            same = now == " ".join([address(d, n) for (d, n), _ in reused])
            bad = [] if same else home.catalog.rows(
                "SELECT j.key FROM json_each(?) j LEFT JOIN blobs b ON b.id = json_extract(j.value, '$[0]') "
                "WHERE b.id IS NULL OR b.raw_len != json_extract(j.value, '$[2]') OR lower(hex(b.hash)) != json_extract(j.value, '$[1]')",
                (json.dumps([[i, d.hex(), n] for (d, n), i in reused]),), raw=True,
            )
            gone = [reused[k][0] for (k,) in bad]
            if gone:
                raise ReusedBlobsGone(gone)
        marked = [k for k in home.bad_blob_ids(list(known.items())) if k not in written] if known else []
        if marked:  # known to be bad (a failed read, fsck): never reused; written again (invariant 14)
            raise ReusedBlobsGone(marked)
        # Plain SQL, not sqlite-utils' tables: these look the schema up (several queries) on every call.
        run_many = home.catalog.conn.executemany
        run_many(
            "INSERT OR IGNORE INTO packs (id, size, created_at) VALUES (?, ?, ?)",
            [(pid, size, created_at) for pid, size in [*writer.pack_ids, *given_packs]],
        )
        if written:
            home.repoint_bad(written)
        run_many(
            "INSERT OR IGNORE INTO blobs (hash, raw_len, pack, offset, stored_len, codec, created_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
            [(loc.digest, loc.raw_len, loc.pack, loc.offset, loc.stored_len, loc.codec, created_at) for loc in written.values()],
        )
        ids = dict(known)
        ids.update(home.lookup(list(written)))
        if explicit_parents is not None:
            parents = explicit_parents
        else:
            current = {r["name"]: r["commit_id"] for r in home.catalog.chunked("SELECT name, commit_id FROM tags WHERE name IN ({})", tags)}
            parents = list(dict.fromkeys(current[t] for t in tags if t in current))
        own, per_leaf = _own_rows(components, leaves, keys, shared)
        for r, keys_of in zip(own, per_leaf):
            if r.encoded is None:  # (set on the records of a Reused component)
                r.encoded = (records.manifest_entry(r, keys_of), (
                    r.path, r.component, r.kind, r.dtype, None if r.shape is None else ints_json(r.shape),
                    None if r.stride is None else ints_json(r.stride), r.nbytes, r.shard_bytes, r.value,
                ))
        components_json = [[c.path, c.adapter, c.version, jsonvalue.dumps(c.meta, c.path)] for c in components]  # (few)
        record = records.commit_text_of(parents, created_at, message, meta_json, components_json, _manifest_parts(components, leaves))
        cid = records.commit_id(record)
        seconds = time.perf_counter() - t0
        if expect is not None and cid != expect:
            raise IntegrityError(f"the commit's content hashes to {cid}, not to its recorded id {expect}")
        if home.catalog.rows("SELECT 1 FROM commits WHERE id = ?", (cid,)):  # imported before: only the tags move
            if tags:
                home.refs.move(dict.fromkeys(tags, (ANY, cid)), "import", created_at, batch)
            return cid, parents, seconds, ids
        new_bytes = sum(n for _, n in written)
        home.catalog.conn.execute(
            "INSERT INTO commits (id, created_at, message, metadata, logical_bytes, new_bytes, stored_bytes, shards_total, shards_new, "
            "seconds, record) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (cid, created_at, message, meta_json, logical_bytes(components, leaves), new_bytes,
             writer.stored_bytes + given_stored(written, given_packs), len(keys), len(written), seconds, record),
        )
        batch.append((records.KIND_COMMIT, cid, None, record))
        run_many("INSERT INTO parents (commit_id, position, parent_id) VALUES (?, ?, ?)", [(cid, i, p) for i, p in enumerate(parents)])
        run_many(
            "INSERT INTO components (commit_id, path, adapter, version, meta, rows_of) VALUES (?, ?, ?, ?, ?, ?)",
            [(cid, c.path, c.adapter, c.version, meta, shared.get(c.path)) for c, (_, _, _, meta) in zip(components, components_json)],
        )
        run_many(  # (a shared component's leaves and shards are rows of its owner's)
            "INSERT INTO leaves (commit_id, path, component, kind, dtype, shape, stride, nbytes, shard_bytes, value) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [(cid, *r.encoded[1]) for r in own],
        )
        leaf_ids = dict(home.catalog.rows("SELECT path, id FROM leaves WHERE commit_id = ?", (cid,), raw=True))
        # A leaf's shard rows from one JSON array of blob ids, as the check above; the one row of a
        # one-shard leaf (most of a state of many small leaves) as a plain row: json_each costs more.
        single, multi = [], []
        for r, keys_of in zip(own, per_leaf):
            if len(keys_of) == 1:
                single.append((leaf_ids[r.path], 0, ids[keys_of[0]]))
            elif keys_of:
                multi.append((leaf_ids[r.path], json.dumps([ids[k] for k in keys_of])))
        run_many("INSERT INTO shards (leaf_id, seq, blob_id) VALUES (?, ?, ?)", single)
        run_many("INSERT INTO shards (leaf_id, seq, blob_id) SELECT ?, key, value FROM json_each(?)", multi)
        if tags:  # in this transaction: the commit's rows and its tag moves are one
            home.refs.move(dict.fromkeys(tags, (ANY, cid)), "commit", created_at, batch)
    return cid, parents, seconds, ids


def _manifest_parts(components: list, leaves: list[LeafRecord]) -> list[str]:
    """The manifest's JSON text in parts (:func:`ckptstore.objects.records.commit_text_of`): a
    :class:`Reused` component's as it keeps it, the runs of leaves
    between them encoded here."""
    if not any(type(c) is Reused for c in components):
        return [records.manifest_json([r.encoded[0] for r in leaves])]
    return [c.manifest_json if type(c) is Reused else records.manifest_json([r.encoded[0] for r in recs])
            for c, recs, _ in per_component(components, leaves)]


def _shared_rows(home: Any, components: list) -> dict[str, str]:
    """``{component path: commit id}`` of the :class:`Reused` components
    whose rows exist now, in the caller's transaction, and the commit that owns them: that
    of the component's last commit (itself, or the owner it points at), else its owner's
    (if it still owns them). A GC that dropped both since leaves the component out: its
    rows are written again (and its blob ids checked). Each one's ``owner`` and
    ``confirmed`` are set to what was found."""
    out: dict[str, str] = {}
    for c in components:
        if type(c) is Reused:
            found = home.catalog.rows(
                "SELECT COALESCE(rows_of, commit_id) FROM components WHERE path = ? AND commit_id IN (?, ?) "
                "ORDER BY commit_id = ? DESC LIMIT 1", (c.path, c.last, c.owner, c.last), raw=True)
            c.confirmed = bool(found)
            if found:
                c.owner = out[c.path] = found[0][0]
    return out


def _own_rows(components: list, leaves: list[LeafRecord], keys: list, shared: dict) -> tuple[list[LeafRecord], list[list]]:
    """The leaves whose rows the commit writes (all but those of the ``shared``
    components), and each one's shard addresses."""
    if not any(type(c) is Reused for c in components):
        return leaves, _keys_per_leaf(leaves, keys)
    own: list[LeafRecord] = []
    per_leaf: list[list] = []
    for c, recs, comp_keys in per_component(components, leaves, keys):
        if type(c) is not Reused or c.path not in shared:
            own += recs
            per_leaf += _keys_per_leaf(recs, comp_keys)
    return own, per_leaf


def _keys_per_leaf(leaves: list[LeafRecord], keys: list[tuple[bytes, int]]) -> list[list[tuple[bytes, int]]]:
    """Each leaf's part of ``keys`` (its shards' addresses, in leaf order)."""
    out, i = [], 0
    for r in leaves:
        n = shard_count(r.nbytes, r.shard_bytes) if r.kind == "tensor" else 0
        out.append(keys[i : i + n])
        i += n
    return out


__all__ = ["Reused", "ReusedBlobsGone", "given_stored", "index_commit", "ints_json", "logical_bytes", "per_component"]
