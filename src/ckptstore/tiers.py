"""Two tiers for a multi-node ``torch.distributed.checkpoint`` job: each node's local store
and one bucket (docs/distributed.md, "Many nodes, one bucket").

Nodes share no filesystem, so each node commits its own ranks' part of a save (its ranks
run ``dcp.save`` over a process group of their own) to its local store, tagged
``step-<n>``, ``latest`` and :func:`part_tag` ``parts/step-<n>/node-<k>``. A background
thread on each node's first rank pushes the part tag to the bucket (:meth:`Store.push`:
only the blobs the bucket lacks); node 0's thread then waits for every node's part and
:func:`compose` s them into one DCP commit on the bucket, the one that moves the bucket's
``step-<n>`` and ``latest``. A step is durable on the bucket once that commit's tags moved,
never before: until then the bucket holds only part tags, which no resume reads.
"""

from __future__ import annotations

import os
import re
import time
import warnings
from dataclasses import dataclass

from .adapters.base import Captured
from .core import jsonvalue
from .core.errors import (
    CkptStoreError,
    IntegrityError,
    LocalTierGCWarning,
    NotAStoreError,
    OlderStepError,
    RefConflictError,
    RefNotFoundError,
    StoreWriteError,
)
from .dcp.format import ADAPTER, FORMAT_VERSION, DCPAdapter
from .objects.records import ESCAPED, LeafRecord
from .pusher import Pusher
from .store import CommitInfo, Store

__all__ = ["Layout", "TierPusher", "bucket_newest", "compose", "node_layout", "open_bucket", "part_tag"]


def part_tag(tag: str, node: int) -> str:
    """The tag of node ``node``'s part of the save tagged ``tag``: ``parts/<tag>/node-<k>``."""
    return f"parts/{tag}/node-{node}"


@dataclass(frozen=True)
class Layout:
    """Where this rank is: ``world`` ranks on ``nodes`` nodes of ``world // nodes`` ranks
    each; this rank is on node ``node``; ``group`` is the process group of that node's
    ranks (``None`` without a process group: one node of one rank)."""

    world: int
    nodes: int
    node: int
    group: object = None

    @property
    def meta(self) -> dict:
        return {"world": self.world, "nodes": self.nodes, "node": self.node}


