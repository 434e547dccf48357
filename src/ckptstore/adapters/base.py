"""The adapter layer's API: turning live objects into state trees and back.

This module holds the :class:`Adapter` base class, the :class:`Registry` and
:func:`register_adapter`, :func:`capture` (objects to components), the stored state an
adapter restores from (:class:`ComponentState`, :class:`LazyTensor`) and :func:`migrate`.
State trees themselves are :mod:`.tree`'s job, change tokens :mod:`.tokens`'; both
are re-exported here.

An adapter handles one kind of object. Leaf adapters turn an object into a
*component*: a state tree (nested ``dict`` with ``str`` keys whose leaves are
tensors or JSON values, see :mod:`ckptstore.core.jsonvalue`) stamped with the
adapter's name and state version. Container adapters (a ``dict`` of objects,
a replay buffer) only name their children; each child becomes a component at
``<container path>/<child name>``.

Register an adapter with the :func:`register_adapter` class decorator::

    @ckptstore.register_adapter
    class CounterAdapter(ckptstore.Adapter):
        name = "myproject.counter"
        version = 2
        types = (Counter,)
        migrations = {1: lambda flat, meta: {**flat, "total": flat["count"]}}  # v1 -> v2

        def to_state(self, obj):
            return {"count": obj.count, "total": obj.total}

        def from_state(self, obj, state):
            obj.count, obj.total = state.json("count"), state.json("total")
            return obj

Restoring state written by an older version first runs ``migrations[v]`` for
each ``v`` from the stored version up: ``fn(flat, meta)`` gets the flat
``{relative path: value}`` dict (tensors materialised) and the component's
meta dict (which it may update in place), and returns the new flat dict.
State from a newer version raises :class:`~ckptstore.core.errors.AdapterVersionError`.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ..core.errors import (
    AdapterError,
    AdapterVersionError,
    IntegrityError,
    MissingLeafError,
    ShapeMismatchError,
    TargetMismatchError,
    UnsupportedTypeError,
)
from ..core.layout import escape, join, split, under, unescape  # noqa: F401 (re-exported: the adapters' path helpers)
from .tokens import RowToken, StorageIdentity, plain_token  # noqa: F401 (re-exported)
from .tree import RAW, RAW_BYTES, Json, check_key, flatten, is_subtree, raw_leaves, unflatten  # noqa: F401 (re-exported)

_MISSING = object()


def _restore_raw(state: ComponentState) -> None:
    """Turn the leaves :func:`raw_leaves` wrote back into raw bytes and nested tensors, in
    place (a nested tensor some of whose parts a partial checkout left out stays in parts).

    Raises:
        IntegrityError: a malformed :data:`RAW` entry or a leaf that does not fit it.
    """
    forms = state.meta.get(RAW)
    if not forms:
        return
    if type(forms) is not dict:
        raise IntegrityError(f"{state.where('')}: malformed raw leaf forms {forms!r}")
    new: dict[str, Any] = {}
    for rel, form in forms.items():
        if form in RAW_BYTES.values():
            leaf = state.leaves.get(rel)
            if leaf is None or not isinstance(leaf, (torch.Tensor, LazyTensor)):
                continue  # not selected, or restored already
            dtype, shape = state.spec(rel)
            if dtype != torch.uint8 or len(shape) != 1:
                raise IntegrityError(f"{state.where(rel)}: raw bytes stored as {dtype} {list(shape)}, not a 1-d uint8 tensor")
            data = state.tensor(rel).cpu().numpy().tobytes()
            new[rel] = data if form == "bytes" else bytearray(data) if form == "bytearray" else io.BytesIO(data)
        elif type(form) is dict and form.get("nested") in ("jagged", "strided"):
            names = form.get("parts")
            allowed = ("values", "offsets", "lengths") if form["nested"] == "jagged" else ("values", "sizes")
            if type(names) is not list or not {"values", allowed[1]} <= set(names) <= set(allowed):
                raise IntegrityError(f"{state.where(rel)}: malformed nested tensor parts {names!r}")
            parts = {n: join(rel, n) for n in names}
            if any(p not in state.leaves or not state.is_tensor(p) for p in parts.values()):
                continue  # a partial checkout of some of its parts, or restored already
            t = {n: state.tensor(p) for n, p in parts.items()}
            try:
                if form["nested"] == "jagged":
                    nt = torch.nested.nested_tensor_from_jagged(t["values"], t["offsets"], t.get("lengths"), jagged_dim=form["ragged_dim"])
                else:
                    sizes = [tuple(int(n) for n in row) for row in t["sizes"].tolist()]
                    pieces = torch.split(t["values"], [int(torch.Size(s).numel()) for s in sizes]) if sizes else []
                    nt = torch.nested.nested_tensor([p.reshape(s) for p, s in zip(pieces, sizes)], dtype=t["values"].dtype, device=t["values"].device)
            except (RuntimeError, ValueError, TypeError, KeyError, IndexError) as exc:
                raise IntegrityError(f"{state.where(rel)}: the stored parts do not make a nested tensor ({exc})") from None
            new[rel] = (nt, list(parts.values()))
        else:
            raise IntegrityError(f"{state.where(rel)}: unknown raw leaf form {form!r}")
    if not new:
        return
    parts_of = {p: rel for rel, v in new.items() if type(v) is tuple for p in v[1]}
    leaves: dict[str, Any] = {}
    for key, value in state.leaves.items():
        rel = parts_of.get(key)
        if rel is not None:
            leaves.setdefault(rel, new[rel][0])
        else:
            leaves[key] = new.get(key, value)
    state.leaves = leaves


class LazyTensor:
    """A stored tensor not read yet: its dtype, shape, strides, and how to read it.

    ``stride`` is ``None`` for a C-contiguous tensor, else the dense layout it
    was committed in. ``read()`` returns a new tensor in that layout;
    ``read_into(dest)`` fills ``dest`` (any layout). Both verify every blob hash.
    """

    def __init__(self, path: str, dtype: torch.dtype, shape: tuple[int, ...], stride: tuple[int, ...] | None, reader: Any, handle: Any):
        self.path = path
        self.dtype = dtype
        self.shape = tuple(shape)
        self.stride = None if stride is None else tuple(stride)
        self._reader = reader
        self._handle = handle

    def empty(self) -> torch.Tensor:
        """An uninitialised tensor of the stored dtype, shape and layout."""
        if self.stride is None:
            return torch.empty(self.shape, dtype=self.dtype)
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype)

    def fits(self, dest: torch.Tensor) -> bool:
        """Can blobs be read straight into ``dest`` (CPU, stored layout)?"""
        if dest.device.type != "cpu" or dest.dtype != self.dtype or tuple(dest.shape) != self.shape:
            return False
        return dest.is_contiguous() if self.stride is None else (dest.numel() == 0 or dest.stride() == self.stride)

    def read_into(self, dest: torch.Tensor) -> None:
        if dest.dtype != self.dtype or tuple(dest.shape) != self.shape:
            raise ShapeMismatchError(
                f"{self.path}: stored {self.dtype} {list(self.shape)}, destination {dest.dtype} {list(dest.shape)}"
            )
        if self.fits(dest):
            self._reader.read_many([(self, dest)])
        else:
            dest.copy_(self.read())

    def read(self) -> torch.Tensor:
        out = self.empty()
        self._reader.read_many([(self, out)])
        return out

    def __repr__(self) -> str:
        return f"LazyTensor({self.path!r}, {self.dtype}, {list(self.shape)})"


@dataclass
class ComponentState:
    """The stored state of one component, handed to :meth:`Adapter.from_state`.

    Leaves are addressed by their path relative to the component (``""`` when
    the component is a single leaf): keys escaped and joined by ``/``
    (:func:`ckptstore.core.layout.escape`; :meth:`names` and :meth:`tree` give the
    keys themselves). Tensors stay unread until asked for.
    """

    path: str
    adapter: str
    version: int
    meta: dict
    leaves: dict[str, Any] = field(default_factory=dict)  # rel path -> LazyTensor | Tensor | JSON value

    def where(self, key: str) -> str:
        return join(self.path, key) or "<root>"

    def keys(self, prefix: str = "") -> list[str]:
        """Relative paths of the leaves under ``prefix``, in stored order."""
        if not prefix:
            return list(self.leaves)
        return [k for k in self.leaves if k == prefix or k.startswith(prefix + "/")]

    def names(self, prefix: str = "") -> dict[str, str]:
        """The keys directly under ``prefix``: ``{key: its relative path}``
        (``{"x/y": "x%2Fy"}``), in stored order."""
        cut = len(prefix) + 1 if prefix else 0
        out: dict[str, str] = {}
        for k in self.keys(prefix):
            if k != prefix:
                segment = k[cut:].split("/", 1)[0]
                out.setdefault(unescape(segment), join(prefix, segment))
        return out

    def has(self, key: str) -> bool:
        return key in self.leaves

    def _get(self, key: str) -> Any:
        try:
            return self.leaves[key]
        except KeyError:
            raise MissingLeafError(f"{self.where(key)}: the stored {self.adapter} state has no leaf {key!r}") from None

    def is_tensor(self, key: str) -> bool:
        return isinstance(self._get(key), (torch.Tensor, LazyTensor))

    def json(self, key: str, default: Any = _MISSING) -> Any:
        """The JSON value at ``key`` (MissingLeafError if absent and no default)."""
        if default is not _MISSING and key not in self.leaves:
            return default
        value = self._get(key)
        if isinstance(value, (torch.Tensor, LazyTensor)):
            raise MissingLeafError(f"{self.where(key)}: expected a JSON value, the store holds a tensor")
        return value

    def spec(self, key: str) -> tuple[torch.dtype, tuple[int, ...]]:
        """``(dtype, shape)`` of the tensor at ``key``, without reading it."""
        value = self._get(key)
        if isinstance(value, LazyTensor):
            return value.dtype, value.shape
        if isinstance(value, torch.Tensor):
            return value.dtype, tuple(value.shape)
        raise MissingLeafError(f"{self.where(key)}: expected a tensor, the store holds a JSON value")

    def tensor(self, key: str) -> torch.Tensor:
        """The tensor at ``key``, read (and hash-verified) on first use."""
        value = self._get(key)
        if isinstance(value, LazyTensor):
            value = self.leaves[key] = value.read()
        elif not isinstance(value, torch.Tensor):
            raise MissingLeafError(f"{self.where(key)}: expected a tensor, the store holds a JSON value")
        return value

    def value(self, key: str) -> Any:
        """The leaf at ``key``: a tensor (read) or a JSON value."""
        return self.tensor(key) if self.is_tensor(key) else self._get(key)

    def read_into(self, key: str, dest: torch.Tensor) -> None:
        """Fill ``dest`` with the tensor at ``key``, straight from the blobs when unread.

        Raises ShapeMismatchError when dtype or shape differ.
        """
        value = self._get(key)
        if isinstance(value, LazyTensor):
            value.read_into(dest)
            return
        if not isinstance(value, torch.Tensor):
            raise MissingLeafError(f"{self.where(key)}: expected a tensor, the store holds a JSON value")
        if value.dtype != dest.dtype or value.shape != dest.shape:
            raise ShapeMismatchError(f"{self.where(key)}: stored {value.dtype} {list(value.shape)}, target {dest.dtype} {list(dest.shape)}")
        dest.copy_(value)

    def tree(self, prefix: str = "") -> Any:
        """The subtree under ``prefix`` as nested dicts, tensors read."""
        keys = self.keys(prefix)
        cut = len(prefix) + 1 if prefix else 0
        return unflatten({k[cut:]: self.value(k) for k in keys})

    def lazy(self) -> list[LazyTensor]:
        return [v for v in self.leaves.values() if isinstance(v, LazyTensor)]


class Adapter:
    """Base class of adapters; see the module docstring.

    Class attributes:
        name: unique, stable name stored with each component (``"torch.nn.Module"``).
        version: the state version this adapter writes (int, from 1).
        types: the classes it handles; subclasses match too, the most specific wins.
        claims: for objects whose classes share no base (tensorclasses): ``claims(obj)``
            returns ``True`` for those it handles; asked only when no ``types`` match.
        migrations: ``{v: fn(flat, meta) -> flat}`` turning version ``v`` state into ``v + 1``.
        direct: ``True`` if ``from_state`` reads large tensors straight into the
            target (``state.read_into``); other components are read and
            verified in full before any target is touched.
        partial_targets: for containers, ``True`` if a target may hold only some
            of the committed children (a dict); otherwise every committed child
            must have its target.
        uses_scope: ``True`` if ``to_state``, ``check`` and ``from_state`` take a
            keyword ``scope`` (:class:`Scope`: the modules committed or restored
            beside the object; optimizers name their parameters through it).
    """

    name: ClassVar[str] = ""
    version: ClassVar[int] = 1
    types: ClassVar[tuple[type, ...]] = ()
    migrations: ClassVar[dict[int, Callable[[dict, dict], dict]]] = {}
    direct: ClassVar[bool] = False
    partial_targets: ClassVar[bool] = False
    uses_scope: ClassVar[bool] = False

    def claims(self, obj: Any) -> bool:
        """Does this adapter handle ``obj``, whose class no adapter's ``types`` match?"""
        return False

    def children(self, obj: Any) -> dict[str, Any] | None:
        """Child objects of a container (by name), or ``None`` for a leaf adapter."""
        return None

    def refusal(self, obj: Any, path: str) -> Exception | None:
        """For an adapter that stands for objects that cannot be stored (a family of
        classes only some of which are supported): the error to raise for ``obj`` at
        ``path`` when it is met, or ``None`` to handle it."""
        return None

    def targets(self, obj: Any) -> dict[str, Any] | None:
        """Child objects to restore into; defaults to :meth:`children`."""
        return self.children(obj)

    def set_child(self, obj: Any, name: str, value: Any) -> None:
        """Put a restored child back when it could not be restored in place."""
        raise TargetMismatchError(f"{type(obj).__name__}: cannot replace child {name!r}")

    def to_state(self, obj: Any) -> Any:
        """The state tree of ``obj`` (a tensor, a JSON value or a nested dict)."""
        raise NotImplementedError

    def meta(self, obj: Any) -> dict:
        """Small JSON dict stored with the component (class name, layout)."""
        return {"class": f"{type(obj).__module__}.{type(obj).__qualname__}"}

    def fingerprints(self, obj: Any) -> dict[str, Any]:
        """Optional change tokens: ``{relative leaf path: hashable token}``.

        A token equal to the one this store saw when it last committed the same
        object means the tensor's bytes did not change, so its shard hashes are
        reused instead of recomputed. Only return tokens that change whenever the
        bytes can (TorchRL storages: their shared mutation revision plus each
        tensor's version counter and address). A :class:`RowToken` also names
        the rows written in between, so only the shards holding them are hashed.
        """
        return {}

    def check_partial(self, obj: Any, restored: list[str], skipped: dict[str, ComponentState]) -> None:
        """For containers whose children depend on each other (a replay buffer): a
        checkout restores only the ``restored`` children of ``obj``; ``skipped``
        holds the stored (unread) state of the committed children it leaves alone.
        Raise TargetMismatchError if the result could not be made consistent
        (called before anything is changed)."""

    def after_partial(self, obj: Any, restored: list[str], skipped: list[str]) -> None:
        """After such a partial restore: bring the ``skipped`` children to a state
        consistent with the restored ones."""

    def check(self, obj: Any, state: ComponentState) -> None:
        """Validate that ``state`` fits ``obj`` before anything is read or written.

        Raise TargetMismatchError (or a subclass) naming what differs.
        """

    def from_state(self, obj: Any, state: ComponentState) -> Any:
        """Load ``state`` into ``obj`` in place and return it, or return a new object."""
        raise NotImplementedError


