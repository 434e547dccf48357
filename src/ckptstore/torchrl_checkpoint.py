"""ckptstore inside TorchRL's own checkpointing: ``torchrl.checkpoint`` and the Trainer.

``torchrl.checkpoint.Checkpoint`` (TorchRL 0.14) chooses a ``CheckpointAdapter``
per component type and lets users register their own. :class:`StoreCheckpointAdapter`
is one: it commits the component to a ckptstore store and writes only a small
reference file (``ckptstore-ref.json``) into the checkpoint folder or archive,
so successive checkpoints share every unchanged shard::

    ckpt = Checkpoint(policy=policy, replay_buffer=rb, optimizer=optim)
    ckptstore.torchrl_checkpoint.use_store(ckpt, store)      # the one added line
    ckpt.save("checkpoints/step-1000")                         # unchanged code
    ckpt.load("checkpoints/step-1000")

Checkpoints saved before ``use_store`` was added keep loading: their components
are restored through TorchRL's own adapters (see :func:`use_store`).

TorchRL's ``Trainer(checkpoint=ckpt, ...)`` saves through the same object, so
a Trainer gets dedup the same way.

The data is tied to the reference file, not to a path: each save draws a
random reference id, writes it into ``ckptstore-ref.json`` and tags the commit
``torchrl-checkpoint:<reference id>:<component>``. A checkpoint folder or
archive that is renamed, moved or copied keeps its data; a tag is deleted only
when its checkpoint is provably gone: :class:`StoreRotation` (TorchRL's
``CheckpointRotation`` with the same arguments) deletes the tags of the
checkpoints it removes itself, and :func:`forget` deletes those of a checkpoint
you are about to delete by hand. ``ckptstore gc`` then frees the data.

Component names map one to one: TorchRL's component ``replay_buffer`` is
ckptstore's component ``replay_buffer`` (``replay_buffer/storage``...), and
``torchrl.checkpoint.GlobalRNGState`` is stored like :class:`ckptstore.RNGState`.

:class:`CheckpointerHook` plugs a :class:`ckptstore.Checkpointer` into a
TorchRL ``Trainer`` as a ``post_steps`` operation.
"""

from __future__ import annotations

import json
import uuid
import zipfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torchrl.checkpoint import Checkpoint, CheckpointAdapter, CheckpointRotation
from torchrl.data import ReplayBuffer
from torchrl.trainers import TrainerHookBase

from .adapters.rng import RNGState
from .checkpointer import Checkpointer
from .core.errors import CkptStoreError, ContainerError, RefNotFoundError
from .store import Store

REF_FILE = "ckptstore-ref.json"
TAG_PREFIX = "torchrl-checkpoint:"
_MAX_REF_BYTES = 1 << 16


def _tag(ref_id: str, component: str) -> str:
    return f"{TAG_PREFIX}{ref_id}:{component}"