def node_layout(ranks_per_node: int | None = None) -> Layout:
    """This rank's :class:`Layout`: ``ranks_per_node`` (default ``LOCAL_WORLD_SIZE``, as
    torchrun sets it, else the whole world: one node) consecutive ranks per node. Called
    by every rank (it creates the node groups, a collective).

    Raises:
        InvalidArgumentError: a world size that is not a multiple of ``ranks_per_node``.
    """
    import torch.distributed as dist

    from .core.errors import InvalidArgumentError

    if not (dist.is_available() and dist.is_initialized()):
        return Layout(1, 1, 0, None)
    world, rank = dist.get_world_size(), dist.get_rank()
    per = int(ranks_per_node or os.environ.get("LOCAL_WORLD_SIZE") or world)
    if per < 1 or world % per:
        raise InvalidArgumentError(f"{world} ranks cannot be split into nodes of {per} ranks (LOCAL_WORLD_SIZE or ranks_per_node)")
    group, _ = dist.new_subgroups(group_size=per)
    return Layout(world, world // per, rank // per, group)


def compose(remote: Store, tag: str, nodes: int, tags: list[str], message: str, metadata: dict) -> CommitInfo:
    """Commit on ``remote`` one DCP commit made of the ``nodes`` parts of the save ``tag``
    (tags :func:`part_tag`), every blob already there, and move ``tags``. Its metadata is
    ``metadata`` plus ``"parts"``: the parts' commit ids, node 0 first (each is the commit
    that node's local store holds for that save).

    A tensor every node saved (replicated) is taken once: its leaf must be the same in
    every part; chunks of sharded tensors are joined; ``dcp.load`` then reads the commit on
    any number of ranks.

    Raises:
        RefNotFoundError: a part is missing. IntegrityError: two parts disagree on a leaf.
        StoreWriteError: a blob of a part is not on ``remote`` (a GC removed it).
    """
    t0 = time.perf_counter()
    remote.prepare_shared_commit()
    cids = [remote.resolve(part_tag(tag, k)) for k in range(nodes)]
    leaves: dict = {}
    items: dict = {}
    planner_data: dict = {}
    version = None
    for k, cid in enumerate(cids):
        record = remote.record(cid)
        comp = record.components.get("")
        if comp is None or comp["adapter"] != ADAPTER:
            raise IntegrityError(f"{part_tag(tag, k)} (commit {cid[:12]}) is not a DCP commit")
        meta = comp["meta"]
        first = record.metadata.get("node", k) * (record.metadata.get("world", nodes) // nodes)  # node-local rank -> rank
        for leaf in record.leaves:
            held = leaves.setdefault(leaf.path, leaf)
            if _same(held) != _same(leaf):
                raise IntegrityError(f"the parts of {tag} disagree on leaf {leaf.path!r} (node {k}): a replicated tensor that is not the same on every node")
        for fqn, e in meta["items"].items():
            if "bytes" in e:
                items.setdefault(fqn, {"bytes": e["bytes"], "rank": None if e.get("rank") is None else first + e["rank"]})
                continue
            held = items.setdefault(fqn, {**e, "chunks": []})
            have = {c[2] for c in held["chunks"]}
            held["chunks"] += [[c[0], c[1], c[2], None if c[3] is None else first + c[3]] for c in e["chunks"] if c[2] not in have]
        planner_data.update(meta.get("planner_data") or {})
        version = meta.get("version", version)
    keys = [k for leaf in leaves.values() if leaf.kind == "tensor" for k in leaf.keys]
    leaf_list = [  # as a commit passes them: JSON values as JSON text, shard addresses in ``keys``
        LeafRecord(r.path, "", "json", None, None, 0, None, jsonvalue.dumps(r.value, r.path)) if r.kind == "json"
        else LeafRecord(r.path, "", "tensor", r.dtype, r.shape, r.nbytes, r.shard_bytes, None, r.stride)
        for r in leaves.values()
    ]
    prior: dict = {}
    for blobs in remote.leaf_blobs(cids, list(leaves)).values():
        prior.update(blobs)
    component = Captured("", ADAPTER, DCPAdapter.version,
                         {"dcp": FORMAT_VERSION, "items": items, "planner_data": planner_data, "version": version, ESCAPED: True}, {})

    def write(writer, key):
        raise StoreWriteError(f"a blob of the parts of {tag} is no longer on {remote.location} (a GC removed it?); save again")

    metadata = {**metadata, "parts": cids}  # which saves of the nodes this step is (a resume on a node compares its own)
    info, _ = remote.commit_manifest([component], leaf_list, keys, write, tags, message, metadata, None, t0, prior=prior)
    return info


class TierPusher:
    """Node ``layout.node``'s background pushes from its local store to the bucket (run on
    the node's first rank, by a :class:`~ckptstore.pusher.Pusher`: one at a time, the newest
    request winning, its error model). :meth:`request` a save's step tag; the job pushes the
    part tag, and on node 0 then waits up to ``part_timeout`` seconds (or until a newer save
    is requested) for every node's part, composes them and **publishes** the step
    (:meth:`_publish`: the bucket's ``latest_tag`` moves by a compare-and-swap only to a higher
    step, then the step tag), then deletes the bucket's part tags of that step and older and
    prunes the bucket's step tags (``keep_last`` newest, plus every step that is a multiple of
    ``keep_every``). After each durable push, ``local_gc`` (a grace period, ``None``: never)
    runs a GC of the local store (every tag kept, ``keep_last=1`` of each lineage) from the
    push thread, so the node's disk holds what its tags and the unpushed parts need.

    :attr:`durable` lists the steps this node saw reach the bucket (node 0: composed;
    other nodes: its part pushed), :attr:`not_durable` those that did not (skipped for a
    newer one, failed after ``attempts``, refused as older than the bucket, or parts
    missing); failures are warned as :class:`~ckptstore.core.errors.PushFailedWarning` and kept
    in :attr:`error` / :attr:`failures` / :attr:`superseded` (the Pusher's error model).
    :attr:`rewind`: the next publish may move ``latest_tag`` to a lower step (set by an
    explicit ``Checkpointer.resume(ref)``).
    """

    def __init__(self, local: str, remote: str, layout: Layout, tag_re: re.Pattern, latest_tag: str,
                 keep_last: int | None, keep_every: int | None, attempts: int, backoff: float, part_timeout: float,
                 remote_config: dict | None = None, local_gc: str | float | None = None):
        self.local, self.remote, self.layout, self.tag_re, self.latest_tag = local, remote, layout, tag_re, latest_tag
        self.keep_last, self.keep_every = keep_last, keep_every
        self.part_timeout, self.remote_config, self.local_gc = part_timeout, remote_config, local_gc
        self.durable: list[int] = []
        self._dropped: list[int] = []  # skipped for a newer save, or given up waiting for parts
        self.rewind = False
        self.gc_reports: list = []
        self._local: Store | None = None
        self._remote: Store | None = None
        self.pusher = Pusher(remote, self._job, attempts, backoff, name="ckptstore-tier-push", skipped=self._skipped,
                             retry=lambda exc: not isinstance(exc, OlderStepError))

    @property
    def not_durable(self) -> list[int]:
        """The steps that did not reach the bucket from this node: skipped or given up for a
        newer save, then those whose push failed (and no later retry of that step succeeded)."""
        failed = [f.step for f in self.pusher.failures if f.step not in self.durable]
        return self._dropped + [s for s in dict.fromkeys(failed) if s not in self._dropped]

    @property
    def error(self) -> Exception | None:
        return self.pusher.error

    @property
    def failures(self) -> list:
        return self.pusher.failures

    @property
    def superseded(self) -> list:
        return self.pusher.superseded

    def request(self, tag: str) -> None:
        self.pusher.request(self._step(tag), tag)

    def wait(self, timeout: float | None = None) -> bool:
        return self.pusher.wait(timeout)

    def _step(self, tag: str) -> int:
        return int(self.tag_re.match(tag).group(1))

    def _skipped(self, step: int, tag: str) -> None:
        self._dropped.append(step)
        self._local = self._local or Store(self.local)
        _forget(self._local, part_tag(tag, self.layout.node))

    def _job(self, step: int, tag: str):
        try:
            self._local = self._local or Store(self.local)
            self._remote = self._remote or open_bucket(self.remote, self.remote_config, create=True)
            done = self._push(self._local, self._remote, tag)
        except BaseException:
            if self._remote is not None:  # a failed request may leave the client unusable: a fresh one next time
                self._remote.close()
                self._remote = None
            raise
        if done and self.local_gc is not None:  # the save is durable: a failed GC of the disk does not undo that
            try:
                self.gc_reports.append(self._local.gc(keep_last=1, grace=self.local_gc))
            except CkptStoreError as exc:
                warnings.warn(f"the GC of the local tier {self.local} after step {step} failed: {exc} (the next durable push runs it again)",
                              LocalTierGCWarning, stacklevel=1)
        return done

    def _push(self, local: Store, remote: Store, tag: str) -> bool:
        part = part_tag(tag, self.layout.node)
        step = self._step(tag)
        held = self._latest_step(remote)[1]
        if held >= step and not self.rewind:  # a stale node writes nothing of that step, not even its part
            raise self._older(step, held)
        if part in local.tags():  # only the blobs the bucket lacks; forced: a part left by a killed run is replaced
            local.push(remote.location, part, force=True)
        if self.layout.node == 0:
            deadline = time.monotonic() + self.part_timeout
            want = {part_tag(tag, k) for k in range(self.layout.nodes)}
            while not want <= set(remote.tags()):
                if self.pusher.pending():  # a newer save is waiting: the other nodes may push it instead of this one
                    self._dropped.append(step)
                    _forget(local, part)
                    return False
                if time.monotonic() > deadline:
                    raise StoreWriteError(f"the parts {sorted(want - set(remote.tags()))} of {tag} did not reach the bucket within {self.part_timeout:g} s")
                time.sleep(0.2)
            held = self._latest_step(remote)[1]
            if held >= step and not self.rewind:  # before composing: a stale node writes nothing of that step
                raise self._older(step, held)
            info = compose(remote, tag, self.layout.nodes, [], f"step {step} from {self.layout.nodes} node(s)",
                           {"step": step, "world": self.layout.world, "nodes": self.layout.nodes})
            self._publish(remote, info.id, tag, step)
            for name in list(remote.tags()):  # the parts of this step and older ones are no longer needed
                m = re.fullmatch(r"parts/(.+)/node-\d+", name)
                if m and self.tag_re.match(m.group(1)) and self._step(m.group(1)) <= step:
                    _forget(remote, name)
            self._prune(remote)
        _forget(local, part)
        self.durable.append(step)
        self.rewind = False  # (other nodes: their part of the rewound step is there)
        return True

    def _latest_step(self, remote: Store) -> tuple[str | None, int]:
        """``(commit, step)`` of the bucket's ``latest_tag`` now (``(None, -1)``: none yet)."""
        try:
            cid = remote.resolve(self.latest_tag)
        except (RefNotFoundError, NotAStoreError):  # (a bucket the first push makes a store)
            return None, -1
        step = remote.info(cid).metadata.get("step")
        return cid, step if type(step) is int else -1

    def _older(self, step: int, held: int) -> OlderStepError:
        return OlderStepError(
            f"{self.remote}: {self.latest_tag!r} holds step {held}, newer than or as new as this save's step {step}: this node "
            "resumed from an older save (its disk was stale, or the bucket was not consulted) and its push would move the "
            "run backwards, so it was refused (the local commit is intact). Resume again to continue from the bucket's "
            "newest step, or resume(ref=...) explicitly to rewind the run")

    def _publish(self, remote: Store, cid: str, tag: str, step: int) -> None:
        """Move ``latest_tag`` to ``cid`` by a compare-and-swap from the commit whose step was
        read (a lost race reads and compares again), only to a higher step (unless
        :attr:`rewind`), then the step tag ``tag``.

        Raises:
            OlderStepError: the bucket's ``latest_tag`` holds ``step`` or a higher one.
        """
        while True:
            old, held = self._latest_step(remote)
            if held >= step and not self.rewind:
                raise self._older(step, held)
            try:
                remote.tag(self.latest_tag, cid, expect=old)
                break
            except RefConflictError:
                continue  # it moved since: read and compare again
        self.rewind = False
        remote.tag(tag, cid)

    def _prune(self, remote: Store) -> None:
        if self.keep_last is None:
            return
        mine = sorted((int(m.group(1)), t) for t in remote.tags() if (m := self.tag_re.match(t)))
        for step, name in mine[: max(0, len(mine) - self.keep_last)]:
            if not (self.keep_every and step % self.keep_every == 0):
                _forget(remote, name)


def open_bucket(url: str, config: dict | None = None, create: bool = False) -> Store:
    """The store at ``url``; on ``s3://`` with ``config`` (keyword arguments of
    :class:`~ckptstore.backends.s3.S3Backend`: ``config``, ``client_options``,
    ``retry_config``) its client is made with them.

    Raises:
        NotAStoreError, BackendError: as :class:`Store`.
    """
    if config and url.startswith("s3://"):
        from .backends.s3 import S3Backend

        return Store(url, create=create, backend=S3Backend(url, **config))
    return Store(url, create=create)


def _backend(url: str, config: dict | None):
    from .backends import open_backend

    if config and url.startswith("s3://"):
        from .backends.s3 import S3Backend

        return S3Backend(url, **config)
    return open_backend(url)


def bucket_newest(url: str, tag_re: re.Pattern, tag_format: str, config: dict | None = None) -> tuple[int, list[str] | None]:
    """``(step, parts)``: the newest step of the bucket's step tags (``tag_re`` group 1; -1:
    none), from one listing of its refs, and the part commit ids (node 0 first) of the save
    that step's tag (``tag_format``) names (its ``"parts"`` metadata, :func:`compose`;
    ``None``: a commit without them), from one read of the tag and one of its record. No
    blob is read.

    Raises:
        NotAStoreError: no bucket. BackendError: it could not be reached (after the client's
        retries).
    """
    from .objects.bucketformat import fetch_record, read_tag

    with _backend(url, config) as backend:
        steps = [int(m.group(1)) for name in backend.list_refs() if (m := tag_re.match(name))]
        if not steps:
            return -1, None
        tag = tag_format.format(step=max(steps))
        cid, _ = read_tag(backend, tag)
        if cid is None:  # (deleted since the listing)
            return max(steps), None
        try:
            parts = fetch_record(backend, cid, f" (named by tag {tag!r})").metadata.get("parts")
        except IntegrityError:  # a damaged record: not this one's to judge (loading it from the bucket would fail)
            parts = None
    return max(steps), parts if isinstance(parts, list) and all(isinstance(p, str) for p in parts) else None


def _same(leaf: LeafRecord) -> tuple:
    return (leaf.kind, leaf.dtype, leaf.shape, leaf.stride, leaf.nbytes, list(leaf.keys), leaf.value)


def _forget(store: Store, tag: str) -> None:
    try:
        store.delete_tag(tag)
    except RefNotFoundError:
        pass
