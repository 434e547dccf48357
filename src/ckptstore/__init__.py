"""ckptstore: a content-addressed, versioned checkpoint store for PyTorch and TorchRL.

>>> import ckptstore
>>> store = ckptstore.Store("runs/store")
>>> info = store.commit({"rb": rb, "policy": policy, "rng": ckptstore.RNGState()}, tag="latest")
>>> store.checkout("latest", into={"policy": policy2}, partial=["policy"])

See docs/quickstart.md and docs/concepts.md.
"""

from . import errors
from .adapters import Adapter, ComponentState, Json, RNGState, register_adapter
from .adapters.torch_nn import NamedOptimizer
from .checkpointer import Checkpointer, Progress
from .store import CommitInfo, IOStats, Store

__version__ = "0.1.0"

__all__ = ["Adapter", "Checkpointer", "CommitInfo", "ComponentState", "IOStats", "Json", "NamedOptimizer", "Progress", "RNGState", "Store", "__version__", "errors", "register_adapter"]
