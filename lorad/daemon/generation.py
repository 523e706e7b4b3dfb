"""One admitted request, from Admit to its single terminal event, as a stream of text deltas.

Admits the prompt, detokenizes each step's ids, ends on the engine's finish reason or a stop
string (then sends Cancel), and sends Cancel if its consumer goes away early. Knows nothing of
OpenAI's JSON shapes (responses.py) or of HTTP.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from lorad.daemon.detokenizer import IncrementalDetokenizer
from lorad.daemon.engine_client import EngineClient, EngineDead, RequestFailed
from lorad.daemon.tokenizer import ModelTokenizer
from lorad.protocol import SamplingParams
from lorad.protocol.messages import TokenLogprobs


class GenerationError(RuntimeError):
    """The request ended with an error; the message is for the client. `status` and `code` are
    what a client gets if no stream has opened: 500 engine_error (failed step, dead worker),
    504 request_timeout (--request-timeout), 503 shutdown (cut at the end of a drain)."""

    def __init__(self, message: str, status: int = 500, code: str = "engine_error") -> None:
        super().__init__(message)
        self.status = status
        self.code = code


@dataclass(frozen=True)
class Delta:
    text: str  # new text, possibly empty
    finish_reason: str | None  # "stop" or "length" on the last delta, else None
    num_prompt_tokens: int
    num_completion_tokens: int  # generated so far
    # (token id, its log probabilities) for each token of this step, when the request asked;
    # every generated token has one, the end-of-sequence token too, whatever text is shown.
    logprobs: tuple[tuple[int, TokenLogprobs], ...] = ()
    # Echo with logprobs, on the first delta only: (token id, its values) for every prompt token,
    # the first with None (it has no position before it).
    prompt_logprobs: tuple[tuple[int, TokenLogprobs | None], ...] = ()


async def generate(engine: EngineClient, tokenizer: ModelTokenizer, request_id: str,
                   prompt_ids: list[int], sampling: SamplingParams, stop: tuple[str, ...],
                   adapter_slot: int = 0, adapter_key: str = "",
                   grammar: str = "") -> AsyncIterator[Delta]:
    """Yield deltas until one carries a finish reason; raise GenerationError on failure.

    adapter_slot 0 (key "") is the base model; grammar "" leaves the output unconstrained. Close
    it (contextlib.aclosing) when abandoning it early: closing sends Cancel.
    """
    try:
        queue = engine.admit(request_id, prompt_ids, sampling, adapter_slot, adapter_key, grammar)
    except EngineDead as exc:
        raise GenerationError(f"the engine is down: {exc}") from None
    detokenizer = IncrementalDetokenizer(tokenizer.decode, stop)
    stop_ids = set(sampling.stop_token_ids)
    num_generated = 0
    finished = False
    prompt_values: list[TokenLogprobs] | None = [] if sampling.prompt_logprobs >= 0 else None
    try:
        while not finished:
            event = await queue.get()
            if isinstance(event, RequestFailed):
                finished = True
                raise GenerationError(event.message)
            if prompt_values is not None and event.prompt_logprobs:
                prompt_values.extend(event.prompt_logprobs)
                if not event.token_ids and event.finish_reason is None:
                    continue  # a prefill step's share: it rides with the first delta
            num_generated += len(event.token_ids)
            ids = event.token_ids
            if event.finish_reason == "stop" and ids and ids[-1] in stop_ids:
                ids = ids[:-1]  # the stop token is counted but never shown
            text = detokenizer.add(ids)
            reason = _finish_reason(event.finish_reason, detokenizer.stopped)
            if reason is not None:
                finished = True
                if detokenizer.stopped and event.finish_reason is None:
                    engine.cancel(request_id)  # a stop string ended it; the workers don't know
                text += detokenizer.finish()
                if detokenizer.stopped:
                    # The text held back until now (an incomplete character) held a stop
                    # string: it ends the request as a stop, whatever ended the generation.
                    reason = "stop"
            logprobs = tuple(zip(event.token_ids, event.logprobs or ()))
            prompt = ()
            if prompt_values is not None:
                prompt, prompt_values = _prompt_entries(prompt_ids, prompt_values), None
            yield Delta(text, reason, len(prompt_ids), num_generated, logprobs, prompt)
    finally:
        if not finished:
            engine.cancel(request_id)


def _prompt_entries(prompt_ids: list[int], values: list[TokenLogprobs]) -> tuple:
    if len(values) != len(prompt_ids) - 1:
        raise GenerationError(f"the engine sent {len(values)} prompt log probabilities for a "
                              f"prompt of {len(prompt_ids)} tokens")
    return ((prompt_ids[0], None), *zip(prompt_ids[1:], values))


def _finish_reason(engine_reason: str | None, stop_string_matched: bool) -> str | None:
    if stop_string_matched:
        return "stop"
    if engine_reason == "cancelled":
        # Only our own Cancel ends a request this way, and after it we stop listening.
        raise GenerationError("the engine cancelled this request")
    if engine_reason not in (None, "stop", "length"):
        raise GenerationError(f"the engine ended this request with {engine_reason!r}")
    return engine_reason
