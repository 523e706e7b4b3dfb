"""A forced tool call's answer as OpenAI's `tool_calls`, in full and as stream chunks.

The output is the constrained text tools.py asked for: a named function's arguments (streamed as
they are generated, as OpenAI streams them), or for "required" a JSON array of calls (each sent
whole once its object closes: its name is not known before). `content` is always null. The engine's
"stop" (the grammar completed, then end-of-sequence) is reported as "tool_calls"; "length" stays
"length", with the arguments cut short (named) or only the calls completed before it (required).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence

from lorad.daemon.logprobs import Entries
from lorad.daemon.responses import ChatFormat, FullChoice
from lorad.daemon.tools import ToolChoice

_WHITESPACE = " \t\n\r"


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class CallSplitter:
    """The calls of a "required" answer (`[{"name": ..., "arguments": {...}}, ...]`) as each one's
    object closes, from text that arrives in pieces."""

    def __init__(self) -> None:
        self._text = ""
        self._pos = 0  # where the next call (or the opening bracket) may begin
        self._opened = False
        self._decoder = json.JSONDecoder()

    def add(self, text: str) -> list[tuple[str, str]]:
        """-> (name, arguments as compact JSON) of each call completed by this text."""
        self._text += text
        calls = []
        while "}" in text:  # no object closes without one
            start = self._skip(_WHITESPACE + ("," if self._opened else ""))
            if not self._opened:
                if not self._text.startswith("[", start):
                    break
                self._opened, self._pos = True, start + 1
                continue
            try:
                call, self._pos = self._decoder.raw_decode(self._text, start)
            except json.JSONDecodeError:  # not closed yet: the grammar allows nothing invalid
                break
            calls.append((call["name"], json.dumps(call["arguments"], ensure_ascii=False)))
        return calls

    def _skip(self, chars: str) -> int:
        pos = self._pos
        while pos < len(self._text) and self._text[pos] in chars:
            pos += 1
        return pos


class ToolCallFormat(ChatFormat):
    def __init__(self, response_id: str, model: str, tool_choice: ToolChoice, **kwargs) -> None:
        super().__init__(response_id, model, **kwargs)
        self.tool_choice = tool_choice
        self._splitters: dict[int, CallSplitter] = {}  # each streamed choice's; full() its own
        self._num_sent: dict[int, int] = {}  # calls announced in each choice's stream so far

    def _full_choice(self, choice: FullChoice) -> dict:
        if self.tool_choice.function is not None:
            calls = [(self.tool_choice.function, choice.text)]
        else:
            calls = CallSplitter().add(choice.text)
        message = {"role": "assistant", "content": None}
        if calls:
            message["tool_calls"] = [_call(name, arguments) for name, arguments in calls]
        return self._with_ids({"index": choice.index, "message": message,
                               "logprobs": self._logprobs(choice.entries, choice.index),
                               "finish_reason": _finish(choice.finish_reason, bool(calls))},
                              choice.token_ids)

    def opening_chunk(self, num_prompt: int, num_completion: int = 0, index: int = 0) -> dict:
        delta = {"role": "assistant", "content": None}
        self._num_sent[index] = 0
        if self.tool_choice.function is not None:  # OpenAI's first delta: id, type and name
            delta["tool_calls"] = [{"index": 0, **_call(self.tool_choice.function, "")}]
            self._num_sent[index] = 1
        return self._chunk(delta, None, (num_prompt, num_completion), None, index)

    def chunk(self, text: str, finish_reason: str | None, num_prompt: int,
              num_completion: int, entries: Entries = (), index: int = 0,
              token_ids: Sequence[int] = ()) -> dict | None:
        """-> the chunk, or None when it would say nothing (sse.py then sends nothing)."""
        sent = self._num_sent.setdefault(index, 0)
        if self.tool_choice.function is not None:
            calls = [{"index": 0, "function": {"arguments": text}}] if text else []
        else:
            calls = []
            for name, arguments in self._splitters.setdefault(index, CallSplitter()).add(text):
                calls.append({"index": sent, **_call(name, arguments)})
                sent += 1
            self._num_sent[index] = sent
        if not calls and finish_reason is None and not self.continuous_usage:
            return None
        return self._chunk({"tool_calls": calls} if calls else {},
                           _finish(finish_reason, sent > 0),
                           (num_prompt, num_completion), self._logprobs(entries, index), index,
                           token_ids)


def _call(name: str, arguments: str) -> dict:
    return {"id": call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _finish(reason: str | None, any_calls: bool) -> str | None:
    # Only the completed grammar ends a forced call with "stop" (stop strings are refused with
    # it), so "stop" means the calls are whole: OpenAI's word for that is "tool_calls". Without
    # a call (a matcher the leader could not build ends the answer at once) "stop" stays.
    return "tool_calls" if reason == "stop" and any_calls else reason
