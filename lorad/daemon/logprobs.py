"""OpenAI's `logprobs` objects from the workers' (token id, TokenLogprobs) pairs.

Completions: {tokens, token_logprobs, top_logprobs, text_offset}; chat: {content: [{token,
logprob, bytes, top_logprobs}]}. A token's text is the token decoded alone (special tokens
skipped, so an end-of-sequence token is ""; a token holding part of a UTF-8 character decodes to
U+FFFD); its bytes are the token's own (token_bytes.py), else its text's UTF-8. The values
themselves are computed by the leader (workers/logprobs.py); nothing here does arithmetic on them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from lorad.daemon.token_bytes import TokenBytes
from lorad.protocol.messages import TokenLogprobs

Entries = Sequence[tuple[int, TokenLogprobs]]


class LogprobsFormat:
    """One request's logprobs objects; a stream's chunks continue each choice's text offsets."""

    def __init__(self, decode: Callable[[list[int]], str], chat: bool,
                 token_bytes: TokenBytes | None = None) -> None:
        self._decode = decode
        self._token_bytes = token_bytes or TokenBytes({})
        self._chat = chat
        # completions: choice index -> characters of its tokens rendered so far
        self._text_offsets: dict[int, int] = {}
        self._texts: dict[int, str] = {}  # token id -> text, for this request's tokens

    def render(self, entries: Entries, index: int = 0) -> dict:
        """The logprobs object of choice `index`'s next tokens."""
        if self._chat:
            return self._chat_object(entries)
        return self._completion_object(entries, index)

    def _text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._decode([token_id])
        return text

    def _chat_object(self, entries: Entries) -> dict:
        content = []
        for token_id, values in entries:
            item = self._chat_item(token_id, values.logprob)
            item["top_logprobs"] = [self._chat_item(i, v)
                                    for i, v in zip(values.top_ids, values.top_logprobs)]
            content.append(item)
        return {"content": content}

    def _chat_item(self, token_id: int, logprob: float) -> dict:
        text = self._text(token_id)
        raw = self._token_bytes(token_id)
        raw = raw if raw is not None else text.encode("utf-8")
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    def _completion_object(self, entries: Entries, index: int) -> dict:
        tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
        offset = self._text_offsets.get(index, 0)
        for token_id, values in entries:
            text = self._text(token_id)
            tokens.append(text)
            token_logprobs.append(values.logprob)
            # OpenAI's "up to logprobs + 1" entries: the k most likely, and the sampled token.
            # Keyed by text, so of two tokens with one text the more likely one is kept.
            top: dict[str, float] = {}
            for i, v in zip(values.top_ids, values.top_logprobs):
                top.setdefault(self._text(i), v)
            top.setdefault(text, values.logprob)
            top_logprobs.append(top)
            text_offset.append(offset)
            offset += len(text)
        self._text_offsets[index] = offset
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": text_offset}
