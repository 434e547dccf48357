"""Adapters for TorchRL samplers: random, without replacement, prioritized, the slice
samplers, and those whose ``state_dict()`` is their whole state (consuming, streaming
slice, prompt group, staleness aware).

Registered by :mod:`ckptstore.adapters.torchrl`, in its order."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torchrl.data.replay_buffers import (
    ConsumingSampler,
    PrioritizedSampler,
    PrioritizedSliceSampler,
    PromptGroupSampler,
    RandomSampler,
    SamplerWithoutReplacement,
    SliceSampler,
    SliceSamplerWithoutReplacement,
    StalenessAwareSampler,
    StreamingSliceSampler,
)

from ...core.errors import HyperparameterOverrideWarning, ShapeMismatchError, TargetMismatchError
from ..base import Adapter, ComponentState, StateDictAdapter, same_class
from .checks import expect_instance


def _warn_overrides(state: ComponentState, built: dict[str, Any]) -> None:
    """Warn (HyperparameterOverrideWarning) for each hyperparameter in ``built`` (leaf name:
    the target's value) that the restore replaces with a different committed value."""
    for key, value in built.items():
        stored = state.json(key)
        if stored != value:
            warnings.warn(
                f"{state.where(key)}: the restore sets {key} to the committed {stored!r}; the target was built with {value!r}",
                HyperparameterOverrideWarning, stacklevel=2,
            )


class RandomSamplerAdapter(Adapter):
    """``RandomSampler``: stateless (it draws from the storage's or torch's generator)."""

    name = "torchrl.sampler.random"
    types = (RandomSampler,)

    def to_state(self, obj: RandomSampler) -> dict:
        return {}

    def check(self, obj: Any, state: ComponentState) -> None:
        expect_instance(obj, RandomSampler, state)

    def from_state(self, obj: RandomSampler, state: ComponentState) -> RandomSampler:
        return obj


class SamplerWithoutReplacementAdapter(Adapter):
    """``SamplerWithoutReplacement``: the remaining permutation (``sample_list``,
    int64, or null before the first sample), ``len_storage``, ``drop_last``,
    ``shuffle``, ``ran_out`` and ``remaining_batches``."""

    name = "torchrl.sampler.without_replacement"
    types = (SamplerWithoutReplacement,)

    def to_state(self, obj: SamplerWithoutReplacement) -> dict:
        return {
            "sample_list": obj._sample_list,
            "len_storage": int(obj.len_storage),
            "drop_last": bool(obj.drop_last),
            "shuffle": bool(obj.shuffle),
            "ran_out": bool(obj._ran_out),
            "remaining_batches": getattr(obj, "_remaining_batches", None),
        }

    def check(self, obj: Any, state: ComponentState) -> None:
        expect_instance(obj, SamplerWithoutReplacement, state)
        length = state.json("len_storage")
        if type(length) is not int or length < 0 or any(type(state.json(k)) is not bool for k in ("drop_last", "shuffle", "ran_out")):
            raise TargetMismatchError(f"{state.where('')}: invalid sampler state")
        if state.is_tensor("sample_list"):
            dtype, shape = state.spec("sample_list")
            values = state.tensor("sample_list")
            if dtype != torch.int64 or len(shape) != 1 or (values.numel() and (int(values.min()) < 0 or int(values.max()) >= length)):
                raise TargetMismatchError(f"{state.where('sample_list')}: indices must be int64 within [0, {length})")

    def from_state(self, obj: SamplerWithoutReplacement, state: ComponentState) -> SamplerWithoutReplacement:
        _warn_overrides(state, {"drop_last": bool(obj.drop_last), "shuffle": bool(obj.shuffle)})
        obj._sample_list = state.tensor("sample_list").clone() if state.is_tensor("sample_list") else None
        obj.len_storage = state.json("len_storage")
        obj.drop_last = state.json("drop_last")
        obj.shuffle = state.json("shuffle")
        obj._ran_out = state.json("ran_out")
        remaining = state.json("remaining_batches")
        if remaining is not None:
            obj._remaining_batches = remaining
        return obj


def _sampler_v1_to_v2(flat: dict, meta: dict) -> dict:
    """Version 1 stored the max priority transformed, ``(p + eps) ** alpha``;
    version 2 stores it raw (as TorchRL does since PR #4014)."""
    value = flat.get("max_priority/value")
    alpha, eps = flat["alpha"], flat["eps"]
    if value is not None and alpha != 0:
        if isinstance(value, torch.Tensor):
            flat["max_priority/value"] = (value.double() ** (1.0 / alpha) - eps).clamp_min(0).to(value.dtype)
        else:
            flat["max_priority/value"] = max(0.0, float(value) ** (1.0 / alpha) - eps)
    return flat


class PrioritizedSamplerAdapter(Adapter):
    """``PrioritizedSampler`` (Schaul et al. 2015, https://arxiv.org/abs/1511.05952).

    Leaves: ``alpha``, ``beta``, ``eps``, ``max_capacity``, ``dtype`` (JSON);
    ``sum_tree`` and ``min_tree``: every leaf value of the two segment trees,
    read as whole tensors (float32 or float64, ``[max_capacity]``), including
    the empty slots (0 and the dtype's max); ``max_priority/value`` and
    ``max_priority/index``: the raw max priority and its index (tensors or
    JSON, null when unset).

    Restoring rewrites every tree leaf; the internal nodes are recomputed from
    them, so sums, minima and samples are bit-identical.
    """

    name = "torchrl.sampler.prioritized"
    version = 2
    types = (PrioritizedSampler,)
    migrations = {1: _sampler_v1_to_v2}

    def to_state(self, obj: PrioritizedSampler) -> dict:
        index = torch.arange(obj._max_capacity, dtype=torch.long)
        value, at = obj._max_priority
        return {
            "alpha": float(obj._alpha), "beta": float(obj._beta), "eps": float(obj._eps),
            "max_capacity": int(obj._max_capacity), "dtype": str(obj.dtype).removeprefix("torch."),
            "sum_tree": torch.as_tensor(obj._sum_tree[index]).cpu(),
            "min_tree": torch.as_tensor(obj._min_tree[index]).cpu(),
            "max_priority": {"value": _scalar(value), "index": _scalar(at)},
        }

    def check(self, obj: Any, state: ComponentState) -> None:
        expect_instance(obj, PrioritizedSampler, state)
        for key in ("alpha", "beta", "eps"):
            value = state.json(key)
            if type(value) not in (int, float) or not value >= 0:
                raise TargetMismatchError(f"{state.where(key)}: {value!r} is not a number >= 0")
        if state.json("max_capacity") != obj._max_capacity:
            raise TargetMismatchError(
                f"{state.where('')}: capacity differs: stored {state.json('max_capacity')}, target {obj._max_capacity}"
            )
        for key in ("sum_tree", "min_tree"):
            dtype, shape = state.spec(key)
            if shape != (obj._max_capacity,) or dtype != obj.dtype:
                raise ShapeMismatchError(f"{state.where(key)}: stored {dtype} {list(shape)}, target trees are {obj.dtype} [{obj._max_capacity}]")

    def from_state(self, obj: PrioritizedSampler, state: ComponentState) -> PrioritizedSampler:
        _warn_overrides(state, {"alpha": float(obj._alpha), "beta": float(obj._beta), "eps": float(obj._eps)})
        obj._init()
        obj._alpha, obj._beta, obj._eps = state.json("alpha"), state.json("beta"), state.json("eps")
        index = torch.arange(obj._max_capacity, dtype=torch.long)
        obj._sum_tree[index] = state.tensor("sum_tree")
        obj._min_tree[index] = state.tensor("min_tree")
        value, at = state.value("max_priority/value"), state.value("max_priority/index")
        obj._max_priority = None if value is None and at is None else (value, at)
        return obj


class SliceSamplerAdapter(RandomSamplerAdapter):
    """``SliceSampler``: stateless apart from a trajectory cache, cleared on restore."""

    name = "torchrl.sampler.slice"
    types = (SliceSampler,)

    def check(self, obj: Any, state: ComponentState) -> None:
        expect_instance(obj, SliceSampler, state)

    def from_state(self, obj: SliceSampler, state: ComponentState) -> SliceSampler:
        obj.load_state_dict({})  # clears the trajectory cache
        return obj


class SliceSamplerWithoutReplacementAdapter(SamplerWithoutReplacementAdapter):
    """``SliceSamplerWithoutReplacement``: the remaining permutation of trajectory starts."""

    name = "torchrl.sampler.slice_without_replacement"
    types = (SliceSamplerWithoutReplacement,)

    def from_state(self, obj: Any, state: ComponentState) -> Any:
        super().from_state(obj, state)
        SliceSampler.load_state_dict(obj, {})
        return obj


class PrioritizedSliceSamplerAdapter(PrioritizedSamplerAdapter):
    """``PrioritizedSliceSampler``: the prioritized sampler's trees and max priority."""

    name = "torchrl.sampler.prioritized_slice"
    types = (PrioritizedSliceSampler,)

    def from_state(self, obj: Any, state: ComponentState) -> Any:
        super().from_state(obj, state)
        SliceSampler.load_state_dict(obj, {})
        return obj


def _scalar(x: Any) -> Any:
    """A max-priority field: tensors stay tensors (dtype kept), numbers stay numbers."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().clone()
    return x


class _StateDictPart(StateDictAdapter):
    """A sampler whose ``state_dict()`` (tensors and numbers) is its whole mutable state."""

    def check(self, obj: Any, state: ComponentState) -> None:
        expect_instance(obj, self.types[0], state)
        same_class(obj, state)


class ConsumingSamplerAdapter(_StateDictPart):
    """``ConsumingSampler``: its ``state_dict()``: ``max_sample_count``, the per-slot
    ``_sample_count`` (int64) and ``_live_mask`` (bool), the free list, ``_ran_out``."""

    name = "torchrl.sampler.consuming"
    types = (ConsumingSampler,)


class StreamingSliceSamplerAdapter(_StateDictPart):
    """``StreamingSliceSampler``: its ``state_dict()``: slot versions, queued and pending
    slices, the last trajectory; the target must have the same ``slice_len``."""

    name = "torchrl.sampler.streaming_slice"
    types = (StreamingSliceSampler,)

    def check(self, obj: Any, state: ComponentState) -> None:
        super().check(obj, state)
        stored = int(state.tensor("slice_len")) if state.is_tensor("slice_len") else None
        if stored != obj.slice_len:
            raise TargetMismatchError(f"{state.where('slice_len')}: stored slice_len {stored}, target {obj.slice_len}")


class PromptGroupSamplerAdapter(_StateDictPart):
    """``PromptGroupSampler``: ``position_recency`` (int64) and ``recency_clock`` (none
    before the first write); its group index is a cache, rebuilt on the next sample."""

    name = "torchrl.sampler.prompt_group"
    types = (PromptGroupSampler,)


class StalenessAwareSamplerAdapter(_StateDictPart):
    """``StalenessAwareSampler``: ``consumer_version`` and ``max_staleness``."""

    name = "torchrl.sampler.staleness_aware"
    types = (StalenessAwareSampler,)
