"""The command line: JSON output for scripts, tables, one-line errors."""

from __future__ import annotations

import json

import pytest
import torch
from rich.console import Console

import ckptstore
from ckptstore.cli import common as cli_module  # the console the commands print to
from ckptstore.cli import main


def cli_at(width: int, monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """Run the CLI in process on a console ``width`` columns wide (as ``COLUMNS=width``): ``(exit code, stdout, stderr)``."""
    monkeypatch.setattr("sys.argv", ["ckptstore", *args])
    monkeypatch.setattr(cli_module, "console", Console(width=width, highlight=False))
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def cli(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """:func:`cli_at` on a console wide enough not to wrap."""
    return cli_at(300, monkeypatch, capsys, *args)


@pytest.fixture
def filled(tmp_path):
    with ckptstore.Store(tmp_path / "s", shard_bytes=4096) as s:
        a = s.commit({"w": torch.zeros(4096), "n": 1}, tag="t", message="one")
        b = s.commit({"w": torch.cat([torch.zeros(2048), torch.ones(2048)]), "n": 2}, tag="t", message="two")
    return tmp_path / "s", a, b


def test_log_tags_show_du_json(filled, monkeypatch, capsys):
    path, a, b = filled
    code, out, _ = cli(monkeypatch, capsys, "log", "t", "--store", str(path), "--json")
    assert code == 0
    log = json.loads(out)
    assert [c["id"] for c in log] == [b.id, a.id] and log[0]["parents"] == [a.id]
    code, out, _ = cli(monkeypatch, capsys, "tags", "--store", str(path), "--json")
    assert json.loads(out) == {"t": b.id}
    code, out, _ = cli(monkeypatch, capsys, "show", "t", "--store", str(path), "--json")
    detail = json.loads(out)
    w = next(leaf for leaf in detail["leaves"] if leaf["path"] == "w")
    assert (w["dtype"], w["shape"], w["logical_bytes"], w["shards"]) == ("float32", [4096], 16384, 4)
    assert w["shared_with_parent"] == 2  # the first half of w did not change
    assert detail["components"][""]["adapter"] == "dict"  # a dict of plain values is one component
    code, out, _ = cli(monkeypatch, capsys, "du", "--store", str(path), "--json")
    usage = json.loads(out)
    assert usage["commits"] == 2 and usage["logical_bytes"] == 2 * 16384
    assert usage["unique_bytes"] == 4096 * 2  # zeros shard and ones shard, each 4096 bytes
    assert usage["dedup_ratio"] == 4.0


def test_tables_and_env_var(filled, monkeypatch, capsys):
    path, _, b = filled
    monkeypatch.setenv("CKPTSTORE_PATH", str(path))
    for args in (("log",), ("tags",), ("show", b.id[:10]), ("du",), ("reflog", "t")):
        code, out, err = cli(monkeypatch, capsys, *args)
        assert code == 0, err
        assert b.id[:12] in out or args[0] == "du"


def test_errors_are_one_line_and_non_zero(tmp_path, filled, monkeypatch, capsys):
    path, _, _ = filled
    for args in (("log", "--store", str(tmp_path / "nowhere")), ("show", "nope", "--store", str(path)),
                 ("export", "t", str(path), "--store", str(path))):
        code, out, err = cli(monkeypatch, capsys, *args)
        assert code == 1 and out == ""
        assert err.startswith("error: ") and err.count("\n") == 1, err
    usage = {
        ("show", "--store", str(path)): "error: Missing argument 'ref'.",
        ("gc", "--keep-last", "abc", "--store", str(path)): "error: Invalid value for '--keep-last'",
        ("tags", "--nope", "--store", str(path)): "error: No such option: --nope",
        ("nosuchcmd",): "error: No such command 'nosuchcmd'.",
    }
    for args, start in usage.items():  # click's usage errors: one line too, exit 2
        code, out, err = cli(monkeypatch, capsys, *args)
        assert code == 2 and out == "" and err.startswith(start) and err.count("\n") == 1, err


def test_export_import_commands(filled, tmp_path, monkeypatch, capsys):
    path, _, _ = filled
    code, _, err = cli(monkeypatch, capsys, "export", "t", str(tmp_path / "e.zip"), "--store", str(path))
    assert code == 0, err
    code, out, err = cli(monkeypatch, capsys, "import", str(tmp_path / "e.zip"), "--tag", "back", "--store", str(tmp_path / "other"), "--json")
    assert code == 0, err
    with ckptstore.Store(tmp_path / "other", create=True) as other:
        assert other.tags() == {"back": json.loads(out)["id"]}
        assert torch.equal(other.checkout("back")["w"], torch.cat([torch.zeros(2048), torch.ones(2048)]))


def test_global_store_version_help_and_tag_commands(filled, tmp_path, monkeypatch, capsys):
    path, _, _ = filled
    for args in (("--store", str(path), "tags", "--json"), ("-s", str(path), "tags", "--json"), ("tags", "--json", "--store", str(path))):
        code, out, err = cli(monkeypatch, capsys, *args)
        assert code == 0 and out.count("\n") == 1 and json.loads(out).keys() == {"t"}, err  # one JSON document per line
    monkeypatch.setenv("CKPTSTORE_PATH", str(path))
    code, out, _ = cli(monkeypatch, capsys, "tag", "v", "t", "--json")
    assert code == 0 and json.loads(out)["tag"] == "v"
    code, out, _ = cli(monkeypatch, capsys, "delete-tag", "v")
    assert code == 0 and out.startswith("deleted v")
    code, _, err = cli(monkeypatch, capsys, "tag", "--", "-x", "t")
    assert code == 1 and "not starting with '-'" in err
    code, out, _ = cli(monkeypatch, capsys, "--version")
    assert code == 0 and out.startswith("ckptstore ")
    code, out, _ = cli(monkeypatch, capsys, "-h")
    assert code == 0 and "delete-tag" in out and "recover" in out
    with ckptstore.Store(path, create=False) as s:
        assert sorted(s.tags()) == ["t"] and [r["action"] for r in s.reflog("v")] == ["delete", "tag"]


def test_tables_keep_ids_and_tags_whole_at_80_columns(filled, monkeypatch, capsys):
    path, _, _ = filled
    with ckptstore.Store(path) as s:
        s.tag("a-rather-long-tag-name-for-a-run", "t")
        ids = [c.id[:12] for c in s.log()]
    monkeypatch.setattr("sys.argv", ["ckptstore", "log", "--store", str(path)])
    monkeypatch.setattr(cli_module, "console", Console(width=80, highlight=False))
    with pytest.raises(SystemExit):
        main()
    out = capsys.readouterr().out
    assert all(len(line) <= 80 for line in out.splitlines())
    assert all(i in out for i in ids) and "a-rather-long-tag-name-for-a-run" in out


def test_catalog_only_commands_never_import_torch(filled):
    """tags, log, show, du, reflog, gc, fsck (not --deep) and verify read the catalog only: no torch import."""
    import subprocess
    import sys

    path, _, _ = filled
    code = (
        "import sys, runpy; sys.argv = ['ckptstore'] + sys.argv[1:]\n"
        "try:\n    runpy.run_module('ckptstore.cli', run_name='__main__')\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "assert 'torch' not in sys.modules and 'tensordict' not in sys.modules, 'torch was imported'\n"
    )
    for args in (["tags"], ["log", "t"], ["show", "t"], ["du"], ["reflog"], ["gc", "--dry-run"], ["gc", "--grace", "1h"], ["fsck"], ["verify", "t"]):
        proc = subprocess.run([sys.executable, "-c", code, *args, "--store", str(path)], capture_output=True, text=True)
        assert proc.returncode == 0, (args, proc.stderr[-2000:])


def test_torch_free_layout_agrees_with_torch():
    from ckptstore import layout
    from ckptstore.core.shards import DTYPES

    assert layout.ITEMSIZE == {n: d.itemsize for n, d in DTYPES.items()}
    for shape in ([0, 2**62], [0, 2**62, 4], [2**31, 2**31], [2**40, 2**22], [3, 0, 5], [2**20, 2**20], [], [1] * 64):
        try:
            torch.empty(shape, dtype=torch.float32, device="meta")
            ok = True
        except (RuntimeError, OverflowError):
            ok = False
        try:
            layout.check_shape(shape, 4)
            mine = True
        except ValueError:
            mine = False
        assert mine == ok, shape


def test_long_work_reports_progress(filled, tmp_path, monkeypatch):
    """export, import, fsck --deep, GC repacks, commits and checkouts report bytes through ckptstore.core.progress."""
    import contextlib

    from ckptstore.core import progress

    seen: dict[str, int] = {}

    @contextlib.contextmanager
    def reporter(description, total):
        seen[description.split()[0]] = 0

        def advance(n):
            seen[description.split()[0]] += n

        yield advance
        assert seen[description.split()[0]] == total, description

    monkeypatch.setattr(progress, "MIN_BYTES", 0)
    path, _, _ = filled
    with progress.reporting(reporter), ckptstore.Store(path) as s:
        s.commit({"big": torch.randn(50_000)}, tag="big")
        s.checkout("big")
        s.fsck(deep=True)
        s.export("big", tmp_path / "big.zip")
        ckptstore.Store(tmp_path / "o", create=True).import_from(tmp_path / "big.zip", tag="big")
    assert {"commit:", "checkout", "fsck", "export", "verify"} <= set(seen) and seen["fsck"] > 200_000


def test_every_command_takes_an_s3_store(s3_server, tmp_path, monkeypatch, capsys):
    import uuid

    url = f"s3://ckpt/cli-{uuid.uuid4().hex[:10]}"
    with ckptstore.Store(url, shard_bytes=4096) as s:
        a = s.commit({"w": torch.zeros(4096), "n": 1}, tag="t", message="one")
        b = s.commit({"w": torch.cat([torch.zeros(2048), torch.ones(2048)]), "n": 2}, tag="t", message="two")
    code, out, _ = cli(monkeypatch, capsys, "--store", url, "log", "t", "--json")
    assert code == 0 and [c["id"] for c in json.loads(out)] == [b.id, a.id]
    code, out, _ = cli(monkeypatch, capsys, "tags", "--store", url, "--json")
    assert json.loads(out) == {"t": b.id}
    code, out, _ = cli(monkeypatch, capsys, "show", "t", "--store", url, "--json")
    w = next(leaf for leaf in json.loads(out)["leaves"] if leaf["path"] == "w")
    assert (w["shards"], w["shared_with_parent"]) == (4, 2)
    assert cli(monkeypatch, capsys, "tag", "old", a.id[:8], "--store", url)[0] == 0
    code, out, _ = cli(monkeypatch, capsys, "reflog", "old", "--store", url, "--json")
    assert [(m["action"], m["new_commit"]) for m in json.loads(out)] == [("tag", a.id)]
    code, out, _ = cli(monkeypatch, capsys, "diff", "old", "t", "--store", url, "--json")
    assert code == 0
    assert cli(monkeypatch, capsys, "verify", "t", "--store", url)[0] == 0
    assert cli(monkeypatch, capsys, "delete-tag", "old", "--store", url)[0] == 0
    code, out, _ = cli(monkeypatch, capsys, "gc", "--grace", "0s", "--store", url, "--json")
    assert code == 0 and json.loads(out)["dropped"] == [a.id]
    code, out, _ = cli(monkeypatch, capsys, "fsck", "--deep", "--store", url, "--json")
    assert code == 0 and json.loads(out)["ok"] and json.loads(out)["commits"] == 1
    code, out, _ = cli(monkeypatch, capsys, "du", "--store", url, "--json")
    assert code == 0 and json.loads(out)["commits"] == 1
    code, out, _ = cli(monkeypatch, capsys, "export", "t", str(tmp_path / "x.zip"), "--store", url)
    assert code == 0 and (tmp_path / "x.zip").is_file()
    code, _, err = cli(monkeypatch, capsys, "tags", "--store", "s3://nosuchbucket-ckpt/x")
    assert code != 0 and len(err.strip().splitlines()) == 1 and "does not exist" in err


def test_object_storage_mistakes_get_one_line_hints(s3_server, tmp_path, monkeypatch, capsys):
    code, _, err = cli(monkeypatch, capsys, "pull", "s3://ckpt/never-pushed", "latest", "--store", str(tmp_path / "new"))
    assert code != 0 and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "new").exists()  # a failed pull leaves no empty store behind
    for url in ("gs://ckpt/x", "S3://ckpt/x", "s3a://ckpt/x"):
        code, _, err = cli(monkeypatch, capsys, "tags", "--store", url)
        assert code != 0 and "unsupported store location" in err and len(err.strip().splitlines()) == 1
    with pytest.raises(ckptstore.errors.InvalidArgumentError):
        ckptstore.Store("gs://ckpt/x", create=True)
    assert not list(tmp_path.glob("gs*"))
    monkeypatch.delenv("AWS_ALLOW_HTTP")
    code, _, err = cli(monkeypatch, capsys, "tags", "--store", "s3://ckpt/x")
    assert code != 0 and "AWS_ALLOW_HTTP=true" in err and len(err.strip().splitlines()) == 1


@pytest.fixture
def long_leaf(tmp_path):
    """Two commits of a state whose one changed leaf has a 60-character path."""
    name = "encoder/" + "a_rather_long_module_name_" * 2 + "w"
    with ckptstore.Store(tmp_path / "s", shard_bytes=4096) as s:
        a = s.commit({name: torch.zeros(4096), "n": 1}, tag="t")
        b = s.commit({name: torch.cat([torch.zeros(3072), torch.ones(1024)]), "n": 1}, tag="t")
    return tmp_path / "s", a.id, b.id


@pytest.mark.parametrize("width", [80, 200])
def test_diff_shows_every_column_at_any_width(long_leaf, width, monkeypatch, capsys):
    path, a, b = long_leaf
    code, out, err = cli_at(width, monkeypatch, capsys, "diff", a, b, "--store", str(path))
    assert code == 0, err
    lines = out.splitlines()
    assert all(len(line) <= width for line in lines)
    header = next(line for line in lines if "leaf" in line)
    assert "new bytes" in header and "changed" in header
    row = next(line for line in lines if "│ changed" in line)
    assert row.rstrip(" │").endswith("4.0 KiB")  # the leaf's new bytes: one 4 KiB shard


@pytest.mark.parametrize("width", [80, 200])
def test_show_says_which_columns_a_narrow_terminal_drops(filled, width, monkeypatch, capsys):
    path, _, b = filled
    code, out, err = cli_at(width, monkeypatch, capsys, "show", "t", "--store", str(path))
    assert code == 0, err
    text = " ".join(out.split())  # the caption may wrap
    if width == 80:
        assert "not shown at 80 columns: kind, shards, shared w/ parent (120 columns or --json show them)" in text
        assert "not shown at 80 columns: parents, stored, dedup, seconds" in text
    else:
        assert "not shown" not in text and "shared w/ parent" in text and "parents" in text


def test_diff_json_lists_what_the_text_lists(filled, monkeypatch, capsys):
    path, a, b = filled
    for extra, statuses in (((), {"w": "changed", "n": "changed"}), (("--all",), {"w": "changed", "n": "changed"})):
        code, out, _ = cli(monkeypatch, capsys, "diff", a.id, a.id, "--store", str(path), "--json", *extra)
        listed = json.loads(out)
        assert listed["counts"] == {"added": 0, "removed": 0, "changed": 0, "unchanged": 2}
        assert [x["path"] for x in listed["leaves"]] == (["n", "w"] if extra else [])
        code, out, _ = cli(monkeypatch, capsys, "diff", a.id, a.id, "--store", str(path), *extra)
        assert ("│ unchanged" in out) == bool(extra)
        code, out, _ = cli(monkeypatch, capsys, "diff", a.id, b.id, "--store", str(path), "--json", *extra)
        assert {x["path"]: x["status"] for x in json.loads(out)["leaves"]} == statuses


def test_messages_state_rules_and_counts_in_words(filled, monkeypatch, capsys):
    path, a, _ = filled
    code, out, err = cli(monkeypatch, capsys, "show", "733", "--store", str(path))
    assert (code, err) == (1, f"error: no tag or commit named '733' in {path} (a commit id prefix needs at least 4 hex digits)\n")
    code, out, err = cli(monkeypatch, capsys, "show", "nope", "--store", str(path))
    assert err == f"error: no tag or commit named 'nope' in {path}\n"
    code, out, err = cli(monkeypatch, capsys, "verify", a.id, "--store", str(path))
    assert code == 0 and out.splitlines()[-1].startswith("ok: 1 commit, 1 blob rehashed")
    for args in (("gc", "-h"), ("-h",), ("show", "--help")):
        code, out, _ = cli(monkeypatch, capsys, *args)
        assert code == 0 and "Show this message and exit" in out and "<bool>" not in out, args


def test_usage_errors_point_to_the_subcommands_help(filled, monkeypatch, capsys):
    path, _, _ = filled
    for args, hint in ((("show", "--store", str(path)), "see ckptstore show --help"), (("gc", "--keep-last", "x"), "see ckptstore gc --help"),
                       (("nosuchcmd",), "see ckptstore --help"), (("--nope",), "see ckptstore --help")):
        code, out, err = cli(monkeypatch, capsys, *args)
        assert code == 2 and err.count("\n") == 1 and err.rstrip().endswith(f"({hint})"), err


def test_du_counts_the_full_disk_reserve_apart_from_the_catalog_and_log_marks_a_root(filled, monkeypatch, capsys):
    path, a, b = filled
    reserve = (path / "catalog.sqlite-reserve").stat().st_size
    code, out, _ = cli(monkeypatch, capsys, "du", "--store", str(path), "--json")
    usage = json.loads(out)
    assert code == 0 and usage["reserve_bytes"] == reserve == 4 << 20
    assert 0 < usage["catalog_bytes"] < 1 << 20  # the catalog (and its WAL while open), not the 4 MiB reserve
    code, out, _ = cli(monkeypatch, capsys, "du", "--store", str(path))
    assert code == 0 and [line.split("│")[2].strip() for line in out.splitlines() if "reserve bytes" in line] == ["4.0 MiB"]
    code, out, _ = cli(monkeypatch, capsys, "log", "t", "--store", str(path))
    rows = {line.split("│")[1].strip(): line.split("│")[3].strip() for line in out.splitlines() if line.startswith("│")}
    assert code == 0 and rows == {b.id[:12]: a.id[:12], a.id[:12]: "-"}  # a root commit has no parents: "-", as in the demo


def test_runs_on_a_store_without_runs_says_so(filled, monkeypatch, capsys):
    path, _, _ = filled
    code, out, _ = cli(monkeypatch, capsys, "runs", "--store", str(path))
    assert (code, out) == (0, "no runs: no commit here was made by a Checkpointer (Checkpointer(store, objects, run=NAME) starts one)\n")
    code, out, _ = cli(monkeypatch, capsys, "runs", "--store", str(path), "--json")
    assert (code, json.loads(out)) == (0, [])


def test_gc_text_names_the_consolidated_packs_and_the_net_bytes(tmp_path, monkeypatch, capsys):
    """The gc line says how many small packs were merged (before, only ``repacked`` was printed)
    and the net bytes freed, the report's ``bytes_freed``."""
    with ckptstore.Store(tmp_path / "s", shard_bytes=4096) as s:
        for i in range(3):
            s.commit({"w": torch.full((1024,), float(i))}, tag="t")
    code, out, _ = cli(monkeypatch, capsys, "gc", "--grace", "0", "--keep-last", "3", "--store", str(tmp_path / "s"), "--json")
    report = json.loads(out)
    assert code == 0 and report["packs_consolidated"] == 6 and report["packs_repacked"] == 0  # a blob pack and a record pack each
    with ckptstore.Store(tmp_path / "s", shard_bytes=4096) as s:
        for i in range(3, 5):
            s.commit({"w": torch.full((1024,), float(i))}, tag="t")
    code, out, _ = cli(monkeypatch, capsys, "gc", "--grace", "0", "--keep-last", "5", "--store", str(tmp_path / "s"))
    assert code == 0 and "0 repacked, 5 consolidated," in out and "freed on disk (net of the packs written)" in out, out


def test_one_line_messages_stay_one_line_at_any_width(filled, monkeypatch, capsys):
    """gc's summary, verify's, diff's counts and a tag move print as one line each on a
    narrow console (a script's or cron's log got them cut at 80 columns), and a name is
    printed as written, not read as rich markup."""
    path, a, b = filled
    code, out, _ = cli_at(80, monkeypatch, capsys, "gc", "--dry-run", "--store", str(path))
    lines = out.splitlines()
    assert code == 0 and len(lines) == 2, out
    assert lines[0].startswith("gc would free: 0 commits, 0 blobs (0 B in packs), 0 packs deleted, ") and lines[1].startswith("phases: ")
    assert "on disk (net of the packs written); pending the grace period: 1 commit, 0 blobs, " in lines[0]
    code, out, _ = cli_at(40, monkeypatch, capsys, "verify", "t", "--store", str(path))
    assert code == 0 and out.count("\n") == 1 and out.startswith("ok: 1 commit, ") and out.rstrip().endswith("0 tmp files"), out
    code, out, _ = cli_at(40, monkeypatch, capsys, "diff", a.id, b.id, "--store", str(path))
    assert code == 0 and out.splitlines()[-1] == f"0 added, 0 removed, 2 changed, 0 unchanged; 4.0 KiB new in {b.id[:12]}", out
    for name in ("a-rather-long-tag-name-for-a-nightly-run", "[red]x"):
        code, out, _ = cli_at(40, monkeypatch, capsys, "tag", name, "t", "--store", str(path))
        assert (code, out) == (0, f"{name} -> {b.id}\n")
        code, out, _ = cli_at(40, monkeypatch, capsys, "delete-tag", name, "--store", str(path))
        assert (code, out) == (0, f"deleted {name} (was {b.id})\n")


def test_show_and_diff_print_keys_as_written_folded_after_separators_at_80_columns(long_leaf, monkeypatch, capsys):
    """The leaf whose one key is ``encoder/a_rather...`` prints as that key, quoted (it holds a
    "/"), not as its stored segment ``encoder%2Fa_rather...``; at 80 columns its name folds
    after a "/" or "_", never mid-word."""
    path, a, b = long_leaf
    name = '"encoder/' + "a_rather_long_module_name_" * 2 + 'w"'
    for args, title in ((("diff", a, b), f"{a[:12]} -> {b[:12]}"), (("show", b), "leaves")):
        code, out, err = cli_at(80, monkeypatch, capsys, *args, "--store", str(path))
        assert code == 0 and "%2F" not in out, err
        lines = out.splitlines()
        assert all(len(line) <= 80 for line in lines)
        body = lines[next(i for i, line in enumerate(lines) if line.strip() == title):]
        body = body[next(i for i, line in enumerate(body) if line.startswith("┡")) + 1:]
        cells = [line.split("│")[1].strip() for line in body if line.startswith("│")]
        cells = [c for c in cells if c != "n"]  # show lists the unchanged leaf n too
        assert "".join(cells) == name and len(cells) > 1, cells
        assert all(c.endswith(("/", "_")) for c in cells[:-1]), cells


def test_shown_path_spells_every_key_apart():
    from ckptstore.cli import shown_path
    from ckptstore.layout import keypath

    cases = {("rb", "storage", "x"): "rb/storage/x", ("rb", "x/y"): 'rb/"x/y"', ("",): '""', ("a", '"q"'): 'a/"\\"q\\""',
             ("<root>",): '"<root>"', ("50%",): "50%", ("a%2Fb",): "a%2Fb", ("x\n",): "x\n"}
    assert shown_path("") == "<root>"
    for keys, shown in cases.items():
        assert shown_path(keypath(*keys)) == shown, keys
    assert len({shown_path(keypath(*keys)) for keys in cases}) == len(cases)


def _pipe_cli(args: list[str], close_first: bool) -> tuple[int, str, str]:
    """Run ``python -m ckptstore.cli ARGS`` with its stdout a pipe into ``head -1`` (or, with
    ``close_first``, a pipe whose reader is already gone: the first write finds it closed):
    ``(the CLI's exit status, its stderr, what head printed)``."""
    import os
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryFile("w+") as errors:
        if close_first:
            r, w = os.pipe()
            os.close(r)
            proc = subprocess.Popen([sys.executable, "-m", "ckptstore.cli", *args], stdout=w, stderr=errors)
            os.close(w)
            head_out = ""
        else:
            proc = subprocess.Popen([sys.executable, "-m", "ckptstore.cli", *args], stdout=subprocess.PIPE, stderr=errors)
            head = subprocess.Popen(["head", "-1"], stdin=proc.stdout, stdout=subprocess.PIPE, text=True)
            proc.stdout.close()  # head holds the only reader
            head_out = head.communicate(timeout=300)[0]
        code = proc.wait(timeout=300)
        errors.seek(0)
        return code, errors.read(), head_out


def test_read_only_commands_end_quietly_when_the_reader_leaves(tmp_path):
    """``ckptstore diff A B | head -1`` and every other read-only command: status 0 and
    nothing on stderr once head has its line (click turned the broken pipe into a silent
    exit 1). log, show, diff, tags and reflog print far more than a pipe holds (64 KiB), so
    head leaves mid-output; every command also meets a reader gone before its first write."""
    path = tmp_path / "s"
    with ckptstore.Store(path) as s:
        a = s.commit({f"k{i}": torch.full((2,), float(i)) for i in range(1500)}, tag="t", message="a long message " * 6000)
        b = s.commit({f"k{i}": torch.full((2,), float(-i)) for i in range(1500)}, tag=["t", *(f"run-{i:04d}-with-a-rather-long-tag-name" for i in range(1000))])
    st = ["--store", str(path)]
    commands = [["log", *st], ["log", "t", "--json", *st], ["show", "t", *st], ["show", "t", "--json", *st], ["diff", a.id, b.id, *st],
                ["diff", a.id, b.id, "--json", *st], ["tags", *st], ["tags", "--json", *st], ["reflog", *st], ["du", *st], ["du", "--json", *st],
                ["runs", *st], ["fsck", *st], ["verify", "t", *st], ["gc", "--dry-run", *st], ["--version"], ["show", "--help"]]
    for args in commands:
        code, err, first = _pipe_cli(args, close_first=False)
        assert (code, err) == (0, ""), (args, code, err[-2000:])
        assert first.endswith("\n") and len(first.splitlines()) == 1, (args, first)
        code, err, _ = _pipe_cli(args, close_first=True)
        assert (code, err) == (0, ""), (args, code, err[-2000:])


def test_a_closed_reader_does_not_hide_what_fsck_found(tmp_path):
    """fsck still exits 1 for a damaged store when its reader left mid-output."""
    path = tmp_path / "s"
    with ckptstore.Store(path) as s:
        s.commit({"w": torch.arange(4096.0)}, tag="t")
    for pack in (path / "blobs").rglob("*.pack"):
        pack.write_bytes(b"")
    code, err, _ = _pipe_cli(["fsck", "--store", str(path)], close_first=True)
    assert (code, err) == (1, "")


def test_torchrl_log_lines_stay_out_of_the_cli_only(tmp_path):
    """torchrl's logger (set up at import, INFO on stdout by default) is at WARNING in a
    command (a LazyTensorStorage's "Initialized ..." line no longer in the output), unless the
    user set $RL_LOGGING_LEVEL; a program that imports ckptstore keeps torchrl's default."""
    import os
    import subprocess
    import sys

    code = (
        "import sys, logging\nfrom ckptstore.cli import common as cli\n"
        "def invoke():\n    import torch, torchrl.data\n    from tensordict import TensorDict\n"
        "    torchrl.data.LazyTensorStorage(4).set(0, TensorDict({'x': torch.zeros(1)}, [1]))\n"
        "    print('level', logging.getLogger('torchrl').getEffectiveLevel())\n"
        "if sys.argv[1] == 'cli':\n    cli.invoke = invoke\n    sys.argv = ['ckptstore', '--help']\n    cli.main()\nelse:\n    invoke()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "RL_LOGGING_LEVEL"}
    for where, extra, level, logged in (("cli", {}, 30, False), ("cli", {"RL_LOGGING_LEVEL": "INFO"}, 20, True), ("library", {}, 20, True)):
        proc = subprocess.run([sys.executable, "-c", code, where], capture_output=True, text=True, env={**env, **extra}, cwd=tmp_path, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.splitlines()[-1] == f"level {level}" and ("[torchrl][INFO]" in proc.stdout) == logged, (where, extra, proc.stdout)
