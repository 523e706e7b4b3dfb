"""Streaming requests read in background threads, for the failure tests: each records its SSE
events and when they arrived, so a test can fail a worker mid-stream and time each ending.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from urllib.parse import urlsplit


class Stream(threading.Thread):
    """POST /v1/completions with stream=true; events are the `data:` payloads in order."""

    def __init__(self, url: str, max_tokens: int = 200, prompt: str = "hello",
                 model: str = "tiny") -> None:
        super().__init__(daemon=True)
        self._address = urlsplit(url).netloc
        self._body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                 "ignore_eos": True, "stream": True})
        self.status: int | None = None
        self.events: list[bytes] = []
        self.event_times: list[float] = []
        self.ended_at: float | None = None
        self.body = b""  # the whole body of a non-200 answer
        self.start()

    def run(self) -> None:
        conn = http.client.HTTPConnection(self._address, timeout=120)
        try:
            conn.request("POST", "/v1/completions", self._body,
                         {"Content-Type": "application/json"})
            resp = conn.getresponse()
            self.status = resp.status
            if resp.status != 200:
                self.body = resp.read()
                return
            buffer = b""
            while chunk := resp.read1(65536):
                buffer += chunk
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    self.events.append(event.removeprefix(b"data: "))
                    self.event_times.append(time.monotonic())
        except (OSError, http.client.HTTPException) as exc:  # the server went away
            self.body = repr(exc).encode()
        finally:
            self.ended_at = time.monotonic()
            conn.close()

    def wait_started(self, timeout_s: float = 60) -> None:
        """Until the first data event (a token) arrived."""
        deadline = time.monotonic() + timeout_s
        while not self.events and time.monotonic() < deadline and self.ended_at is None:
            time.sleep(0.02)
        assert self.events, f"no first event (status {self.status}, body {self.body[:300]!r})"

    def error_message(self) -> str:
        """The message of the stream's terminal error event; fails unless it ended with one."""
        assert self.ended_at is not None, "the stream is still open"
        assert self.status == 200 and self.events[-1:] == [b"[DONE]"], \
            (self.status, self.body[:300], self.events[-3:])
        errors = [json.loads(e)["error"] for e in self.events[:-1] if e.startswith(b'{"error"')]
        assert len(errors) == 1 and self.events[-2].startswith(b'{"error"'), self.events[-3:]
        return errors[0]["message"]
