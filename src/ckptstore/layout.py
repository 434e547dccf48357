"""Public path of :mod:`ckptstore.core.layout` (moved there in the layered tree; docs/changelog.md).

``import ckptstore.layout`` gives that module itself, not a copy.
"""

import sys

from .core import layout as _module

sys.modules[__name__] = _module
