"""The ``ckptstore`` command line (typer + rich).

Every command takes ``--store PATH`` (or the ``CKPTSTORE_PATH`` environment
variable) and ``--json`` for machine-readable output. Errors print one line,
``error: <message>``, on stderr and exit with status 1; usage errors exit 2;
``gc`` exits 3 when another GC holds the store; ``fsck`` and ``verify`` exit 1
when they find a problem.

The typer ``app``, :func:`main`, the one-line error handling (:func:`invoke`), the options and
the output helpers every command shares are in :mod:`.common`; the commands live in one
module per group: :mod:`.views` (``log``, ``runs``, ``show``, ``diff``,
``du``), :mod:`.tagging` (``tags``, ``tag``, ``delete-tag``, ``reflog``),
:mod:`.transfers` (``push``, ``pull``, ``export``, ``import``, ``import-torchrl``),
:mod:`.maintenance` (``gc``, ``fsck``, ``verify``, ``recover``) and :mod:`.demo_cmd`
(``demo``), and are registered here.
"""

from .common import app, invoke, main, shown_path  # noqa: F401 (the entry point ckptstore.cli:main, and what tests use)

# The commands, one module per group, registered in this order (``--help`` lists them so).
from .demo_cmd import demo
from .maintenance import fsck, gc, recover, verify
from .tagging import delete_tag_cmd, natural_key, reflog, tag_cmd, tags  # noqa: F401 (natural_key: re-exported)
from .transfers import export_cmd, import_cmd, import_torchrl_cmd, pull, push
from .views import diff, du, log, runs_cmd, show

for _name, _command in (
    ("log", log),
    ("tags", tags),
    ("runs", runs_cmd),
    ("tag", tag_cmd),
    ("push", push),
    ("pull", pull),
    ("delete-tag", delete_tag_cmd),
    ("reflog", reflog),
    ("show", show),
    ("diff", diff),
    ("du", du),
    ("gc", gc),
    ("fsck", fsck),
    ("verify", verify),
    ("recover", recover),
    ("export", export_cmd),
    ("import", import_cmd),
    ("import-torchrl", import_torchrl_cmd),
    ("demo", demo),
):
    app.command(_name)(_command)
del _name, _command
