"""Adapters for PyTorch training objects: modules, optimizers, schedulers, GradScaler."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import ShapeMismatchError, TargetMismatchError, UnsupportedTypeError
from .base import Adapter, ComponentState, StateDictAdapter, register_adapter, same_class


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
        stored = state.names()
        _same_keys("state-dict", list(stored), list(target), state.where(""))
        for key, value in target.items():
            if isinstance(value, torch.Tensor):
                leaf = stored[key]
                if not state.has(leaf) or not state.is_tensor(leaf):
                    raise ShapeMismatchError(f"{state.where(leaf)}: stored a JSON value, target holds a tensor")
                dtype, shape = state.spec(leaf)
                if (dtype, shape) != (value.dtype, tuple(value.shape)):
                    raise ShapeMismatchError(
                        f"{state.where(leaf)}: size mismatch, stored {dtype} {list(shape)}, target {value.dtype} {list(value.shape)}"
                    )

    def from_state(self, obj: torch.nn.Module, state: ComponentState) -> torch.nn.Module:
        obj.load_state_dict(state.tree(), strict=True)
        return obj


def _check_optimizer(state: ComponentState, opt: torch.optim.Optimizer, stored_class: str, groups: list[dict], params: dict[str, Any]) -> None:
    """Same optimizer class, numeric options still numbers, per-parameter state
    tensors shaped like their parameter: checked before loading, since
    ``load_state_dict`` accepts a misfit that only fails at the next ``step()``."""
    where = state.where("")
    if stored_class and not stored_class.endswith(".Optimizer"):  # imported state may not name its class
        same_class(opt, state, stored_class)
    for i, (g, target) in enumerate(zip(groups, opt.param_groups)):
        for key, value in target.items():
            if key != "params" and type(value) in (int, float) and type(g.get(key)) not in (int, float):
                raise TargetMismatchError(f"{where}: param_groups/{i}/{key} is {g.get(key)!r}, a number was expected")
    for leaf in state.keys("state"):
        parts = leaf.split("/")
        if len(parts) == 3 and parts[1] in params and state.is_tensor(leaf):
            param = params[parts[1]]
            _, shape = state.spec(leaf)
            if len(shape) == param.dim() and shape != tuple(param.shape):
                raise ShapeMismatchError(f"{state.where(leaf)}: stored {list(shape)}, its parameter is {list(param.shape)}")


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
        groups = self._groups(state)
        stored = [len(g["params"]) for g in groups]
        target = [len(g["params"]) for g in obj.param_groups]
        if stored != target:
            raise TargetMismatchError(f"{state.where('')}: parameters per group differ: stored {stored}, target {target}")
        params = [p for g in obj.param_groups for p in g["params"]]
        _check_optimizer(state, obj, state.meta.get("class", ""), groups, {str(i): p for i, p in enumerate(params)})

    def from_state(self, obj: torch.optim.Optimizer, state: ComponentState) -> torch.optim.Optimizer:
        per_param = state.tree("state")
        obj.load_state_dict({"state": {int(k): v for k, v in per_param.items()}, "param_groups": self._groups(state)})
        return obj


@register_adapter
class LRSchedulerAdapter(StateDictAdapter):
    """A learning-rate scheduler: its ``state_dict()`` (epochs, base and last
    learning rates, nested schedulers), as JSON leaves.

    Schedulers that hold code (``LambdaLR``, ``MultiplicativeLR``: their lambdas)
    are refused with UnsupportedTypeError: code is never stored or pickled.
    """

    name = "torch.optim.lr_scheduler"
    types = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)

    def to_state(self, obj: Any) -> dict:
        for fn in getattr(obj, "lr_lambdas", ()):
            if callable(fn):
                raise UnsupportedTypeError(
                    f"{type(obj).__name__} holds code ({getattr(fn, '__qualname__', type(fn).__name__)}), which ckptstore "
                    "never stores; use a scheduler defined by numbers (StepLR, CosineAnnealingLR, ...)"
                )
        return super().to_state(obj)


@register_adapter
class GradScalerAdapter(StateDictAdapter):
    """``torch.amp.GradScaler``: scale, growth and backoff factors, interval, growth tracker."""

    name = "torch.amp.GradScaler"
    types = (torch.amp.GradScaler,)

    def check(self, obj: Any, state: ComponentState) -> None:
        same_class(obj, state)
        if bool(state.tree()) != obj.is_enabled():
            raise TargetMismatchError(f"{state.where('')}: stored from an {'enabled' if state.tree() else 'disabled'} GradScaler")

    def from_state(self, obj: torch.amp.GradScaler, state: ComponentState) -> torch.amp.GradScaler:
        return super().from_state(obj, state) if obj.is_enabled() else obj


class NamedOptimizer:
    """An optimizer whose state is stored by parameter name (``module.named_parameters()``).

    ``store.commit({"optim": NamedOptimizer(optim, model)})`` keys every
    moment by the parameter's name, so checkout into an optimizer whose
    parameter list is ordered differently gives each parameter its own state.
    Tied parameters appear once, under their first name.

    Raises (at commit): UnsupportedTypeError if the optimizer holds a parameter
    the module does not name.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, module: torch.nn.Module):
        self.optimizer = optimizer
        self.module = module

    def names(self) -> dict[int, str]:
        """``{id(parameter): name}``."""
        return {id(p): n for n, p in self.module.named_parameters()}


