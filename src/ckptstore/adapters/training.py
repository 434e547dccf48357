"""Training counters: :class:`Progress` and its adapter ``ckptstore.core.progress``.

It lives with the other built-in adapters (not beside the Checkpointer that uses it), so
that a store holding it can be imported, checked out, pulled or recovered by a process
that never touched ``ckptstore.Progress``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ..core.errors import TargetMismatchError
from .base import Adapter, ComponentState, register_adapter


@dataclass
class Progress:
    """Training counters: optimisation ``step``, environment ``frames``, ``epoch``
    and the ``best_metric`` so far (None until one is known; a Python or numpy
    scalar, stored without pickle and restored as the same type)."""

    step: int = 0
    frames: int = 0
    epoch: int = 0
    best_metric: float | None = None


@register_adapter
class ProgressAdapter(Adapter):
    """:class:`Progress`: one JSON leaf per field."""

    name = "ckptstore.core.progress"
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
