"""OpenAI request bodies, checked field by field into frozen dataclasses.

Unknown fields are ignored as OpenAI does; known fields lorad cannot honour (suffix, functions,
best_of other than n, echo with n > 1, ...) and contradictory ones are refused by name, never
dropped silently. `adapter`, `regex` and `grammar` are lorad's own fields, read by
constraints.py; chat's messages and tools are read by chat_messages.py and tools.py. Checks that
need the model (served ids and adapters, context length, vocabulary, n against --max-num-seqs)
happen in routes.py and model_ids.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lorad.daemon.chat_messages import parse_messages, text
from lorad.daemon.constraints import Constraint, parse_constraint
from lorad.daemon.errors import bad_request
from lorad.daemon.token_fields import parse_logit_bias, parse_stop_token_ids
from lorad.daemon.tools import ToolChoice, parse_tools
from lorad.protocol.messages import MAX_ADAPTER_STRENGTH, MAX_CHOICES, MAX_TOP_LOGPROBS

MAX_STOP_STRINGS = 4
MAX_PROMPTS = 64  # prompts in one completions request (each its own choice or choices)
_INT64 = 2**63
# Known OpenAI fields lorad does not implement: refused unless they hold their "off" value.
_UNSUPPORTED = {
    "completions": ("suffix",),
    "chat": ("functions", "audio"),
}


@dataclass(frozen=True)
class SamplingOptions:
    max_tokens: int | None  # None: the rest of the context; 0 only with completions' echo
    temperature: float
    top_p: float
    top_k: int  # 0 disables
    seed: int | None  # None: a random seed per request
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    # vLLM's stream_options.continuous_usage_stats: usage on every chunk (with include_usage)
    continuous_usage: bool
    ignore_eos: bool
    # None: no log probabilities; k: each token's log probability and its k most likely
    # alternatives (completions' logprobs, chat's top_logprobs with logprobs true)
    num_logprobs: int | None = None
    n: int = 1  # choices per prompt, sharing the prompt's prefill
    # The logits transforms (docs/api.md, *Sampling order*); each default is "off".
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), sorted by id
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    # lorad extension: false computes the prompt from its first token and caches nothing of it
    cache_prompt: bool = True
    # vLLM's extension: each choice carries its generated ids (streamed: each chunk its new ones)
    return_token_ids: bool = False
    # lorad extension: the multiplier of the chosen adapter's scales, 0..MAX_ADAPTER_STRENGTH;
    # None: absent (1.0). routes.py refuses it on a request for the base model.
    adapter_strength: float | None = None
    # lorad extension: false keeps this request's decodes to one token a step (no n-gram draft)
    draft: bool = True


@dataclass(frozen=True)
class CompletionRequest:
    model: str
    adapter: str | None  # lorad extension: an adapter's name, with model = the base model's id
    prompts: tuple[str | list[int], ...]  # 1..MAX_PROMPTS, in the order of their choices
    options: SamplingOptions
    constraint: Constraint | None = None  # response_format, regex or grammar, compiled
    echo: bool = False  # the answer's text (and logprobs) begin with the prompt's

    @property
    def prompt(self) -> str | list[int]:
        """The request's only prompt."""
        if len(self.prompts) != 1:
            raise ValueError(f"the request holds {len(self.prompts)} prompts")
        return self.prompts[0]


@dataclass(frozen=True)
class ChatRequest:
    model: str
    adapter: str | None
    messages: list[dict]  # [{"role": ..., "content": str, ...}], as the chat template sees them
    options: SamplingOptions
    constraint: Constraint | None = None  # response_format, regex, grammar or the forced call
    tools: list[dict] | None = None  # the chat template's `tools`
    tool_choice: ToolChoice | None = None  # None: the answer is text


