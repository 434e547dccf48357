"""Commit records and ref-move records: the self-verifying objects the catalog indexes.

A **commit record** is the canonical text of one commit: a compact JSON array
``[parents, created_at, message, metadata, components, manifest]`` where

- ``parents`` is a list of commit ids (first parent first), ``created_at`` seconds
  since the epoch (a float), ``message`` a string, ``metadata`` the commit
  metadata in ckptstore's type-preserving JSON (:mod:`ckptstore.core.jsonvalue`), as a string;
- ``components`` is a list of ``[path, adapter, version, meta]`` (``meta`` a
  type-preserving JSON string);
- ``manifest`` is a list of leaves ``[path, component, kind, dtype, shape,
  stride, value, shards]``: ``kind`` is ``"tensor"`` or ``"json"``; tensors give
  a dtype name, a shape (list of ints), a stride list for dense permuted layouts
  (else ``null``) and ``shards``, the space-separated blob addresses
  (``<32 hex>-<length>``) in order; JSON leaves give ``value`` (a type-preserving
  JSON string) and empty ``shards``.

The commit id is the XXH3-128 of the record's UTF-8 bytes (32 hex digits), so a
record read from the catalog or from a pack is checked against its id before
use (:func:`parse_commit`). Each shard's length follows from the lengths in its
addresses; the shard size of a leaf is the first shard's length.

A **ref-move record** is ``{"action", "at", "new", "old", "seq", "tag"}`` as
compact JSON with sorted keys: tag ``tag`` moved from commit ``old`` to ``new``
(``null`` when created or deleted) by ``action`` (``commit``, ``tag``,
``delete``, ``import``) at time ``at``; ``seq`` is the catalog's reflog row id,
which orders the moves of one store.

Both kinds are written inside packs (kind 1 and 2 in the entry header, see
:mod:`ckptstore.objects.packs`) before the catalog transaction that makes them true
commits, so the catalog can be rebuilt from the packs alone (:mod:`ckptstore.protocols.recover`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from ..core import jsonvalue
from ..core.errors import CkptStoreError, IntegrityError, InvalidArgumentError, InvalidNameError
from ..core.layout import (
    ShardPlan,
    address,
    check_path,
    check_shape,
    dense_order,
    digest,
    escape,
    from_raw_keys,
    is_escaped,
    itemsize,
    unescape,
)
from .packs import BlobLoc

KIND_COMMIT = 1
KIND_REF = 2


@dataclass
class LeafRecord:
    """One manifest entry: a tensor (dtype, shape, shards) or a JSON value.

    ``value`` is the JSON text when committing, the decoded value when read back.
    ``keys`` are the shards' ``(XXH3-128 digest, length)`` addresses in order;
    ``shards`` their locations, filled in when a checkout looks them up.
    """

    path: str
    component: str
    kind: str
    dtype: str | None
    shape: tuple[int, ...] | None
    nbytes: int
    shard_bytes: int | None
    value: Any = None
    stride: tuple[int, ...] | None = None  # recorded for dense non-contiguous layouts
    shards: list[BlobLoc] = field(default_factory=list)
    keys: list[tuple[bytes, int]] = field(default_factory=list)
    #: set by a commit that indexed this record: ``(manifest entry, leaves row without the
    #: commit id)``; a later commit of the same unchanged leaf reuses both (not compared, not shown)
    encoded: tuple | None = field(default=None, repr=False, compare=False)


@dataclass
class CommitRecord:
    """A parsed, verified commit record."""

    id: str
    parents: list[str]
    created_at: float
    message: str
    metadata: dict
    components: dict[str, dict]  # path -> {"adapter", "version", "meta"}
    leaves: list[LeafRecord]
    text: str


@dataclass(frozen=True)
class CommitInfo:
    """One commit, as returned by :meth:`ckptstore.Store.commit` and :meth:`ckptstore.Store.log`.

    Attributes:
        id: 32 hex digits (XXH3-128 of the commit record).
        tags: tags that pointed to it when returned (for ``commit``: the tags it moved).
        parents: parent commit ids (lineage), first parent first.
        created_at: seconds since the epoch.
        logical_bytes: bytes of all tensors in the state.
        new_bytes: raw bytes of shards the store did not hold before.
        stored_bytes: bytes written to pack files (after compression, with headers);
            ``None`` on object storage for a commit made elsewhere whose new blobs this
            machine's cache has not located yet (a checkout, commit, fsck, GC or ``du`` does).
        shards_total: shard references in the manifest.
        shards_new: blobs written by this commit.
        seconds: wall time of the commit call.
    """

    id: str
    tags: tuple[str, ...]
    parents: tuple[str, ...]
    created_at: float
    message: str
    metadata: dict
    logical_bytes: int
    new_bytes: int
    stored_bytes: int | None
    shards_total: int
    shards_new: int
    seconds: float

    @property
    def tag(self) -> str | None:
        """The first tag, or ``None``."""
        return self.tags[0] if self.tags else None

    @property
    def dedup_ratio(self) -> float:
        """``logical_bytes / new_bytes`` (``inf`` when nothing was new)."""
        return self.logical_bytes / self.new_bytes if self.new_bytes else float("inf")


@dataclass(frozen=True)
class Component:
    """A component as :meth:`ckptstore.Store.commit_manifest` takes it."""

    path: str
    adapter: str
    version: int
    meta: dict


def recreate(rec: CommitRecord) -> tuple[list[Component], list[LeafRecord]]:
    """The components and leaf records (paths and JSON values as their stored text)
    that recreate commit ``rec`` through ``Store.commit_manifest(origin=...)`` in
    another store or an export: the rebuilt record is the same text, so it hashes to
    the same id (a component from before keys were escaped keeps its raw paths)."""
    _, _, _, _, components, entries = json.loads(rec.text)
    comps = [Component(p, adapter, version, jsonvalue.loads(meta)) for p, adapter, version, meta in components]
    leaves = [
        LeafRecord(e[0], e[1], r.kind, r.dtype, r.shape, r.nbytes, r.shard_bytes, e[6] if r.kind == "json" else None, r.stride, keys=r.keys)
        for r, e in zip(rec.leaves, entries)
    ]
    return comps, leaves


def commit_text(parents, created_at: float, message: str, meta_json: str, components: list, manifest: list) -> str:
    """The canonical record text (see the module docstring); its hash is the commit id."""
    return json.dumps([list(parents), created_at, message, meta_json, components, manifest], separators=(",", ":"))


def commit_text_of(parents, created_at: float, message: str, meta_json: str, components: list, manifest_json: list[str]) -> str:
    """:func:`commit_text` with the manifest given as JSON text in consecutive parts (each
    the entries of a run of leaves joined by ``,``, as ``json.dumps`` writes a list's
    items): the same text, without encoding again the parts a commit kept."""
    head = json.dumps([list(parents), created_at, message, meta_json, components], separators=(",", ":"))
    return head[:-1] + ",[" + ",".join(p for p in manifest_json if p) + "]]"


def manifest_json(entries: list) -> str:
    """The JSON text of manifest ``entries`` as :func:`commit_text_of` takes a part."""
    return json.dumps(entries, separators=(",", ":"))[1:-1]


def manifest_entry(r: LeafRecord, keys: list[tuple[bytes, int]]) -> list:
    """One ``manifest`` entry for a leaf to commit (``r.value`` is JSON text)."""
    shape = None if r.shape is None else list(r.shape)
    stride = None if r.stride is None else list(r.stride)
    return [r.path, r.component, r.kind, r.dtype, shape, stride, r.value, " ".join(address(d, n) for d, n in keys)]


def commit_id(text: str) -> str:
    return digest(text.encode()).hex()


def check_paths(paths: list[str]) -> str | None:
    """Why a set of leaf paths cannot live in one state tree, or ``None``: a path twice,
    one leaf the folder of another (``a`` and ``a/b``), a root leaf (``""``) beside others, or
    an empty segment (``a//b``: the empty key is written ``%``, see :func:`ckptstore.core.layout.escape`)."""
    present = set(paths)
    if len(present) != len(paths):
        return "a leaf path appears twice"
    for p in present:
        try:
            check_path(p)
        except ValueError as exc:
            return str(exc)
    for p in sorted(present):
        parts = p.split("/")
        above = ([""] if p else []) + ["/".join(parts[:i]) for i in range(1, len(parts))]
        for a in above:
            if a in present:
                return f"leaves {a!r} and {p!r}: {a!r} cannot be both a leaf and a folder of leaves"
    return None


def _leaf(entry: Any, comps: dict, where: str) -> LeafRecord:
    if type(entry) is not list or len(entry) != 8:
        raise IntegrityError(f"{where}: malformed manifest entry")
    path, component, kind, dtype_name, shape, stride, value, shards = entry
    if type(path) is not str or type(component) is not str or component not in comps:
        raise IntegrityError(f"{where}: manifest entry {path!r} names no component of the commit")
    if not (component == "" or path == component or path.startswith(component + "/")):
        raise IntegrityError(f"{where}: leaf {path!r} lies outside its component {component!r}")
    where = f"{where}, leaf {path}"
    if kind == "json":
        if type(value) is not str or shards != "" or dtype_name is not None or shape is not None:
            raise IntegrityError(f"{where}: malformed JSON leaf")
        try:
            decoded = jsonvalue.loads(value)
        except CkptStoreError as exc:
            raise IntegrityError(f"{where}: {exc}") from None
        return LeafRecord(path, component, "json", None, None, 0, None, decoded)
    if kind != "tensor" or type(shards) is not str or value is not None:
        raise IntegrityError(f"{where}: unknown leaf kind {kind!r}")
    size = itemsize(dtype_name)
    if size is None:
        raise IntegrityError(f"{where}: unknown dtype {dtype_name!r}")
    try:
        check_shape(shape, size)
    except ValueError as exc:
        raise IntegrityError(f"{where}: {exc}") from None
    if stride is not None and (
        type(stride) is not list or any(type(x) is not int or x < 0 for x in stride) or dense_order(tuple(shape), tuple(stride)) is None
    ):
        raise IntegrityError(f"{where}: strides {stride!r} are not a dense layout of shape {shape}")
    keys = []
    for a in shards.split(" "):
        h, _, n = a.partition("-")
        if len(h) != 32 or not n.isdigit() or len(n) > 16:
            raise IntegrityError(f"{where}: malformed shard address {a!r}")
        keys.append((bytes.fromhex(h), int(n)))
    nbytes = math.prod(shape) * size
    shard_bytes = keys[0][1] if len(keys) > 1 else max(nbytes, 1)
    plan = ShardPlan(nbytes, shard_bytes)
    if plan.count != len(keys) or any(n != plan.bounds(i)[1] - plan.bounds(i)[0] for i, (_, n) in enumerate(keys)):
        raise IntegrityError(f"{where}: its shard lengths do not add up to shape {shape} x {dtype_name} ({nbytes} bytes)")
    return LeafRecord(path, component, "tensor", dtype_name, tuple(shape), nbytes, shard_bytes, None,
                      None if stride is None else tuple(stride), keys=keys)


def parse_commit(text: Any, cid: str) -> CommitRecord:
    """Check a commit record against its id, then parse and validate it.

    Raises:
        IntegrityError: the record is missing, does not hash to ``cid``, or is
            malformed (names the commit and, where known, the leaf).
    """
    if type(text) is not str:
        raise IntegrityError(f"commit {cid}: its record is missing from the catalog")
    if commit_id(text) != cid:
        raise IntegrityError(f"commit {cid}: its record in the catalog does not hash to the commit id (damaged catalog)")
    where = f"commit {cid}"
    try:
        parents, created_at, message, meta_json, components, manifest = json.loads(text)
        metadata = jsonvalue.loads(meta_json)
        comps = {}
        for c in components:
            path, adapter, version, meta = c
            comps[path] = {"adapter": adapter, "version": version, "meta": jsonvalue.loads(meta)}
        ok = (
            type(parents) is list and all(type(p) is str for p in parents) and type(created_at) in (int, float)
            and type(message) is str and type(metadata) is dict and type(manifest) is list
            and all(type(p) is str and type(c["adapter"]) is str and type(c["version"]) is int for p, c in comps.items())
        )
    except (ValueError, TypeError, CkptStoreError) as exc:
        raise IntegrityError(f"{where}: malformed record ({exc})") from None
    if not ok:
        raise IntegrityError(f"{where}: malformed record")
    leaves = [_leaf(e, comps, where) for e in manifest]
    bad, read_as = path_problem(comps, leaves)
    if bad:
        raise IntegrityError(f"{where}: {bad}")
    for r in leaves:  # components from before keys were escaped: read as today's escaped paths
        r.path, r.component = read_as(r.path, r.component), read_as(r.component, r.component)
    comps = {read_as(c, c): row for c, row in comps.items()}
    for row in comps.values():  # the marker is the record's business, not the adapters'
        row["meta"].pop(ESCAPED, None)
    return CommitRecord(cid, parents, float(created_at), message, metadata, comps, leaves, text)


#: Component meta key (value ``true``) of components whose paths are escaped: every
#: component committed since keys are escaped has it; older ones are read through
#: ``layout.from_raw_keys``. Reserved: adapters' ``meta()`` must not use it.
ESCAPED = "ckptstore.keys"


def path_problem(comps: dict[str, dict], leaves: list) -> tuple[str | None, Any]:
    """Why the paths of a commit's components (``{path: {"meta": ...}}``) and leaves cannot
    be read back as one state tree, or ``None``; and ``read_as(path, component)``, the
    path as read (``layout.from_raw_keys`` for a component without the :data:`ESCAPED` marker).

    Refused: a segment of a marked component that is not the one ``layout.escape`` writes
    for its key (two spellings of one key would collide); components or leaves that are
    one path once read; what :func:`check_paths` refuses.
    """
    legacy = {c for c, row in comps.items() if not row["meta"].get(ESCAPED)}

    def read_as(path: str, component: str) -> str:
        return from_raw_keys(path) if component in legacy else path

    for c in comps:
        for part in (c.split("/") if c and c not in legacy else []):
            if part and not is_escaped(part):
                return f"component {c!r}: segment {part!r} is not the escaped form of its key ({escape(unescape(part))!r})", read_as
    for r in leaves:
        if r.component not in legacy:
            for part in (r.path.split("/") if r.path else []):
                if part and not is_escaped(part):
                    return f"leaf {r.path!r}: segment {part!r} is not the escaped form of its key ({escape(unescape(part))!r})", read_as
    if len({read_as(c, c) for c in comps}) != len(comps):
        return "two components are one path once read (a component from before keys were escaped beside a newer one)", read_as
    return check_paths([read_as(r.path, r.component) for r in leaves]), read_as


def check_checkable(components: list, leaves: list, paths_checked: bool = False) -> None:
    """Refuse a manifest a store could not check out (every commit's check, on both homes):
    component and leaf paths that are not one state tree (:func:`path_problem`; skipped with
    ``paths_checked``), and a tensor leaf whose dtype is unknown or whose shape does not fit
    it. Leaves already encoded (``r.encoded``) were checked by the commit that encoded them.

    Raises:
        InvalidNameError: the paths.
        InvalidArgumentError: a tensor leaf's dtype or shape.
    """
    bad, _ = (None, None) if paths_checked else path_problem({c.path: {"meta": c.meta} for c in components}, leaves)
    if bad:
        raise InvalidNameError(f"cannot commit: {bad}")
    for r in leaves:
        if r.kind != "tensor" or getattr(r, "encoded", None) is not None:
            continue
        try:
            size = itemsize(r.dtype)
            if size is None:
                raise ValueError(f"unknown dtype {r.dtype!r}")
            check_shape(r.shape, size)
        except ValueError as exc:
            raise InvalidArgumentError(f"cannot commit leaf {r.path}: {exc}") from None


def ref_text(seq: int, tag: str, old: str | None, new: str | None, at: float, action: str) -> str:
    """A ref-move record (see the module docstring)."""
    return json.dumps({"action": action, "at": at, "new": new, "old": old, "seq": seq, "tag": tag}, sort_keys=True, separators=(",", ":"))


def parse_ref(text: str) -> dict | None:
    """A ref-move record's fields, or ``None`` if it is malformed."""
    try:
        r = json.loads(text)
    except ValueError:
        return None
    ok = (
        type(r) is dict and set(r) == {"action", "at", "new", "old", "seq", "tag"} and type(r["seq"]) is int
        and type(r["tag"]) is str and type(r["at"]) in (int, float) and r["action"] in ("commit", "tag", "delete", "import")
        and all(x is None or (type(x) is str and len(x) == 32) for x in (r["old"], r["new"]))
    )
    return r if ok else None


def check_message(message: Any, metadata: Any) -> dict:
    """A commit's message and metadata, checked; returns the metadata (``{}`` for ``None``).

    Raises:
        InvalidArgumentError: a message that is not a UTF-8 ``str``, metadata not a dict.
        UnsupportedTypeError: metadata values that are not JSON (:mod:`ckptstore.core.jsonvalue`).
    """
    if type(message) is not str or not jsonvalue.is_text(message):
        raise InvalidArgumentError(f"message must be a UTF-8 str, got {message!r}")
    metadata = {} if metadata is None else metadata
    if type(metadata) is not dict:
        raise InvalidArgumentError(f"metadata must be a dict, got {type(metadata).__name__}")
    jsonvalue.encode(metadata, "metadata")
    return metadata


_LOOKS_LIKE_ID = re.compile(r"^[0-9a-fA-F]{4,32}$")
MIN_PREFIX = 4  # the fewest hex digits read as a commit id prefix (as git: fewer are too easily a mistyped tag)


def unknown_ref(ref: str, where: object, run_tags: list[str] = ()) -> str:
    """The message for a ``ref`` that names no tag and no commit in ``where``; it states
    the prefix rule when ``ref`` is hex digits too few to be read as one, and names a few
    of ``run_tags`` (the tags ``<ref>/...`` there: ``ref`` is a run's name)."""
    short = re.fullmatch(r"[0-9a-fA-F]{1,%d}" % (MIN_PREFIX - 1), ref)
    rule = f" (a commit id prefix needs at least {MIN_PREFIX} hex digits)" if short else ""
    if run_tags:
        named = sorted(run_tags, key=lambda t: (not t.endswith("/latest"), t))[:3]
        rule += f" ({ref!r} is a run: name one of its tags, e.g. {', '.join(map(repr, named))})"
    return f"no tag or commit named {ref!r} in {where}{rule}"


def check_tag(name: Any) -> str:
    """``name`` if it is a valid tag name: 1 to 255 characters of UTF-8 without control
    characters or edge spaces, not starting with ``-``, and not 4 to 32 hex digits (those
    are read as commit id prefixes).

    Raises:
        InvalidNameError: what is wrong with it.
    """
    if (
        type(name) is not str or not name or len(name) > 255 or name != name.strip() or name.startswith("-")
        or any(c in name for c in "\x00\n\r\t") or not jsonvalue.is_text(name)
    ):
        raise InvalidNameError(
            f"invalid tag name {name!r}: 1 to 255 characters of UTF-8 without control characters or edge spaces, not starting with '-'"
        )
    if _LOOKS_LIKE_ID.match(name):
        raise InvalidNameError(f"invalid tag name {name!r}: 4 to 32 hex digits read as a commit id prefix; a tag would hide it")
    return name
