"""Compare a results file with a saved baseline; flag every metric that got worse.

    .venv/bin/python -m benchmarks.compare results.json baseline.json [--tolerance 0.05] [--all]

Compares the median of every metric of every (workload, operation, system) the
baseline measured. Worse means: time, bytes and RSS up, throughput down, by more than
the tolerance (relative, default 5 %). Differences smaller than a noise floor
(``--min-bytes``, default 64 KiB, for byte and RSS metrics; ``--min-seconds``, default
1 ms, for times) are never flagged; set them to 0 for a strict comparison. An entry the
baseline measured that the results lack (or that failed) is flagged too.

Exit status: 1 if anything is flagged, 0 otherwise (2 on bad input).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from .spec import HIGHER_IS_BETTER, INFO_METRICS


def _kind(metric: str) -> str:
    if metric.endswith("_s"):
        return "seconds"
    if "bytes" in metric or "rss" in metric or metric in ("rchar",):
        return "bytes"
    return "other"


def compare(result: dict, baseline: dict, tolerance: float = 0.05, min_bytes: float = 64 * 1024, min_seconds: float = 0.001) -> list[dict]:
    """Rows ``{workload, op, system, metric, baseline, result, change, verdict}``;
    verdict is ``worse`` (flagged), ``better``, ``same``, ``missing`` (flagged) or ``new``."""
    rows: list[dict] = []
    res_all = result.get("results", {})
    for wl, ops in baseline.get("results", {}).items():
        for op, systems in ops.items():
            for system, base in systems.items():
                if base.get("status") != "ok":
                    continue
                new = res_all.get(wl, {}).get(op, {}).get(system)
                where = {"workload": wl, "op": op, "system": system}
                if not new or new.get("status") != "ok":
                    status = "absent" if not new else new.get("status")
                    rows.append({**where, "metric": "(entry)", "baseline": "ok", "result": status, "change": None, "verdict": "missing"})
                    continue
                for metric, bstats in sorted(base.get("metrics", {}).items()):
                    if metric in INFO_METRICS:
                        continue
                    nstats = new.get("metrics", {}).get(metric)
                    b = bstats["median"]
                    if nstats is None:
                        rows.append({**where, "metric": metric, "baseline": b, "result": None, "change": None, "verdict": "missing"})
                        continue
                    n = nstats["median"]
                    higher_better = metric in HIGHER_IS_BETTER
                    change = (n - b) / abs(b) if b else (0.0 if n == b else math.copysign(math.inf, n - b))
                    worse_by = -change if higher_better else change
                    floor = {"bytes": min_bytes, "seconds": min_seconds}.get(_kind(metric), 0.0)
                    if abs(n - b) <= floor:
                        verdict = "same"
                    elif worse_by > tolerance:
                        verdict = "worse"
                    elif worse_by < -tolerance:
                        verdict = "better"
                    else:
                        verdict = "same"
                    rows.append({**where, "metric": metric, "baseline": b, "result": n, "change": change, "verdict": verdict})
    for wl, ops in res_all.items():
        for op, systems in ops.items():
            for system, new in systems.items():
                base = baseline.get("results", {}).get(wl, {}).get(op, {}).get(system)
                if new.get("status") == "ok" and (not base or base.get("status") != "ok"):
                    rows.append({"workload": wl, "op": op, "system": system, "metric": "(entry)", "baseline": base.get("status") if base else "absent",
                                 "result": "ok", "change": None, "verdict": "new"})
    return rows


def _fmt(x) -> str:
    if x is None:
        return ""
    if isinstance(x, str):
        return x
    return f"{x:.4g}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.compare", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", type=Path)
    p.add_argument("baseline", type=Path)
    p.add_argument("--tolerance", type=float, default=0.05, help="relative change that counts (default 0.05 = 5%%)")
    p.add_argument("--min-bytes", type=float, default=64 * 1024, help="ignore byte/RSS differences up to this many bytes (default 65536)")
    p.add_argument("--min-seconds", type=float, default=0.001, help="ignore time differences up to this many seconds (default 0.001)")
    p.add_argument("--all", action="store_true", help="list every compared metric, not only the changed ones")
    args = p.parse_args(argv)
    console = Console(width=max(160, Console().width))
    try:
        result = json.loads(args.results.read_text())
        baseline = json.loads(args.baseline.read_text())
    except (OSError, ValueError) as exc:
        console.print(f"error: {exc}")
        return 2
    rsz, bsz = result.get("meta", {}).get("sizes"), baseline.get("meta", {}).get("sizes")
    if rsz != bsz:
        console.print(f"[yellow]warning: the two runs used different sizes: results {rsz}, baseline {bsz}[/yellow]")
    if result.get("meta", {}).get("reads") != baseline.get("meta", {}).get("reads"):
        console.print("[yellow]warning: the two runs read differently (cold vs warm page cache)[/yellow]")
    rows = compare(result, baseline, args.tolerance, args.min_bytes, args.min_seconds)
    flagged = [r for r in rows if r["verdict"] in ("worse", "missing")]
    shown = rows if args.all else [r for r in rows if r["verdict"] != "same"]
    t = Table(title=f"{args.results} vs baseline {args.baseline} (tolerance {args.tolerance:.1%}, medians)", title_justify="left")
    for col in ("workload", "op", "system", "metric", "baseline", "result", "change", "verdict"):
        t.add_column(col, justify="right" if col in ("baseline", "result", "change") else "left")
    style = {"worse": "red", "missing": "red", "better": "green", "new": "cyan", "same": None}
    for r in shown:
        change = "" if r["change"] is None else f"{r['change']:+.1%}"
        t.add_row(r["workload"], r["op"], r["system"], r["metric"], _fmt(r["baseline"]), _fmt(r["result"]), change,
                  "FLAGGED " + r["verdict"] if r["verdict"] in ("worse", "missing") else r["verdict"], style=style[r["verdict"]])
    console.print(t)
    compared = sum(1 for r in rows if r["verdict"] not in ("new",))
    console.print(f"{compared} compared, {len(flagged)} flagged (worse by more than {args.tolerance:.1%} or missing), "
                  f"{sum(r['verdict'] == 'better' for r in rows)} better, {sum(r['verdict'] == 'new' for r in rows)} new")
    return 1 if flagged else 0


if __name__ == "__main__":
    sys.exit(main())
