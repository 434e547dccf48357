"""Object-storage client choice: obstore against boto3 on the same S3 server.

    .venv/bin/python -m benchmarks.objstore_client              # ~1-2 min on 2 cores
    .venv/bin/python -m benchmarks.objstore_client --mib 64 -r 3 --json out.json

Starts moto's S3 server on loopback (tests/s3server.py, threaded: requests may
overlap) and measures, median of ``-r`` runs each:

- **upload** of one ``--mib`` MiB object: obstore ``put`` as ckptstore writes packs
  (one create-only PUT, ``mode="create"``) and multipart (5 MiB parts, 12 at once);
  boto3 ``put_object`` (one PUT) and ``upload_fileobj`` (its managed multipart
  transfer, 8 MiB parts, 10 threads);
- **ranged reads** of ``--ranges`` × ``--range-kib`` KiB at scattered offsets of a
  ``--pack-mib`` MiB object, a pack (what a partial checkout does; moto reads the whole
  object for every ranged GET, so a bigger one measures moto): obstore ``get_ranges``
  (coalesced as ckptstore does, and with obstore's default 1 MiB, parallel),
  obstore ``get_range`` one after another, boto3 ``get_object(Range=…)`` one after
  another and from 10 threads.

moto on loopback is slow and CPU-bound (Python parses and stores every byte, on the
same 2 cores as the client), so absolute numbers are moto's, not S3's; the ratios of
the clients' medians are what the choice rests on. Sizes are kept modest so the run
takes about a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.s3server when run from anywhere

from ckptstore.backends.s3 import DEFAULT_COALESCE
from tests.s3server import ACCESS_KEY, REGION, SECRET_KEY, MotoServer


def coalesced(ranges: list[tuple[int, int]], gap: int) -> tuple[int, int]:
    """``(requests, bytes fetched)`` when sorted ranges closer than ``gap`` bytes are merged
    (object_store's rule, which obstore's ``get_ranges`` applies)."""
    merged: list[list[int]] = []
    for s, e in sorted(ranges):
        if merged and s <= merged[-1][1] + gap:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return len(merged), sum(e - s for s, e in merged)


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=256, help="size of the uploaded object, MiB")
    p.add_argument("--pack-mib", type=int, default=64, help="size of the object the ranges are read from (a pack), MiB")
    p.add_argument("--ranges", type=int, default=64, help="number of ranged reads")
    p.add_argument("--range-kib", type=int, default=256, help="size of each range, KiB")
    p.add_argument("-r", "--repeats", type=int, default=3)
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)

    import boto3
    import obstore
    from boto3.s3.transfer import TransferConfig
    from obstore.store import S3Store

    size = args.mib << 20
    data = os.urandom(size)  # incompressible; random.randbytes caps at 256 MiB
    rng = random.Random(1)
    span = args.range_kib << 10
    pack = data[: args.pack_mib << 20]
    starts = sorted(slot * span for slot in rng.sample(range(len(pack) // span), args.ranges))  # distinct blobs, some adjacent
    results: dict[str, list[float]] = {}

    with MotoServer(buckets=["bench"], serialize=False) as server:
        store = S3Store("bench", prefix="obstore", config={"endpoint": server.endpoint, "region": REGION, "access_key_id": ACCESS_KEY,
                                                          "secret_access_key": SECRET_KEY}, client_options={"allow_http": True})
        client = boto3.client("s3", endpoint_url=server.endpoint, region_name=REGION,
                              aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY)

        def obstore_create():
            obstore.delete(store, "single")
            obstore.put(store, "single", data, mode="create")

        def boto3_multipart():
            import io

            client.upload_fileobj(io.BytesIO(data), "bench", "boto3/multi", Config=TransferConfig(multipart_chunksize=8 << 20, max_concurrency=10))

        uploads = {
            "upload obstore put (one create-only PUT)": obstore_create,
            "upload obstore put (multipart)": lambda: obstore.put(store, "multi", data),
            "upload boto3 put_object (one PUT)": lambda: client.put_object(Bucket="bench", Key="boto3/single", Body=data),
            "upload boto3 upload_fileobj (multipart)": boto3_multipart,
        }
        for name, fn in uploads.items():
            results[name] = timed(fn, args.repeats)
            print(f"{name:48s} median {statistics.median(results[name]):7.3f} s", flush=True)

        # moto reads a whole object for every ranged GET, so ranges come from a pack-sized object
        obstore.put(store, "pack", pack)
        client.put_object(Bucket="bench", Key="boto3/pack", Body=pack)
        ends = [s + span for s in starts]

        def check(bufs):
            assert all(bytes(b) == pack[s:e] for b, s, e in zip(bufs, starts, ends))

        def boto3_range(s: int, e: int) -> bytes:
            return client.get_object(Bucket="bench", Key="boto3/pack", Range=f"bytes={s}-{e - 1}")["Body"].read()

        with ThreadPoolExecutor(10) as pool:
            reads = {
                "ranges obstore get_ranges (coalesced, parallel)": lambda: check(
                    obstore.get_ranges(store, "pack", starts=starts, ends=ends, coalesce=DEFAULT_COALESCE)),
                "ranges obstore get_ranges (obstore's 1 MiB coalescing)": lambda: check(obstore.get_ranges(store, "pack", starts=starts, ends=ends)),
                "ranges obstore get_range (sequential)": lambda: check([obstore.get_range(store, "pack", start=s, end=e) for s, e in zip(starts, ends)]),
                "ranges boto3 get_object (sequential)": lambda: check([boto3_range(s, e) for s, e in zip(starts, ends)]),
                "ranges boto3 get_object (10 threads)": lambda: check(list(pool.map(boto3_range, starts, ends))),
            }
            for name, fn in reads.items():
                results[name] = timed(fn, args.repeats)
                print(f"{name:48s} median {statistics.median(results[name]):7.3f} s", flush=True)

    med = {k: statistics.median(v) for k, v in results.items()}
    ratios = {
        "upload: boto3 put_object / obstore create-only PUT": med["upload boto3 put_object (one PUT)"] / med["upload obstore put (one create-only PUT)"],
        "upload: boto3 multipart / obstore multipart": med["upload boto3 upload_fileobj (multipart)"] / med["upload obstore put (multipart)"],
        "upload: obstore create-only PUT / obstore multipart": med["upload obstore put (one create-only PUT)"] / med["upload obstore put (multipart)"],
        "ranges: obstore sequential / obstore get_ranges": med["ranges obstore get_range (sequential)"] / med["ranges obstore get_ranges (coalesced, parallel)"],
        "ranges: boto3 sequential / obstore get_ranges": med["ranges boto3 get_object (sequential)"] / med["ranges obstore get_ranges (coalesced, parallel)"],
        "ranges: boto3 10 threads / obstore get_ranges": med["ranges boto3 get_object (10 threads)"] / med["ranges obstore get_ranges (coalesced, parallel)"],
    }
    for gap in (DEFAULT_COALESCE, 1 << 20):
        requests, fetched = coalesced(list(zip(starts, ends)), gap)
        print(f"coalescing ranges closer than {gap >> 10} KiB: {requests} requests, {fetched / (args.ranges * span):.2f}x the requested bytes")
    print(f"\n{args.mib} MiB upload; {args.ranges} x {args.range_kib} KiB ranges of a {args.pack_mib} MiB object; median of {args.repeats}; "
          "ratios of medians (>1: obstore's way faster):")
    for k, v in ratios.items():
        print(f"  {k:55s} {v:6.2f}x")
    print(f"  upload throughput, obstore create-only PUT: {args.mib / med['upload obstore put (one create-only PUT)']:.0f} MiB/s (moto-bound)")
    out = {"args": {k: str(v) for k, v in vars(args).items()}, "seconds": results, "medians": med, "ratios": ratios}
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
