"""OpenAI response bodies and stream chunks for /v1/completions and /v1/chat/completions.

One small class per endpoint builds its JSON shapes; routes.py and sse.py decide when to send
them. Pure dicts in, dicts out. Every choice carries its index (prompt index * n + j); usage is
the request's: each prompt's tokens once, every choice's completion tokens. With completions'
echo, each choice's text and logprobs begin with its own prompt's. With return_token_ids every
choice object carries "token_ids": its generated ids, or in a chunk those since its last chunk.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import NamedTuple

from lorad.daemon.logprobs import Entries, LogprobsFormat, PromptEntries


class FullChoice(NamedTuple):
    """One choice of a non-streamed answer."""

    index: int  # prompt index * n + j
    text: str
    finish_reason: str
    entries: Entries = ()  # its tokens' log probabilities, when asked
    prompt_index: int = 0  # which prompt of the request it continues
    prompt_entries: PromptEntries = ()  # echo with logprobs: its prompt's tokens' entries
    token_ids: Sequence[int] = ()  # every id it generated (shown with return_token_ids)


def usage(num_prompt_tokens: int, num_completion_tokens: int,
          num_cached_tokens: int | None = None) -> dict:
    """OpenAI's usage object; the request's final usage (num_cached_tokens given) also says how
    many prompt tokens came from the prefix cache, as OpenAI's prompt_tokens_details does."""
    body = {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens}
    if num_cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": num_cached_tokens}
    return body


class CompletionFormat:
    object_name = "text_completion"
    id_prefix = "cmpl-"

    def __init__(self, response_id: str, model: str, include_usage: bool = False,
                 continuous_usage: bool = False, logprobs: LogprobsFormat | None = None,
                 echo: list[str] | None = None, return_token_ids: bool = False) -> None:
        self.response_id = response_id
        self.return_token_ids = return_token_ids  # vLLM's extension: each choice's ids
        self.logprobs = logprobs  # None: the request did not ask; every choice says null
        # Completions' echo: each prompt's text, by prompt index, which its choices' text begins
        self.echo = echo
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

    def _logprobs(self, entries: Entries, index: int = 0) -> dict | None:
        return self.logprobs.render(entries, index) if self.logprobs is not None else None

    def _with_ids(self, choice: dict, token_ids: Sequence[int]) -> dict:
        # After finish_reason, as vLLM places it (and after the text, where chunk_template.py
        # expects its hole).
        if self.return_token_ids:
            choice["token_ids"] = list(token_ids)
        return choice

    def full(self, choices: list[FullChoice], num_prompt: int, num_completion: int,
             num_cached: int = 0) -> dict:
        """choices: each choice's whole text, by index; the counts summed over the request."""
        body = self._envelope([self._full_choice(c) for c in choices], self.object_name)
        body["usage"] = usage(num_prompt, num_completion, num_cached)
        return body

    def _full_choice(self, choice: FullChoice) -> dict:
        if self.echo is None:
            return self._with_ids({"index": choice.index, "text": choice.text,
                                   "logprobs": self._logprobs(choice.entries, choice.index),
                                   "finish_reason": choice.finish_reason}, choice.token_ids)
        echoed = self.echo[choice.prompt_index]
        logprobs = None
        if self.logprobs is not None:
            prompt = self.logprobs.render_prompt(choice.prompt_entries, echoed, choice.index)
            rest = self.logprobs.render(choice.entries, choice.index)
            logprobs = {key: prompt[key] + rest[key] for key in prompt}
        return self._with_ids({"index": choice.index, "text": echoed + choice.text,
                               "logprobs": logprobs, "finish_reason": choice.finish_reason},
                              choice.token_ids)  # the generated ids only: echo adds text

    def echo_chunk(self, num_prompt: int, num_completion: int, prompt_entries: PromptEntries,
                   index: int = 0, prompt_index: int = 0) -> dict:
        """A choice's echo in a stream: its prompt's text and its tokens' log probabilities in
        one chunk, right after the choice's opening chunk."""
        echoed = self.echo[prompt_index]
        logprobs = (self.logprobs.render_prompt(prompt_entries, echoed, index)
                    if self.logprobs is not None else None)
        return self._envelope([self._with_ids({"index": index, "text": echoed,
                                               "logprobs": logprobs, "finish_reason": None}, ())],
                              self.object_name, (num_prompt, num_completion))

    def opening_chunk(self, num_prompt: int, num_completion: int = 0, index: int = 0) -> dict:
        """A choice's first chunk, sent when its first token exists, whatever its text."""
        return self.chunk("", None, num_prompt, num_completion, index=index)

    def chunk(self, text: str, finish_reason: str | None, num_prompt: int,
              num_completion: int, entries: Entries = (), index: int = 0,
              token_ids: Sequence[int] = ()) -> dict:
        """One choice's chunk; the counts are the request's so far (continuous usage);
        token_ids: the choice's ids since its previous chunk."""
        return self._envelope([self._with_ids({"index": index, "text": text,
                                               "logprobs": self._logprobs(entries, index),
                                               "finish_reason": finish_reason}, token_ids)],
                              self.object_name, (num_prompt, num_completion))

    def usage_chunk(self, num_prompt: int, num_completion: int, num_cached: int = 0) -> dict:
        body = self._envelope([], self.object_name)
        body["usage"] = usage(num_prompt, num_completion, num_cached)
        return body


class ChatFormat(CompletionFormat):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def _full_choice(self, choice: FullChoice) -> dict:  # chat has no echo
        return self._with_ids({"index": choice.index,
                               "message": {"role": "assistant", "content": choice.text},
                               "logprobs": self._logprobs(choice.entries, choice.index),
                               "finish_reason": choice.finish_reason}, choice.token_ids)

    def opening_chunk(self, num_prompt: int, num_completion: int = 0, index: int = 0) -> dict:
        # OpenAI's first chunk of a choice: the role, with empty content.
        return self._chunk({"role": "assistant", "content": ""}, None,
                           (num_prompt, num_completion), None, index)

    def chunk(self, text: str, finish_reason: str | None, num_prompt: int,
              num_completion: int, entries: Entries = (), index: int = 0,
              token_ids: Sequence[int] = ()) -> dict:
        # Mid-stream chunks keep "content" even when empty, for clients that index it; the
        # finish chunk without text has an empty delta, as OpenAI's does.
        delta = {"content": text} if text or finish_reason is None else {}
        return self._chunk(delta, finish_reason, (num_prompt, num_completion),
                           self._logprobs(entries, index), index, token_ids)

    def usage_chunk(self, num_prompt: int, num_completion: int, num_cached: int = 0) -> dict:
        body = self._envelope([], self.chunk_object_name)
        body["usage"] = usage(num_prompt, num_completion, num_cached)
        return body

    def _chunk(self, delta: dict, finish_reason: str | None, counts: tuple[int, int],
               logprobs: dict | None, index: int, token_ids: Sequence[int] = ()) -> dict:
        return self._envelope([self._with_ids({"index": index, "delta": delta,
                                               "logprobs": logprobs,
                                               "finish_reason": finish_reason}, token_ids)],
                              self.chunk_object_name, counts)
