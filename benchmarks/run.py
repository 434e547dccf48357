"""Run the benchmark suite: every workload against ckptstore and its peers, in one run.

    .venv/bin/python -m benchmarks.run                 # full default run (7-9 min on 2 idle cores, more when busy)
    .venv/bin/python -m benchmarks.run --w1-mib 1024 --w2-mib 1024   # nominal sizes (the baseline's): ~18 min
    .venv/bin/python -m benchmarks.run --smoke         # tiny sizes, 1 repetition
    .venv/bin/python -m benchmarks.run --workloads w1,w5 --repetitions 3 --w1-mib 256

Each repetition runs every system of a workload, in an order rotated by one per
repetition; each save sequence and each load runs in its own fresh child process.
Prints one table per workload (rich) and writes JSON (median, min, max of each metric,
and ckptstore/peer ratios of the medians). See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import fields
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .spec import DATA_OF, FLOOR, FLOOR_LABEL, PEERS, SYSTEMS, WARM_OPS, WORKLOADS, Sizes

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_OUTPUT = HERE / "results" / "latest.json"
ORDER = ["w1", "async", "w2", "w3", "w4", "w5", "w6", "stall"]
SCHEMA = 2  # 2: the "floor" pseudo-system, floor_ratios, peak_rss_over_state

DURABILITY = (
    "every save is durable for every system: ckptstore through its commit protocol (pack files fsynced, "
    "renamed, folders fsynced; SQLite WAL with synchronous=FULL); every peer by an fsync of each file it wrote, "
    "of each folder, and of the parent folder, inside the timed save"
)
RSS_METHOD = (
    "VmHWM of the child process (/proc/self/status), reset with /proc/self/clear_refs just before the "
    "operation: the peak resident set (anonymous + mapped file pages) during it, state already in memory included. "
    "peak_rss_over_state = peak_rss - rss_baseline (VmRSS of the same child right after its imports, before it built "
    "any state) - logical bytes of the state: the memory the operation needed beyond the state itself"
)
FLOOR_METHOD = (
    "the 'floor' system is the physical limit, not a product: save = the state's tensor bytes (every column of the "
    "written rows and both priority trees; W5: parameters and optimizer state) written raw, back to back, into one "
    "file with os.write, then fsync of the file and of its folder; load = os.preadv of that file into freshly "
    "allocated tensors (W5: into the fresh policy's parameters and new optimizer state tensors), every page touched; "
    "load_into_existing = the same into tensors allocated and zeroed beforehand. Tensors are gathered (priority trees "
    "read out of TorchRL's segment trees) before the timed window"
)


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", s).strip("_")


def _versions() -> dict:
    out = {"python": platform.python_version()}
    for pkg in ("torch", "tensordict", "torchrl", "safetensors", "ckptstore", "zstandard", "xxhash"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def _git() -> dict:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], check=False, cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "src"], check=False, cwd=ROOT, capture_output=True, text=True, timeout=10).stdout
        return {"commit": head or None, "src_dirty": bool(dirty.strip())}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "src_dirty": None}


def _host() -> dict:
    mem = None
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    except OSError:
        pass
    return {"machine": platform.machine(), "kernel": platform.release(), "cpus": os.cpu_count(), "mem_bytes": mem,
            "loadavg_start": os.getloadavg()}


# --- child processes ---------------------------------------------------------------------


class Runner:
    def __init__(self, start_method: str, timeout: float, console: Console):
        self.ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            self.ctx.set_forkserver_preload(["benchmarks.workloads", "rich.console", "rich.markup", "rich.table"])
        self.timeout = timeout
        self.console = console

    def run(self, task: dict, label: str):
        """Run ``task`` in a fresh child. Returns (ok, result or error text)."""
        from .child import entry

        recv, send = self.ctx.Pipe(duplex=False)
        t0 = time.perf_counter()
        proc = self.ctx.Process(target=entry, args=(task, send), daemon=True)
        proc.start()
        send.close()
        msg, timed_out = None, False
        try:
            if recv.poll(self.timeout):
                msg = recv.recv()
            else:
                timed_out = True
        except EOFError:
            msg = None
        finally:
            recv.close()
        if msg is None:
            if proc.is_alive():
                proc.kill()
            proc.join()
            err = f"child timed out after {self.timeout:.0f} s" if timed_out else f"child died (exit code {proc.exitcode})"
            self.console.print(f"[red]{escape(label)}: {escape(err)}[/red]")
            return False, err
        proc.join()
        dt = time.perf_counter() - t0
        if msg["ok"]:
            self.console.print(f"[dim]{escape(label)}: {dt:.1f} s[/dim]")
            return True, msg["result"]
        self.console.print(f"[red]{escape(label)}: error[/red]\n{escape(msg['error'])}")
        return False, msg["error"].strip().splitlines()[-1]


# --- aggregation ----------------------------------------------------------------------------


def _stats(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def aggregate(samples: dict, errors: dict, statuses: dict, names: list[str]) -> dict:
    results: dict = {}
    for wl in names:
        spec = WORKLOADS[wl]
        results[wl] = {}
        for op in spec.ops:
            results[wl][op] = {}
            for system in SYSTEMS:
                key = (wl, op, system)
                reason = spec.reason(op, system)
                if key in statuses:
                    results[wl][op][system] = statuses[key]
                elif reason is not None:
                    results[wl][op][system] = {"status": "n/a", "reason": reason}
                elif samples.get(key):
                    runs = samples[key]
                    metric_names = sorted({k for r in runs for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
                    entry = {"status": "ok", "n": len(runs),
                             "metrics": {k: _stats([r[k] for r in runs if k in r]) for k in metric_names}}
                    if errors.get(key):
                        entry["errors"] = errors[key]
                    results[wl][op][system] = entry
                else:
                    results[wl][op][system] = {"status": "error", "errors": errors.get(key, ["not run"])}
    return results


def _median_ratios(num: dict, den: dict) -> dict:
    """``num``'s median / ``den``'s median for every metric both have (``den``'s non-zero)."""
    return {k: v["median"] / d["median"] for k, v in num["metrics"].items() if (d := den["metrics"].get(k)) is not None and d["median"]}


def ratios(results: dict) -> dict:
    """ckptstore median / peer median, per workload, operation, peer and metric."""
    out: dict = {}
    for wl, ops in results.items():
        for op, systems in ops.items():
            ck = systems.get("ckptstore", {})
            if ck.get("status") != "ok":
                continue
            for peer in PEERS:
                pe = systems.get(peer, {})
                if pe.get("status") != "ok":
                    continue
                out.setdefault(wl, {}).setdefault(op, {})[peer] = _median_ratios(ck, pe)
    return out


def floor_ratios(results: dict) -> dict:
    """Each system's median / the floor's median, per workload, operation, system and metric."""
    out: dict = {}
    for wl, ops in results.items():
        for op, systems in ops.items():
            fl = systems.get(FLOOR, {})
            if fl.get("status") != "ok":
                continue
            for system, e in systems.items():
                if system == FLOOR or e.get("status") != "ok":
                    continue
                out.setdefault(wl, {}).setdefault(op, {})[system] = _median_ratios(e, fl)
    return out


# --- table ----------------------------------------------------------------------------------------


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return ""
    n = float(n)
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            v = n / size
            return f"{v:.3g} {unit}" if abs(v) < 1000 else f"{v:.0f} {unit}"
    return f"{n:.0f} B"


def fmt_s(x: float | None) -> str:
    if x is None:
        return ""
    return f"{x:.3g}"


def _med(entry: dict, metric: str):
    m = entry.get("metrics", {}).get(metric)
    return None if m is None else m["median"]


def _ratio(r: dict | None, metric: str) -> str:
    if not r or metric not in r:
        return ""
    return f"{r[metric]:.3g}"


def _notes(wl: str, op: str, system: str, e: dict) -> str:
    notes = []
    med = lambda k: _med(e, k)
    if med("resident_before") is not None and med("resident_before") > 0.05:
        notes.append(f"eviction incomplete: {med('resident_before'):.0%} cached")
    if med("resident_warm") is not None:
        notes.append(f"warm: {med('resident_warm'):.0%} cached")
    if med("rehash_commit_s") is not None:
        notes.append(f"reuse_hashes=False re-commit {fmt_s(med('rehash_commit_s'))} s")
    if op == "train_steps":
        notes.append(f"step mean {fmt_s(med('step_mean_s'))} s vs {fmt_s(med('base_step_mean_s'))} s without commits "
                     f"(x{med('stall_ratio_mean'):.3f}), median {fmt_s(med('step_median_s'))} vs {fmt_s(med('base_step_median_s'))} s "
                     f"(x{med('stall_ratio_median'):.3f}), max {fmt_s(med('step_max_s'))} s; {med('commits_started'):.0f} commits, "
                     f"{med('commits_completed_in_window'):.0f} done within the window; commit_async call {fmt_s(med('call_mean_s'))} s, "
                     f"resolves {fmt_s(med('resolve_mean_s'))} s; per commit the loop lost {fmt_s(med('stall_per_commit_s'))} s. "
                     f"Floor (copy the changed bytes, write and fsync them in a thread): step mean {fmt_s(med('floor_step_mean_s'))} s "
                     f"(x{med('floor_ratio_mean'):.3f}), call {fmt_s(med('floor_call_mean_s'))} s, per save the loop lost {fmt_s(med('floor_per_save_s'))} s")
    if op == "load_sampler_only":
        notes.append(f"sampler stored {fmt_bytes(med('sampler_stored_bytes'))}")
    if med("store_io_bytes_read") is not None and op.startswith("load"):
        notes.append(f"store.io read {fmt_bytes(med('store_io_bytes_read'))}")
    if med("ckpt_new_bytes") is not None:
        notes.append(f"new {fmt_bytes(med('ckpt_new_bytes'))}")
    if med("stored_over_logical") is not None:
        notes.append(f"stored/logical {med('stored_over_logical'):.3f}")
    if op == "rolling_commit":
        notes.append(f"store {fmt_bytes(med('store_bytes'))} after {med('commits'):.0f} commits; first {fmt_s(med('first_commit_s'))} s; "
                     f"all {fmt_s(med('commits_total_s'))} s")
    if op == "commit_async":
        notes.append(f"call returns {fmt_s(med('wall_s'))} s, future resolves {fmt_s(med('resolve_s'))} s (buffers reused); "
                     f"first call {fmt_s(med('first_call_s'))} s, resolves {fmt_s(med('first_resolve_s'))} s; "
                     f"floors, copies into preallocated memory: changed rows + trees {fmt_s(med('prealloc_copy_s'))} s "
                     f"(call / it {_x(med('call_over_row_copy'))}), changed tensors (whole columns) + trees "
                     f"{fmt_s(med('prealloc_copy_tensors_s'))} s (call / it {_x(med('call_over_tensor_copy'))})")
    return "; ".join(notes)


def _x(v: float | None) -> str:
    return "" if v is None else f"{v:.3g}x"


COLUMNS = (("op", "left"), ("system", "left"), ("time s [min-max]", "right"), ("GB/s", "right"),
           ("written", "right"), ("read", "right"), ("peak RSS", "right"), ("RSS>state", "right"),
           ("ck/peer time", "right"), ("ck/peer written", "right"), ("ck/peer read", "right"), ("ck/peer RSS", "right"),
           ("time/floor", "right"), ("notes", "left"))


def table_rows(doc: dict, wl: str) -> tuple[str, list[tuple[list[str], str | None]], str | None]:
    """One workload's table: its title, rows of plain-text cells (one per COLUMNS entry) with a
    style name (None, "bold", "floor", "dim", "red"), and a caption naming hidden systems (or None)."""
    spec = WORKLOADS[wl]
    rows, hidden = [], set()
    for op, systems in doc["results"][wl].items():
        for system, e in systems.items():
            if e["status"] == "n/a" and e["reason"] == spec.not_compared:
                hidden.add(system)
                continue
            label = FLOOR_LABEL if system == FLOOR else system
            blank = [""] * 10
            if e["status"] == "n/a":
                rows.append(([op, label, "n/a", *blank, e["reason"]], "dim"))
                continue
            if e["status"] != "ok":
                why = e.get("reason") or "; ".join(e.get("errors", []))
                rows.append(([op, label, e["status"], *blank, why], "red"))
                continue
            w = e["metrics"]["wall_s"]
            r = doc["ratios"].get(wl, {}).get(op, {}).get(system)
            fr = doc["floor_ratios"].get(wl, {}).get(op, {}).get(system)
            is_load = op.startswith("load")
            rows.append(([
                op, label,
                f"{fmt_s(w['median'])} [{fmt_s(w['min'])}-{fmt_s(w['max'])}]",
                f"{_med(e, 'throughput_gbps'):.3g}",
                "" if is_load else fmt_bytes(_med(e, "bytes_written")),
                fmt_bytes(_med(e, "bytes_read")) if is_load else "",
                fmt_bytes(_med(e, "peak_rss")),
                fmt_bytes(_med(e, "peak_rss_over_state")),
                _ratio(r, "wall_s"),
                "" if is_load else _ratio(r, "bytes_written"),
                _ratio(r, "bytes_read") if is_load else "",
                _ratio(r, "peak_rss"),
                _ratio(fr, "wall_s"),
                _notes(wl, op, system, e),
            ], "bold" if system == "ckptstore" else ("floor" if system == FLOOR else None)))
    caption = f"{', '.join(s for s in SYSTEMS if s in hidden)}: {spec.not_compared}" if hidden else None
    return spec.title.format(**doc["meta"]["sizes"]), rows, caption


def print_tables(doc: dict, console: Console) -> None:
    meta = doc["meta"]
    console.print(f"\n[bold]ckptstore benchmarks[/bold]: {meta['repetitions']} repetition(s), medians \\[min-max]; "
                  f"reads: {escape(meta['reads'])}")
    console.print(f"Durability: {escape(DURABILITY)}.")
    console.print("Ratios: ckptstore median / peer median (below 1: ckptstore takes less time / writes less / peaks lower). "
                  "time/floor: the row's median time / the floor's (1 = at the physical limit).")
    console.print(f"{FLOOR_LABEL}: not a product; {escape(FLOOR_METHOD)}.")
    console.print("RSS>state: peak RSS - the child's RSS after its imports - the state's logical bytes.")
    styles = {"floor": "italic cyan"}
    for wl in doc["results"]:
        title, rows, caption = table_rows(doc, wl)
        t = Table(title=escape(title), title_justify="left", show_lines=False)
        for col, just in COLUMNS:
            t.add_column(escape(col), justify=just, overflow="fold")
        for cells, style in rows:
            t.add_row(*map(escape, cells), style=styles.get(style, style))
        if caption:
            t.caption = escape(caption)
            t.caption_justify = "left"
        console.print(t)


def markdown_tables(doc: dict) -> str:
    """The tables of print_tables as GitHub Markdown (ckptstore's rows in bold, the floor's in italics)."""
    out = []
    for wl in doc["results"]:
        title, rows, caption = table_rows(doc, wl)
        out += [f"**{title}**", "", "| " + " | ".join(c for c, _ in COLUMNS) + " |",
                "|" + "|".join("---:" if j == "right" else "---" for _, j in COLUMNS) + "|"]
        for cells, style in rows:
            mark = {"bold": "**", "floor": "*"}.get(style, "")
            cells = [f"{mark}{c}{mark}" if c and i < 2 else c for i, c in enumerate(cells)]
            out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        out += (["", caption] if caption else []) + [""]
    return "\n".join(out)


# --- main ----------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repetitions", "-r", type=int, default=5, help="repetitions per workload (default 5; --smoke: 1)")
    p.add_argument("--workloads", default=",".join(ORDER), help=f"comma-separated subset of {','.join(ORDER)}")
    p.add_argument("--workdir", default="/tmp/ckptstore-bench", help="stores and peer outputs go here, one fresh folder per repetition and system, deleted after")
    p.add_argument("--datadir", default=None, help="generated input data (default: /dev/shm/ckptstore-bench-<pid>, else <workdir>/data)")
    p.add_argument("--output", "-o", default=str(DEFAULT_OUTPUT), help="JSON results (default benchmarks/results/latest.json)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, 1 repetition (a functional check, not a measurement)")
    p.add_argument("--reads", choices=("cold", "warm"), default="cold",
                   help="cold (default): evict the output's pages (posix_fadvise DONTNEED) before each load; warm: leave the page cache")
    p.add_argument("--start-method", choices=("forkserver", "spawn"), default="forkserver",
                   help="forkserver (default): children fork from a server that only imported the libraries; spawn: new interpreters")
    p.add_argument("--child-timeout", type=float, default=1800.0, help="seconds before a child is killed")
    defaults = Sizes()
    for f in fields(Sizes):
        p.add_argument("--" + f.name.replace("_", "-"), type=type(getattr(defaults, f.name)), default=None,
                       help=f"default {getattr(defaults, f.name)}")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(stderr=True)
    sizes = Sizes.smoke() if args.smoke else Sizes()
    for f in fields(Sizes):
        v = getattr(args, f.name)
        if v is not None:
            setattr(sizes, f.name, v)
    reps = 1 if args.smoke else args.repetitions
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown:
        console.print(f"unknown workload(s): {unknown}; choose from {ORDER}")
        return 2
    names = [w for w in ORDER if w in names]
    cold = args.reads == "cold"

    run_dir = Path(args.workdir) / f"run-{os.getpid()}"
    if args.datadir:
        data_root = Path(args.datadir)
    elif os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        data_root = Path("/dev/shm") / f"ckptstore-bench-{os.getpid()}"
    else:
        data_root = run_dir / "data"
    runner = Runner(args.start_method, args.child_timeout, console)

    started = datetime.now(timezone.utc)
    t_start = time.perf_counter()
    git = _git()  # the code under test: children fork from a server that imports it now
    host = _host()
    samples: dict = {}
    errors: dict = {}
    statuses: dict = {}
    data_meta: dict = {}
    last_use = {d: max(i for i, w in enumerate(names) if DATA_OF.get(w) == d) for d in {DATA_OF[w] for w in names if w in DATA_OF}}

    def record(key, ok, value):
        if ok:
            samples.setdefault(key, []).append(value)
        else:
            errors.setdefault(key, []).append(value)

    try:
        for wi, wl in enumerate(names):
            spec = WORKLOADS[wl]
            task_base = {"workload": wl, "sizes": sizes.as_dict(), "cold": cold}
            if spec.shared_data:
                d = DATA_OF[wl]
                if d not in data_meta:
                    ok, res = runner.run({"kind": "gen", "data": d, "sizes": sizes.as_dict(), "root": str(data_root / d)}, f"generate {d} data")
                    if not ok:
                        for op in spec.ops:
                            for s in spec.systems():
                                errors.setdefault((wl, op, s), []).append(f"data generation failed: {res}")
                        continue
                    data_meta[d] = {k: v for k, v in res.items() if k != "tensors"}
                task_base["data"] = str(data_root / d)
            for rep in range(reps):
                order = spec.save_systems[rep % len(spec.save_systems):] + spec.save_systems[: rep % len(spec.save_systems)]
                for system in order:
                    out = run_dir / f"{wl}-r{rep}-{_slug(system)}"
                    label = f"[{wl} {rep + 1}/{reps}] {system}"
                    ok, res = runner.run({**task_base, "kind": "save", "system": system, "out": str(out), "rep": rep}, f"{label} saves")
                    if not ok:
                        for op in spec.ops:
                            for s in spec.loaders(system):
                                record((wl, op, s), False, res)
                        shutil.rmtree(out, ignore_errors=True)
                        continue
                    for item in res:
                        if item.get("status") == "not available":
                            statuses[(wl, item["op"], system)] = {"status": "not available", "reason": item["reason"]}
                        else:
                            record((wl, item["op"], system), True, item["metrics"])
                    # warm loads first, right after the save (its files still in the page cache), then the cold ones
                    for op in sorted(spec.load_ops, key=lambda o: o not in WARM_OPS):
                        for loader in spec.loaders(system):
                            if spec.reason(op, loader) is not None:
                                continue
                            op_cold = cold and op not in WARM_OPS
                            ok, m = runner.run({**task_base, "cold": op_cold, "kind": "load", "system": loader, "op": op, "out": str(out)},
                                               f"{label} {op} ({loader})")
                            record((wl, op, loader), ok, m)
                    shutil.rmtree(out, ignore_errors=True)
            for d, last in last_use.items():
                if last == wi:
                    shutil.rmtree(data_root / d, ignore_errors=True)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        if not args.datadir:
            shutil.rmtree(data_root, ignore_errors=True)

    results = aggregate(samples, errors, statuses, names)
    doc = {
        "schema": SCHEMA,
        "meta": {
            "started": started.isoformat(timespec="seconds"),
            "wall_s": time.perf_counter() - t_start,
            "repetitions": reps,
            "smoke": args.smoke,
            "workloads": names,
            "sizes": sizes.as_dict(),
            "data": data_meta,
            "warm_ops": "load_warm: the same load as 'load', right after the save child (before any cold load), nothing evicted: "
                        "the page cache holds the files just written; bytes_read = rchar, resident_warm = fraction of the files cached",
            "reads": "cold: each output's files evicted from the page cache (posix_fadvise DONTNEED) before each load; "
                     "bytes_read = /proc/self/io read_bytes (block-layer reads, mmap faults included)" if cold else
                     "warm: outputs were just written and sit in the page cache; bytes_read = /proc/self/io rchar "
                     "(read syscalls only: mmap-based loaders show ~0)",
            "durability": DURABILITY,
            "floor": FLOOR_METHOD,
            "peak_rss": RSS_METHOD,
            "bytes_written": "growth of the allocated size (st_blocks, like du) of the system's output folder during the save; "
                             "io_write_bytes: /proc/self/io write_bytes of the child during it",
            "throughput": "logical bytes (tensor bytes of the state, the same for every system) / wall time, GB = 1e9 bytes",
            "ratios": "ckptstore median / peer median (the floor included)",
            "floor_ratios": "each system's median / the floor's median",
            "w2_noise": f"W2 frames: {sizes.w2_noise:.1%} of the pixels nudged by -3..3"
                        + (" (0: deterministic renders like ALE's, the Atari-like case)" if not sizes.w2_noise else " (a stress case)"),
            "start_method": args.start_method,
            "host": {**host, "loadavg_end": os.getloadavg()},
            "versions": _versions(),
            "git": git,
            "argv": sys.argv[1:] if argv is None else argv,
        },
        "results": results,
    }
    doc["ratios"] = ratios(results)
    doc["floor_ratios"] = floor_ratios(results)
    out_path = Path(args.output)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
    print_tables(doc, Console(width=max(230, Console().width)))
    console.print(f"\nwrote {out_path} ({doc['meta']['wall_s']:.0f} s)")
    failed = any(e["status"] == "error" or e.get("errors") for ops in results.values() for sy in ops.values() for e in sy.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
