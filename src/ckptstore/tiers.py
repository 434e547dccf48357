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
import threading
import time
import warnings
from dataclasses import dataclass

from . import jsonvalue
from .adapters.base import Captured
from .dcp_layout import ADAPTER, FORMAT_VERSION, DCPAdapter
from .errors import CkptStoreError, IntegrityError, PushFailedWarning, RefNotFoundError, StoreWriteError
from .records import ESCAPED, LeafRecord
from .store import CommitInfo, Store

__all__ = ["Layout", "TierPusher", "compose", "node_layout", "part_tag"]


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

    from .errors import InvalidArgumentError

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
    (tags :func:`part_tag`), every blob already there, and move ``tags``.

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

    info, _ = remote.commit_manifest([component], leaf_list, keys, write, tags, message, metadata, None, t0, prior=prior)
    return info


class TierPusher:
    """Node ``layout.node``'s background pushes from its local store to the bucket (run on
    the node's first rank). :meth:`request` a save's step tag; the thread pushes the newest
    requested part tag, and on node 0 then waits up to ``part_timeout`` seconds (or until a
    newer save is requested) for every node's part, composes them and moves the bucket's step tag and ``latest_tag``, then
    deletes the bucket's part tags of that step and older and prunes the bucket's step tags
    (``keep_last`` newest, plus every step that is a multiple of ``keep_every``).

    :attr:`durable` lists the steps this node saw reach the bucket (node 0: composed;
    other nodes: its part pushed), :attr:`not_durable` those that did not (skipped for a
    newer one, failed after ``attempts``, or parts missing), each failure also warned as a
    :class:`~ckptstore.errors.PushFailedWarning` and kept in :attr:`error`.
    """

    def __init__(self, local: str, remote: str, layout: Layout, tag_re: re.Pattern, latest_tag: str,
                 keep_last: int | None, keep_every: int | None, attempts: int, backoff: float, part_timeout: float):
        self.local, self.remote, self.layout, self.tag_re, self.latest_tag = local, remote, layout, tag_re, latest_tag
        self.keep_last, self.keep_every = keep_last, keep_every
        self.attempts, self.backoff, self.part_timeout = attempts, backoff, part_timeout
        self.durable: list[int] = []
        self.not_durable: list[int] = []
        self.error: Exception | None = None
        self._cond = threading.Condition()
        self._queue: list[str] = []
        self._busy = False
        self._thread: threading.Thread | None = None

    def request(self, tag: str) -> None:
        with self._cond:
            self._queue.append(tag)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ckptstore-tier-push", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout)

    def _step(self, tag: str) -> int:
        return int(self.tag_re.match(tag).group(1))

    def _run(self) -> None:
        local = remote = None
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._queue))
                *skipped, tag = self._queue
                self._queue.clear()
                self._busy = True
            try:
                local = local or Store(self.local)
                for old in skipped:  # the newest request wins
                    self.not_durable.append(self._step(old))
                    _forget(local, part_tag(old, self.layout.node))
                error = None
                for attempt in range(self.attempts):
                    try:
                        remote = remote or Store(self.remote, create=True)
                        self._push(local, remote, tag)
                        error = None
                        break
                    except CkptStoreError as exc:
                        error = exc
                        if attempt + 1 < self.attempts:
                            time.sleep(self.backoff * 2**attempt)
            except Exception as exc:  # noqa: BLE001 - reported below, the thread must keep serving
                error = exc
            if error is not None:
                self.error = error
                self.not_durable.append(self._step(tag))
                warnings.warn(f"{tag} did not reach {self.remote}: {error} (the local commit is intact; it is not durable on the bucket)",
                              PushFailedWarning, stacklevel=1)
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def _push(self, local: Store, remote: Store, tag: str) -> None:
        part = part_tag(tag, self.layout.node)
        if part in local.tags():  # only the blobs the bucket lacks; forced: a part left by a killed run is replaced
            local.push(remote.location, part, force=True)
        if self.layout.node == 0:
            deadline = time.monotonic() + self.part_timeout
            want = {part_tag(tag, k) for k in range(self.layout.nodes)}
            while not want <= set(remote.tags()):
                with self._cond:
                    newer = bool(self._queue)
                if newer:  # a newer save is waiting: the other nodes may push it instead of this one
                    self.not_durable.append(self._step(tag))
                    _forget(local, part)
                    return
                if time.monotonic() > deadline:
                    raise StoreWriteError(f"the parts {sorted(want - set(remote.tags()))} of {tag} did not reach the bucket within {self.part_timeout:g} s")
                time.sleep(0.2)
            step = self._step(tag)
            compose(remote, tag, self.layout.nodes, [tag, self.latest_tag], f"step {step} from {self.layout.nodes} node(s)",
                    {"step": step, "world": self.layout.world, "nodes": self.layout.nodes})
            for name in list(remote.tags()):  # the parts of this step and older ones are no longer needed
                m = re.fullmatch(r"parts/(.+)/node-\d+", name)
                if m and self.tag_re.match(m.group(1)) and self._step(m.group(1)) <= step:
                    _forget(remote, name)
            self._prune(remote)
        _forget(local, part)
        self.durable.append(self._step(tag))

    def _prune(self, remote: Store) -> None:
        if self.keep_last is None:
            return
        mine = sorted((int(m.group(1)), t) for t in remote.tags() if (m := self.tag_re.match(t)))
        for step, name in mine[: max(0, len(mine) - self.keep_last)]:
            if not (self.keep_every and step % self.keep_every == 0):
                _forget(remote, name)


def _same(leaf: LeafRecord) -> tuple:
    return (leaf.kind, leaf.dtype, leaf.shape, leaf.stride, leaf.nbytes, list(leaf.keys), leaf.value)


def _forget(store: Store, tag: str) -> None:
    try:
        store.delete_tag(tag)
    except RefNotFoundError:
        pass
