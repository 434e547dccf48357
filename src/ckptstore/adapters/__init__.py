"""Adapters: the built-in ones and the registration API (see :mod:`.base`).

TorchRL's adapters are imported the first time an object or a stored
component from ``torchrl`` is met, so ``import ckptstore`` does not import TorchRL.
"""

from . import rng, torch_nn, training, values  # noqa: F401  (registers the built-in adapters)
from .base import (
    REGISTRY,
    Adapter,
    ComponentState,
    Json,
    LazyTensor,
    Registry,
    StateDictAdapter,
    capture,
    flatten,
    join,
    migrate,
    register_adapter,
    unflatten,
)
from .rng import RNGState

__all__ = [
    "REGISTRY",
    "Adapter",
    "ComponentState",
    "Json",
    "LazyTensor",
    "RNGState",
    "Registry",
    "StateDictAdapter",
    "capture",
    "flatten",
    "join",
    "migrate",
    "register_adapter",
    "unflatten",
]
