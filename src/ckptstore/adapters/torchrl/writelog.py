"""Row-level change tracking of a TorchRL ``TensorStorage``: :class:`WriteLog`, which
names the rows written since a commit so that only their shards are hashed again."""

from __future__ import annotations

import threading
import weakref
from itertools import pairwise
from typing import Any

import numpy as np
import torch
from torchrl.data.replay_buffers import TensorStorage

from .layouts import storage_leaves


class WriteLog:
    """Which rows of a TorchRL ``TensorStorage`` (``ndim == 1``) were written, and when.

    Installed as the storage's ``set`` (an instance attribute calling the class's
    method) by the first commit that fingerprints the storage: every TorchRL write
    path of rows goes through ``set`` (``extend``, ``add``, ``rb[idx] = ...``,
    the writers). It also installs the storage's ``__getstate__``, which leaves both
    out: a copied or pickled storage has no log (until a commit of it installs one).
    Each call gets a write number ``seq``, and the rows it writes are stamped with it
    (one int64 per row of capacity, 8 bytes per row), so a commit hashes only the
    shards holding rows written since the last commit.

    A write the log does not see makes it forget: before and after each ``set``,
    and when a token is taken, it compares the storage's mutation revision (TorchRL
    bumps it on every write through the storage or buffer, in any process) and
    each column's address and torch version counter with what it recorded after
    the last logged write; ``set`` itself must bump the revision exactly once. Any
    difference (``rb.update_``, ``set_at_``, ``empty``, a spawned process's write, an
    in-place op on a column or a view of it) sets ``valid_from`` past every
    earlier token, so the next commit hashes whole columns. Writes that change
    neither (``.data``, numpy views, another process writing a memory map) are
    what the store's random sample of reused shards is for (see ``Store``).
    Columns that share memory (views of one buffer) are never tracked: a write to
    rows of one changes other rows of another.

    The log never raises into the training loop: any problem only makes it forget.
    """

    def __init__(self, storage: TensorStorage):
        self._ref = weakref.ref(storage)
        self._lock = threading.RLock()
        self.seq = 0
        self.valid_from = 1
        self._stamps: torch.Tensor | None = None  # write number per row, allocated at the first logged write
        self._state: tuple | None = None  # (revision, ((key, address, version), ...)) after the last logged write
        self._data: Any = None  # weak reference to the storage's backing TensorDict or tensor
        self._cols: tuple = ()  # ((key, weak reference to the column), ...)
        self._since: tuple = (None, None)  # the last rows_since answer, by (its seq, the log's seq): one per commit
        self._aliased = False  # two columns share memory

    @classmethod
    def of(cls, storage: TensorStorage) -> WriteLog | None:
        """The storage's log, installed now if it has none; ``None`` for storages it
        cannot follow (``ndim > 1``, or another ``set`` already set on the instance)."""
        current = vars(storage).get("set")
        if isinstance(current, cls) and current._ref() is storage:
            return current
        if current is not None or storage.ndim != 1:
            return None
        log = cls(storage)
        storage.set = log
        storage.__getstate__ = log._getstate  # found before the class's by copy and pickle
        return log

    def _getstate(self) -> dict:
        storage = self._ref()
        state = type(storage).__getstate__(storage)
        if state is vars(storage):
            state = dict(state)
        state.pop("set", None)
        state.pop("__getstate__", None)
        return state

    def __call__(self, cursor: Any, data: Any, *args: Any, **kwargs: Any) -> Any:
        storage = self._ref()
        method = type(storage).set.__get__(storage, type(storage))
        with self._lock:
            before = self._observe(storage)
            ok = False
            try:
                result = method(cursor, data, *args, **kwargs)
                ok = True
            finally:
                after = self._observe(storage)
                self.seq += 1
                if not (ok and before is not None and after is not None and before == self._state and after[0] == before[0] + 1 and self._stamp(cursor)):
                    self.valid_from = self.seq
                self._state = after
        return result

    def _stamp(self, cursor: Any) -> bool:
        try:
            if self._stamps is None:
                with torch.inference_mode(False):  # a first write under inference mode must not make it an inference tensor
                    self._stamps = torch.zeros(int(self._ref().max_size), dtype=torch.int64)
            self._stamps[torch.as_tensor(cursor) if isinstance(cursor, range) else cursor] = self.seq
        except (TypeError, ValueError, IndexError, RuntimeError):
            return False
        return True

    def _observe(self, storage: TensorStorage, refresh: bool = False) -> tuple | None:
        try:
            if not storage.initialized:
                return None
            data = storage._storage
            tensors = [ref() for _, ref in self._cols]
            if refresh or self._data is None or self._data() is not data or any(t is None for t in tensors):
                leaves = storage_leaves(data, "storage")
                self._data = weakref.ref(data)
                self._cols = tuple((k, weakref.ref(t)) for k, t in leaves.items())
                tensors = list(leaves.values())
                spans = sorted((m.data_ptr(), m.data_ptr() + m.nbytes()) for m in (t.untyped_storage() for t in tensors))
                self._aliased = any(b[0] < a[1] for a, b in pairwise(spans))  # overlapping memory
            return int(storage._mutation_revision), tuple((k, t.data_ptr(), t._version) for (k, _), t in zip(self._cols, tensors))
        except Exception:  # noqa: BLE001 - a write through the buffer must never fail because of the log
            return None

    def token_seq(self, storage: TensorStorage) -> int:
        """The write number for tokens taken now. If anything was written since the
        last logged write that the log did not see (the columns are listed afresh:
        one added or replaced is such a write), earlier tokens become incomparable."""
        with self._lock:
            now = self._observe(storage, refresh=True)
            if now is None or now != self._state or self._aliased:
                self.seq += 1
                self.valid_from = self.seq
                self._state = now
            return self.seq

    def rows_since(self, seq: int) -> torch.Tensor | None:
        """Indices of the rows written after write number ``seq``, or ``None`` if the
        log cannot tell (an unseen write since)."""
        with self._lock:
            if seq < self.valid_from or self._stamps is None:
                return None
            if self._since[0] != (seq, self.seq):
                # numpy's flatnonzero: a quarter of torch's compare-then-nonzero time on a large buffer
                self._since = (seq, self.seq), torch.from_numpy(np.flatnonzero(self._stamps.numpy() > seq))
            return self._since[1]