def parse_completion(body: object) -> CompletionRequest:
    body = _object(body)
    _refuse_unsupported(body, "completions")
    n = _n(body)
    if _int(body, "best_of", lo=1, default=n) != n:
        raise bad_request("best_of other than n is not supported", "best_of", "unsupported")
    echo = _bool(body, "echo", False)
    if echo and n > 1:
        # The workers score a prompt once, for its first choice: its other choices have no values.
        raise bad_request(f"echo takes n = 1, got n = {n}", "n", "unsupported")
    if type(body.get("max_tokens")) is int and body["max_tokens"] == 0 and not echo:
        raise bad_request("max_tokens 0 generates nothing; it is allowed only with echo: true",
                          "max_tokens")
    return CompletionRequest(model=_model(body), adapter=_adapter(body),
                             prompts=_prompts(body.get("prompt")),
                             options=_options(body, "max_tokens",
                                              _int(body, "logprobs", lo=0, hi=MAX_TOP_LOGPROBS),
                                              min_max_tokens=0 if echo else 1),
                             constraint=parse_constraint(body), echo=echo)


def parse_chat(body: object) -> ChatRequest:
    body = _object(body)
    _refuse_unsupported(body, "chat")
    tokens = _max_tokens_field(body)
    tools = parse_tools(body)
    return ChatRequest(model=_model(body), adapter=_adapter(body),
                       messages=parse_messages(body.get("messages")),
                       options=_options(body, tokens, _chat_logprobs(body)),
                       constraint=tools.constraint or parse_constraint(body),
                       tools=tools.tools, tool_choice=tools.choice)


def _object(body: object) -> dict:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", None, "invalid_json")
    return body


def _refuse_unsupported(body: dict, route: str) -> None:
    for name in _UNSUPPORTED[route]:
        if body.get(name) not in (None, False, 0, "", [], {}):
            raise bad_request(f"{name} is not supported by lorad", name, "unsupported")


def _n(body: dict) -> int:
    return _int(body, "n", lo=1, hi=MAX_CHOICES, default=1)


def _model(body: dict) -> str:
    model = body.get("model")
    if model is None:
        raise bad_request("you must provide a model parameter", "model", "missing_required")
    if not isinstance(model, str):
        raise bad_request("model must be a string", "model", "invalid_type")
    return model


def _adapter(body: dict) -> str | None:
    adapter = body.get("adapter")
    if adapter is not None and not isinstance(adapter, str):
        raise bad_request("adapter must be a string (an adapter's name)", "adapter",
                          "invalid_type")
    return adapter


def _max_tokens_field(body: dict) -> str:
    """Chat accepts max_completion_tokens (current) and max_tokens (older); both must agree."""
    new, old = body.get("max_completion_tokens"), body.get("max_tokens")
    if new is not None and old is not None and new != old:
        raise bad_request("max_tokens and max_completion_tokens disagree; send one",
                          "max_completion_tokens")
    return "max_completion_tokens" if new is not None else "max_tokens"


def _chat_logprobs(body: dict) -> int | None:
    """Chat's logprobs (bool) and top_logprobs (0..20, only with logprobs true) -> how many
    alternatives each token carries, or None for no log probabilities."""
    wanted = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", lo=0, hi=MAX_TOP_LOGPROBS)
    if top is not None and not wanted:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    return (top or 0) if wanted else None


