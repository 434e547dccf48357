"""Adapters for TorchRL: replay buffers (storage, writer, sampler), target-network
updaters, collectors, trainers and ``torchrl.checkpoint.GlobalRNGState``.

A replay buffer is a container of three components, ``storage``, ``writer``
and ``sampler``, restored in that order so that the writer and sampler see
the restored storage. Checking out into a freshly built, never-written buffer
initialises its lazy storage from the stored shapes first (TorchRL issue #3056).

Read from TorchRL 0.14's sources (``torchrl/data/replay_buffers``); the state
layouts are ckptstore's own, versioned independently of TorchRL's
``state_dict``/``dumps`` formats.

One module per class family (the adapters' classes; this package registers them all, in
one fixed order, when it is imported: the registry imports it the first time a ``torchrl``
object or a stored ``torchrl.*`` component is met):

- :mod:`.storages`: tensor and list storages (:mod:`.layouts`: how a storage's data is
  read as columns; :mod:`.writelog`: which of its rows were written since a commit);
- :mod:`.writers` and :mod:`.samplers`;
- :mod:`.buffer`: the replay buffer itself, and the storages, samplers and writers refused;
- :mod:`.services`: target-network updaters, collectors, ``GlobalRNGState``;
- :mod:`.trainer`: a ``Trainer`` and its environment's step in progress.
"""

from __future__ import annotations

from ..base import register_adapter
from .buffer import REFUSED, ReplayBufferAdapter, UnsupportedPartAdapter
from .samplers import (
    ConsumingSamplerAdapter,
    PrioritizedSamplerAdapter,
    PrioritizedSliceSamplerAdapter,
    PromptGroupSamplerAdapter,
    RandomSamplerAdapter,
    SamplerWithoutReplacementAdapter,
    SliceSamplerAdapter,
    SliceSamplerWithoutReplacementAdapter,
    StalenessAwareSamplerAdapter,
    StreamingSliceSamplerAdapter,
)
from .services import CollectorAdapter, GlobalRNGStateAdapter, TargetUpdaterAdapter
from .storages import CompressedListStorageAdapter, ListStorageAdapter, TensorStorageAdapter
from .trainer import TrainerAdapter
from .writelog import WriteLog
from .writers import ImmutableDatasetWriterAdapter, MaxValueWriterAdapter, RoundRobinWriterAdapter

# The order of registration (that of the single module these came from): a type's adapter is
# found along its MRO whatever the order, but the registry's tables keep this one.
for _adapter in (
    ReplayBufferAdapter,
    TensorStorageAdapter,
    RoundRobinWriterAdapter,
    RandomSamplerAdapter,
    SamplerWithoutReplacementAdapter,
    PrioritizedSamplerAdapter,
    SliceSamplerAdapter,
    SliceSamplerWithoutReplacementAdapter,
    PrioritizedSliceSamplerAdapter,
    ListStorageAdapter,
    CompressedListStorageAdapter,
    MaxValueWriterAdapter,
    ConsumingSamplerAdapter,
    StreamingSliceSamplerAdapter,
    PromptGroupSamplerAdapter,
    StalenessAwareSamplerAdapter,
    ImmutableDatasetWriterAdapter,
    UnsupportedPartAdapter,
    TargetUpdaterAdapter,
    CollectorAdapter,
    GlobalRNGStateAdapter,
    TrainerAdapter,
):
    register_adapter(_adapter)
del _adapter

__all__ = [
    "REFUSED",
    "CollectorAdapter",
    "CompressedListStorageAdapter",
    "ConsumingSamplerAdapter",
    "GlobalRNGStateAdapter",
    "ImmutableDatasetWriterAdapter",
    "ListStorageAdapter",
    "MaxValueWriterAdapter",
    "PrioritizedSamplerAdapter",
    "PrioritizedSliceSamplerAdapter",
    "PromptGroupSamplerAdapter",
    "RandomSamplerAdapter",
    "ReplayBufferAdapter",
    "RoundRobinWriterAdapter",
    "SamplerWithoutReplacementAdapter",
    "SliceSamplerAdapter",
    "SliceSamplerWithoutReplacementAdapter",
    "StalenessAwareSamplerAdapter",
    "StreamingSliceSamplerAdapter",
    "TargetUpdaterAdapter",
    "TensorStorageAdapter",
    "TrainerAdapter",
    "UnsupportedPartAdapter",
    "WriteLog",
]
