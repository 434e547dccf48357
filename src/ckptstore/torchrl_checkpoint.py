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

TorchRL's ``Trainer(checkpoint=ckpt, ...)`` saves through the same object, so
a Trainer gets dedup the same way. Each component's commit is tagged
``torchrl-checkpoint:<checkpoint path>:<component>``; after ``CheckpointRotation``
deletes old checkpoints, :func:`prune_tags` drops their tags so that
``ckptstore gc`` can free the data.

Component names map one to one: TorchRL's component ``replay_buffer`` is
ckptstore's component ``replay_buffer`` (``replay_buffer/storage``...), and
``torchrl.checkpoint.GlobalRNGState`` is stored like :class:`ckptstore.RNGState`.

:class:`CheckpointerHook` plugs a :class:`ckptstore.Checkpointer` into a
TorchRL ``Trainer`` as a ``post_steps`` operation.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torchrl.checkpoint import Checkpoint, CheckpointAdapter
from torchrl.data import ReplayBuffer
from torchrl.trainers import TrainerHookBase

from .checkpointer import Checkpointer
from .errors import ContainerError
from .store import Store

REF_FILE = "ckptstore-ref.json"
TAG_PREFIX = "torchrl-checkpoint:"
_STAGE = re.compile(r"^\.(?P<name>.+)\.stage-[0-9a-f]{32}$")


def _destination(component_path: Path) -> tuple[str, str]:
    """``(checkpoint path, component name)`` from the staging path TorchRL hands adapters."""
    stage = component_path.parent.parent
    match = _STAGE.match(stage.name)
    dest = stage.parent / match.group("name") if match else stage
    return str(dest.resolve()), component_path.name.split("-", 1)[-1]


class StoreCheckpointAdapter(CheckpointAdapter):
    """A ``torchrl.checkpoint`` adapter that keeps the component's state in a ckptstore store.

    ``save`` commits the component (any object ckptstore has an adapter for) and
    writes ``{"store", "commit", "component"}`` to ``ckptstore-ref.json``;
    ``load`` checks that commit out into the live component in place.

    Raises (on load): ContainerError if the reference file is missing or
    malformed; RefNotFoundError if the store lacks the commit.
    """

    adapter_id = "ckptstore.store"
    format_version = 1

    def __init__(self, store: Store):
        self.store = store

    def save(self, component: Any, path: Path, *, args: tuple, kwargs: Mapping[str, Any]) -> Any:
        path.mkdir(parents=True, exist_ok=True)
        dest, name = _destination(path)
        info = self.store.commit(component, tag=f"{TAG_PREFIX}{dest}:{name}", message=f"torchrl checkpoint {dest} {name}")
        (path / REF_FILE).write_text(json.dumps({"store": str(self.store.root.resolve()), "commit": info.id, "component": name}))
        return None

    def load(self, component: Any, path: Path, *, map_location: Any, tensor_load_kwargs: Mapping[str, Any],
             args: tuple, kwargs: Mapping[str, Any]) -> Any:
        try:
            ref = json.loads((path / REF_FILE).read_text())
            commit = ref["commit"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ContainerError(f"{path / REF_FILE}: not a ckptstore reference ({exc})") from None
        self.store.checkout(commit, into=component)
        return None


DEFAULT_TYPES = (ReplayBuffer, torch.nn.Module, torch.optim.Optimizer)


def use_store(checkpoint: Checkpoint, store: Store, types: Iterable[type] = DEFAULT_TYPES) -> Checkpoint:
    """Route every component of ``checkpoint`` of one of ``types`` through ``store``; returns it."""
    adapter = StoreCheckpointAdapter(store)
    for t in types:
        checkpoint.register_adapter(t, adapter)
    return checkpoint


def prune_tags(store: Store) -> list[str]:
    """Delete the tags of TorchRL checkpoints whose folder or archive no longer exists.

    Returns the deleted tag names; run ``store.gc()`` afterwards to free the data.
    """
    gone = []
    for tag in store.tags():
        if tag.startswith(TAG_PREFIX):
            dest = tag[len(TAG_PREFIX):].rsplit(":", 1)[0]
            if not Path(dest).exists():
                store.delete_tag(tag)
                gone.append(tag)
    return gone


class CheckpointerHook(TrainerHookBase):
    """A TorchRL ``Trainer`` hook calling ``checkpointer.step()`` after each batch's
    optimisation steps (``post_steps``); ``resume()`` before ``trainer.train()``
    restores the run."""

    def __init__(self, checkpointer: Checkpointer):
        self.checkpointer = checkpointer

    def __call__(self) -> None:
        self.checkpointer.step()

    def register(self, trainer: Any, name: str = "ckptstore") -> None:
        trainer.register_op("post_steps", self)
        trainer.register_module(name, self)

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.checkpointer.steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.checkpointer.steps = int(state_dict["steps"])
