"""Adapters for ``torch.nn.Module`` and ``torch.optim.Optimizer``."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import ShapeMismatchError, TargetMismatchError
from .base import Adapter, ComponentState, register_adapter


def _same_keys(what: str, stored: list[str], target: list[str], where: str) -> None:
    missing = [k for k in target if k not in stored]
    unexpected = [k for k in stored if k not in target]
    if missing or unexpected:
        raise TargetMismatchError(
            f"{where}: {what} keys differ; missing from the commit: {missing[:10]}, not in the target: {unexpected[:10]}"
        )


@register_adapter
class ModuleAdapter(Adapter):
    """An ``nn.Module``: its ``state_dict()`` (parameters, buffers, extra state).

    Leaves are the state-dict keys (``"0.weight"``). Checkout needs the same
    keys, shapes and dtypes (no size-1 leniency: a ``[1]`` tensor does not load
    into a 0-d parameter) and checks them all before the module is touched.
    """

    name = "torch.nn.Module"
    types = (torch.nn.Module,)

    def to_state(self, obj: torch.nn.Module) -> dict:
        return dict(obj.state_dict(keep_vars=False))

    def check(self, obj: Any, state: ComponentState) -> None:
        if not isinstance(obj, torch.nn.Module):
            raise TargetMismatchError(f"{state.where('')}: stored a module, target is {type(obj).__name__}")
        target = obj.state_dict(keep_vars=False)
        _same_keys("state-dict", state.keys(), list(target), state.where(""))
        for key, value in target.items():
            if isinstance(value, torch.Tensor):
                if not state.is_tensor(key):
                    raise ShapeMismatchError(f"{state.where(key)}: stored a JSON value, target holds a tensor")
                dtype, shape = state.spec(key)
                if (dtype, shape) != (value.dtype, tuple(value.shape)):
                    raise ShapeMismatchError(
                        f"{state.where(key)}: size mismatch, stored {dtype} {list(shape)}, target {value.dtype} {list(value.shape)}"
                    )

    def from_state(self, obj: torch.nn.Module, state: ComponentState) -> torch.nn.Module:
        obj.load_state_dict({k: state.value(k) for k in state.keys()}, strict=True)
        return obj


def _indexed(tree: Any, where: str) -> list:
    """``{"0": a, "1": b}`` -> ``[a, b]``."""
    if tree == {}:
        return []
    if not isinstance(tree, dict) or sorted(tree, key=int) != [str(i) for i in range(len(tree))]:
        raise TargetMismatchError(f"{where}: malformed indexed state")
    return [tree[str(i)] for i in range(len(tree))]


@register_adapter
class OptimizerAdapter(Adapter):
    """A ``torch.optim.Optimizer``: ``state/<param index>/<name>`` and
    ``param_groups/<group index>/<option>`` leaves (tensors or JSON values).

    Checkout needs the same number of groups and parameters per group.
    """

    name = "torch.optim.Optimizer"
    types = (torch.optim.Optimizer,)

    def to_state(self, obj: torch.optim.Optimizer) -> dict:
        sd = obj.state_dict()
        return {
            "state": {str(i): dict(s) for i, s in sd["state"].items()},
            "param_groups": {str(i): dict(g) for i, g in enumerate(sd["param_groups"])},
        }

    def _groups(self, state: ComponentState) -> list[dict]:
        return _indexed(state.tree("param_groups"), state.where("param_groups"))

    def check(self, obj: Any, state: ComponentState) -> None:
        if not isinstance(obj, torch.optim.Optimizer):
            raise TargetMismatchError(f"{state.where('')}: stored an optimizer, target is {type(obj).__name__}")
        stored = [len(g["params"]) for g in self._groups(state)]
        target = [len(g["params"]) for g in obj.param_groups]
        if stored != target:
            raise TargetMismatchError(f"{state.where('')}: parameters per group differ: stored {stored}, target {target}")

    def from_state(self, obj: torch.optim.Optimizer, state: ComponentState) -> torch.optim.Optimizer:
        per_param = state.tree("state")
        obj.load_state_dict({"state": {int(k): v for k, v in per_param.items()}, "param_groups": self._groups(state)})
        return obj
