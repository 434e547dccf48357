"""The check every TorchRL adapter makes first: the target is of the class the component was taken from."""

from __future__ import annotations

from typing import Any

from ...core.errors import TargetMismatchError
from ..base import ComponentState


def expect_instance(obj: Any, cls: type, state: ComponentState) -> None:
    """Raise TargetMismatchError, naming the stored class and the target's, unless ``obj`` is a ``cls``."""
    if not isinstance(obj, cls):
        raise TargetMismatchError(
            f"{state.where('')}: stored a {state.meta.get('class', state.adapter)}, target is a {type(obj).__module__}.{type(obj).__qualname__}"
        )
