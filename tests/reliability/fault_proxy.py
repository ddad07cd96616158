"""A fault-injecting HTTP proxy for the S3 tests: forwards each request to the real S3 server on loopback and,
at a configurable rate, answers it badly instead.

    with FaultProxy(upstream="http://127.0.0.1:8333", rate=0.2, seed=1) as proxy:   # proxy.endpoint
        ...                                                                           # proxy.injected: Counter

Faults (one per faulty request, chosen at random): `500` (InternalError), `503` (SlowDown), `reset` (the
connection is closed without an answer), `truncate` (the upstream answer with only half its body, then the
connection closes), `delay` (the request is forwarded after 0.3 s). Requests keep their headers, Host
included, so SigV4 signatures still verify upstream. Bodies are forwarded as received (Content-Length or
chunked).
"""

from __future__ import annotations

import http.client
import random
import socket
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

FAULTS = ("500", "503", "reset", "truncate", "delay")
_ERROR_XML = (
    '<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>injected by the test '
    "proxy</Message></Error>"
)


class FaultProxy:
    def __init__(self, upstream: str, *, rate: float, seed: int = 0, faults: tuple[str, ...] = FAULTS) -> None:
        parts = urlsplit(upstream)
        self.upstream_host, self.upstream_port = parts.hostname, parts.port or 80
        self.rate, self.faults = rate, faults
        self.random = random.Random(seed)
        self.lock = threading.Lock()
        self.injected: Counter = Counter()
        self.requests = 0
        self.ranged = 0  # GETs with a Range header: how often a reader resumed a broken body
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def _handle(self) -> None:
                body = self._read_body()
                with proxy.lock:
                    proxy.requests += 1
                    proxy.ranged += "Range" in self.headers
                    fault = proxy.random.choice(proxy.faults) if proxy.random.random() < proxy.rate else None
                    if fault:
                        proxy.injected[fault] += 1
                if fault in ("500", "503"):
                    payload = _ERROR_XML.format(code="InternalError" if fault == "500" else "SlowDown").encode()
                    self.send_response(int(fault))
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(payload)
                    return
                if fault == "reset":
                    self.close_connection = True
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                    self.connection.close()
                    return
                if fault == "delay":
                    time.sleep(0.3)
                status, headers, data = self._forward(body)
                truncate = fault == "truncate" and self.command != "HEAD" and len(data) > 1
                self.send_response(status)
                for name, value in headers:
                    if name.lower() not in ("transfer-encoding", "content-length", "connection"):
                        self.send_header(name, value)
                length = (
                    len(data)
                    if self.command != "HEAD"
                    else int(dict((k.lower(), v) for k, v in headers).get("content-length", "0"))
                )
                self.send_header("Content-Length", str(length))
                if truncate:
                    self.send_header("Connection", "close")
                    self.close_connection = True
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data[: len(data) // 2] if truncate else data)

            def _read_body(self) -> bytes:
                if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
                    raw = b""
                    while True:
                        line = self.rfile.readline()
                        raw += line
                        size = int(line.split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            while True:  # trailers, then the blank line
                                trailer = self.rfile.readline()
                                raw += trailer
                                if trailer in (b"\r\n", b"\n", b""):
                                    return raw
                        raw += self.rfile.read(size + 2)
                length = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(length) if length else b""

            def _forward(self, body: bytes):
                conn = http.client.HTTPConnection(proxy.upstream_host, proxy.upstream_port, timeout=60)
                try:
                    conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                    for name, value in self.headers.items():
                        conn.putheader(name, value)
                    conn.endheaders(body if body else None)
                    response = conn.getresponse()
                    data = response.read()
                    return response.status, response.getheaders(), data
                finally:
                    conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FaultProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
