"""A delaying HTTP proxy on loopback, for slow clients without patching them.

Run in its own process (no torch, no ckptstore: it starts in a fraction of a second)::

    python tests/delay_proxy.py --upstream 127.0.0.1:5555    # prints "READY <port>"

A client pointed at ``http://127.0.0.1:<port>`` (``AWS_ENDPOINT_URL``) talks to the
upstream server through it; each request whose method and path match a rule waits
that many seconds before it is forwarded. Rules are set, like the S3 server's faults,
by a POST of JSON to the control path ``/__delay__`` (which the proxy answers itself)::

    [{"method": "PUT", "key": "/commits/", "seconds": 4.0}]

(``key``: a substring of the request path; ``method`` ``"*"`` matches every method.)
Each client connection gets its own upstream connection and a thread per direction;
requests are parsed only as far as their head and ``Content-Length`` (a chunked
request body switches the connection to plain forwarding, with no more delays).
Nothing of the client is patched: it sees a slow server.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass

CONTROL = "/__delay__"
READY = "READY"


class _Rules:
    def __init__(self):
        self.lock = threading.Lock()
        self.rules: list[dict] = []
        self.delayed = 0

    def delay(self, method: str, path: str) -> float:
        with self.lock:
            for r in self.rules:
                if r["method"] in ("*", method) and r["key"] in path:
                    self.delayed += 1
                    return float(r["seconds"])
        return 0.0


def _read_head(sock: socket.socket, buf: bytearray) -> bytes | None:
    """Read from ``sock`` into ``buf`` until a whole request head is there; return it (and remove it from ``buf``)."""
    while b"\r\n\r\n" not in buf:
        data = sock.recv(65536)
        if not data:
            return None
        buf += data
    end = buf.index(b"\r\n\r\n") + 4
    head = bytes(buf[:end])
    del buf[:end]
    return head


def _client_to_server(client: socket.socket, server: socket.socket, rules: _Rules) -> None:
    buf = bytearray()
    try:
        while True:
            head = _read_head(client, buf)
            if head is None:
                break
            line = head.split(b"\r\n", 1)[0].decode("latin-1")
            method, path = (line.split(" ") + ["", ""])[:2]
            headers = {}
            for h in head.split(b"\r\n")[1:]:
                if b":" in h:
                    k, v = h.split(b":", 1)
                    headers[k.strip().lower().decode("latin-1")] = v.strip().decode("latin-1")
            if path.startswith(CONTROL):
                length = int(headers.get("content-length", "0"))
                while len(buf) < length:
                    data = client.recv(65536)
                    if not data:
                        return
                    buf += data
                body = bytes(buf[:length])
                del buf[:length]
                if method == "POST":
                    with rules.lock:
                        rules.rules = json.loads(body or b"[]")
                    out = b"ok"
                else:
                    with rules.lock:
                        out = json.dumps({"rules": rules.rules, "delayed": rules.delayed}).encode()
                client.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(out), out))
                continue
            wait = rules.delay(method, path)
            if wait:
                time.sleep(wait)
            server.sendall(head)
            if "chunked" in headers.get("transfer-encoding", "").lower():
                server.sendall(bytes(buf))
                buf.clear()
                while True:  # plain forwarding from here on
                    data = client.recv(65536)
                    if not data:
                        return
                    server.sendall(data)
            length = int(headers.get("content-length", "0"))
            sent = min(length, len(buf))
            server.sendall(bytes(buf[:sent]))
            del buf[:sent]
            while sent < length:
                data = client.recv(min(65536, length - sent))
                if not data:
                    return
                server.sendall(data)
                sent += len(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            server.shutdown(socket.SHUT_WR)


def _server_to_client(server: socket.socket, client: socket.socket) -> None:
    try:
        while True:
            data = server.recv(65536)
            if not data:
                break
            client.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            client.shutdown(socket.SHUT_RDWR)
        client.close()
        server.close()


def serve(upstream: tuple[str, int], port: int = 0) -> None:
    rules = _Rules()
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind(("127.0.0.1", port))
    lsock.listen(128)
    print(f"{READY} {lsock.getsockname()[1]}", flush=True)
    while True:
        client, _ = lsock.accept()
        try:
            server = socket.create_connection(upstream)
        except OSError:
            client.close()
            continue
        for s in (client, server):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=_client_to_server, args=(client, server, rules), daemon=True).start()
        threading.Thread(target=_server_to_client, args=(server, client), daemon=True).start()


def free_port() -> int:
    """A loopback port free now (for a proxy whose port must be known before it starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class DelayProxy:
    """The proxy in a subprocess, in front of ``upstream`` (``"http://127.0.0.1:PORT"``), on
    ``port`` (0: any free one). A start after a stop listens on the same port again, so a
    client keeps its endpoint across a network cut (stop) and its end (start)."""

    upstream: str
    port: int = 0
    proc: subprocess.Popen | None = None

    def start(self) -> DelayProxy:
        hostport = self.upstream.split("://", 1)[-1].rstrip("/")
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--upstream", hostport, "--port", str(self.port)],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        ready, _, _ = select.select([self.proc.stdout], [], [], 30)
        line = self.proc.stdout.readline() if ready else ""
        if not line.startswith(READY):
            self.stop()
            raise RuntimeError("the delay proxy did not start")
        self.port = int(line.split()[1])
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc.stdout.close()
            self.proc = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def set_rules(self, rules: list[dict]) -> None:
        req = urllib.request.Request(self.endpoint + CONTROL, data=json.dumps(rules).encode(), method="POST")
        with urllib.request.urlopen(req, timeout=10) as resp:
            resp.read()

    def status(self) -> dict:
        with urllib.request.urlopen(self.endpoint + CONTROL, timeout=10) as resp:
            return json.loads(resp.read())

    def __enter__(self) -> DelayProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="a delaying HTTP proxy on loopback")
    p.add_argument("--upstream", required=True, help="host:port of the server")
    p.add_argument("--port", type=int, default=0)
    a = p.parse_args(argv)
    host, port = a.upstream.rsplit(":", 1)
    with contextlib.suppress(KeyboardInterrupt):
        serve((host, int(port)), a.port)


if __name__ == "__main__":
    main()
