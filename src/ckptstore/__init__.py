"""ckptstore: a content-addressed, versioned checkpoint store for PyTorch and TorchRL.

>>> import ckptstore
>>> store = ckptstore.Store("runs/store")
>>> info = store.commit({"rb": rb, "policy": policy, "rng": ckptstore.RNGState()}, tag="latest")
>>> store.checkout("latest", into={"policy": policy2}, partial=["policy"])

See docs/quickstart.md and docs/concepts.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .core import errors

__version__ = "0.1.0"

# Imported on first use (PEP 562): the command line's catalog-only commands never import torch.
_LAZY = {
    "Adapter": "adapters", "ComponentState": "adapters", "Json": "adapters", "RNGState": "adapters", "register_adapter": "adapters",
    "NamedOptimizer": "adapters.torch_nn", "Checkpointer": "checkpointer", "Progress": "adapters.training",
    "CommitInfo": "store", "IOStats": "store", "Store": "store", "RunInfo": "run", "runs": "run",
}

if TYPE_CHECKING:
    from .adapters import Adapter, ComponentState, Json, RNGState, register_adapter
    from .adapters.torch_nn import NamedOptimizer
    from .adapters.training import Progress
    from .checkpointer import Checkpointer
    from .run import RunInfo, runs
    from .store import CommitInfo, IOStats, Store


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        try:
            return importlib.import_module(f".{name}", __name__)  # a submodule: ckptstore.objects.records, ckptstore.adapters...
        except ModuleNotFoundError:
            raise AttributeError(f"module 'ckptstore' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value

__all__ = ["Adapter", "Checkpointer", "CommitInfo", "ComponentState", "IOStats", "Json", "NamedOptimizer", "Progress", "RNGState", "RunInfo", "Store", "__version__", "errors", "register_adapter", "runs"]