class StoreCheckpointAdapter(CheckpointAdapter):
    """A ``torchrl.checkpoint`` adapter that keeps the component's state in a ckptstore store.

    ``save`` commits the component (any object ckptstore has an adapter for),
    tags it ``torchrl-checkpoint:<reference id>:<component>`` with a fresh random
    reference id, and writes ``{"store", "commit", "component", "ref"}`` to
    ``ckptstore-ref.json``; ``load`` checks that commit out into the live
    component in place, or returns the restored value when it cannot be restored
    in place (an int, a str, a tuple...), which TorchRL reports in
    ``CheckpointLoadResult.values``.

    Raises (on load): ContainerError if the reference file is missing or
    malformed; RefNotFoundError if the store lacks the commit.
    """

    adapter_id = "ckptstore.store"
    format_version = 1

    def __init__(self, store: Store):
        self.store = store

    def save(self, component: Any, path: Path, *, args: tuple, kwargs: Mapping[str, Any]) -> Any:
        path.mkdir(parents=True, exist_ok=True)
        name, ref_id = path.name.split("-", 1)[-1], uuid.uuid4().hex
        info = self.store.commit(component, tag=_tag(ref_id, name), message=f"torchrl checkpoint component {name}")
        ref = {"store": str(self.store.root.resolve()), "commit": info.id, "component": name, "ref": ref_id}
        (path / REF_FILE).write_text(json.dumps(ref))
        return None

    def load(self, component: Any, path: Path, *, map_location: Any, tensor_load_kwargs: Mapping[str, Any],
             args: tuple, kwargs: Mapping[str, Any]) -> Any:
        try:
            ref = json.loads((path / REF_FILE).read_text())
            commit = ref["commit"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ContainerError(f"{path / REF_FILE}: not a ckptstore reference ({exc})") from None
        restored = self.store.checkout(commit, into=component)
        return None if restored is component else restored  # an immutable value (int, str...) comes back as a new one


DEFAULT_TYPES = (ReplayBuffer, torch.nn.Module, torch.optim.Optimizer)


def use_store(checkpoint: Checkpoint, store: Store, types: Iterable[type] = DEFAULT_TYPES) -> Checkpoint:
    """Route every component of ``checkpoint`` of one of ``types`` through ``store``; returns it.

    Checkpoints saved before (by TorchRL's own adapters, ``torchrl.state_dict`` and the
    like) still load: ``checkpoint.load`` restores each component whose manifest names
    another adapter than ``ckptstore.store`` through TorchRL's own adapter resolution, and
    the rest from the store. The next save writes every such component to the store.
    """
    types = tuple(types)
    adapter = StoreCheckpointAdapter(store)
    for t in types:
        checkpoint.register_adapter(t, adapter)
    if not getattr(checkpoint.load, "ckptstore_legacy", False):
        checkpoint.load = _loading_legacy(checkpoint, checkpoint.load, types)
    return checkpoint


def _loading_legacy(checkpoint: Checkpoint, load: Any, types: tuple[type, ...]) -> Any:
    """``checkpoint.load`` that loads the components saved before :func:`use_store` with
    TorchRL's own adapters (a plain ``Checkpoint`` holding only them), the others with ``load``."""

    def load_both(path: str | Path, *, components: Iterable[str] | None = None, component_options: Mapping[str, Any] | None = None, **kwargs: Any) -> Any:
        records = Checkpoint.manifest(path).get("components", {})
        values = checkpoint.components
        requested = set(values) if components is None else set(components)
        legacy = {n for n in requested if n in values and isinstance(values[n], types) and isinstance(records.get(n), dict)
                  and records[n].get("adapter") != StoreCheckpointAdapter.adapter_id}
        if not legacy:
            return load(path, components=components, component_options=component_options, **kwargs)
        options = component_options or {}
        result = load(path, components=requested - legacy, component_options={n: o for n, o in options.items() if n not in legacy}, **kwargs)
        old = Checkpoint(strict=checkpoint.strict)
        for name in sorted(legacy):
            old.register(name, values[name])
        before = old.load(path, components=legacy, component_options={n: o for n, o in options.items() if n in legacy}, **kwargs)
        result.loaded |= before.loaded
        result.incompatible.update(before.incompatible)
        result.values.update(before.values)
        result.unrequested -= legacy
        return result

    load_both.ckptstore_legacy = True
    return load_both


def references(checkpoint: str | Path) -> list[tuple[str, str]]:
    """``(reference id, component)`` of every ckptstore reference file in a TorchRL
    checkpoint folder or ZIP archive (none if it is gone or holds none)."""
    checkpoint = Path(checkpoint)
    texts: list[bytes] = []
    if checkpoint.is_dir():
        texts = [f.read_bytes()[:_MAX_REF_BYTES] for f in checkpoint.rglob(REF_FILE) if f.is_file() and not f.is_symlink()]
    elif zipfile.is_zipfile(checkpoint):
        with zipfile.ZipFile(checkpoint) as zf:
            texts = [zf.read(i)[:_MAX_REF_BYTES] for i in zf.infolist() if i.filename.rsplit("/", 1)[-1] == REF_FILE and i.file_size < _MAX_REF_BYTES]
    out = []
    for text in texts:
        try:
            ref = json.loads(text)
        except ValueError:
            continue
        if isinstance(ref, dict) and type(ref.get("ref")) is str and type(ref.get("component")) is str:
            out.append((ref["ref"], ref["component"]))
    return out


def forget(store: Store, checkpoint: str | Path) -> list[str]:
    """Delete the tags that hold TorchRL checkpoint ``checkpoint``'s data (read from its
    reference files); call it before you delete the checkpoint by hand, then run
    ``store.gc()``. Copies of the checkpoint elsewhere share its reference ids:
    forget a checkpoint only when no copy of it is kept. Returns the deleted tags."""
    gone = []
    for ref_id, component in references(checkpoint):
        try:
            store.delete_tag(_tag(ref_id, component))
            gone.append(_tag(ref_id, component))
        except RefNotFoundError:
            pass
    return gone


class StoreRotation(CheckpointRotation):
    """TorchRL's ``CheckpointRotation`` (same arguments, after ``store``) that also deletes
    the store tags of the checkpoints it removes, so ``store.gc()`` frees exactly their
    data. Checkpoints it does not remove keep their data, renamed or not."""

    def __init__(self, directory: str | Path, store: Store, **kwargs: Any):
        super().__init__(directory, **kwargs)
        self.store = store

    def _entries(self) -> dict[Path, list[tuple[str, str]]]:
        return {p: references(p) for p in self.directory.iterdir()} if self.directory.is_dir() else {}

    def _forget_removed(self, before: dict[Path, list[tuple[str, str]]]) -> None:
        for path, refs in before.items():
            if not path.exists():  # removed by this rotation, between the two looks
                for ref_id, component in refs:
                    try:
                        self.store.delete_tag(_tag(ref_id, component))
                    except RefNotFoundError:
                        pass

    def save(self, checkpoint: Checkpoint, **kwargs: Any) -> Path:
        before = self._entries()
        path = super().save(checkpoint, **kwargs)
        self._forget_removed(before)
        return path

    def prune(self) -> tuple[Path, ...]:
        before = self._entries()
        removed = super().prune()
        self._forget_removed({p: before.get(p, []) for p in removed})
        return removed


class CheckpointerHook(TrainerHookBase):
    """A TorchRL ``Trainer`` hook calling ``checkpointer.step()`` after each batch's
    optimisation steps (``post_steps``). :meth:`register` also adds the trainer
    itself to the checkpointer's objects (component ``trainer``: its counters, its
    collector's frame count and pending step, its environment's state; see
    :class:`ckptstore.adapters.torchrl.TrainerAdapter`) and, unless one is there, the
    global RNG streams (component ``rng``), so that ``hook.checkpointer.resume()``
    before ``trainer.train()`` continues the run where it stopped instead of
    starting its frame budget again (bit-identically where docs/training.md says so)."""

    def __init__(self, checkpointer: Checkpointer):
        self.checkpointer = checkpointer

    def __call__(self) -> None:
        self.checkpointer.step()

    def register(self, trainer: Any, name: str = "ckptstore") -> None:
        trainer.register_op("post_steps", self)
        trainer.register_module(name, self)
        ckpt = self.checkpointer
        if "trainer" not in ckpt.objects:
            ckpt.objects["trainer"] = trainer
            ckpt.components.append("trainer")
        if not any(isinstance(obj, RNGState) for obj in ckpt.objects.values()) and "rng" not in ckpt.objects and self._resumes_with_rng():
            ckpt.objects["rng"] = RNGState()
            ckpt.components.append("rng")

    def _resumes_with_rng(self) -> bool:
        """False when the run's latest commit was made without an ``rng`` component (by an
        earlier ckptstore): the run resumes from it, without the RNG streams, as it was."""
        store, tag = self.checkpointer.store, self.checkpointer.latest_tag
        try:
            return not isinstance(store, Store) or tag not in store.tags() or "rng" in store.components(tag)
        except CkptStoreError:  # no store yet: a new run
            return True

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.checkpointer.steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.checkpointer.steps = int(state_dict["steps"])
