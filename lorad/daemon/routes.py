"""The HTTP API: /v1/models, /v1/completions, /v1/chat/completions and /health.

Each generation route validates the body, resolves the model id (the base model or an adapter),
tokenizes, checks the context length and only then admits the request and answers in full or as
a stream. Sockets and processes live elsewhere;
handlers see the engine only through EngineClient.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field

from aiohttp import web

from lorad.config.adapters import AdapterSpec
from lorad.daemon.engine_client import EngineClient
from lorad.daemon.auth import auth_middleware
from lorad.daemon.errors import bad_request, error_middleware, error_response
from lorad.daemon.generation import GenerationError, generate
from lorad.daemon.model_ids import ModelChoice, choose, model_cards
from lorad.daemon.responses import ChatFormat, CompletionFormat
from lorad.daemon.schemas import SamplingOptions, parse_chat, parse_completion
from lorad.daemon.sse import stream_events
from lorad.daemon.tokenizer import ChatTemplateError, ModelTokenizer
from lorad.protocol import SamplingParams

MAX_BODY_BYTES = 32 * 1024 * 1024  # a long prompt as a JSON list of ids is several MB


@dataclass(frozen=True)
class ServedModel:
    name: str  # the id clients must send
    tokenizer: ModelTokenizer
    max_model_len: int
    vocab_size: int  # the model's embedding rows: token-id prompts must be below it
    stop_token_ids: tuple[int, ...]
    adapters: tuple[AdapterSpec, ...] = ()  # the registry fixed at start, slots 1..K in order


@dataclass
class AppState:
    model: ServedModel
    engine: EngineClient
    status: str = "ok"  # "ok", "stopping" or "failed"; anything but ok answers /health with 503
    created: int = field(default_factory=lambda: int(time.time()))


STATE = web.AppKey("lorad_state", AppState)


def build_app(state: AppState, api_key: str | None = None) -> web.Application:
    # The key check runs first: an unauthenticated request never reaches a handler.
    middlewares = ([auth_middleware(api_key)] if api_key else []) + [error_middleware]
    app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY_BYTES)
    app[STATE] = state
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model_id:.+}", get_model)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/health", health)
    return app


async def list_models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": _model_cards(request.app[STATE])})


async def get_model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    choice = choose(state.model.name, state.model.adapters, request.match_info["model_id"], None)
    card = next(c for c in _model_cards(state) if c["id"] == choice.model_id)
    return web.json_response(card)


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    facts, load = state.engine.facts, state.engine.load
    body = {"status": state.status, "model": state.model.name,
            "ranks": facts.num_ranks if facts else 0,
            "kv_blocks": {"free": load.num_free_blocks, "total": facts.num_kv_blocks if facts else 0},
            "running": load.num_running, "waiting": load.num_waiting,
            "open_requests": state.engine.num_open_requests,
            "rank_states": [dataclasses.asdict(r) for r in state.engine.rank_states()],
            "adapters": [{"name": a.name, "slot": a.slot, "key": a.key, "strength": a.strength}
                         for a in state.model.adapters]}
    return web.json_response(body, status=200 if state.status == "ok" else 503)


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = parse_completion(await _read_json(request))
    choice = choose(state.model.name, state.model.adapters, body.model, body.adapter)
    if isinstance(body.prompt, str):
        prompt_ids = state.model.tokenizer.encode(body.prompt)
    else:
        prompt_ids = _check_token_ids(body.prompt, state.model.vocab_size)
    return await _generate(request, state, CompletionFormat, choice, prompt_ids, body.options,
                           "prompt")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = parse_chat(await _read_json(request))
    choice = choose(state.model.name, state.model.adapters, body.model, body.adapter)
    try:
        prompt_ids = state.model.tokenizer.encode_chat(body.messages)
    except ChatTemplateError as exc:
        raise bad_request(str(exc), "messages", "chat_template_error") from None
    return await _generate(request, state, ChatFormat, choice, prompt_ids, body.options,
                           "messages")


async def _generate(request: web.Request, state: AppState, format_cls: type[CompletionFormat],
                    choice: ModelChoice, prompt_ids: list[int], options: SamplingOptions,
                    prompt_param: str) -> web.StreamResponse:
    sampling = _sampling(state.model, prompt_ids, options, prompt_param)
    if state.status != "ok":
        return error_response(503, f"the server is {state.status}; not accepting requests",
                              code="unavailable")
    fmt = format_cls(f"{format_cls.id_prefix}{uuid.uuid4().hex}", choice.model_id,
                     include_usage=options.stream and options.include_usage)
    deltas = generate(state.engine, state.model.tokenizer, fmt.response_id, prompt_ids, sampling,
                      options.stop, choice.adapter_slot, choice.adapter_key)
    async with aclosing(deltas):
        if options.stream:
            return await stream_events(request, deltas, fmt)
        texts, last = [], None
        try:
            async for delta in deltas:
                texts.append(delta.text)
                last = delta
        except GenerationError as exc:
            return error_response(500, str(exc), code="engine_error")
    return web.json_response(fmt.full("".join(texts), last.finish_reason, last.num_prompt_tokens,
                                      last.num_completion_tokens))


def _sampling(model: ServedModel, prompt_ids: list[int], options: SamplingOptions,
              prompt_param: str) -> SamplingParams:
    num_prompt, limit = len(prompt_ids), model.max_model_len
    if num_prompt == 0:
        raise bad_request("the prompt is empty after tokenization", prompt_param)
    if num_prompt >= limit:
        raise bad_request(f"This model's maximum context length is {limit} tokens, but the prompt "
                          f"has {num_prompt} tokens, leaving no room for a completion.",
                          prompt_param, "context_length_exceeded")
    max_tokens = options.max_tokens if options.max_tokens is not None else limit - num_prompt
    if num_prompt + max_tokens > limit:
        raise bad_request(f"This model's maximum context length is {limit} tokens. However, you "
                          f"requested {num_prompt + max_tokens} tokens ({num_prompt} in the "
                          f"prompt, {max_tokens} for the completion).", "max_tokens",
                          "context_length_exceeded")
    seed = options.seed if options.seed is not None else secrets.randbits(63)
    return SamplingParams(temperature=options.temperature, top_p=options.top_p,
                          top_k=options.top_k, seed=seed, max_tokens=max_tokens,
                          stop_token_ids=list(model.stop_token_ids), ignore_eos=options.ignore_eos)


async def _read_json(request: web.Request) -> object:
    raw = await request.read()
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise bad_request(f"the body is not valid JSON: {exc}", None, "invalid_json") from None


def _check_token_ids(token_ids: list[int], vocab_size: int) -> list[int]:
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary (0..{vocab_size - 1})",
                          "prompt")
    return token_ids


def _model_cards(state: AppState) -> list[dict]:
    return model_cards(state.model.name, state.model.adapters, state.created,
                       state.model.max_model_len)