#: Adapter modules imported on first need, by the top-level package they serve.
LAZY_MODULES = {"torchrl": "ckptstore.adapters.torchrl", "dcp": "ckptstore.dcp"}


def plain(value: Any) -> Any:
    """Ordered dicts (state dicts) as plain dicts, recursively, lists included."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


def same_class(obj: Any, state: ComponentState, stored: str | None = None) -> None:
    """Raise TargetMismatchError unless ``obj`` is of the class the component was taken from."""
    stored = state.meta.get("class", "") if stored is None else stored
    if not stored.endswith("." + type(obj).__qualname__):
        raise TargetMismatchError(f"{state.where('')}: stored a {stored}, target is a {type(obj).__module__}.{type(obj).__qualname__}")


class StateDictAdapter(Adapter):
    """For objects whose ``state_dict()`` holds tensors and JSON values: stored
    as is, loaded with ``load_state_dict`` into an object of the same class."""

    def to_state(self, obj: Any) -> dict:
        return plain(obj.state_dict())

    def check(self, obj: Any, state: ComponentState) -> None:
        same_class(obj, state)

    def from_state(self, obj: Any, state: ComponentState) -> Any:
        obj.load_state_dict(state.tree())
        return obj


class Registry:
    """Adapters by name and by type."""

    def __init__(self) -> None:
        self.by_name: dict[str, Adapter] = {}
        self.by_type: dict[type, Adapter] = {}
        self.claimants: dict[str, Adapter] = {}  # by name: adapters overriding Adapter.claims

    @staticmethod
    def _load(package: str) -> bool:
        module = LAZY_MODULES.get(package)
        if module is None:
            return False
        import importlib
        import sys

        if module in sys.modules:
            return False
        importlib.import_module(module)
        return True

    def register(self, cls: type[Adapter], replace: bool = False) -> type[Adapter]:
        if not cls.name or cls.version < 1:
            raise AdapterError(f"adapter {cls.__qualname__} needs a name and a version >= 1")
        if cls.name in self.by_name and not replace:
            raise AdapterError(f"an adapter named {cls.name!r} is already registered (pass replace=True to override)")
        adapter = cls()
        self.by_name[cls.name] = adapter
        for t in cls.types:
            self.by_type[t] = adapter
        if cls.claims is not Adapter.claims:
            self.claimants[cls.name] = adapter
        return cls

    def for_object(self, obj: Any, path: str = "") -> Adapter:
        for klass in type(obj).__mro__:
            adapter = self.by_type.get(klass)
            if adapter is not None:
                problem = adapter.refusal(obj, path)
                if problem is not None:
                    raise problem
                return adapter
        for adapter in self.claimants.values():
            if adapter.claims(obj):
                return adapter
        if any(self._load(k.__module__.split(".")[0]) for k in type(obj).__mro__):
            return self.for_object(obj, path)
        t = type(obj)
        raise UnsupportedTypeError(
            f"{path or '<root>'}: no adapter for objects of type {t.__module__}.{t.__qualname__}; "
            "ckptstore never pickles - register one with ckptstore.register_adapter"
        )

    def named(self, name: str, path: str) -> Adapter:
        if name not in self.by_name:
            self._load(name.split(".")[0])
        try:
            return self.by_name[name]
        except KeyError:
            raise AdapterError(f"{path or '<root>'}: stored by adapter {name!r}, which is not registered here") from None


REGISTRY = Registry()


def register_adapter(cls: type[Adapter] | None = None, *, replace: bool = False):
    """Class decorator registering an :class:`Adapter` subclass (see module doc).

    Raises:
        AdapterError: no name, version < 1, or the name is taken (unless ``replace``).
    """
    if cls is None:
        return lambda c: REGISTRY.register(c, replace=replace)
    return REGISTRY.register(cls, replace=replace)


@dataclass
class Captured:
    """One component captured at commit time."""

    path: str
    adapter: str
    version: int
    meta: dict
    leaves: dict[str, Any]  # absolute path -> tensor | JSON value
    fingerprints: dict[str, Any] = field(default_factory=dict)  # absolute path -> token (see Adapter.fingerprints)
    owner: Any = None  # the object the fingerprints belong to


class Scope:
    """The modules of one commit, or of one checkout's target, by component path.

    A parameter's *name* in a commit is the leaf path where its module's
    component stores it (``"policy/0.weight"``; a parameter two modules share is
    named where it is met first, depth first). Optimizers are stored by these
    names (see :class:`~ckptstore.adapters.torch_nn.OptimizerAdapter`), and found
    again at checkout through every name of the target's modules.
    """

    def __init__(self, modules: list[tuple[str, Any]]):
        self.modules = [(p, m) for p, m in modules if isinstance(m, torch.nn.Module)]
        self._names: dict[int, str] | None = None
        self._params: dict[str, torch.Tensor] | None = None

    def name(self, param: torch.Tensor) -> str | None:
        """The name of ``param`` in this commit, or ``None`` if no module here holds it."""
        if self._names is None:
            self._names = {}
            for path, module in self.modules:
                for n, p in module.named_parameters():
                    self._names.setdefault(id(p), join(path, escape(n)))
        return self._names.get(id(param))

    def param(self, name: str) -> torch.Tensor | None:
        """The target's parameter a stored name refers to, or ``None``."""
        if self._params is None:
            self._params = {}
            for path, module in self.modules:
                try:
                    named = module.named_parameters(remove_duplicate=False)
                except TypeError:  # an override without it (TorchRL's LossModule): its own names
                    named = module.named_parameters()
                for n, p in named:
                    self._params.setdefault(join(path, escape(n)), p)
        return self._params.get(name)


