"""A real S3-compatible server on loopback for the tests: moto's server in a subprocess.

Run by hand (the README's "Object storage" paragraph)::

    python tests/s3server.py --port 5555 --bucket ckpt    # prints "READY 5555", serves until Ctrl-C

and point the standard environment at it::

    AWS_ENDPOINT_URL=http://127.0.0.1:5555 AWS_ALLOW_HTTP=true AWS_REGION=us-east-1 \\
    AWS_ACCESS_KEY_ID=testing AWS_SECRET_ACCESS_KEY=testing

The server binds port 0 unless told otherwise, so the OS picks a free port and there
is no window in which another process can take it; it prints ``READY <port>`` once it
listens. Buckets are created through moto's own backend in the server process before
it serves (no S3 client is needed for that), and live in memory until it stops.

**Serialized requests (the default).** moto checks ``If-None-Match: *`` and
``If-Match: <etag>`` on ``PutObject`` by reading the current object and then writing
(check, then act: ``moto/s3/responses.py``, ``put_object``), with no lock. Under
werkzeug's threaded server two concurrent conditional PUTs to one key can both pass
the check, which real S3 never allows. ``serialize=True`` therefore runs every request
under one lock around the WSGI app (the response body is produced inside the lock), so
each conditional write is atomic, as on S3; the race tests rely on it.
``serialize=False`` (``--threaded``) is moto's plain threaded server, for benchmarks.

**Faults.** ``MotoServer.set_faults(rules)`` makes the server fail chosen requests, to
test that clients retry and settle lost responses (it POSTs the rules to the control
path ``/__faults__``, which the server answers itself; ``faults()`` GETs what is left). A rule is a dict:
``{"method": "PUT", "key": "refs/", "action": ..., "count": n}`` (``key``: a substring
of the request path; the first ``count`` matching requests are hit), with ``action``

- ``"500-before"``: answer HTTP 500 without doing the request;
- ``"500-after"``: do it (the write lands), then answer HTTP 500;
- ``"drop-after"``: do it, then close the connection without an answer (a lost response).

**Bytes served.** The server counts the body bytes of the GET responses it sends, per
store (the first segment of the key under the bucket, or of a listing's ``prefix``):
``MotoServer.served(url)`` returns ``{"gets", "bytes", "blob_gets", "blob_bytes"}`` (``blob_*``:
requests for objects under ``blobs/``, that is packs and their ``.idx``) of the store at
``url`` since the last ``reset_served()`` (control path ``/__served__``: GET reads, POST
resets). One server serves a whole test session, so a test counts its own store only:
another test's Checkpointer still alive renews its lease with a listing now and then.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field

REGION = "us-east-1"
ACCESS_KEY = "testing"
SECRET_KEY = "testing"
READY = "READY"
SERVED_PATH = "/__served__"


class _Serialized:
    """WSGI middleware: one request at a time through ``app``, body included."""

    def __init__(self, app):
        self.app = app
        self.lock = threading.Lock()

    def __call__(self, environ, start_response) -> Iterable[bytes]:
        with self.lock:
            result = self.app(environ, start_response)
            try:
                return [b"".join(result)]
            finally:
                close = getattr(result, "close", None)
                if close is not None:
                    close()


FAULTS_PATH = "/__faults__"
_ACTIONS = ("500-before", "500-after", "drop-after")
_ERROR_500 = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InternalError</Code>'
              b"<Message>We encountered an internal error. Please try again.</Message></Error>")


class _Faults:
    """WSGI middleware: fail the requests the current rules match (see the module docstring)."""

    def __init__(self, app):
        self.app = app
        self.lock = threading.Lock()
        self.rules: list[dict] = []

    def _match(self, environ) -> str | None:
        with self.lock:
            for rule in self.rules:
                if rule["method"] == environ["REQUEST_METHOD"] and rule["key"] in environ.get("PATH_INFO", ""):
                    rule["count"] -= 1
                    if rule["count"] <= 0:
                        self.rules.remove(rule)
                    return rule["action"]
        return None

    def __call__(self, environ, start_response) -> Iterable[bytes]:
        if environ.get("PATH_INFO") == FAULTS_PATH and environ["REQUEST_METHOD"] == "GET":
            with self.lock:
                body = json.dumps(self.rules).encode()
            start_response("200 OK", [("Content-Type", "application/json")])
            return [body]
        if environ.get("PATH_INFO") == FAULTS_PATH:
            rules = json.loads(environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0)) or b"[]")
            for rule in rules:
                if set(rule) != {"method", "key", "action", "count"} or rule["action"] not in _ACTIONS:
                    start_response("400 Bad Request", [("Content-Type", "text/plain")])
                    return [f"bad fault rule {rule!r}".encode()]
            with self.lock:
                self.rules = rules
            start_response("200 OK", [("Content-Type", "text/plain")])
            return [b"ok"]
        action = self._match(environ)
        if action is None:
            return self.app(environ, start_response)
        if action != "500-before":
            result = self.app(environ, lambda *a, **k: None)  # the request is done; its answer is thrown away
            b"".join(result)
            if action == "drop-after":
                sock = environ["werkzeug.socket"]
                sock.shutdown(socket.SHUT_RDWR)
                raise ConnectionAbortedError("fault injected: response dropped")
        start_response("500 Internal Server Error", [("Content-Type", "application/xml"), ("Content-Length", str(len(_ERROR_500)))])
        return [_ERROR_500]


class _Served:
    """WSGI middleware: count the body bytes of GET responses (see the module docstring)."""

    FIELDS = ("gets", "bytes", "blob_gets", "blob_bytes")

    def __init__(self, app):
        self.app = app
        self.lock = threading.Lock()
        self.counts: dict[str, dict[str, int]] = {}  # store (bucket/first segment) -> counts

    def __call__(self, environ, start_response) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == SERVED_PATH:
            with self.lock:
                body = json.dumps(self.counts).encode()
                if environ["REQUEST_METHOD"] == "POST":
                    self.counts = {}
            start_response("200 OK", [("Content-Type", "application/json")])
            return [body]
        result = self.app(environ, start_response)
        if environ["REQUEST_METHOD"] != "GET":
            return result
        try:
            body = b"".join(result)
        finally:
            close = getattr(result, "close", None)
            if close is not None:
                close()
        blob = "/blobs/" in path
        bucket, _, key = path.lstrip("/").partition("/")
        listed = urllib.parse.parse_qs(environ.get("QUERY_STRING", "")).get("prefix", [""])[0]
        store = f"{bucket}/{(key or listed).split('/', 1)[0]}"
        with self.lock:
            counts = self.counts.setdefault(store, dict.fromkeys(self.FIELDS, 0))
            counts["gets"] += 1
            counts["bytes"] += len(body)
            counts["blob_gets"] += blob
            counts["blob_bytes"] += len(body) if blob else 0
        return [body]


def _serve(host: str, port: int, buckets: list[str], serialize: bool) -> None:
    """Run in the server process: create ``buckets``, then serve forever."""
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.moto_server.threaded_moto_server import MotoRequestHandler
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
    from moto.s3.models import s3_backends
    from werkzeug.serving import make_server

    app = DomainDispatcherApplication(create_backend_app)
    app = _Served(_Faults(_Serialized(app) if serialize else app))
    server = make_server(host, port, app, threaded=True, request_handler=MotoRequestHandler)
    os.environ["MOTO_PORT"] = str(server.server_port)
    for bucket in buckets:
        s3_backends[DEFAULT_ACCOUNT_ID]["aws"].create_bucket(bucket, REGION)
    print(f"{READY} {server.server_port}", flush=True)
    server.serve_forever()


@dataclass
class MotoServer:
    """moto's S3 server in a subprocess on ``127.0.0.1``.

    Args:
        buckets: bucket names created before the server serves.
        serialize: one request at a time (see the module docstring); needed for races.
        startup_timeout: seconds to wait for ``READY`` before raising ``RuntimeError``.
    """

    buckets: list[str] = field(default_factory=lambda: ["ckpt"])
    serialize: bool = True
    startup_timeout: float = 60.0
    port: int = 0
    proc: subprocess.Popen | None = None

    def start(self) -> MotoServer:
        cmd = [sys.executable, os.path.abspath(__file__), "--port", "0"]
        cmd += [a for b in self.buckets for a in ("--bucket", b)]
        if not self.serialize:
            cmd.append("--threaded")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.5)
            if ready:
                line = self.proc.stdout.readline()
                if line.startswith(READY):
                    self.port = int(line.split()[1])
                    return self
                if not line and self.proc.poll() is not None:
                    break
        self.stop()
        raise RuntimeError(f"moto server did not start within {self.startup_timeout} s")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc.stdout.close()
            self.proc = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """The standard AWS environment that points a client at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ALLOW_HTTP": "true",
            "AWS_REGION": REGION,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        }

    def set_faults(self, rules: list[dict]) -> None:
        """Replace the server's fault rules (``[]``: none); see the module docstring."""
        req = urllib.request.Request(self.endpoint + FAULTS_PATH, data=json.dumps(rules).encode(), method="POST")
        with urllib.request.urlopen(req, timeout=10) as resp:
            if resp.status != 200:
                raise RuntimeError(f"fault rules refused: {resp.read()!r}")

    def faults(self) -> list[dict]:
        """The fault rules not yet used up (a rule's ``count`` is what is left of it)."""
        with urllib.request.urlopen(self.endpoint + FAULTS_PATH, timeout=10) as resp:
            return json.loads(resp.read())

    def served(self, url: str) -> dict[str, int]:
        """The GET requests for the store at ``url`` (``s3://bucket/name``: keys under
        ``name/``) and their body bytes since the last :meth:`reset_served` (see the module
        docstring)."""
        with urllib.request.urlopen(self.endpoint + SERVED_PATH, timeout=10) as resp:
            counts = json.loads(resp.read())
        return counts.get(url.removeprefix("s3://").rstrip("/"), dict.fromkeys(_Served.FIELDS, 0))

    def reset_served(self) -> None:
        """Zero the counts of :meth:`served`, for every store."""
        req = urllib.request.Request(self.endpoint + SERVED_PATH, data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=10):
            pass

    def __enter__(self) -> MotoServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="moto's S3 server on loopback, for ckptstore's tests")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: a free port chosen by the OS (printed)")
    parser.add_argument("--bucket", action="append", default=[], help="create this bucket first (repeatable)")
    parser.add_argument("--threaded", action="store_true", help="do not serialize requests (conditional writes can race)")
    args = parser.parse_args(argv)
    try:
        _serve(args.host, args.port, args.bucket, serialize=not args.threaded)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
