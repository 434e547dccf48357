"""A training-loop checkpointer: commit on a schedule, resume exactly.

>>> ckpt = ckptstore.Checkpointer(store, {"rb": rb, "policy": policy, "optim": optim,
...                                       "rng": ckptstore.RNGState()}, every_n_steps=1000)
>>> start = ckpt.resume() or 0          # restores everything from "latest", if it exists
>>> for step in range(start, total):
...     train_one_step()
...     ckpt.step()                       # commits "step-<n>" and rewrites "latest" every 1000 steps

A run killed at any instant and restarted with the same code continues from the
last commit bit-identically: the replay buffer, parameters, optimizer moments
and every RNG stream are restored in place.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from .adapters.base import Adapter, ComponentState, register_adapter
from .errors import InvalidArgumentError, TargetMismatchError
from .store import CommitInfo, Store


@dataclass
class Progress:
    """Training counters: optimisation ``step``, environment ``frames``, ``epoch``
    and the ``best_metric`` so far (None until one is known)."""

    step: int = 0
    frames: int = 0
    epoch: int = 0
    best_metric: float | None = None


@register_adapter
class ProgressAdapter(Adapter):
    """:class:`Progress`: one JSON leaf per field."""

    name = "ckptstore.progress"
    types = (Progress,)

    def to_state(self, obj: Progress) -> dict:
        return asdict(obj)

    def check(self, obj: Any, state: ComponentState) -> None:
        if not isinstance(obj, Progress):
            raise TargetMismatchError(f"{state.where('')}: stored a Progress, target is {type(obj).__name__}")

    def from_state(self, obj: Progress, state: ComponentState) -> Progress:
        for key, value in state.tree().items():
            setattr(obj, key, value)
        return obj


class Checkpointer:
    """Commits ``objects`` every ``every_n_steps`` calls of :meth:`step`.

    Args:
        store: the store to commit to.
        objects: ``{name: object}``; each becomes component ``<name>`` (a replay
            buffer ``rb`` gives ``rb/storage``, ``rb/writer``, ``rb/sampler``).
        every_n_steps: commit when the step count crosses a multiple of this.
        tag_format: tag for each scheduled commit, formatted with ``step``
            (``None``: only ``latest_tag`` moves).
        latest_tag: rewritten atomically by every commit.
        components: names of ``objects`` to commit (default: all).

    The step count itself is committed as component ``checkpointer``.

    Raises:
        InvalidArgumentError: ``objects`` not a non-empty dict with str keys,
            ``every_n_steps`` < 1, unknown component names, or a name ``checkpointer``.
    """

    def __init__(
        self,
        store: Store,
        objects: dict[str, Any],
        *,
        every_n_steps: int = 1000,
        tag_format: str | None = "step-{step}",
        latest_tag: str = "latest",
        components: Iterable[str] | None = None,
    ):
        if type(objects) is not dict or not objects or not all(type(k) is str for k in objects):
            raise InvalidArgumentError(f"objects must be a non-empty dict of name -> object, got {type(objects).__name__}")
        if type(every_n_steps) is not int or every_n_steps < 1:
            raise InvalidArgumentError(f"every_n_steps must be an int >= 1, got {every_n_steps!r}")
        names = list(objects) if components is None else list(components)
        unknown = [n for n in names if n not in objects]
        if unknown or "checkpointer" in objects:
            raise InvalidArgumentError(f"components {unknown} are not in objects, or an object is named 'checkpointer'")
        self.store = store
        self.objects = objects
        self.every = every_n_steps
        self.tag_format = tag_format
        self.latest_tag = latest_tag
        self.components = names
        self.steps = 0

    def step(self, n: int = 1, metadata: dict | None = None) -> CommitInfo | None:
        """Count ``n`` steps; commit if a multiple of ``every_n_steps`` was crossed."""
        before = self.steps
        self.steps += n
        if self.steps // self.every > before // self.every:
            return self.commit(metadata)
        return None

    def commit(self, metadata: dict | None = None) -> CommitInfo:
        """Commit now: the selected objects and the step count; moves the tags."""
        state = {name: self.objects[name] for name in self.components}
        state["checkpointer"] = {"step": self.steps}
        tags = ([self.tag_format.format(step=self.steps)] if self.tag_format else []) + [self.latest_tag]
        return self.store.commit(state, tag=tags, message=f"step {self.steps}", metadata={"step": self.steps, **(metadata or {})})

    def resume(self, ref: str | None = None) -> int | None:
        """Restore every selected object in place from ``ref`` (default: the latest tag).

        Returns the restored step count, or ``None`` when there is no latest tag
        yet (a fresh run). Plain values in ``objects`` (ints, dicts of numbers)
        are replaced in the ``objects`` dict.

        Raises:
            RefNotFoundError: an explicit ``ref`` that does not exist.
            TargetMismatchError, IntegrityError, ...: as :meth:`Store.checkout`.
        """
        if ref is None:
            if self.latest_tag not in self.store.tags():
                return None
            ref = self.latest_tag
        target = {name: self.objects[name] for name in self.components}
        target["checkpointer"] = {}
        self.store.checkout(ref, into=target)
        for name in self.components:
            self.objects[name] = target[name]
        self.steps = target["checkpointer"]["step"]
        return self.steps
