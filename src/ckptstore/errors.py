"""Public path of :mod:`ckptstore.core.errors` (moved there in the layered tree; docs/changelog.md).

``import ckptstore.errors`` gives that module itself, not a copy.
"""

import sys

from .core import errors as _module

sys.modules[__name__] = _module
