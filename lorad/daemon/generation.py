"""One admitted request, from its Admits to its choices' terminal events, as a stream of deltas.

Admits each prompt (one Admit carrying n), detokenizes each choice's ids (passing the ids on as
well, for return_token_ids), hands each echoed prompt's log probabilities to its choice's first
delta, ends a choice on the engine's finish reason or a stop string (then sends Cancel), and
sends Cancel for every open choice if its consumer goes away early or one choice fails. Knows
nothing of OpenAI's JSON shapes (responses.py) or of HTTP.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
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
    finish_reason: str | None  # "stop" or "length" on the choice's last delta, else None
    num_prompt_tokens: int  # of this choice's prompt
    num_completion_tokens: int  # this choice's tokens generated so far
    # (token id, its log probabilities) for each token of this step, when the request asked;
    # every generated token has one, the end-of-sequence token too, whatever text is shown.
    logprobs: tuple[tuple[int, TokenLogprobs], ...] = ()
    index: int = 0  # the choice: prompt index * n + j, OpenAI's order
    prompt_index: int = 0  # which prompt of the request it continues
    # Echo with logprobs, on the choice's first delta only: (token id, its values) for every
    # token of its prompt, the first with None (it has no position before it).
    prompt_logprobs: tuple[tuple[int, TokenLogprobs | None], ...] = ()
    # Tokens of its prompt found in the workers' prefix cache (usage's cached_tokens)
    num_cached_tokens: int = 0
    # Every id generated in this step, the stop token that ended the choice included (as
    # logprobs and num_completion_tokens count it), whatever text is shown or held back.
    token_ids: Sequence[int] = ()


@dataclass(frozen=True)
class Prompt:
    """One prompt of a request, admitted as one Admit carrying n."""

    token_ids: list[int]
    sampling: SamplingParams  # its max_tokens follows its own length


class _Choice:
    """One choice's state: its worker request id, detokenizer and counts; with echo, its
    prompt's values until its first delta carries them."""

    def __init__(self, index: int, prompt_index: int, request_id: str, prompt_ids: list[int],
                 tokenizer: ModelTokenizer, stop: tuple[str, ...], echo: bool) -> None:
        self.index = index
        self.prompt_index = prompt_index
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.detokenizer = IncrementalDetokenizer(tokenizer.decode, stop)
        self.num_generated = 0
        self.finished = False
        self.prompt_values: list[TokenLogprobs] | None = [] if echo else None


async def generate(engine: EngineClient, tokenizer: ModelTokenizer, request_id: str,
                   prompts: list[Prompt], stop: tuple[str, ...], adapter_id: int = 0,
                   adapter_key: str = "", grammar: str = "", n: int = 1,
                   cache_prompt: bool = True, adapter_strength: float = 1.0,
                   draft: bool = True) -> AsyncIterator[Delta]:
    """Yield every choice's deltas, interleaved as their tokens arrive, until each choice has
    yielded one with a finish reason; raise GenerationError when any choice fails (the others
    are cancelled: one error ends the whole request).

    adapter_id 0 (key "") is the base model; grammar "" leaves the output unconstrained. Close
    it (contextlib.aclosing) when abandoning it early: closing sends Cancel for every choice.
    """
    queue: asyncio.Queue = asyncio.Queue()  # every choice's outputs, in arrival order
    choices: dict[str, _Choice] = {}
    # A stop string is matched here, on text: the tokens a drafted step emits after a match
    # would be counted in usage and return_token_ids, where one token a step would have stopped.
    draft = draft and not stop
    try:
        for i, prompt in enumerate(prompts):
            prompt_id = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            ids = engine.admit(prompt_id, prompt.token_ids, prompt.sampling, adapter_id,
                               adapter_key, grammar, n, queue, cache_prompt, adapter_strength,
                               draft)
            for j, choice_id in enumerate(ids):
                # The workers send a prompt's values with its first choice (echo takes n = 1).
                echo = prompt.sampling.prompt_logprobs >= 0 and j == 0
                choices[choice_id] = _Choice(i * n + j, i, choice_id, prompt.token_ids,
                                             tokenizer, stop, echo)
    except EngineDead as exc:
        _cancel_open(engine, choices)
        raise GenerationError(f"the engine is down: {exc}") from None
    except BaseException:
        _cancel_open(engine, choices)  # all or nothing: no prompt runs without the others
        raise
    sampling = prompts[0].sampling  # the prompts differ only in max_tokens
    stop_ids = set(sampling.stop_token_ids) | set(sampling.request_stop_token_ids)
    num_open = len(choices)
    try:
        while num_open:
            event = await queue.get()
            if isinstance(event, RequestFailed):
                raise GenerationError(event.message)
            choice = choices[event.request_id]
            if choice.finished:
                continue
            if choice.prompt_values is not None and event.prompt_logprobs:
                choice.prompt_values.extend(event.prompt_logprobs)
                if not event.token_ids and event.finish_reason is None:
                    continue  # a prefill step's share: it rides with the choice's first delta
            delta = _delta(engine, choice, event, stop_ids)
            if delta.finish_reason is not None:
                num_open -= 1
            yield delta
    finally:
        _cancel_open(engine, choices)


def _delta(engine: EngineClient, choice: _Choice, event, stop_ids: set[int]) -> Delta:
    choice.num_generated += len(event.token_ids)
    ids = event.token_ids
    if event.finish_reason == "stop" and ids and ids[-1] in stop_ids:
        ids = ids[:-1]  # the stop token is counted but never shown
    detokenizer = choice.detokenizer
    text = detokenizer.add(ids)
    reason = _finish_reason(event.finish_reason, detokenizer.stopped)
    if reason is not None:
        choice.finished = True
        if detokenizer.stopped and event.finish_reason is None:
            engine.cancel(choice.request_id)  # a stop string ended it; the workers don't know
        text += detokenizer.finish()
        if detokenizer.stopped:
            # The text held back until now (an incomplete character) held a stop string: it
            # ends the choice as a stop, whatever ended the generation.
            reason = "stop"
    logprobs = tuple(zip(event.token_ids, event.logprobs)) if event.logprobs else ()
    prompt = ()
    if choice.prompt_values is not None:
        prompt = _prompt_entries(choice.prompt_ids, choice.prompt_values)
        choice.prompt_values = None
    return Delta(text, reason, len(choice.prompt_ids), choice.num_generated, logprobs,
                 choice.index, choice.prompt_index, prompt, event.num_cached_tokens,
                 token_ids=event.token_ids)


def _cancel_open(engine: EngineClient, choices: dict[str, _Choice]) -> None:
    for choice in choices.values():
        if not choice.finished:
            choice.finished = True
            engine.cancel(choice.request_id)


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
