"""Turns a request's generated ids into text deltas, safe to stream, and applies its stop strings.

Byte-level BPE can split one character across tokens, so text is released only once it decodes
to whole characters; the concatenated deltas equal decoding all ids at once. Text that could be
the start of a stop string is held back; a matched stop string and everything after it is never
released. Knows nothing about sockets or HTTP.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

log = logging.getLogger("lorad.detokenizer")

REPLACEMENT_CHAR = "\ufffd"  # what a decoder makes of an incomplete UTF-8 sequence


class IncrementalDetokenizer:
    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()) -> None:
        self._decode = decode  # ids -> text, special tokens skipped
        self._stop = tuple(s for s in stop if s)
        self._ids: list[int] = []
        # Decoding re-reads a short window: ids[prefix_offset:read_offset] is text already
        # counted, ids[read_offset:] is not. The window starts at a character boundary.
        self._prefix_offset = 0
        self._read_offset = 0
        self._text = ""  # whole characters decoded so far
        self._num_released = 0  # characters of _text already returned
        self.stopped = False  # a stop string matched; nothing more will be released

    @property
    def text(self) -> str:
        """Everything released so far."""
        return self._text[:self._num_released]

    def add(self, token_ids: Sequence[int]) -> str:
        """Take new ids; return the text that is now safe to send ('' if none)."""
        if self.stopped:
            return ""
        self._ids.extend(token_ids)
        self._text += self._decode_new()
        return self._release(final=False)

    def finish(self) -> str:
        """No more ids will come: release what was held back, incomplete characters included."""
        if self.stopped:
            return ""
        full = self._decode(self._ids)
        if full.startswith(self._text):
            self._text = full
        else:  # a decoder whose output depends on context the window did not see
            log.warning("incremental text diverged from the full decode; keeping the stream's text")
            self._text += self._decode_new(force=True)
        return self._release(final=True)

    def _decode_new(self, force: bool = False) -> str:
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        window = self._decode(self._ids[self._prefix_offset:])
        if not force and (len(window) <= len(prefix) or window.endswith(REPLACEMENT_CHAR)):
            return ""  # nothing new, or the last character is still incomplete
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return window[len(prefix):]

    def _release(self, final: bool) -> str:
        start = self._num_released
        if not self._stop:  # most requests: nothing to find, nothing to hold back
            self._num_released = len(self._text)
            return self._text[start:]
        match = self._first_stop_match(start)
        if match is not None:
            self.stopped = True
            self._num_released = match
            return self._text[start:match]
        end = len(self._text) if final else len(self._text) - self._partial_stop_len(start)
        self._num_released = max(end, start)
        return self._text[start:self._num_released]

    def _first_stop_match(self, start: int) -> int | None:
        # Held-back text always covers any partial match, so a stop string cannot begin before
        # `start`: searching from there is enough.
        hits = [i for i in (self._text.find(s, start) for s in self._stop) if i >= 0]
        return min(hits) if hits else None

    def _partial_stop_len(self, start: int) -> int:
        """Length of the longest tail of the unreleased text that begins some stop string."""
        tail = self._text[start:]
        longest = 0
        for stop in self._stop:
            for k in range(min(len(stop) - 1, len(tail)), longest, -1):
                if tail.endswith(stop[:k]):
                    longest = k
                    break
        return longest
