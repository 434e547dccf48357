"""``python -m ckptstore.cli``: the ``ckptstore`` command."""

from . import main

main()