def _options(body: dict, max_tokens_field: str, num_logprobs: int | None,
             min_max_tokens: int = 1) -> SamplingOptions:
    stream = _bool(body, "stream", False)
    stream_options = body.get("stream_options")
    if stream_options is not None and not stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise bad_request("stream_options must be an object", "stream_options", "invalid_type")
    top_k = _int(body, "top_k", lo=-1, default=0)
    max_tokens = _int(body, max_tokens_field, lo=min_max_tokens, default=None)  # 0: echo's
    min_tokens = _int(body, "min_tokens", lo=0,
                      hi=_INT64 - 1 if max_tokens is None else max_tokens, default=0)
    penalty = {name: _number(body, name, 0.0, lambda v: -2 <= v <= 2, "between -2 and 2")
               for name in ("presence_penalty", "frequency_penalty")}
    return SamplingOptions(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, lambda v: 0 <= v <= 2, "between 0 and 2"),
        top_p=_number(body, "top_p", 1.0, lambda v: 0 < v <= 1, "greater than 0 and at most 1"),
        top_k=0 if top_k == -1 else top_k,
        seed=_int(body, "seed", lo=-_INT64, hi=_INT64 - 1, default=None),
        stop=_stop(body.get("stop")),
        stream=stream,
        include_usage=_bool(stream_options or {}, "include_usage", False, "stream_options."),
        continuous_usage=_bool(stream_options or {}, "continuous_usage_stats", False,
                               "stream_options."),
        ignore_eos=_bool(body, "ignore_eos", False),
        num_logprobs=num_logprobs,
        n=_n(body),
        **penalty,
        repetition_penalty=_number(body, "repetition_penalty", 1.0, lambda v: 0 < v <= 2,
                                   "greater than 0 and at most 2"),
        min_p=_number(body, "min_p", 0.0, lambda v: 0 <= v <= 1, "between 0 and 1"),
        logit_bias=parse_logit_bias(body.get("logit_bias")),
        stop_token_ids=parse_stop_token_ids(body.get("stop_token_ids")),
        min_tokens=min_tokens,
        cache_prompt=_bool(body, "cache_prompt", True),
        draft=_bool(body, "draft", True),
        return_token_ids=_bool(body, "return_token_ids", False),
        adapter_strength=_number(body, "adapter_strength", None,
                                 lambda v: 0 <= v <= MAX_ADAPTER_STRENGTH,
                                 f"between 0 and {MAX_ADAPTER_STRENGTH}"),
    )


def _bool(body: dict, name: str, default: bool, prefix: str = "") -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{prefix}{name} must be a boolean", prefix + name, "invalid_type")
    return value


def _int(body: dict, name: str, lo: int, hi: int = _INT64 - 1, default=None):
    # Every integer has an upper bound: past 64 bits it could not even reach the workers.
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{name} must be an integer", name, "invalid_type")
    if not lo <= value <= hi:
        shown = value if abs(value) < 10**30 else f"an integer of {len(str(abs(value)))} digits"
        raise bad_request(f"{name} must be between {lo} and {hi}, got {shown}", name)
    return value


def _number(body: dict, name: str, default: float | None, ok, bounds: str) -> float | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(f"{name} must be a number", name, "invalid_type")
    if isinstance(value, int) and abs(value) > 10**30:
        raise bad_request(f"{name} must be {bounds}, got an integer of {len(str(abs(value)))} "
                          f"digits", name)
    if not math.isfinite(value):  # 1e400 reads as infinity
        raise bad_request(f"{name} must be {bounds}, got a number beyond the float range", name)
    if not ok(value):
        raise bad_request(f"{name} must be {bounds}, got {value}", name)
    return float(value)


def _stop(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request("stop must be a string or a list of strings", "stop", "invalid_type")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"stop may hold at most {MAX_STOP_STRINGS} strings", "stop")
    if any(s == "" for s in stops):
        raise bad_request("stop strings must not be empty", "stop")
    return tuple(stops)


def _prompts(value: object) -> tuple[str | list[int], ...]:
    """A string, a list of token ids, or a list of up to MAX_PROMPTS of either."""
    if value is None:
        raise bad_request("you must provide a prompt", "prompt", "missing_required")
    if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
        if len(value) > MAX_PROMPTS:
            raise bad_request(f"prompt may hold at most {MAX_PROMPTS} prompts, got {len(value)}",
                              "prompt")
        return tuple(_prompt(p, f"prompt[{i}]") for i, p in enumerate(value))
    return (_prompt(value, "prompt"),)


def _prompt(value: object, where: str) -> str | list[int]:
    if isinstance(value, str):
        return text(value, where, "prompt")
    if isinstance(value, list) and value and all(
            isinstance(t, int) and not isinstance(t, bool) for t in value):
        return value
    raise bad_request(f"{where} must be a string or a non-empty list of token ids", "prompt",
                      "invalid_type")
