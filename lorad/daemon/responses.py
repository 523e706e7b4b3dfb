"""OpenAI response bodies and stream chunks for /v1/completions and /v1/chat/completions.

One small class per endpoint builds its JSON shapes; routes.py and sse.py decide when to send
them. Pure dicts in, dicts out.
"""

from __future__ import annotations

import time


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens}


class CompletionFormat:
    object_name = "text_completion"
    id_prefix = "cmpl-"

    def __init__(self, response_id: str, model: str, include_usage: bool = False) -> None:
        self.response_id = response_id
        self.model = model
        self.created = int(time.time())
        self.include_usage = include_usage

    def _envelope(self, choices: list[dict], object_name: str) -> dict:
        body = {"id": self.response_id, "object": object_name, "created": self.created,
                "model": self.model, "choices": choices}
        if self.include_usage:
            body["usage"] = None  # filled only in the final usage chunk, as OpenAI does
        return body

    def full(self, text: str, finish_reason: str, num_prompt: int, num_completion: int) -> dict:
        body = self._envelope([{"index": 0, "text": text, "logprobs": None,
                                "finish_reason": finish_reason}], self.object_name)
        body["usage"] = usage(num_prompt, num_completion)
        return body

    def opening_chunks(self) -> list[dict]:
        return []

    def chunk(self, text: str, finish_reason: str | None) -> dict:
        return self._envelope([{"index": 0, "text": text, "logprobs": None,
                                "finish_reason": finish_reason}], self.object_name)

    def usage_chunk(self, num_prompt: int, num_completion: int) -> dict:
        body = self._envelope([], self.object_name)
        body["usage"] = usage(num_prompt, num_completion)
        return body


class ChatFormat(CompletionFormat):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def full(self, text: str, finish_reason: str, num_prompt: int, num_completion: int) -> dict:
        message = {"role": "assistant", "content": text}
        body = self._envelope([{"index": 0, "message": message, "logprobs": None,
                                "finish_reason": finish_reason}], self.object_name)
        body["usage"] = usage(num_prompt, num_completion)
        return body

    def opening_chunks(self) -> list[dict]:
        return [self._chunk({"role": "assistant", "content": ""}, None)]

    def chunk(self, text: str, finish_reason: str | None) -> dict:
        return self._chunk({"content": text} if text else {}, finish_reason)

    def usage_chunk(self, num_prompt: int, num_completion: int) -> dict:
        body = self._envelope([], self.chunk_object_name)
        body["usage"] = usage(num_prompt, num_completion)
        return body

    def _chunk(self, delta: dict, finish_reason: str | None) -> dict:
        return self._envelope([{"index": 0, "delta": delta, "logprobs": None,
                                "finish_reason": finish_reason}], self.chunk_object_name)
