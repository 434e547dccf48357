"""A training-loop checkpointer: commit on a schedule, resume exactly.

>>> ckpt = ckptstore.Checkpointer(store, {"rb": rb, "policy": policy, "optim": optim,
...                                       "rng": ckptstore.RNGState()}, every_n_steps=1000)
>>> start = ckpt.resume() or 0          # restores everything from "latest", if it exists
>>> for step in range(start, total):
...     train_one_step()
...     ckpt.step()                       # commits "step-<n>" and rewrites "latest" every 1000 steps

A run killed at any instant and restarted with the same code continues from the
last commit bit-identically: the replay buffer, parameters, optimizer moments
and every RNG stream are restored in place. A run told to stop (SIGTERM from
SLURM or a spot machine, or SIGUSR1) commits at the next step boundary and exits.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import warnings
import weakref
from collections.abc import Iterable
from typing import Any

from .adapters.base import capture
from .adapters.training import Progress  # noqa: F401 (re-exported: ckptstore.checkpointer.Progress)
from .core.errors import (
    BackendError,
    BucketNotConsultedWarning,
    CkptStoreError,
    DefaultRunResumedWarning,
    InvalidArgumentError,
    NotAStoreError,
    RefNotFoundError,
    RunBusyError,
    TargetMismatchError,
)
from .home.refs import fenced
from .pusher import Pusher
from .run import LEASE_SECONDS, Lease, acquire, check_run, describe, run_tag
from .store import CommitInfo, Store


class Checkpointer:
    """Commits ``objects`` every ``every_n_steps`` calls of :meth:`step`.

    Args:
        store: the store to commit to, or its location, a folder or
            ``"s3://bucket/prefix"`` (opened with ``create=True``: a training run makes
            its store; with ``dcp``, a bucket needs no shared filesystem between ranks).
        objects: ``{name: object}``; each becomes component ``<name>`` (a replay
            buffer ``rb`` gives ``rb/storage``, ``rb/writer``, ``rb/sampler``).
        every_n_steps: commit when the step count crosses a multiple of this.
        run: the run this Checkpointer writes (docs/training.md, "Runs that share a
            store"): its tags are ``<run>/<tag_format>`` and ``<run>/<latest_tag>``
            (``exp-a/step-1000``, ``exp-a/latest``), so its lineage (parents come from its
            own tags) and its retention (``keep_last``) are its own, and its commits'
            metadata say ``"run": run``. ``None`` (default): the default run, with the
            plain tags ``step-<n>`` and ``latest`` (stores written before runs existed
            resume unchanged); an implicit :meth:`resume` of it refuses a commit made by
            another script or for other objects. While a Checkpointer lives it holds the
            run's lease (:mod:`ckptstore.run`): a second live one on the same run of the
            same store, in another process, is refused; in the same process the newer one
            takes over. :meth:`close` gives the run up, as does the end of the process.
        tag_format: tag for each scheduled commit, formatted with ``step``
            (``None``: only ``latest_tag`` moves); prefixed with ``<run>/``.
        latest_tag: rewritten atomically by every commit; prefixed with ``<run>/``.
        components: names of ``objects`` to commit (default: all).
        keep_last: after each commit, delete this checkpointer's ``tag_format``
            tags beyond the newest ``keep_last`` (``latest_tag`` always stays;
            ``None`` keeps every tag). GC then frees what no tag keeps.
        on_signal: signals (default SIGTERM and SIGUSR1, as SLURM and spot
            machines send before they stop a job) after which the next
            :meth:`step` commits and exits the process with status 0; ``()``
            installs no handler. Handlers are installed only in the main thread.
        dcp: multi-rank mode (docs/distributed.md): every rank builds the same
            Checkpointer and calls :meth:`step`; commits go through
            ``torch.distributed.checkpoint`` (``dcp.save`` with a
            :class:`ckptstore.dcp.StoreWriter`: one commit per save, made by rank 0)
            and :meth:`resume` through ``dcp.load``. ``objects`` are then what DCP
            takes (tensors, JSON values, objects with ``state_dict``/``load_state_dict``);
            :meth:`commit` returns the CommitInfo on the coordinator, ``None`` elsewhere.
        push_to: a remote (``"s3://bucket/prefix"``, or another store's folder) to which
            every commit's ``latest_tag`` is pushed in a background thread
            (:meth:`Store.push`); the step does not wait. Pushes run one at a time and
            the newest request wins (a push started after several commits pushes the
            newest). A failed push is retried ``push_attempts`` times (waits of
            ``push_backoff`` seconds, doubling), then reported with a
            :class:`~ckptstore.core.errors.PushFailedWarning` and kept in :attr:`push_failures`
            (:attr:`push_error` while it is the newest save's); the local commit is never
            affected, and the next commit pushes again. :meth:`wait_pushed` blocks until the
            pushes requested so far are done and raises only if the newest save is not
            durable (a superseded failure is in :attr:`push_superseded`; with
            ``local``/``remote``: this node's pushes). One worker,
            :class:`ckptstore.pusher.Pusher`, serves both.
            With ``dcp``, the coordinator (rank 0) pushes after each of its commits; on
            the other ranks nothing is pushed and :meth:`wait_pushed` returns ``None``.
        local, remote: the two tiers of a multi-node job (with ``dcp``, instead of
            ``store``; :mod:`ckptstore.tiers`, docs/distributed.md "Many nodes, one bucket"):
            ``local`` is this node's folder (its own disk), ``remote`` the bucket
            (``"s3://bucket/run"``). Each save commits this node's ranks' part to ``local``
            (the step waits only for that), then a background thread pushes it to the
            bucket (only the blobs it lacks); the bucket's step tag and ``latest_tag``
            move once every node's part is there, and ``latest_tag`` only ever to a higher
            step (a push that would lower it is refused with
            :class:`~ckptstore.core.errors.OlderStepError`). :meth:`resume` first reads the
            bucket's newest step (a listing of its refs, that step's tag and record), then loads the newest step every
            node holds locally if it is no older than that, else the bucket's ``latest_tag``;
            a bucket it cannot reach is not consulted (local resume, with a
            :class:`~ckptstore.core.errors.BucketNotConsultedWarning`; :attr:`bucket_step` is then
            ``None``). A resumed local save that never reached the bucket is pushed again.
            ``keep_last`` applies to ``local``; ``remote_keep_last`` (``None``: keep all)
            and ``remote_keep_every`` (steps that are a multiple of it stay) to the bucket.
            ``ranks_per_node`` defaults to ``LOCAL_WORLD_SIZE``; node 0 waits up to
            ``part_timeout`` seconds for the other nodes' parts. :attr:`durable_steps` /
            :attr:`not_durable_steps` report which saves reached the bucket, as seen by this node.
        remote_config: keyword arguments of the bucket's client
            (:class:`~ckptstore.backends.s3.S3Backend`: ``config``, ``client_options``,
            ``retry_config``), e.g. ``{"retry_config": {"max_retries": 2}}`` to give up on an
            unreachable bucket sooner than the default three minutes.
        local_gc: after each save that became durable on the bucket, the push thread runs a
            GC of ``local`` with this grace period (seconds or ``"30m"``; ``None``: never):
            every tag stays, and ``keep_last=1`` of each lineage, so the node's disk holds
            what retention and the saves not yet pushed need.

        lease_seconds: on object storage, how long the run's lease lasts without renewal
            (it is renewed every third of it): a killed holder blocks the run that long.

    The step count itself is committed as component ``checkpointer``. Attributes
    ``latest_tag`` and ``tag_format`` hold the full (run-prefixed) names.

    Raises:
        InvalidArgumentError: ``objects`` not a non-empty dict with str keys,
            ``every_n_steps`` < 1, ``keep_last`` < 1, unknown component names, or a name ``checkpointer``.
        UnsupportedTypeError / InvalidNameError: an object that cannot be committed
            (checked here, not at the first due step), or a bad run name.
        RunBusyError: another live process writes the same run of this store (names its pid and host).
    """

    def __init__(
        self,
        store: Store | str | os.PathLike,
        objects: dict[str, Any],
        *,
        every_n_steps: int = 1000,
        tag_format: str | None = "step-{step}",
        latest_tag: str = "latest",
        components: Iterable[str] | None = None,
        keep_last: int | None = 3,
        on_signal: Iterable[int] = (signal.SIGTERM, signal.SIGUSR1),
        dcp: bool = False,
        push_to: str | os.PathLike | None = None,
        push_attempts: int = 3,
        push_backoff: float = 1.0,
        run: str | None = None,
        lease_seconds: float = LEASE_SECONDS,
        local: str | os.PathLike | None = None,
        remote: str | None = None,
        remote_keep_last: int | None = 10,
        remote_keep_every: int | None = None,
        ranks_per_node: int | None = None,
        part_timeout: float = 60.0,
        remote_config: dict | None = None,
        local_gc: str | float | None = "1h",
    ):
        self.run = check_run(run)
        self.dcp = dcp
        self._layout = self._tier_pusher = None
        self.resumed_from: str | None = None  # "local" or "remote" after a tiered resume
        self.bucket_step: int | None = None  # the bucket's newest step a tiered resume read (None: not reached)
        self._remote_config, self._bucket_error, self._bucket_parts = remote_config, None, None
        if local is not None or remote is not None:
            if not dcp or local is None or remote is None or store is not None or push_to is not None or tag_format is None:
                raise InvalidArgumentError("local= and remote= go together, with dcp=True and a tag_format, instead of store and push_to")
            if remote_keep_last is not None and (type(remote_keep_last) is not int or remote_keep_last < 1):
                raise InvalidArgumentError(f"remote_keep_last must be an int >= 1 or None, got {remote_keep_last!r}")
            from .tiers import node_layout

            self._layout = node_layout(ranks_per_node)
            self._remote = str(remote)
            store = os.fspath(local)
        if dcp and isinstance(store, (str, os.PathLike, Store)):
            store = _DCPStore(store)  # every rank: no catalog is opened until a read needs it
        elif isinstance(store, (str, os.PathLike)):
            store = Store(store, create=True)
        if not isinstance(store, (Store, _DCPStore)):
            raise InvalidArgumentError(f"store must be a ckptstore.Store or a path, got {type(store).__name__}")
        if type(objects) is not dict or not objects or not all(type(k) is str for k in objects):
            raise InvalidArgumentError(f"objects must be a non-empty dict of name -> object, got {type(objects).__name__}")
        if type(every_n_steps) is not int or every_n_steps < 1:
            raise InvalidArgumentError(f"every_n_steps must be an int >= 1, got {every_n_steps!r}")
        names = list(objects) if components is None else list(components)
        unknown = [n for n in names if n not in objects]
        if unknown or "checkpointer" in objects:
            raise InvalidArgumentError(f"components {unknown} are not in objects, or an object is named 'checkpointer'")
        if keep_last is not None and (type(keep_last) is not int or keep_last < 1):
            raise InvalidArgumentError(f"keep_last must be an int >= 1 or None, got {keep_last!r}")
        self.store = store
        self.objects = objects
        self.every = every_n_steps
        self.tag_format = None if tag_format is None else run_tag(self.run, tag_format)
        self.latest_tag = run_tag(self.run, latest_tag)
        self.components = names
        self.keep_last = keep_last
        self.steps = 0
        self.stop_requested: int | None = None  # the signal received, until the next step commits
        self._pusher = None if push_to is None else _push_latest(store.location, push_to, self.latest_tag, push_attempts, push_backoff)
        if not dcp:
            capture(self._state(), store.registry)  # every object must be committable now, not after 1000 steps
        self._tag_re = None if tag_format is None else re.compile(
            "^" + re.escape(self.tag_format).replace(re.escape("{step}"), r"(\d+)") + "$"
        )
        self._lease: Lease | None = None
        self._closed = False
        self._lease_seconds = lease_seconds
        self._hold(create=False)
        if self._layout is not None:  # its thread starts with the first push, on each node's first rank
            from .tiers import TierPusher

            self._tier_pusher = TierPusher(self.store.location, self._remote, self._layout, self._tag_re, self.latest_tag,
                                           remote_keep_last, remote_keep_every, push_attempts, push_backoff, part_timeout,
                                           remote_config, local_gc)
        handlers: list[_SignalHandler] = []
        self._signals = weakref.finalize(self, _restore_signals, handlers)  # on close(), or when collected
        if on_signal and _in_main_thread():
            for signum in on_signal:
                handler = _SignalHandler(self, signum, signal.getsignal(signum))
                signal.signal(signum, handler)
                handlers.append(handler)

    def _hold(self, create: bool) -> None:
        """Take the run's lease if not held yet (DCP mode: every rank builds the Checkpointer,
        and the run is not leased: docs/distributed.md)."""
        if self._lease is None and not self.dcp:
            self._lease = acquire(self.store, self.run, self._lease_seconds, create=create)
            if self._lease is not None:
                weakref.finalize(self, self._lease.abandon)

    def close(self) -> None:
        """Give the run's lease up and put back the signal handlers found at construction
        (each one only if the handler installed now is still this Checkpointer's: see
        :class:`_SignalHandler`); the store stays open; idempotent. The Checkpointer
        commits no more: :meth:`commit` raises RunBusyError afterwards."""
        self._closed = True
        self._signals()
        if self._lease is not None:
            self._lease.release()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _metadata(self, metadata: dict | None) -> dict:
        """The commit metadata: the step, the run (named runs only) and the script, then the caller's."""
        script = _script()
        return {"step": self.steps, **(metadata or {}), **({} if self.run is None else {"run": self.run}), **({"script": script} if script else {})}

    def _request_stop(self, signum, frame) -> None:
        self.stop_requested = signum

    def _state(self) -> dict:
        state = {name: self.objects[name] for name in self.components}
        state["checkpointer"] = {"step": self.steps}
        return state

    def step(self, n: int = 1, metadata: dict | None = None) -> CommitInfo | None:
        """Count ``n`` steps; commit if a multiple of ``every_n_steps`` was crossed.

        After one of the ``on_signal`` signals, commit now and exit the process
        (``SystemExit(0)``): the job's grace period is spent on one commit.
        """
        before = self.steps
        self.steps += n
        if self.stop_requested is not None:
            signum, self.stop_requested = self.stop_requested, None
            self.commit({**(metadata or {}), "stopped_by": signal.Signals(signum).name})
            for pusher in (self._pusher, self._tier_pusher):
                if pusher is not None:
                    pusher.wait()  # the last commit reaches the remote before the job ends (failures are warned)
            sys.exit(0)
        if self.steps // self.every > before // self.every:
            return self.commit(metadata)
        return None

    def commit(self, metadata: dict | None = None) -> CommitInfo:
        """Commit now: the selected objects and the step count; moves the tags,
        then deletes this checkpointer's step tags past ``keep_last``.

        Raises:
            RunBusyError: this Checkpointer no longer holds its run (closed, superseded by a
                newer one in this process, or its lease on object storage taken over).
            RunTakenOverError: (a RunBusyError) a newer holder of the run was issued a newer
                fencing token: no tag moved; the commit's objects stay untagged, for GC.
        """
        tags = ([self.tag_format.format(step=self.steps)] if self.tag_format else []) + [self.latest_tag]
        if self.dcp:
            return self._commit_dcp(tags, metadata)
        if self._closed:
            raise RunBusyError(f"this Checkpointer of {describe(self.run)} was closed: it commits no more")
        self._hold(create=True)
        self._lease.check()
        with fenced(self._lease):  # every tag move passes the run's fencing token (docs/design.md, "Fenced writers")
            info = self.store.commit(self._state(), tag=tags, message=f"step {self.steps}", metadata=self._metadata(metadata))
            self._prune(self.store)
        if self._pusher is not None:
            self._pusher.request(self.steps)
        return info

    @property
    def push_error(self) -> Exception | None:
        """The error of the newest save's background push if it failed after its retries (that
        save is not durable on the remote), else ``None``: a failure that a later durable save
        superseded is not an error any more (it is in :attr:`push_superseded`)."""
        pusher = self._tier_pusher or self._pusher
        return None if pusher is None else pusher.error

    @property
    def push_failures(self) -> list:
        """Every background push that failed after its retries, oldest first: a
        :class:`~ckptstore.pusher.PushFailure` ``(step, error, seq)`` each (superseded ones included)."""
        pusher = self._tier_pusher or self._pusher
        return [] if pusher is None else list(pusher.failures)

    @property
    def push_superseded(self) -> list:
        """The failed pushes (:class:`~ckptstore.pusher.PushFailure`) that a later save, durable
        on the remote, superseded: each was warned once and is never raised by :meth:`wait_pushed`."""
        pusher = self._tier_pusher or self._pusher
        return [] if pusher is None else list(pusher.superseded)

    @property
    def durable_steps(self) -> list[int]:
        """With ``local``/``remote``: the steps whose save this node saw reach the bucket
        (node 0: the whole save, its tags moved; other nodes: this node's part), oldest first."""
        return [] if self._tier_pusher is None else list(self._tier_pusher.durable)

    @property
    def not_durable_steps(self) -> list[int]:
        """With ``local``/``remote``: the steps saved locally that never reached the bucket
        from this node (a newer save was pushed instead, the push failed, or node 0 waited in
        vain for another node's part); they are not on the bucket and :meth:`resume` on new
        nodes never sees them."""
        return [] if self._tier_pusher is None else list(self._tier_pusher.not_durable)

    def wait_pushed(self, timeout: float | None = None):
        """Block until every push requested so far has finished (``timeout`` in seconds,
        ``None``: no limit); returns the last successful push's TransferReport (``None`` if
        none ran; with ``local``/``remote``: ``True`` or ``None``).

        It raises only when the newest save is not durable on the remote: older failed pushes
        that a later durable save superseded are warned and listed in :attr:`push_superseded`,
        not raised (docs/training.md, "Background pushes and their errors").

        Raises:
            InvalidArgumentError: no ``push_to`` (or ``local``/``remote``) was given.
            TimeoutError: pushes still running after ``timeout`` seconds.
            CkptStoreError: the newest save's push failed after its retries (its error; a
                BackendError, NotAStoreError, RefConflictError; with tiers an
                :class:`~ckptstore.core.errors.OlderStepError` when the bucket holds a newer step).
        """
        pusher = self._tier_pusher or self._pusher
        if pusher is None:
            raise InvalidArgumentError("this Checkpointer has no push_to")
        if not pusher.wait(timeout):
            raise TimeoutError(f"pushes to {pusher.remote} still running after {timeout} s")
        error = pusher.error
        if error is not None:
            raise error
        return pusher.pusher.report if pusher is self._tier_pusher else pusher.report

    def _commit_dcp(self, tags: list[str], metadata: dict | None) -> CommitInfo | None:
        import torch.distributed.checkpoint as dcp

        from .dcp import StoreWriter

        meta = self._metadata(metadata)
        if self._layout is None:
            writer = StoreWriter(self.store.path, tags[0], tags=tags[1:], message=f"step {self.steps}", metadata=meta)
            dcp.save(self._state(), storage_writer=writer)
        else:  # this node's ranks commit their part to the node's local store
            from .tiers import part_tag

            writer = StoreWriter(self.store.path, tags[0], tags=[*tags[1:], part_tag(tags[0], self._layout.node)],
                                 message=f"step {self.steps}, node {self._layout.node}", metadata={**meta, **self._layout.meta})
            dcp.save(self._state(), storage_writer=writer, process_group=self._layout.group)
        info = writer.commit_info
        if info is not None:  # the coordinator (with tiers: each node's first rank) prunes and pushes
            self._prune(self.store.opened())
            if self._pusher is not None:
                self._pusher.request(self.steps)
            if self._tier_pusher is not None:
                self._tier_pusher.request(tags[0])
        return info

    def _prune(self, store: Store) -> None:
        if self.keep_last is not None and self._tag_re is not None:
            mine = sorted((int(m.group(1)), t) for t in store.tags() if (m := self._tag_re.match(t)))
            for _, tag in mine[: max(0, len(mine) - self.keep_last)]:
                try:
                    store.delete_tag(tag)
                except RefNotFoundError:
                    pass  # another process pruned it first

    def _resume_dcp(self, ref: str | None) -> int | None:
        import torch.distributed.checkpoint as dcp

        from .dcp import StoreReader

        store = self.store.opened(must_exist=ref is not None)
        if store is None or (ref is None and self.latest_tag not in store.tags()):
            return None
        state = self._state()
        state["checkpointer"] = {"step": -1}
        dcp.load(state, storage_reader=StoreReader(store, ref or self.latest_tag))
        for name in self.components:
            self.objects[name] = state[name]
        self.steps = state["checkpointer"]["step"]
        return self.steps

    def _local_steps(self) -> list[int]:
        """The steps this node's local store holds whole for this layout (its part, committed)."""
        store = self.store.opened(must_exist=False)
        if store is None:
            return []
        out = []
        for tag, info in store.tagged().items():
            m = self._tag_re.match(tag)
            if m and info.metadata.get("step") == int(m.group(1)) and all(info.metadata.get(k) == v for k, v in self._layout.meta.items()):
                out.append(int(m.group(1)))
        return sorted(out)

    def _resume_tiers(self, ref: str | None) -> int | None:
        """Every rank: the newest step every node holds locally, if it is as new as the
        bucket's newest step (read first: one listing of the bucket's refs), loaded from the
        local stores (each node over its own group); else (none, older than the bucket, or
        one failed to verify) the bucket's. A bucket that cannot be reached is not
        consulted: the local step is resumed with a :class:`~ckptstore.core.errors.BucketNotConsultedWarning`.
        After a local resume, a save of that step that never reached the bucket is pushed
        again. An explicit ``ref`` reads the bucket and allows the next push to rewind it."""
        import torch
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        from .dcp import StoreReader
        from .tiers import open_bucket

        lay, remote = self._layout, self._remote
        on = lay.group is not None
        state = self._state()
        state["checkpointer"] = {"step": -1}
        steps = self._local_steps()[-64:] if ref is None else []
        bucket = self._bucket_step() if ref is None else -1
        self.bucket_step = None if bucket == -2 else bucket
        if on:
            mine = torch.full((64,), -1, dtype=torch.int64)
            mine[: len(steps)] = torch.tensor(steps, dtype=torch.int64)
            every = [torch.empty_like(mine) for _ in range(lay.world)]
            dist.all_gather(every, mine)
            held = [{int(x) for x in t if x >= 0} for t in every]
            common = set.intersection(*held)
        else:
            common = set(steps)
        common = {s for s in common if s >= bucket}  # never older than the bucket's newest step (-2: not reached)
        if common and max(common) == bucket and not self._same_save(bucket):
            common = set()  # the bucket's save of that step is not these nodes' (a stale node saved it again): the bucket's
        failure = None
        if common:
            tag = self.tag_format.format(step=max(common))
            try:
                dcp.load(state, storage_reader=StoreReader(self.store.path, tag, process_group=lay.group), process_group=lay.group)
            except (CheckpointException, CkptStoreError) as exc:
                failure = exc
                warnings.warn(f"the local tier could not restore {tag} ({exc}); resuming from {remote}", stacklevel=2)
            failed = torch.tensor([failure is not None], dtype=torch.int32)
            if on:
                dist.all_reduce(failed, op=dist.ReduceOp.MAX)
            if not failed.item():
                if bucket == -2:
                    warnings.warn(
                        f"resumed step {max(common)} from the local tier {self.store.location} without consulting the bucket "
                        f"{remote}: it could not be reached ({self._bucket_error}). A newer step may be there; this node's "
                        "pushes never move the bucket's latest to a lower step than it holds (they are refused instead)",
                        BucketNotConsultedWarning, stacklevel=2)
                self._push_again(tag, bucket)
                return self._restored(state, "local")
        found = torch.zeros(17, dtype=torch.uint8)
        if not on or dist.get_rank() == 0:
            try:
                with open_bucket(remote, self._remote_config) as bucket_store:
                    found[1:] = torch.frombuffer(bytearray.fromhex(bucket_store.resolve(ref or self.latest_tag)), dtype=torch.uint8)
                    found[0] = 1
            except (NotAStoreError, RefNotFoundError):
                if ref is not None:
                    raise
        if on:
            dist.broadcast(found, src=0)
        if not found[0]:
            if failure is not None:
                raise failure
            return None
        with open_bucket(remote, self._remote_config) as bucket_store:
            dcp.load(state, storage_reader=StoreReader(bucket_store, bytes(found[1:].tolist()).hex()))
        if ref is not None and self._tier_pusher is not None:
            self._tier_pusher.rewind = True  # an explicit rewind: the next save may move the bucket's latest lower
        return self._restored(state, "remote")

    def _same_save(self, step: int) -> bool:
        """Every rank: is the bucket's save of ``step`` the one every node's local store holds
        (the ``"parts"`` of its commit, read by rank 0 with the step, name each node's local
        commit of that step)? A commit without parts counts as the same."""
        import torch
        import torch.distributed as dist

        lay = self._layout
        on = lay.group is not None
        tag = self.tag_format.format(step=step)
        store = self.store.opened(must_exist=False)
        mine = torch.zeros(16, dtype=torch.uint8)
        if store is not None and tag in store.tags():
            mine[:] = torch.frombuffer(bytearray.fromhex(store.resolve(tag)), dtype=torch.uint8)
        every = [mine]
        if on:
            every = [torch.empty_like(mine) for _ in range(lay.world)]
            dist.all_gather(every, mine)
        same = torch.tensor([1], dtype=torch.int32)
        if not on or dist.get_rank() == 0:
            parts = self._bucket_parts  # (read with the step)
            per = lay.world // lay.nodes
            if parts is not None:
                held = [bytes(every[r].tolist()).hex() for r in range(0, lay.world, per)]
                same[0] = int(len(parts) == lay.nodes and parts == held)
        if on:
            dist.broadcast(same, src=0)
        return bool(same.item())

    def _push_again(self, tag: str, bucket: int) -> None:
        """After a local resume of ``tag``: on each node's first rank, if this node's part of
        it never reached the bucket (its part tag is still in the local store) and the bucket
        holds an older step (or could not be reached), push it again; a part of a step the
        bucket already holds or passed is dropped (its tag only: GC decides about its data)."""
        import torch.distributed as dist

        from .tiers import part_tag

        lay = self._layout
        if lay.group is not None and dist.get_rank() % (lay.world // lay.nodes):
            return
        local = self.store.opened(must_exist=False)
        part = part_tag(tag, lay.node)
        if local is None or part not in local.tags():
            return
        step = int(self._tag_re.match(tag).group(1))
        if bucket == -2 or bucket < step:
            self._tier_pusher.request(tag)
        else:
            try:
                local.delete_tag(part)
            except RefNotFoundError:
                pass

    def _bucket_step(self) -> int:
        """Every rank: the newest step of the bucket's step tags (-1: none, or no bucket; -2:
        the bucket could not be reached, its error in ``_bucket_error``), read by rank 0 with
        one listing of the bucket's refs (and that step's parts, for :meth:`_same_save`)."""
        import torch
        import torch.distributed as dist

        from .tiers import bucket_newest

        on = self._layout.group is not None
        found = torch.tensor([-1], dtype=torch.int64)
        self._bucket_error = self._bucket_parts = None
        if not on or dist.get_rank() == 0:
            try:
                found[0], self._bucket_parts = bucket_newest(self._remote, self._tag_re, self.tag_format, self._remote_config)
            except NotAStoreError:
                pass
            except BackendError as exc:
                found[0] = -2
                self._bucket_error = exc
        if on:
            dist.broadcast(found, src=0)
        if found[0] == -2 and self._bucket_error is None:
            self._bucket_error = "as rank 0 found"
        return int(found[0])

    def _restored(self, state: dict, where: str) -> int:
        for name in self.components:
            self.objects[name] = state[name]
        self.steps = state["checkpointer"]["step"]
        self.resumed_from = where
        return self.steps

    def resume(self, ref: str | None = None, *, step: int | None = None) -> int | None:
        """Restore every selected object in place from ``ref`` (default: the latest tag), or
        from the step tag of ``step`` (``resume(step=4000)`` is ``resume("step-4000")``, with
        this run's ``tag_format``). An explicit ``ref`` or ``step`` older than the latest,
        followed by a commit, is an explicit rewind: that commit moves the latest tag back
        (docs/training.md, "Never backwards"); nothing else does.

        Returns the restored step count, or ``None`` when there is no latest tag
        yet (a fresh run). Plain values in ``objects`` (ints, dicts of numbers)
        are replaced in the ``objects`` dict.

        Without ``ref`` the run's latest commit must be this run's: for the default run,
        one made by the same script (``"script"`` in its metadata: the main module's name,
        e.g. ``train`` for ``python train.py`` or ``python -m train``; commits from before
        runs existed have none and pass), and for every run one whose components fit
        ``objects``. An explicit ``ref`` (``resume("latest")``) skips the script check.

        Raises:
            RefNotFoundError: an explicit ``ref`` that does not exist.
            TargetMismatchError: the latest commit was made by another script, or its
                state does not fit ``objects`` (the message names the run and how to
                start a separate one); nothing was restored.
            IntegrityError, ...: as :meth:`Store.checkout`.
            InvalidArgumentError: both ``ref`` and ``step``, ``step`` not an int >= 0, or ``step`` without a ``tag_format``.
        """
        if step is not None:
            if ref is not None or type(step) is not int or step < 0 or self.tag_format is None:
                raise InvalidArgumentError(f"resume(step=...) takes an int >= 0 instead of a ref, with a tag_format; got ref={ref!r}, step={step!r}")
            ref = self.tag_format.format(step=step)
        if self._layout is not None:
            return self._resume_tiers(ref)
        if self.dcp:
            return self._resume_dcp(ref)
        try:
            tags = self.store.tags()
        except NotAStoreError as exc:
            raise NotAStoreError(f"{exc}. Resuming reads only: for a new run, open the store with Store(path, create=True)") from None
        self._hold(create=False)
        implicit = ref is None
        if implicit:
            if self.latest_tag not in tags:
                return None
            ref = self.latest_tag
        record = self.store.record(ref)
        where = f"{describe(self.run)} of {self.store.location}: {ref!r} (commit {record.id[:12]}, step {record.metadata.get('step')})"
        separate = ("To start a separate experiment in this store, give it its own run: Checkpointer(..., run='<name>'); "
                    "to continue this run on purpose, resume(ref=...) explicitly")
        made_by, script = record.metadata.get("script"), _script()
        if implicit and self.run is None and made_by is not None and script is not None and made_by != script:
            raise TargetMismatchError(f"{where} was made by script {made_by!r}, this is {script!r}. {separate}")
        if not any(leaf.path == "checkpointer/step" for leaf in record.leaves):
            held = sorted({leaf.path.split("/")[0] for leaf in record.leaves})
            raise TargetMismatchError(
                f"{ref!r} (commit {record.id[:12]}) was not made by a Checkpointer: it holds "
                f"{', '.join(held) or 'nothing'}, not the 'checkpointer' step counter. "
                f"Another commit moved the tag {ref!r}; give this Checkpointer its own latest_tag=..., or "
                f"resume(ref=...) from one of its step tags"
            )
        held = {path.split("/")[0] for path in [*record.components, *(leaf.path for leaf in record.leaves)] if path} - {"checkpointer"}
        if held != set(self.components) if implicit else not held >= set(self.components):
            raise TargetMismatchError(
                f"{where} holds components {sorted(held)}, these objects are {sorted(self.components)}"
                + (f". {separate}" if implicit else "; resume only those it holds: Checkpointer(..., components=[...])")
            )
        target = {name: self.objects[name] for name in self.components}
        target["checkpointer"] = {}
        try:
            self.store.checkout(ref, into=target)
        except TargetMismatchError as exc:
            if not implicit:
                raise
            raise type(exc)(f"{where} does not fit these objects: {exc}. {separate}") from None
        for name in self.components:
            self.objects[name] = target[name]
        self.steps = target["checkpointer"]["step"]
        if implicit and self.run is None:
            warnings.warn(
                f"resumed {where}" + (f", made by script {made_by!r}" if made_by else "")
                + ": another experiment in this store (another seed, say) needs its own Checkpointer(..., run='<name>')",
                DefaultRunResumedWarning, stacklevel=2,
            )
        return self.steps


class _DCPStore:
    """The store of a Checkpointer in DCP mode: a location (folder or ``s3://`` URL) opened
    (for reads, and for pruning on the coordinator) only when needed, so ranks that only
    save never open the catalog or a cache; or a Store the caller opened."""

    def __init__(self, store: Store | str | os.PathLike):
        self.path = store  # what StoreWriter takes: every rank writes its packs there
        self._store: Store | None = store if isinstance(store, Store) else None
        self.location = store.location if isinstance(store, Store) else os.fspath(store)

    def opened(self, must_exist: bool = True) -> Store | None:
        if self._store is None:
            try:
                self._store = Store(self.path, create=False)
            except NotAStoreError:
                if must_exist:
                    raise
                return None
        return self._store


def _push_latest(root, remote, tag: str, attempts: int, backoff: float) -> Pusher:
    """The :class:`~ckptstore.pusher.Pusher` of ``push_to``: each job pushes ``tag`` of the
    store at ``root`` to ``remote``, with its own Store (the catalog connection is not shared
    across threads)."""
    held: list[Store] = []

    def job(step, item):
        if not held:
            held.append(Store(root))
        return held[0].push(str(remote), tag)

    return Pusher(str(remote), job, attempts, backoff, label=lambda step: repr(tag))


def _script() -> str | None:
    """The running script's name: ``train`` for ``python train.py``, ``python -m train`` or
    ``python -m pkg.train`` (the last part); ``None`` for ``python -c`` and interactive sessions."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:
        parts = spec.name.split(".")
        return parts[-2] if parts[-1] == "__main__" and len(parts) > 1 else parts[-1]
    path = getattr(main, "__file__", None)
    return os.path.splitext(os.path.basename(path))[0] if path else None


class _SignalHandler:
    """The handler a Checkpointer installs for one of its ``on_signal`` signals, borrowed
    from the handler it found (``previous``: what ``signal.getsignal`` returned).

    On the signal it first requests its Checkpointer's stop (the next :meth:`Checkpointer.step`
    commits and exits with status 0), then chains: a callable ``previous`` (a handler of the
    user's or of the scheduler's library, another Checkpointer's, ``signal.default_int_handler``)
    is called with the same arguments, and what it raises propagates; ``SIG_DFL``, ``SIG_IGN``
    or ``None`` are not called (the Checkpointer's commit-and-exit stands for the default action).

    Once its Checkpointer is closed or collected, or in a forked child of its process, the
    handler only passes the signal on: to a callable ``previous``; for ``SIG_DFL``, the
    default action (``SIG_DFL`` is put back and the signal sent again: SIGTERM terminates
    the process); nothing for ``SIG_IGN``. :func:`_restore_signals` puts ``previous`` back
    when its Checkpointer closes, if this handler is still the one installed."""

    def __init__(self, ckpt: Checkpointer, signum: int, previous: Any):
        self._ckpt = weakref.ref(ckpt)  # (no strong reference: a dropped Checkpointer is collected)
        self.signum, self.previous = signum, previous
        self.pid = os.getpid()
        self.active = True

    def __call__(self, signum: int, frame: Any) -> None:
        ckpt = self._ckpt() if self.active and os.getpid() == self.pid else None
        if ckpt is not None:
            ckpt._request_stop(signum, frame)
        if callable(self.previous):
            self.previous(signum, frame)
        elif ckpt is None and self.previous == signal.SIG_DFL:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)


def _restore_signals(handlers: list[_SignalHandler]) -> None:
    """Retire a Checkpointer's handlers, newest first, and put back, for each signal whose
    installed handler is still its own, the newest handler below it that is not a retired
    Checkpointer's (so Checkpointers closed in any order leave the handler found by the
    first). A handler installed over it by someone else stays (it may chain to this one,
    which then only passes signals on). In another thread than the main one (a garbage
    collection there) nothing can be installed: the retired handlers pass signals on."""
    for handler in reversed(handlers):
        handler.active = False
        if os.getpid() != handler.pid or not _in_main_thread():
            continue
        try:
            if signal.getsignal(handler.signum) is not handler:
                continue
            previous = handler.previous
            while isinstance(previous, _SignalHandler) and not previous.active:
                previous = previous.previous
            if previous is not None:  # (None: a handler not installed from Python, which cannot be put back)
                signal.signal(handler.signum, previous)
        except (ValueError, OSError):  # (the interpreter is finalizing)
            pass


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()
