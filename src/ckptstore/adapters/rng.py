"""The global random number generators: Python, numpy, torch CPU and CUDA."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from ..core.errors import TargetMismatchError
from .base import Adapter, ComponentState, register_adapter


class RNGState:
    """Stands for the process-wide random generators in ``commit`` and ``checkout``.

    Committing an ``RNGState()`` captures, without pickle:

    - ``python``: :func:`random.getstate` (version, 625 ints as int64 ``[625]``,
      cached gauss value);
    - ``numpy``: the legacy global ``np.random`` MT19937 state (key as int64
      ``[624]``, position, cached-gaussian flag and value), which TorchRL's
      ``PrioritizedSampler`` draws from on CPU;
    - ``torch``: :func:`torch.get_rng_state` (uint8 ``[5056]``);
    - ``cuda/<i>``: each CUDA device's generator state, when CUDA is initialised.

    ``checkout(ref, into=RNGState())`` (or a dict holding one) sets them all;
    a missing record raises :class:`~ckptstore.core.errors.MissingLeafError`.

    Args:
        cuda: with ``False``, CUDA generator states are neither committed nor
            restored (explicitly skipped: for a checkout on a machine without the
            GPUs the commit was made on); with ``True`` a stored CUDA state must
            find as many devices (TargetMismatchError otherwise).
    """

    def __init__(self, cuda: bool = True):
        self.cuda = cuda

    def __repr__(self) -> str:
        return "RNGState()" if self.cuda else "RNGState(cuda=False)"


@register_adapter
class RNGStateAdapter(Adapter):
    name = "rng"
    types = (RNGState,)

    def to_state(self, obj: RNGState) -> dict:
        version, internal, gauss = random.getstate()
        algo, key, pos, has_gauss, cached = np.random.get_state(legacy=True)
        state = {
            "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss_next": gauss},
            "numpy": {
                "algorithm": algo, "key": torch.from_numpy(key.astype(np.int64)),
                "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached),
            },
            "torch": torch.get_rng_state(),
        }
        if getattr(obj, "cuda", True) and torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = {str(i): s for i, s in enumerate(torch.cuda.get_rng_state_all())}
        return state

    def check(self, obj: Any, state: ComponentState) -> None:
        """Every field is range-checked here: the values go to C code that trusts them."""
        if not isinstance(obj, RNGState):
            raise TargetMismatchError(f"{state.where('')}: stored RNG state, target is {type(obj).__name__}")

        def bad(key: str, what: str) -> TargetMismatchError:
            return TargetMismatchError(f"{state.where(key)}: invalid RNG state, {what}")

        for key, dtype, shape in (("python/state", torch.int64, (625,)), ("numpy/key", torch.int64, (624,))):
            if state.spec(key) != (dtype, shape):
                raise bad(key, f"expected {dtype} {list(shape)}, stored {state.spec(key)}")
        if state.json("python/version") != 3:
            raise bad("python/version", f"version {state.json('python/version')!r} (only 3 exists)")
        words = state.tensor("python/state")
        if bool((words[:624] < 0).any() or (words[:624] >= 2**32).any()) or not 1 <= int(words[624]) <= 624:
            raise bad("python/state", "words outside [0, 2**32) or position outside [1, 624]")
        if type(state.json("python/gauss_next")) not in (float, type(None)):
            raise bad("python/gauss_next", "not a float or null")
        key = state.tensor("numpy/key")
        if bool((key < 0).any() or (key >= 2**32).any()):
            raise bad("numpy/key", "words outside [0, 2**32)")
        if state.json("numpy/algorithm") != "MT19937":
            raise bad("numpy/algorithm", f"unknown generator {state.json('numpy/algorithm')!r}")
        pos, has_gauss = state.json("numpy/pos"), state.json("numpy/has_gauss")
        if type(pos) is not int or not 0 <= pos <= 624 or has_gauss not in (0, 1) or type(state.json("numpy/cached_gaussian")) is not float:
            raise bad("numpy", f"position {pos!r} outside [0, 624], or bad cached-gaussian fields")
        if state.spec("torch") != (torch.uint8, tuple(torch.get_rng_state().shape)):
            raise bad("torch", f"expected uint8 {list(torch.get_rng_state().shape)}, stored {state.spec('torch')}")
        cuda = state.keys("cuda") if getattr(obj, "cuda", True) else []
        if cuda:
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if len(cuda) != count:
                raise TargetMismatchError(f"{state.where('cuda')}: stored {len(cuda)} CUDA generator states, this process has {count} devices")

    def from_state(self, obj: RNGState, state: ComponentState) -> RNGState:
        internal = tuple(int(x) for x in state.tensor("python/state").tolist())
        random.setstate((state.json("python/version"), internal, state.json("python/gauss_next")))
        np.random.set_state((
            "MT19937", state.tensor("numpy/key").numpy().astype(np.uint32), state.json("numpy/pos"),
            state.json("numpy/has_gauss"), state.json("numpy/cached_gaussian"),
        ))
        torch.set_rng_state(state.tensor("torch"))
        for key in state.keys("cuda") if getattr(obj, "cuda", True) else []:
            torch.cuda.set_rng_state(state.tensor(key), int(key.split("/")[1]))
        return obj


@register_adapter
class TorchGeneratorAdapter(Adapter):
    """A dedicated ``torch.Generator``: ``state`` (uint8 tensor) and ``device``.

    Restored in place (``set_state``), so objects sharing the generator (a
    replay buffer, its sampler and storage) keep sharing it.
    """

    name = "torch.Generator"
    types = (torch.Generator,)

    def to_state(self, obj: torch.Generator) -> dict:
        return {"state": obj.get_state(), "device": str(obj.device)}

    def check(self, obj: Any, state: ComponentState) -> None:
        if not isinstance(obj, torch.Generator):
            raise TargetMismatchError(f"{state.where('')}: stored a torch.Generator, target is {type(obj).__name__}")
        if torch.device(state.json("device")).type != obj.device.type:
            raise TargetMismatchError(f"{state.where('device')}: stored a {state.json('device')} generator, target is on {obj.device}")
        if state.spec("state") != (torch.uint8, tuple(obj.get_state().shape)):
            raise TargetMismatchError(f"{state.where('state')}: expected uint8 {list(obj.get_state().shape)}, stored {state.spec('state')}")

    def from_state(self, obj: torch.Generator, state: ComponentState) -> torch.Generator:
        obj.set_state(state.tensor("state"))
        return obj


def _arrays_to_tensors(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value.copy())
    if isinstance(value, dict):
        return {k: _arrays_to_tensors(v) for k, v in value.items()}
    return value


def _tensors_to_arrays(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.numpy().copy()
    if isinstance(value, dict):
        return {k: _tensors_to_arrays(v) for k, v in value.items()}
    return value


def _int_in(x: Any, high: int) -> bool:
    return type(x) is int and 0 <= x < high


def _array(x: Any, dtype: str, n: int) -> bool:
    return isinstance(x, np.ndarray) and x.dtype == np.dtype(dtype) and x.shape == (n,)


def _valid_bitgen_state(d: Any) -> bool:
    """Schema of numpy's bit-generator state dicts; numpy itself does not range-check
    them (an MT19937 position of 10**9 reads out of bounds), so this does."""
    if not isinstance(d, dict) or not isinstance(d.get("state"), dict):
        return False
    name, st = d.get("bit_generator"), d["state"]
    counters = _int_in(d.get("has_uint32"), 2) and _int_in(d.get("uinteger"), 2**32)
    if name == "MT19937":
        legacy = "has_gauss" not in d or (d["has_gauss"] in (0, 1) and type(d.get("gauss")) is float)
        return _array(st.get("key"), "uint32", 624) and _int_in(st.get("pos"), 625) and legacy
    if name in ("PCG64", "PCG64DXSM"):
        return _int_in(st.get("state"), 2**128) and _int_in(st.get("inc"), 2**128) and counters
    if name == "SFC64":
        return _array(st.get("state"), "uint64", 4) and counters
    if name == "Philox":
        return (_array(st.get("counter"), "uint64", 4) and _array(st.get("key"), "uint64", 2)
                and _array(d.get("buffer"), "uint64", 4) and _int_in(d.get("buffer_pos"), 5) and counters)
    return False


class _NumpyBitGeneratorAdapter(Adapter):
    """Shared by numpy ``Generator`` and ``RandomState``: the bit generator's
    state dict (arbitrary-size ints as JSON ints, arrays as tensors of their dtype)."""

    def _get(self, obj: Any) -> dict:
        raise NotImplementedError

    def _set(self, obj: Any, state: dict) -> None:
        raise NotImplementedError

    def to_state(self, obj: Any) -> dict:
        return _arrays_to_tensors(self._get(obj))

    def check(self, obj: Any, state: ComponentState) -> None:
        if not isinstance(obj, self.types):
            raise TargetMismatchError(f"{state.where('')}: stored a {self.name}, target is {type(obj).__name__}")
        stored, target = state.json("bit_generator"), self._get(obj)["bit_generator"]
        if stored != target:
            raise TargetMismatchError(f"{state.where('bit_generator')}: stored {stored}, target uses {target}")
        if not _valid_bitgen_state(_tensors_to_arrays(state.tree())):
            raise TargetMismatchError(f"{state.where('')}: invalid or unsupported {stored} state")

    def from_state(self, obj: Any, state: ComponentState) -> Any:
        self._set(obj, _tensors_to_arrays(state.tree()))
        return obj


@register_adapter
class NumpyGeneratorAdapter(_NumpyBitGeneratorAdapter):
    """``numpy.random.Generator`` (PCG64, MT19937, Philox, SFC64): its own stream,
    not the global one (DeepSpeed #8405 replayed a stream by saving the wrong one)."""

    name = "numpy.random.Generator"
    types = (np.random.Generator,)

    def _get(self, obj: np.random.Generator) -> dict:
        return obj.bit_generator.state

    def _set(self, obj: np.random.Generator, state: dict) -> None:
        obj.bit_generator.state = state


@register_adapter
class NumpyRandomStateAdapter(_NumpyBitGeneratorAdapter):
    """A ``numpy.random.RandomState`` object (legacy API, its own stream)."""

    name = "numpy.random.RandomState"
    types = (np.random.RandomState,)

    def _get(self, obj: np.random.RandomState) -> dict:
        return obj.get_state(legacy=False)

    def _set(self, obj: np.random.RandomState, state: dict) -> None:
        obj.set_state(state)