def _find(obj: Any, registry: Registry, path: str, out: list[tuple[str, Adapter, Any]]) -> None:
    adapter = registry.for_object(obj, path)
    kids = adapter.children(obj)
    if kids is None:
        out.append((path, adapter, obj))
        return
    for name, child in kids.items():
        _find(child, registry, join(path, check_key(name, path)), out)


def capture(obj: Any, registry: Registry = REGISTRY, path: str = "") -> list[Captured]:
    """Turn ``obj`` into components (depth first, children in their order).

    Adapters with ``uses_scope`` get the commit's :class:`Scope` (``to_state(obj, scope=)``).

    Raises:
        UnsupportedTypeError / InvalidNameError: naming the offending path.
    """
    found: list[tuple[str, Adapter, Any]] = []
    _find(obj, registry, path, found)
    scope = Scope([(p, o) for p, _, o in found])
    out = []
    for p, adapter, o in found:
        state = adapter.to_state(o, scope=scope) if adapter.uses_scope else adapter.to_state(o)
        leaves, forms = raw_leaves(flatten(state, p), p)
        tokens = {join(p, rel): token for rel, token in adapter.fingerprints(o).items()}
        raw = {join(p, rel) for rel in forms}
        for leaf, value in leaves.items():
            if leaf not in tokens and isinstance(value, torch.Tensor) and not (raw and any(under(leaf, r) for r in raw)):
                token = plain_token(value)
                if token is not None:
                    tokens[leaf] = token
        meta = adapter.meta(o)
        if forms:
            meta = {**meta, RAW: forms}
        out.append(Captured(p, adapter.name, adapter.version, meta, leaves, tokens, o if tokens else None))
    return out


def migrate(adapter: Adapter, state: ComponentState) -> ComponentState:
    """Bring ``state`` to ``adapter.version`` through its migrations, after turning the
    leaves stored in plain tensor form back into raw bytes and nested tensors (component
    meta :data:`RAW`; those leaves are read here).

    Raises:
        AdapterVersionError: stored version newer than the adapter's, or a
            missing migration step.
        IntegrityError: a raw leaf that does not fit its form.
    """
    _restore_raw(state)
    if state.version == adapter.version:
        return state
    where = state.path or "<root>"
    if state.version > adapter.version:
        raise AdapterVersionError(
            f"{where}: stored by {adapter.name} version {state.version}, this ckptstore has version {adapter.version}; "
            "upgrade to restore it"
        )
    flat = {k: state.value(k) for k in state.keys()}
    meta = dict(state.meta)
    for v in range(state.version, adapter.version):
        step = adapter.migrations.get(v)
        if step is None:
            raise AdapterVersionError(f"{where}: no migration of {adapter.name} state from version {v} to {v + 1}")
        flat = step(dict(flat), meta)
    return ComponentState(state.path, state.adapter, adapter.version, meta, flat)
