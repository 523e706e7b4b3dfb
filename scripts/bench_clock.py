"""How one bench.py stream's chunks become its outcome: the first token's time, per-token gaps,
token counts (cached prompt tokens too), the text. Pure: the caller reads the socket and passes
each chunk with its arrival time.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Outcome:
    model: str
    ok: bool = False
    error: str = ""
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)  # inter-token latencies (see TokenClock)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    # usage.prompt_tokens_details.cached_tokens, as OpenAI reports its prompt cache's hits
    num_cached_tokens: int = 0
    cached_reported: bool = False  # the usage carried that field (servers without a cache omit it)
    num_text_chunks: int = 0
    usage_per_chunk: bool = False  # the server counted the tokens on every chunk
    text: str = ""  # the answer (chat-turns appends it to the conversation)
    sent_at: float = 0.0  # time.perf_counter() when the request was sent
    done_at: float = 0.0  # and when its stream ended (or failed)


class TokenClock:
    """When one stream's tokens arrived. With usage on every chunk (lorad's and vLLM's
    continuous_usage_stats), the first chunk whose count is above 0 is the first token, and a
    later chunk that brings k tokens after a gap g adds k latencies of g / k, as lorad's
    lorad_inter_token_seconds does. Without it, the first chunk with choices is the first token
    (lorad and OpenAI send it then, whatever its text) and each later chunk with text one more."""

    def __init__(self, outcome: Outcome, started: float) -> None:
        self.outcome = outcome
        self.started = started
        self.num_tokens = 0
        self.last_at = started

    def chunk(self, chunk: dict, now: float) -> None:
        if not chunk.get("choices"):
            return  # the final usage chunk: no token
        text = chunk_text(chunk)
        has_text = bool(text)
        self.outcome.text += text
        self.outcome.num_text_chunks += has_text
        usage = chunk.get("usage")
        if usage:
            self.outcome.usage_per_chunk = True
            num_new = usage["completion_tokens"] - self.num_tokens
        else:
            num_new = 1 if has_text or self.outcome.ttft_s is None else 0
        if num_new <= 0:
            return
        if self.outcome.ttft_s is None:
            self.outcome.ttft_s = now - self.started  # tokens that came with it have no gap
        else:
            self.outcome.gaps_s += [(now - self.last_at) / num_new] * num_new
        self.num_tokens += num_new
        self.last_at = now


def read_usage(outcome: Outcome, usage: dict) -> None:
    """The counts of a chunk's usage; a later chunk's replace an earlier one's."""
    outcome.num_prompt_tokens = usage["prompt_tokens"]
    outcome.num_output_tokens = usage["completion_tokens"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is not None:
        outcome.num_cached_tokens = cached
        outcome.cached_reported = True


def chunk_text(chunk: dict) -> str:
    text = ""
    for choice in chunk.get("choices") or []:
        text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text
