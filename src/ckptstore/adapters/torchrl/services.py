"""Adapters for TorchRL's training services: target-network updaters, collectors and
``torchrl.checkpoint.GlobalRNGState``.

Registered by :mod:`ckptstore.adapters.torchrl`, in its order."""

from __future__ import annotations

from typing import Any

from torchrl.checkpoint import GlobalRNGState
from torchrl.collectors import BaseCollector
from torchrl.objectives.utils import TargetNetUpdater

from ...core.errors import TargetMismatchError
from ..base import Adapter, ComponentState, StateDictAdapter
from ..rng import RNGState, RNGStateAdapter
from .checks import expect_instance


class TargetUpdaterAdapter(Adapter):
    """``SoftUpdate`` / ``HardUpdate``: ``initialized``, and ``HardUpdate``'s step
    ``counter``. The target parameters themselves belong to the loss module:
    commit it too (its ``state_dict`` holds ``target_*_params``)."""

    name = "torchrl.target_updater"
    types = (TargetNetUpdater,)

    def to_state(self, obj: TargetNetUpdater) -> dict:
        return {"initialized": bool(obj.initialized), "counter": getattr(obj, "counter", None)}

    def check(self, obj: Any, state: ComponentState) -> None:
        expect_instance(obj, TargetNetUpdater, state)
        if (state.json("counter") is None) != (getattr(obj, "counter", None) is None):
            raise TargetMismatchError(f"{state.where('')}: stored a {state.meta.get('class')}, target is a {type(obj).__qualname__}")

    def from_state(self, obj: TargetNetUpdater, state: ComponentState) -> TargetNetUpdater:
        obj.initialized = state.json("initialized")
        if state.json("counter") is not None:
            obj.counter = state.json("counter")
        return obj


class CollectorAdapter(StateDictAdapter):
    """A TorchRL collector's ``state_dict()``: frame and iteration counters, the
    policy weights it holds, its environment transforms' state, trajectory ids."""

    name = "torchrl.collector"
    types = (BaseCollector,)


class GlobalRNGStateAdapter(RNGStateAdapter):
    """``torchrl.checkpoint.GlobalRNGState``: the same state as :class:`~ckptstore.RNGState`."""

    name = "torchrl.global_rng"
    types = (GlobalRNGState,)

    def check(self, obj: Any, state: ComponentState) -> None:
        super().check(RNGState(), state)
        expect_instance(obj, GlobalRNGState, state)
