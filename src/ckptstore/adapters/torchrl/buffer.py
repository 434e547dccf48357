"""The replay buffer as a whole: :class:`ReplayBufferAdapter` (a container of its storage,
writer, sampler, generator and transform, and the rules of restoring only some of them),
and the refusal of every TorchRL storage, sampler or writer without an adapter.

Registered by :mod:`ckptstore.adapters.torchrl`, in its order."""

from __future__ import annotations

from typing import Any

import torch
from torchrl.data.replay_buffers import (
    PrioritizedSampler,
    ReplayBuffer,
    RoundRobinWriter,
    Sampler,
    SamplerEnsemble,
    Storage,
    StorageEnsemble,
    StoreStorage,
    Writer,
    WriterEnsemble,
)

from ...core.errors import TargetMismatchError, UnsupportedTypeError
from ..base import REGISTRY, Adapter, ComponentState, join
from .storages import ListStorageAdapter


class ReplayBufferAdapter(Adapter):
    """Any TorchRL ``ReplayBuffer`` (``TensorDict*`` and prioritized variants).

    Children: ``storage``, ``writer``, ``sampler``; ``generator`` when the buffer
    was built with its own ``torch.Generator``; ``transform`` when its transforms
    hold state (``ObservationNorm``, ``VecNorm`` statistics...).
    """

    name = "torchrl.replay_buffer"
    types = (ReplayBuffer,)

    def check_partial(self, obj: ReplayBuffer, restored: list[str], skipped: dict[str, ComponentState]) -> None:
        """The rules of a partial restore (docs/adapters.md):

        - a writer or sampler restored without the storage needs the target's
          storage to hold as many rows as the committed one did, with the same
          capacity (their cursors, priorities and permutations index those rows);
        - a storage restored without its writer or sampler resets them as if the
          restored rows had just been written, in order, into an emptied buffer:
          supported for round-robin writers without generation tracking and for
          every sampler over a one-dimensional storage.
        """
        parent = skipped[next(iter(skipped))].path.rpartition("/")[0]
        where, storage_path = parent or "<root>", join(parent, "storage")
        dependent = [n for n in ("writer", "sampler") if n in restored]
        if "storage" in skipped and dependent:
            state = skipped["storage"]
            rows = len(state.json("kinds")) if state.adapter == ListStorageAdapter.name else state.json("len")
            capacity = state.json("max_size")
            if rows != len(obj._storage) or capacity != obj._storage.max_size:
                raise TargetMismatchError(
                    f"{where}: restoring the {' and '.join(dependent)} without the storage needs the target's storage to hold "
                    f"the {rows} rows the commit's did, with its capacity {capacity}; it holds {len(obj._storage)} of "
                    f"{obj._storage.max_size}: check out {storage_path} as well"
                )
        if "storage" in skipped and "writer" in restored and not isinstance(obj._writer, RoundRobinWriter):
            raise TargetMismatchError(  # its state ranks the committed rows' values, not the target's
                f"{where}: a {type(obj._writer).__name__} restored without its storage would rank rows it does not hold: "
                f"check out {storage_path} with it"
            )
        if "storage" in restored:
            writer = obj._writer
            if "writer" in skipped and not (isinstance(writer, RoundRobinWriter) and not getattr(writer, "_track_generations", False)):
                raise TargetMismatchError(
                    f"{where}: a {type(writer).__name__} cannot be rebuilt from restored rows: check out {join(parent, 'writer')} with the storage"
                )
            if "sampler" in skipped and getattr(obj._storage, "ndim", 1) != 1:
                raise TargetMismatchError(f"{where}: check out {join(parent, 'sampler')} with a storage of ndim {obj._storage.ndim}")

    def after_partial(self, obj: ReplayBuffer, restored: list[str], skipped: list[str]) -> None:
        if "storage" not in restored:
            return
        rows = len(obj._storage)
        if "writer" in skipped:
            obj._writer._cursor = rows % obj._storage.max_size
            obj._writer._write_count = rows
        if "sampler" in skipped:
            sampler = obj._sampler
            sampler._empty()  # what ReplayBuffer.empty() does
            if isinstance(sampler, PrioritizedSampler) and rows:
                sampler.mark_update(torch.arange(rows), storage=obj._storage)  # what extend() does: the default priority

    def children(self, obj: ReplayBuffer) -> dict:
        kids = {"storage": obj._storage, "writer": obj._writer, "sampler": obj._sampler}
        rng = getattr(obj, "_rng", None)
        if rng is not None:
            kids["generator"] = rng
        transform = getattr(obj, "_transform", None)
        if transform is not None and len(transform.state_dict()):
            kids["transform"] = transform
        return kids


#: Why the TorchRL storages, samplers and writers ckptstore refuses cannot be stored.
REFUSED = {
    StorageEnsemble: "an ensemble of storages; commit each storage (or each buffer of a ReplayBufferEnsemble) on its own",
    StoreStorage: "its items live in an external key-value server (Redis), which a commit cannot copy or restore",
    SamplerEnsemble: "an ensemble of samplers; commit each buffer of the ensemble on its own",
    WriterEnsemble: "an ensemble of writers; commit each buffer of the ensemble on its own",
}


class UnsupportedPartAdapter(Adapter):
    """Every TorchRL storage, sampler or writer without an adapter of its own: refused at
    commit and checkout, naming the class, why, and the classes that are supported."""

    name = "torchrl.unsupported"
    types = (Storage, Sampler, Writer)

    def refusal(self, obj: Any, where: str) -> UnsupportedTypeError:
        kind = next(k for k in (Storage, Sampler, Writer) if isinstance(obj, k))
        supported = sorted({t.__name__ for t, a in REGISTRY.by_type.items()
                            if issubclass(t, kind) and t is not kind and not isinstance(a, UnsupportedPartAdapter)})
        default = "the base class, with no state of its own" if type(obj) is kind else "ckptstore has no adapter for this class"
        reason = next((r for t, r in REFUSED.items() if isinstance(obj, t)), default)
        return UnsupportedTypeError(
            f"{where or '<root>'}: a {type(obj).__module__}.{type(obj).__qualname__} (a TorchRL {kind.__name__.lower()}) "
            f"cannot be stored: {reason}. Supported {kind.__name__.lower()}s (and their subclasses): {', '.join(supported)} "
            "(docs/adapters.md); register an adapter for others with ckptstore.register_adapter"
        )

    def to_state(self, obj: Any) -> Any:
        raise self.refusal(obj, "")
