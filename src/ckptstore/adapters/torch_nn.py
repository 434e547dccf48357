"""Adapters for PyTorch training objects: modules, optimizers, schedulers, GradScaler."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ..core.errors import ShapeMismatchError, TargetMismatchError, UnsupportedTypeError
from .base import Adapter, ComponentState, Scope, StateDictAdapter, register_adapter, same_class


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
    tensors shaped like their parameter (``params``: stored key -> target parameter):
    checked before loading, since ``load_state_dict`` accepts a misfit that only
    fails at the next ``step()``."""
    where = state.where("")
    if stored_class and not stored_class.endswith(".Optimizer"):  # imported state may not name its class
        same_class(opt, state, stored_class)
    for i, (g, target) in enumerate(zip(groups, opt.param_groups)):
        for key, value in target.items():
            if key != "params" and type(value) in (int, float) and type(g.get(key)) not in (int, float):
                raise TargetMismatchError(f"{where}: param_groups/{i}/{key} is {g.get(key)!r}, a number was expected")
    for key, rel in state.names("state").items():
        param = params.get(key)
        if param is None:
            raise TargetMismatchError(f"{state.where(rel)}: state of parameter {key!r}, which no param group lists")
        for leaf in state.names(rel).values():
            if state.has(leaf) and state.is_tensor(leaf):
                _, shape = state.spec(leaf)
                if len(shape) == param.dim() and shape != tuple(param.shape):
                    raise ShapeMismatchError(f"{state.where(leaf)}: stored {list(shape)}, the target parameter matched to {key} is {list(param.shape)}")


def _indexed(tree: Any, where: str) -> list:
    """``{"0": a, "1": b}`` -> ``[a, b]``."""
    if tree == {}:
        return []
    if not isinstance(tree, dict) or sorted(tree, key=int) != [str(i) for i in range(len(tree))]:
        raise TargetMismatchError(f"{where}: malformed indexed state")
    return [tree[str(i)] for i in range(len(tree))]


