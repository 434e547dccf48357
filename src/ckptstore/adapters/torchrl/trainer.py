"""The adapter of a TorchRL ``Trainer``: its progress, its collector's state and, for a
gym(nasium) environment, the environment's step in progress (wrapper attributes,
numpy arrays and generator states).

Registered by :mod:`ckptstore.adapters.torchrl`, in its order."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict
from torchrl.trainers import Trainer

from ...core.errors import TargetMismatchError
from ..base import Adapter, ComponentState, plain, same_class


def _gym_layers(env: Any) -> list:
    """The gym(nasium) environment a TorchRL ``GymEnv`` wraps (under any ``TransformedEnv``):
    its wrapper chain, outermost first (``TimeLimit``, ..., ``CartPoleEnv``); empty for
    other environments (batched, DMControl, custom ``EnvBase``)."""
    layer = getattr(getattr(env, "base_env", env), "_env", None)
    layers = []
    while layer is not None and hasattr(layer, "unwrapped") and len(layers) < 64:
        layers.append(layer)
        layer = None if layer is layer.unwrapped else getattr(layer, "env", None)
    return layers


def _class_name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


_BIT_GENERATORS = ("MT19937", "PCG64", "PCG64DXSM", "Philox", "SFC64")  # numpy's; a stored name is one of them


def _is_json_number(v: Any) -> bool:
    return type(v) is bool or (type(v) is int and -(1 << 63) <= v < 1 << 63) or (type(v) is float and np.isfinite(v))


def _gym_state(layers: list) -> dict[str, dict]:
    """Per wrapper layer (``"0"`` outermost): its class, its plain attributes (``values``: numbers, strings,
    None; ``arrays``: numeric numpy arrays as tensors) and its numpy generators' states
    (``generators``: JSON text). Anything else a layer holds (a physics engine's objects,
    a renderer) is not stored."""
    out = {}
    for i, layer in enumerate(layers):
        values, arrays, generators = {}, {}, {}
        for key, v in vars(layer).items():
            if isinstance(v, np.generic):
                v = v.item()
            if v is None or type(v) is str or _is_json_number(v):
                values[key] = v
            elif isinstance(v, np.ndarray) and v.dtype.kind in "biuf" and v.ndim <= 8:
                arrays[key] = torch.from_numpy(np.ascontiguousarray(v).copy())
            elif isinstance(v, np.random.Generator):
                generators[key] = json.dumps(v.bit_generator.state)
        out[str(i)] = {"class": _class_name(layer), "values": values, "arrays": arrays, "generators": generators}
    return out


def _check_gym_state(layers: list, state: ComponentState) -> None:
    """Raise TargetMismatchError unless the stored ``env`` fits the target's wrapper layers
    (the same classes, known numpy bit generators)."""
    stored = [state.json(f"env/{i}/class") for i in range(sum(k.endswith("/class") for k in state.keys("env")))]
    if stored != [_class_name(x) for x in layers]:
        raise TargetMismatchError(f"{state.where('env')}: stored an environment {stored}, target is {[_class_name(x) for x in layers]}")
    for key in state.keys("env"):
        if "/generators/" in key:
            text = state.json(key)
            name = json.loads(text).get("bit_generator") if type(text) is str and text.startswith("{") else None
            if name not in _BIT_GENERATORS:
                raise TargetMismatchError(f"{state.where(key)}: not a numpy generator state")


def _set_gym_state(layers: list, stored: dict[str, dict]) -> None:
    """Write :func:`_gym_state`'s output (checked by :func:`_check_gym_state`) back into the target's wrapper layers."""
    for i, layer in enumerate(layers):
        state = stored[str(i)]
        for key, value in state.get("values", {}).items():
            setattr(layer, key, value)
        for key, value in state.get("arrays", {}).items():
            setattr(layer, key, value.numpy().copy())
        for key, text in state.get("generators", {}).items():
            generator_state = json.loads(text)
            generator = getattr(layer, key, None)
            if not isinstance(generator, np.random.Generator) or type(generator.bit_generator).__name__ != generator_state["bit_generator"]:
                generator = np.random.Generator(getattr(np.random, generator_state["bit_generator"])())
            generator.bit_generator.state = generator_state
            setattr(layer, key, generator)


class TrainerAdapter(Adapter):
    """A TorchRL ``Trainer``'s progress: ``state`` (collected frames, optimisation
    steps, last log and save) and its collector's ``state_dict()`` (frames and
    iterations so far, the collector's policy weights, its environment transforms'
    state such as ``ObservationNorm``'s or ``VecNorm``'s statistics), so that
    ``trainer.train()`` continues where it stopped. Also, for a single-process
    collector, the environment's step in progress: ``carrier`` (the collector's
    pending TensorDict, the next observation, as tensors; ``carrier_batch_size``)
    and, for a gym(nasium) environment, ``env``: per wrapper layer its plain
    attributes, numpy arrays (CartPole's ``state``, ``TimeLimit``'s elapsed steps)
    and numpy generator states (the reset RNG). The loss module and optimizer are
    components of their own (commit them beside the trainer); docs/training.md says
    where a resume is bit-identical and where not."""

    name = "torchrl.trainer"
    types = (Trainer,)

    def to_state(self, obj: Trainer) -> dict:
        sd = obj.state_dict()
        state = plain({"state": sd["state"], "collector": sd["collector"]})
        carrier = getattr(obj.collector, "_carrier", None)
        if isinstance(carrier, TensorDict):
            state["carrier"] = carrier.to_dict()
            state["carrier_batch_size"] = list(carrier.batch_size)
            state["env"] = _gym_state(_gym_layers(obj.collector.env))
        return state

    def check(self, obj: Any, state: ComponentState) -> None:
        same_class(obj, state)
        if state.has("carrier_batch_size") and hasattr(obj.collector, "_carrier"):
            _check_gym_state(_gym_layers(obj.collector.env), state)

    def from_state(self, obj: Trainer, state: ComponentState) -> Trainer:
        tree = state.tree()
        obj.collector.load_state_dict(tree["collector"])
        for key, value in tree["state"].items():
            setattr(obj, key, value)
        if "carrier" in tree and hasattr(obj.collector, "_carrier"):
            obj.collector._carrier = TensorDict(tree["carrier"], batch_size=tree["carrier_batch_size"])
            _set_gym_state(_gym_layers(obj.collector.env), tree.get("env") or {})
        return obj
