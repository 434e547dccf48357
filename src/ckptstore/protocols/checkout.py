"""Reading commits back: blob reads into tensors, and restoring live objects.

:func:`checkout_ref` (``Store.checkout``, on either home) resolves the ref and selects
the leaves; this module reads their shards (in threads, every blob hash verified) and, for ``into=``, walks
the target's structure against the commit's components, checks every
component, reads the small ones in full, and only then loads them (see
docs/design.md, "Checkout").
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.graph import increment_version

from ..adapters import Adapter, ComponentState, LazyTensor, Registry, join, migrate
from ..adapters.base import Scope, check_key, escape, under
from ..core import jsonvalue, progress
from ..core.errors import (
    AdapterError,
    BlobCorruptError,
    BlobMissingError,
    CkptStoreError,
    IntegrityError,
    PartialPathError,
    TargetMismatchError,
)
from ..core.layout import check_path, keypath, split
from ..core.shards import DTYPES, ShardPlan, byte_view, dense_order
from ..objects.packs import BLOB_HEADER, CODEC_RAW, RUN_BLOBS

if TYPE_CHECKING:
    from ..home.interfaces import CheckoutRepository
    from ..objects.records import LeafRecord

_INLINE_BYTES = 4 << 20  # below this, reading in threads costs more than it saves
_RUN_BYTES = 4 << 20  # the most bytes one read_run reads: the shards it hashes after the copy are still in the cache


class BlobReader:
    """Reads tensor leaves of one commit for one checkout, in threads."""

    def __init__(self, store: CheckoutRepository, cid: str, verify: bool, sparse: bool = False):
        self.store = store
        self.cid = cid
        self.verify = verify
        self.packs = store.pack_reader(sparse)

    def lazy(self, rec: LeafRecord) -> LazyTensor:
        """A tensor leaf to read. ``rec`` comes from a verified commit record:
        :func:`ckptstore.objects.records.parse_commit` checked its dtype, shape, strides and
        shard lengths, and its shards were located by their exact addresses."""
        dtype = DTYPES.get(rec.dtype or "")
        if dtype is None:  # a dtype name of a newer torch than this one
            raise IntegrityError(f"commit {self.cid[:12]}, leaf {rec.path}: dtype {rec.dtype!r} does not exist in this torch")
        return LazyTensor(rec.path, dtype, tuple(rec.shape), rec.stride, self, (rec, ShardPlan(rec.nbytes, rec.shard_bytes)))

    def read_many(self, pairs: list[tuple[LazyTensor, torch.Tensor | None]], states: list[ComponentState] | None = None) -> None:
        """Read each lazy tensor into its destination (a new tensor when ``None``).

        With ``states``, lazy leaves are replaced by the tensors read.
        """
        tasks, results = [], []
        for lazy, dest in pairs:
            if dest is None:
                try:
                    dest = lazy.empty()
                except RuntimeError as exc:
                    raise IntegrityError(f"commit {self.cid}, leaf {lazy.path}: cannot allocate {list(lazy.shape)}: {exc}") from None
            elif not lazy.fits(dest):
                raise ValueError(f"{lazy.path}: read destination must be a CPU tensor in the stored layout")
            results.append((lazy, dest))
            rec, expected = lazy._handle
            order = None if lazy.stride is None else dense_order(lazy.shape, lazy.stride)
            view = byte_view(dest if order is None else dest.permute(order))
            for i, loc in enumerate(rec.shards):
                a, b = expected.bounds(i)
                tasks.append((loc, view[a:b], rec, i))
        total = sum(task[0].raw_len for task in tasks)
        self.packs.prefetch([task[0] for task in tasks])
        units = self._runs(tasks)
        bad: list[tuple] = []  # (location, why) of the blobs whose read failed verification
        try:
            with progress.task(f"checkout {self.cid[:12]}", total) as advance:
                def run(unit: list[tuple]) -> None:
                    if len(unit) == 1 or not self.packs.read_run([t[0] for t in unit], [t[1] for t in unit], self.verify):
                        for loc, dest, rec, i in unit:  # one by one: what is wrong is named, a moved blob found
                            try:
                                self.packs.read_into(loc, dest, f"commit {self.cid}, leaf {rec.path}, shard {i}", self.verify)
                            except (BlobCorruptError, BlobMissingError) as exc:
                                bad.append((loc, str(exc)))  # marked below, in the calling thread
                                raise
                    advance(sum(t[0].raw_len for t in unit))

                if total > _INLINE_BYTES:
                    self.store._map(run, units)
                else:
                    for unit in units:
                        run(unit)
        finally:
            if bad:  # dedup must never reuse them: the next commit of their content writes a good copy (invariant 14)
                self.store.home.mark_bad(bad)
            # The bytes went in through raw memory, which torch does not count: a live target
            # (a replay buffer's columns) must not keep the fingerprints of what it held
            # before, even when a bad blob stopped the read part-way.
            for _, dest in results:
                if not dest.is_inference():  # inference tensors have no version counter
                    increment_version(dest)
        if states:
            done = {id(lazy): dest for lazy, dest in results}
            for state in states:
                for k, v in state.leaves.items():
                    if isinstance(v, LazyTensor) and id(v) in done:
                        state.leaves[k] = done[id(v)]

    def _runs(self, tasks: list[tuple]) -> list[list[tuple]]:
        """``tasks`` (``(location, destination, leaf record, shard index)``) in pack order, cut
        into runs that :meth:`~ckptstore.objects.packs.PackReader.read_run` reads with one call each:
        raw blobs back to back in one pack, at most :data:`_RUN_BYTES` (a pack of files only;
        object storage reads blob by blob). One call per 256 KiB shard cost more in Python
        (location checks, header parsing, messages) than the copy and hash of its bytes."""
        if getattr(self.packs, "read_run", None) is None:
            return [[task] for task in tasks]
        units: list[list[tuple]] = []
        run: list[tuple] = []
        end, size = None, 0
        for task in sorted(tasks, key=lambda t: (t[0].pack, t[0].offset)):
            loc = task[0]
            raw = loc.codec == CODEC_RAW and loc.stored_len == loc.raw_len
            if raw and loc.offset == end and loc.pack == run[-1][0].pack and len(run) < RUN_BLOBS and size + loc.raw_len <= _RUN_BYTES:
                run.append(task)
                size += loc.raw_len
            else:
                run = [task]
                units.append(run)
                size = loc.raw_len
            end = loc.offset + BLOB_HEADER.size + loc.raw_len if raw else None
        return units

    def close(self) -> None:
        self.store.io.blobs_read += self.packs.blobs_read
        self.store.io.bytes_read += self.packs.bytes_read
        self.packs.close()


# --- restoring into live objects ---------------------------------------------------------


@dataclass
class Step:
    obj: Any
    path: str
    parent: tuple[Any, Any, str] | None  # (container adapter, container, child name)


@dataclass
class Partial:
    """A container (with partial-restore rules) of which only some committed children are restored."""

    adapter: Any
    obj: Any
    restored: list[str]  # child names
    skipped: dict[str, str]  # child name -> component path


@dataclass
class Plan:
    steps: list[Step]  # one per component to load
    scope: Scope  # the target's modules at component paths, restored or not (optimizers find their parameters there)
    partials: list[Partial]

    @property
    def paths(self) -> list[str]:
        """Components whose stored state the restore looks at (loaded, or checked for consistency)."""
        return [s.path for s in self.steps] + [p for part in self.partials for p in part.skipped.values()]


def plan_restore(into: Any, comps: dict[str, dict], prefixes: list[str] | None, registry: Registry, cid: str) -> Plan:
    """Match ``into``'s structure to the commit's components.

    Raises TargetMismatchError for structure that does not match.
    """
    steps: list[Step] = []
    at_components: list[tuple[str, Any]] = []
    partials: list[Partial] = []

    def selected(path: str) -> bool:
        return prefixes is None or any(under(path, p) or under(p, path) for p in prefixes)

    def walk(obj: Any, path: str, parent) -> None:
        if path in comps:
            at_components.append((path, obj))
            if selected(path):
                steps.append(Step(obj, path, parent))
            return
        below = [c for c in comps if under(c, path)]
        if not below:
            names = ", ".join(c or "<root>" for c in comps)
            raise TargetMismatchError(f"{path or '<root>'}: commit {cid[:12]} has no component here; components: {names}")
        adapter = registry.for_object(obj, path)
        kids = adapter.targets(obj)
        if kids is None:
            raise TargetMismatchError(
                f"{path or '<root>'}: the commit holds components {', '.join(below)} here, "
                f"but the target {type(obj).__name__} is not a container of them"
            )
        first = len(steps)
        for name, child in kids.items():
            walk(child, join(path, check_key(name, path)), (adapter, obj, name))
        if type(adapter).check_partial is not Adapter.check_partial:
            committed = {n: join(path, escape(n)) for n in kids if join(path, escape(n)) in comps}
            restored = [n for n, c in committed.items() if any(s.path == c for s in steps[first:])]
            if restored and len(restored) < len(committed):
                partials.append(Partial(adapter, obj, restored, {n: c for n, c in committed.items() if n not in restored}))
        if not adapter.partial_targets:  # a buffer must receive every part the commit has for it
            names = {join(path, escape(n)) for n in kids}
            left = [c for c in below if selected(c) and not any(under(c, n) for n in names)]
            if left:
                raise TargetMismatchError(f"{path or '<root>'}: the commit holds {', '.join(left)}, which the target {type(obj).__name__} lacks")

    walk(into, "", None)
    if prefixes is not None:
        for p in prefixes:
            if not any(under(s.path, p) or under(p, s.path) for s in steps):
                raise TargetMismatchError(f"partial path {p!r} selects components that the target given as into does not contain")
    return Plan(steps, Scope(at_components), partials)


_VALUE_ADAPTERS = ("tensor", "json", "bytes", "dict", "tensordict")


def _compatible(stored: Any, step: Step, registry: Registry) -> None:
    """The target must be handled by the stored adapter, a subclass of it, or a base of it."""
    if stored.name in _VALUE_ADAPTERS:
        return  # plain values may replace whatever placeholder the target holds
    try:
        target = registry.for_object(step.obj, step.path)
    except CkptStoreError:
        target = None
    if target is None or not (isinstance(target, type(stored)) or isinstance(stored, type(target))):
        what = "an object with no adapter" if target is None else f"{target.name}"
        raise TargetMismatchError(
            f"{step.path or '<root>'}: stored by {stored.name}, the target {type(step.obj).__name__} is handled by {what}"
        )


def restore(into: Any, plan: Plan, states: dict[str, ComponentState], registry: Registry, reader: BlobReader) -> Any:
    """Check every component and partial restore, read the small components, then load them all."""
    plans = []
    scope = plan.scope
    for step in plan.steps:
        state = states[step.path]
        adapter = registry.named(state.adapter, step.path)
        _compatible(adapter, step, registry)
        state = migrate(adapter, state)
        if adapter.uses_scope:
            adapter.check(step.obj, state, scope=scope)
        else:
            adapter.check(step.obj, state)
        plans.append((step, adapter, state))
    for part in plan.partials:
        part.adapter.check_partial(part.obj, part.restored, {n: states[c] for n, c in part.skipped.items()})
    prefetch = [s for _, a, s in plans if not a.direct]
    reader.read_many([(lt, None) for s in prefetch for lt in s.lazy()], states=prefetch)
    result = into
    with torch.no_grad():
        for done, (step, adapter, state) in enumerate(plans):
            try:
                new = adapter.from_state(step.obj, state, scope=scope) if adapter.uses_scope else adapter.from_state(step.obj, state)
            except CkptStoreError:
                raise
            except Exception as exc:  # an adapter's check let through state its object refuses
                loaded = ", ".join(s.path or "<root>" for s, _, _ in plans[:done]) or "none"
                raise TargetMismatchError(
                    f"{step.path or '<root>'}: restoring failed ({type(exc).__name__}: {exc}); components already restored: {loaded}"
                ) from exc
            if new is not step.obj:
                if step.parent is None:
                    result = new
                else:
                    parent_adapter, container, name = step.parent
                    parent_adapter.set_child(container, name, new)
        for part in plan.partials:
            part.adapter.after_partial(part.obj, part.restored, list(part.skipped))
    return result


# --- the protocol: resolve, select, read or restore ---------------------------------------------------


def checkout_ref(store: CheckoutRepository, ref: str, partial: Iterable[str] | str | None = None, into: Any = None, verify: bool = True,
                 map_location: Any = None) -> Any:
    """:meth:`ckptstore.store.Store.checkout` (its docstring gives the arguments, the result and
    the errors), on either home: resolve ``ref``, select the leaves ``partial`` names, then
    read them into a TensorDict, or plan and restore ``into``."""
    with store.catalog.read():
        cid = store.resolve(ref)
        comps = store.components(cid)
        prefixes = _select(store, cid, partial, comps)
        reader = BlobReader(store, cid, verify, sparse=prefixes is not None)
        if into is None:
            states = _states(store, cid, prefixes, comps, reader)
        else:
            plan = plan_restore(into, comps, prefixes, store.registry, cid)
            if not plan.steps:
                return into
            states = _states(store, cid, plan.paths, comps, reader)
    try:
        if into is None:
            return _as_tensordict(store, states, reader, map_location)
        return restore(into, plan, states, store.registry, reader)
    finally:
        reader.close()


def _select(store: CheckoutRepository, cid: str, partial: Iterable[str] | str | None, comps: dict[str, dict]) -> list[str] | None:
    """Normalise ``partial`` prefixes and check each matches something."""
    if partial is None:
        return None
    if isinstance(partial, str):
        partial = [partial]
    partial = list(partial)
    if not partial:
        raise PartialPathError("partial is empty: name at least one path prefix, or pass None to read everything")
    prefixes = []
    for p in partial:
        if type(p) is tuple:  # keys, escaped here: ("rb", "x/y") is "rb/x%2Fy"
            try:
                p = keypath(*p)
            except TypeError as exc:
                raise PartialPathError(f"partial path {p!r}: {exc}") from None
        elif type(p) is not str or not jsonvalue.is_text(p):
            raise PartialPathError(f"partial prefixes must be strings (escaped paths) or tuples of keys, got {p!r}")
        if not p:
            return None
        try:
            check_path(p)
        except ValueError as exc:
            raise PartialPathError(f"partial: {exc}") from None
        hit = any(under(c, p) for c in comps) or any(under(r.path, p) for r in store.record(cid).leaves)
        if not hit:
            names = ", ".join(c or "<root>" for c in comps) or "(none)"
            hint = " (a key holding '/' or '%' is written escaped, 'x%2Fy', '50%25', or given as a tuple of keys)" if "%" in p or "/" in p else ""
            raise PartialPathError(f"partial path {p!r} matches nothing in commit {cid[:12]}; components: {names}{hint}")
        prefixes.append(p)
    return prefixes

def _states(store: CheckoutRepository, cid: str, prefixes: list[str] | None, comps: dict[str, dict],
            reader: BlobReader) -> dict[str, ComponentState]:
    if prefixes is not None and "" in prefixes:
        prefixes = None
    states: dict[str, ComponentState] = {}
    for c, row in comps.items():
        if prefixes is None or any(under(c, p) or under(p, c) for p in prefixes):
            states[c] = ComponentState(c, row["adapter"], row["version"], row["meta"])
    for rec in store.manifest(cid, prefixes):
        state = states.get(rec.component)
        if state is None:
            raise IntegrityError(f"commit {cid}, leaf {rec.path}: its component {rec.component!r} is not in the catalog")
        rel = rec.path[len(rec.component) + 1 :] if rec.component else rec.path
        if rec.path == rec.component:
            rel = ""
        if rec.kind == "tensor":
            state.leaves[rel] = reader.lazy(rec)
        elif rec.kind == "json":
            state.leaves[rel] = rec.value
        else:
            raise IntegrityError(f"commit {cid}, leaf {rec.path}: unknown leaf kind {rec.kind!r}")
    return states


#: Adapters whose components check out without ``into`` as a TensorDict (a tensorclass's fields: its class is never imported).
TENSORDICTS = ("tensordict", "tensorclass")


def _as_tensordict(store: CheckoutRepository, states: dict[str, ComponentState], reader: BlobReader, map_location: Any = None) -> Any:
    from tensordict import TensorDict

    reader.read_many([(lt, None) for s in states.values() for lt in s.lazy()], states=list(states.values()))
    for path, state in states.items():  # older adapter versions: show the state as it is now
        try:
            adapter = store.registry.named(state.adapter, path)
        except AdapterError:
            continue  # an adapter this process does not have: the raw state still reads
        states[path] = migrate(adapter, state)
    if map_location is not None:
        device = str(torch.device(map_location))
        for state in states.values():
            if "device" in state.meta:  # a copy: the parsed record is shared
                state.meta = {**state.meta, "device": device}
            state.leaves = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in state.leaves.items()}
    if len(states) == 1 and "" in states:
        only = states[""]
        if only.adapter in TENSORDICTS:
            return store.registry.named(only.adapter, "").build(only)
        if only.adapter == "numpy":
            return store.registry.named("numpy", "").from_state(None, only)
        if list(only.leaves) == [""]:
            return only.value("")
    out = TensorDict({}, batch_size=[])
    for state in states.values():
        if state.adapter in TENSORDICTS and state.path:
            out.set(split(state.path), store.registry.named(state.adapter, state.path).build(state))
            continue
        for rel, value in state.leaves.items():
            key = split(join(state.path, rel))
            if isinstance(value, torch.Tensor):
                out.set(key, value)
            else:
                out.set_non_tensor(key, value)
    return out
