"""OpenAI response bodies and stream chunks for /v1/completions and /v1/chat/completions.

One small class per endpoint builds its JSON shapes; routes.py and sse.py decide when to send
them. Pure dicts in, dicts out.
"""

from __future__ import annotations

import time

from lorad.daemon.logprobs import Entries, LogprobsFormat, PromptEntries


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens}


class CompletionFormat:
    object_name = "text_completion"
    id_prefix = "cmpl-"

    def __init__(self, response_id: str, model: str, include_usage: bool = False,
                 continuous_usage: bool = False, logprobs: LogprobsFormat | None = None,
                 echo: str | None = None) -> None:
        self.response_id = response_id
        self.logprobs = logprobs  # None: the request did not ask; every choice says null
        self.echo = echo  # completions' echo: the prompt's text, which the answer's text begins
        self.model = model
        self.created = int(time.time())
        self.include_usage = include_usage
        # vLLM's continuous_usage_stats, which counts only together with include_usage: every
        # chunk carries the counts so far, and sse.py sends a chunk for every step's tokens.
        self.continuous_usage = include_usage and continuous_usage

    def _envelope(self, choices: list[dict], object_name: str,
                  counts: tuple[int, int] | None = None) -> dict:
        body = {"id": self.response_id, "object": object_name, "created": self.created,
                "model": self.model, "choices": choices}
        if self.continuous_usage and counts is not None:
            body["usage"] = usage(*counts)
        elif self.include_usage:
            body["usage"] = None  # filled only in the final usage chunk, as OpenAI does
        return body

    def _logprobs(self, entries: Entries) -> dict | None:
        return self.logprobs.render(entries) if self.logprobs is not None else None

    def full(self, text: str, finish_reason: str, num_prompt: int, num_completion: int,
             entries: Entries = (), prompt_entries: PromptEntries = ()) -> dict:
        logprobs = None
        if self.echo is not None and self.logprobs is not None:
            prompt = self.logprobs.render_prompt(prompt_entries, self.echo)
            rest = self.logprobs.render(entries)
            logprobs = {key: prompt[key] + rest[key] for key in prompt}
        elif self.logprobs is not None:
            logprobs = self.logprobs.render(entries)
        body = self._envelope([{"index": 0, "text": (self.echo or "") + text,
                                "logprobs": logprobs, "finish_reason": finish_reason}],
                              self.object_name)
        body["usage"] = usage(num_prompt, num_completion)
        return body

    def echo_chunk(self, num_prompt: int, prompt_entries: PromptEntries) -> dict:
        """A stream's echo: the prompt's text and its tokens' log probabilities in one chunk,
        right after the opening chunk."""
        logprobs = (self.logprobs.render_prompt(prompt_entries, self.echo)
                    if self.logprobs is not None else None)
        return self._envelope([{"index": 0, "text": self.echo, "logprobs": logprobs,
                                "finish_reason": None}], self.object_name, (num_prompt, 0))

    def opening_chunk(self, num_prompt: int) -> dict:
        """The stream's first chunk, sent when the first token exists, whatever its text."""
        return self.chunk("", None, num_prompt, 0)

    def chunk(self, text: str, finish_reason: str | None, num_prompt: int,
              num_completion: int, entries: Entries = ()) -> dict:
        return self._envelope([{"index": 0, "text": text, "logprobs": self._logprobs(entries),
                                "finish_reason": finish_reason}], self.object_name,
                              (num_prompt, num_completion))

    def usage_chunk(self, num_prompt: int, num_completion: int) -> dict:
        body = self._envelope([], self.object_name)
        body["usage"] = usage(num_prompt, num_completion)
        return body


class ChatFormat(CompletionFormat):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def full(self, text: str, finish_reason: str, num_prompt: int, num_completion: int,
             entries: Entries = (), prompt_entries: PromptEntries = ()) -> dict:
        # Chat has no echo: prompt_entries is always empty here.
        message = {"role": "assistant", "content": text}
        body = self._envelope([{"index": 0, "message": message,
                                "logprobs": self._logprobs(entries),
                                "finish_reason": finish_reason}], self.object_name)
        body["usage"] = usage(num_prompt, num_completion)
        return body

    def opening_chunk(self, num_prompt: int) -> dict:
        # OpenAI's first chunk: the role, with empty content.
        return self._chunk({"role": "assistant", "content": ""}, None, (num_prompt, 0), None)

    def chunk(self, text: str, finish_reason: str | None, num_prompt: int,
              num_completion: int, entries: Entries = ()) -> dict:
        # Mid-stream chunks keep "content" even when empty, for clients that index it; the
        # finish chunk without text has an empty delta, as OpenAI's does.
        delta = {"content": text} if text or finish_reason is None else {}
        return self._chunk(delta, finish_reason, (num_prompt, num_completion),
                           self._logprobs(entries))

    def usage_chunk(self, num_prompt: int, num_completion: int) -> dict:
        body = self._envelope([], self.chunk_object_name)
        body["usage"] = usage(num_prompt, num_completion)
        return body

    def _chunk(self, delta: dict, finish_reason: str | None, counts: tuple[int, int],
               logprobs: dict | None) -> dict:
        return self._envelope([{"index": 0, "delta": delta, "logprobs": logprobs,
                                "finish_reason": finish_reason}], self.chunk_object_name, counts)
