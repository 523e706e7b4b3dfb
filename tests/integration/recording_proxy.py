"""An HTTP proxy in a thread that keeps what a client sent: it forwards each request to a real
daemon and streams the answer back as it comes, recording every POST's JSON body. With
`refuse_field`, a body holding that field gets OpenAI's 400 for an unknown argument instead,
as a server stricter than lorad would answer. Knows nothing of the bodies otherwise.
"""

from __future__ import annotations

import http.client
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

# Hop-by-hop or length headers: the proxy answers in HTTP/1.0 and ends each body by closing.
_DROPPED = {"connection", "content-length", "keep-alive", "transfer-encoding"}


class RecordingProxy:
    def __init__(self, upstream: str, refuse_field: str | None = None) -> None:
        self.upstream = urlsplit(upstream).netloc
        self.refuse_field = refuse_field
        self.bodies: list[dict] = []  # POST bodies in the order they arrived
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                proxy._forward(self, None)

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                proxy.bodies.append(json.loads(raw))
                proxy._forward(self, raw)

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> RecordingProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _forward(self, handler: BaseHTTPRequestHandler, raw: bytes | None) -> None:
        if raw is not None and self.refuse_field and self.refuse_field in json.loads(raw):
            error = {"message": f"Unrecognized request argument supplied: {self.refuse_field}",
                     "type": "invalid_request_error", "param": None, "code": None}
            payload = json.dumps({"error": error}).encode()
            handler.send_response(400)
            handler.send_header("Content-Type", "application/json")
            handler.end_headers()
            handler.wfile.write(payload)
            return
        conn = http.client.HTTPConnection(self.upstream, timeout=120)
        try:
            conn.request(handler.command, handler.path, body=raw,
                         headers={"Content-Type": "application/json"} if raw else {})
            response = conn.getresponse()
            handler.send_response(response.status)
            for name, value in response.getheaders():
                if name.lower() not in _DROPPED:
                    handler.send_header(name, value)
            handler.end_headers()
            while chunk := response.read1(65536):
                handler.wfile.write(chunk)
                handler.wfile.flush()
        finally:
            conn.close()