def _load(opt: torch.optim.Optimizer, per_param: dict[str, Any], groups: list[dict], params: dict[str, Any]) -> None:
    """``load_state_dict`` pairs saved ids with the target's parameters by position:
    number every parameter by its position in ``opt`` and key its state so."""
    index = {id(p): j for j, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    loaded = [{**g, "params": [index[id(p)] for p in target["params"]]} for g, target in zip(groups, opt.param_groups)]
    opt.load_state_dict({"state": {index[id(params[k])]: v for k, v in per_param.items()}, "param_groups": loaded})


@register_adapter
class OptimizerAdapter(Adapter):
    """A ``torch.optim.Optimizer``: ``state/<param>/<name>`` and
    ``param_groups/<group index>/<option>`` leaves (tensors or JSON values).

    ``<param>`` is the parameter's *name* when every parameter of the optimizer
    belongs to a module committed with it: the leaf path where that module
    stores it (``"model/0.weight"``, one escaped key: ``state/model%2F0.weight/exp_avg``;
    see :class:`~ckptstore.adapters.base.Scope`). Otherwise it is the
    parameter's position in the optimizer (torch's ``state_dict`` numbering).
    ``param_groups/<i>/params`` lists them in the group's order.

    Checkout of named state looks each name up among the parameters of the
    modules at the same paths in ``into`` (restored in the same checkout or
    not), so each parameter gets its own moments whatever order a refactored
    module declares them in. Each group must hold the same parameters (in any
    order) and every moment the shape of its parameter; otherwise
    TargetMismatchError / ShapeMismatchError naming the parameter, before the
    optimizer is touched. When ``into`` holds none of those modules, parameters
    are matched by position, as ``load_state_dict`` does.

    Version 1 state is the positional form.
    """

    name = "torch.optim.Optimizer"
    version = 2
    types = (torch.optim.Optimizer,)
    migrations = {1: lambda flat, meta: flat}
    uses_scope = True

    def to_state(self, obj: torch.optim.Optimizer, scope: Scope | None = None) -> dict:
        sd = obj.state_dict()
        params = [p for g in obj.param_groups for p in g["params"]]
        names = [scope.name(p) for p in params] if scope is not None else [None]
        if None in names:
            return {
                "state": {str(i): dict(s) for i, s in sd["state"].items()},
                "param_groups": {str(i): dict(g) for i, g in enumerate(sd["param_groups"])},
            }
        return {
            "state": {names[i]: dict(s) for i, s in sd["state"].items()},
            "param_groups": {str(i): {**g, "params": [names[j] for j in g["params"]]} for i, g in enumerate(sd["param_groups"])},
        }

    def _groups(self, state: ComponentState) -> list[dict]:
        groups = _indexed(state.tree("param_groups"), state.where("param_groups"))
        for i, g in enumerate(groups):
            keys = g.get("params") if isinstance(g, dict) else None
            if type(keys) is not list or not (all(type(k) is int for k in keys) or all(type(k) is str for k in keys)):
                raise TargetMismatchError(f"{state.where(f'param_groups/{i}/params')}: expected a list of parameter positions or names")
        return groups

    def _params(self, opt: torch.optim.Optimizer, state: ComponentState, groups: list[dict], scope: Scope | None) -> dict[str, Any]:
        """``{stored parameter key: target parameter}``, or TargetMismatchError naming what differs."""
        where = state.where("")
        if len(groups) != len(opt.param_groups):
            raise TargetMismatchError(f"{where}: the commit has {len(groups)} param groups, the target {len(opt.param_groups)}")
        keys = [k for g in groups for k in g["params"]]
        found = {k: scope.param(k) for k in keys if type(k) is str} if scope is not None else {}
        named = any(p is not None for p in found.values())
        if found and not named:
            warnings.warn(
                f"{where}: state stored by parameter name ({keys[0]}...) is matched by position: the modules that own these "
                "parameters are not in into= (put them there, restored or not, to match by name)",
                stacklevel=6,
            )
        if named and None in found.values():
            missing = [k for k, p in found.items() if p is None]
            raise TargetMismatchError(f"{where}: parameters {missing[:10]} of the commit are not parameters of the target's modules")
        out: dict[str, Any] = {}
        for i, (g, target) in enumerate(zip(groups, opt.param_groups)):
            if named:
                mine = {id(p) for p in target["params"]}
                theirs = {id(found[k]): k for k in g["params"]}
                if len(theirs) != len(g["params"]):
                    tied = [k for k in g["params"] if theirs[id(found[k])] != k]
                    raise TargetMismatchError(
                        f"{where}: parameters {tied[:10]} of the commit are one parameter in the target with another of its "
                        "parameters (tied there, not in the commit)"
                    )
                if set(theirs) != mine:
                    names = {id(p): scope.name(p) or list(p.shape) for p in target["params"]}
                    raise TargetMismatchError(
                        f"{where}: param group {i} differs: in the commit only {[theirs[x] for x in theirs if x not in mine][:10]}, "
                        f"in the target only {[names[x] for x in mine if x not in theirs][:10]}"
                    )
                out.update({k: found[k] for k in g["params"]})
            else:
                if len(g["params"]) != len(target["params"]):
                    stored = [len(x["params"]) for x in groups]
                    raise TargetMismatchError(
                        f"{where}: parameters per group differ: stored {stored}, target {[len(x['params']) for x in opt.param_groups]}"
                    )
                out.update({str(k): p for k, p in zip(g["params"], target["params"])})
        return out

    def check(self, obj: Any, state: ComponentState, scope: Scope | None = None) -> None:
        if not isinstance(obj, torch.optim.Optimizer):
            raise TargetMismatchError(f"{state.where('')}: stored an optimizer, target is {type(obj).__name__}")
        groups = self._groups(state)
        _check_optimizer(state, obj, state.meta.get("class", ""), groups, self._params(obj, state, groups, scope))

    def from_state(self, obj: torch.optim.Optimizer, state: ComponentState, scope: Scope | None = None) -> torch.optim.Optimizer:
        groups = self._groups(state)
        _load(obj, state.tree("state"), groups, self._params(obj, state, groups, scope))
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
        groups = _indexed(state.tree("param_groups"), state.where("param_groups"))
        _load(obj.optimizer, state.tree("state"), groups, dict(obj.module.named_parameters()))
        return obj