@register_adapter
class NamedOptimizerAdapter(Adapter):
    """:class:`NamedOptimizer`: ``state/<param name>/<key>`` and
    ``param_groups/<i>/<option>`` with ``params`` as a list of names."""

    name = "torch.optim.NamedOptimizer"
    types = (NamedOptimizer,)

    @staticmethod
    def _groups(obj: NamedOptimizer) -> list[list[str]]:
        """Parameter names of each group, in the optimizer's order."""
        names = obj.names()
        out = []
        for group in obj.optimizer.param_groups:
            missing = [list(p.shape) for p in group["params"] if id(p) not in names]
            if missing:
                raise UnsupportedTypeError(f"optimizer parameters of shapes {missing} are not parameters of the given module")
            out.append([names[id(p)] for p in group["params"]])
        return out

    def to_state(self, obj: NamedOptimizer) -> dict:
        order = [n for group in self._groups(obj) for n in group]
        sd = obj.optimizer.state_dict()
        return {
            "state": {order[i]: dict(s) for i, s in sd["state"].items()},
            "param_groups": {str(i): {**g, "params": [order[j] for j in g["params"]]} for i, g in enumerate(sd["param_groups"])},
        }

    def meta(self, obj: NamedOptimizer) -> dict:
        return {**super().meta(obj), "optimizer": f"{type(obj.optimizer).__module__}.{type(obj.optimizer).__qualname__}"}

    def check(self, obj: Any, state: ComponentState) -> None:
        if not isinstance(obj, NamedOptimizer):
            raise TargetMismatchError(f"{state.where('')}: stored a NamedOptimizer, target is {type(obj).__name__}")
        groups = _indexed(state.tree("param_groups"), state.where("param_groups"))
        stored = [sorted(g["params"]) for g in groups]
        target = [sorted(g) for g in self._groups(obj)]
        if stored != target:
            raise TargetMismatchError(f"{state.where('')}: parameter names per group differ: stored {stored}, target {target}")
        _check_optimizer(state, obj.optimizer, state.meta.get("optimizer", ""), groups, dict(obj.module.named_parameters()))

    def from_state(self, obj: NamedOptimizer, state: ComponentState) -> NamedOptimizer:
        # load_state_dict pairs ids with the target's parameters by position: number them in the target's order
        order = [n for group in self._groups(obj) for n in group]
        index = {name: i for i, name in enumerate(order)}
        groups = _indexed(state.tree("param_groups"), state.where("param_groups"))
        loaded = [{**g, "params": [index[n] for n in names]} for g, names in zip(groups, self._groups(obj))]
        per_param = {index[n]: v for n, v in state.tree("state").items()}
        obj.optimizer.load_state_dict({"state": per_param, "param_groups": loaded})
        return obj
