"""OpenAI's `logprobs` objects from the workers' (token id, TokenLogprobs) pairs.

Completions: {tokens, token_logprobs, top_logprobs, text_offset}, with echo the prompt's tokens
first (the first one's values null); chat: {content: [{token, logprob, bytes, top_logprobs}]}.
A token's text is the token decoded alone (special tokens skipped, so an end-of-sequence token
is ""; a token holding part of a UTF-8 character decodes to U+FFFD); its bytes are the token's own (token_bytes.py), else its text's UTF-8. The values
themselves are computed by the leader (workers/logprobs.py); nothing here does arithmetic on them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from lorad.daemon.detokenizer import REPLACEMENT_CHAR
from lorad.daemon.token_bytes import TokenBytes
from lorad.protocol.messages import TokenLogprobs

Entries = Sequence[tuple[int, TokenLogprobs]]
PromptEntries = Sequence[tuple[int, TokenLogprobs | None]]  # echo: the first has None


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

    def render_prompt(self, entries: PromptEntries, echoed: str, index: int = 0) -> dict:
        """Completions' echo for choice `index`: its prompt's tokens, each at the offset where it
        begins in the prompt's ids decoded together (the echoed text, when the tokenizer gives
        back what it took, as byte-level BPE does); the choice's tokens rendered after it count
        from len(echoed)."""
        offsets = prompt_offsets(self._decode, [token_id for token_id, _ in entries])
        rendered = self._completion_object(entries, index, offsets)
        self._text_offsets[index] = len(echoed)
        return rendered

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

    def _completion_object(self, entries: PromptEntries, index: int,
                           offsets: list[int] | None = None) -> dict:
        tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
        offset = self._text_offsets.get(index, 0)
        for n, (token_id, values) in enumerate(entries):
            text = self._text(token_id)
            tokens.append(text)
            text_offset.append(offset if offsets is None else offsets[n])
            offset += len(text)
            if values is None:  # echo's first prompt token: nothing comes before it
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(values.logprob)
            # OpenAI's "up to logprobs + 1" entries: the k most likely, and the sampled token.
            # Keyed by text, so of two tokens with one text the more likely one is kept.
            top: dict[str, float] = {}
            for i, v in zip(values.top_ids, values.top_logprobs):
                top.setdefault(self._text(i), v)
            top.setdefault(text, values.logprob)
            top_logprobs.append(top)
        self._text_offsets[index] = offset
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": text_offset}


def prompt_offsets(decode: Callable[[list[int]], str], ids: list[int]) -> list[int]:
    """-> where each token's text begins in decode(ids): after the characters the tokens before
    it settled. A token that continues or completes a character split over several begins where
    that character does; a lone byte that never completes one is its own U+FFFD. Linear: tokens
    are decoded from the last whole character on, after one token of context (as
    IncrementalDetokenizer does, for decoders that drop a leading space)."""
    offsets: list[int] = []
    base = 0  # characters of decode(ids[:read])
    prefix, read = 0, 0  # ids[prefix:read]: context, already counted in base
    head = before = ""  # decode(ids[prefix:read]), decode(ids[prefix:i])
    for i in range(len(ids)):
        after = decode(ids[prefix:i + 1])
        settled = next((n for n, (a, b) in enumerate(zip(before, after)) if a != b),
                       min(len(before), len(after)))
        if (settled == len(before) and after.endswith(REPLACEMENT_CHAR)
                and len(after) == len(before)):  # before's last character is still open
            settled = len(before.rstrip(REPLACEMENT_CHAR))
        offsets.append(max(base + max(settled - len(head), 0), offsets[-1] if offsets else 0))
        if after.endswith(REPLACEMENT_CHAR):
            before = after
        else:  # a whole character ends here
            base += len(after) - len(head)
            prefix, read = read, i + 1
            head = before = decode(ids[prefix:read])
    return offsets
