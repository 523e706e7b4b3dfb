"""The HTTP API: /v1/models, /v1/completions, /v1/chat/completions, /health, /ready, /metrics.

Each generation route validates the body, resolves the model id (the base model or an adapter),
checks admission (503 draining, 429 queue full), tokenizes, checks the context length and only
then admits the request and answers in full or as a stream. Sockets and processes live
elsewhere; handlers see the engine only through EngineClient.
"""

from __future__ import annotations

import secrets
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field

from aiohttp import web

from lorad.config.adapter_capacity import LoraCapacity
from lorad.config.adapters import AdapterSpec
from lorad.config.model import ModelConfig
from lorad.daemon.adapter_catalog import AdapterCatalog
from lorad.daemon.adapter_routes import ADMIN_PREFIXES, add_admin_routes
from lorad.daemon.admission import RETRY_AFTER_UNAVAILABLE_S, Admission
from lorad.daemon.engine_client import EngineClient
from lorad.daemon.auth import auth_middleware
from lorad.daemon.constraints import Constraint
from lorad.daemon.errors import bad_request, error_middleware, error_response
from lorad.daemon.generation import GenerationError, Prompt, generate
from lorad.daemon.json_body import MAX_BODY_BYTES, read_json
from lorad.daemon.logprobs import LogprobsFormat
from lorad.daemon.metrics import ADMITTED_KEY, MODEL_KEY, Metrics, metrics_middleware
from lorad.daemon.model_ids import ModelChoice, choose, model_cards
from lorad.daemon.probes import probe_body
from lorad.daemon.responses import ChatFormat, CompletionFormat, FullChoice
from lorad.daemon.schemas import SamplingOptions, parse_chat, parse_completion
from lorad.daemon.sse import stream_events
from lorad.daemon.token_bytes import TokenBytes
from lorad.daemon.tool_calls import ToolCallFormat
from lorad.daemon.tools import ToolChoice
from lorad.daemon.token_fields import check_vocabulary
from lorad.daemon.tokenizer import ChatTemplateError, ModelTokenizer
from lorad.protocol import SamplingParams
from lorad.protocol.messages import TokenBias


@dataclass(frozen=True)
class ServedModel:
    name: str  # the id clients must send
    tokenizer: ModelTokenizer
    max_model_len: int
    vocab_size: int  # the model's embedding rows: token-id prompts must be below it
    stop_token_ids: tuple[int, ...]
    adapters: tuple[AdapterSpec, ...] = ()  # the start adapters, ids 1..K in order
    token_bytes: TokenBytes = field(default_factory=lambda: TokenBytes({}))  # logprobs' bytes
    # The device slots and what adapters fit them; the base config (run-time validation).
    capacity: LoraCapacity = LoraCapacity(0, False, 0)
    model_config: ModelConfig | None = None


@dataclass
class AppState:
    model: ServedModel
    engine: EngineClient
    admission: Admission
    metrics: Metrics
    # "serving"; "draining" after a signal (no new generation requests, open ones finish);
    # "stopping" once the workers are being stopped; "failed" after a worker failure.
    # service.py is the one place that changes it.
    status: str = "serving"
    prefix_cache: bool = True  # --no-prefix-cache turns it off, for /health
    deterministic: bool = True  # --no-deterministic turns it off, for /health
    speculative_ngram: int = 0  # --speculative-ngram, for /health
    created: int = field(default_factory=lambda: int(time.time()))
    # The served adapters as they change while serving; None: the start adapters, fixed.
    catalog: AdapterCatalog | None = None

    def __post_init__(self) -> None:
        if self.catalog is None:
            self.catalog = AdapterCatalog(self.model.adapters, self.model.capacity,
                                          self.model.model_config, self.model.name)
        self.catalog.engine = self.engine


STATE = web.AppKey("lorad_state", AppState)
ADAPTER_KEY = "lorad_adapter"  # request -> the AdapterSpec version it runs on (None: base)


def build_app(state: AppState, api_key: str | None = None,
              admin_key: str | None = None) -> web.Application:
    # Rejections are counted outermost, so a 401 counts too; the key check runs before any
    # handler, so an unauthenticated request never reaches one. With an admin key, the adapter
    # routes take it instead of the API key.
    exempt = ADMIN_PREFIXES if admin_key else ()
    middlewares = ([metrics_middleware(lambda app: app[STATE].metrics)]
                   + ([auth_middleware(api_key, exempt)] if api_key else [])
                   + ([auth_middleware(admin_key, only=ADMIN_PREFIXES)] if admin_key else [])
                   + [error_middleware])
    app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY_BYTES)
    app[STATE] = state
    add_admin_routes(app, state.catalog if state is not None else None,
                     enabled=admin_key is not None)
    app.on_response_prepare.append(_adapter_headers)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model_id:.+}", get_model)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    return app


async def _adapter_headers(request: web.Request, response: web.StreamResponse) -> None:
    """Which adapter version served a generation: its registry id and identity key (a reload
    changes both), so a client can tell versions apart."""
    spec = request.get(ADAPTER_KEY)
    if spec is not None:
        response.headers["lorad-adapter-id"] = str(spec.adapter_id)
        response.headers["lorad-adapter-key"] = spec.key


async def list_models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": _model_cards(request.app[STATE])})


async def get_model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    choice = choose(state.model.name, state.catalog.served(), request.match_info["model_id"],
                    None)
    card = next(c for c in _model_cards(state) if c["id"] == choice.model_id)
    return web.json_response(card)


async def health(request: web.Request) -> web.Response:
    return web.json_response(probe_body(request.app[STATE]))


async def ready(request: web.Request) -> web.Response:
    body = probe_body(request.app[STATE])
    return web.json_response(body, status=200 if body["ready"] else 503)


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.Response(body=state.metrics.render(state),
                        headers={"Content-Type": state.metrics.content_type})


async def completions(request: web.Request) -> web.StreamResponse:
    started = time.monotonic()
    state = request.app[STATE]
    body = parse_completion(await read_json(request))
    choice = await _choose(request, state, body.model, body.adapter)
    _check_n(state, body.options.n)
    state.admission.check(state.status, len(body.prompts) * body.options.n)
    prompts_ids = [state.model.tokenizer.encode(p) if isinstance(p, str)
                   else _check_token_ids(p, state.model.vocab_size) for p in body.prompts]
    echo = None
    if body.echo:  # each prompt as sent; token ids as they decode together
        echo = [p if isinstance(p, str) else state.model.tokenizer.decode(ids)
                for p, ids in zip(body.prompts, prompts_ids)]
    return await _generate(request, state, CompletionFormat, choice, prompts_ids, body.options,
                           "prompt", started, body.constraint, echo=echo)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    started = time.monotonic()
    state = request.app[STATE]
    body = parse_chat(await read_json(request))
    choice = await _choose(request, state, body.model, body.adapter)
    _check_n(state, body.options.n)
    state.admission.check(state.status, body.options.n)
    try:
        prompt_ids = state.model.tokenizer.encode_chat(body.messages, body.tools)
    except ChatTemplateError as exc:
        raise bad_request(str(exc), "messages", "chat_template_error") from None
    return await _generate(request, state, ChatFormat, choice, [prompt_ids], body.options,
                           "messages", started, body.constraint, body.tool_choice)


def _check_n(state: AppState, n: int) -> None:
    """A prompt's choices run in one step once they fork: at most --max-num-seqs of them."""
    max_num_seqs = state.engine.facts.max_num_seqs if state.engine.facts else n
    if n > max_num_seqs:
        raise bad_request(f"n must be at most {max_num_seqs} here: a prompt's choices run in "
                          f"one step (--max-num-seqs {max_num_seqs})", "n")


async def _choose(request: web.Request, state: AppState, model: str,
                  adapter: str | None) -> ModelChoice:
    """The model id's current version; with --adapter-dir, a name's first request loads it."""
    await state.catalog.first_use(adapter if adapter is not None else model)
    choice = choose(state.model.name, state.catalog.served(), model, adapter)
    request[MODEL_KEY] = choice.model_id
    return choice


async def _generate(request: web.Request, state: AppState, format_cls: type[CompletionFormat],
                    choice: ModelChoice, prompts_ids: list[list[int]], options: SamplingOptions,
                    prompt_param: str, started: float, constraint: Constraint | None = None,
                    tool_choice: ToolChoice | None = None,
                    echo: list[str] | None = None) -> web.StreamResponse:
    if options.adapter_strength is not None and choice.adapter is None:
        raise bad_request(f"adapter_strength multiplies an adapter's scales, and "
                          f"`{choice.model_id}` is the base model: name an adapter, or leave "
                          f"adapter_strength out",
                          "adapter_strength")
    strength = 1.0 if options.adapter_strength is None else options.adapter_strength
    # From admission.check() to the Admits inside generate() nothing awaits, so the queue bound
    # and the draining switch hold exactly.
    prompts = [Prompt(ids, _sampling(state.model, ids, options, prompt_param, echo is not None))
               for ids in prompts_ids]
    num_prompt = sum(len(ids) for ids in prompts_ids)
    logprobs = (LogprobsFormat(state.model.tokenizer.decode, format_cls is ChatFormat,
                               state.model.token_bytes)
                if options.num_logprobs is not None else None)
    # A forced tool call answers in tool_calls (tool_calls.py), whatever the route's format.
    extra = {} if tool_choice is None else {"tool_choice": tool_choice}
    fmt = (format_cls if tool_choice is None else ToolCallFormat)(
        f"{format_cls.id_prefix}{uuid.uuid4().hex}", choice.model_id,
        include_usage=options.stream and options.include_usage,
        continuous_usage=options.stream and options.continuous_usage, logprobs=logprobs,
        echo=echo, return_token_ids=options.return_token_ids, **extra)
    request[ADMITTED_KEY] = True
    request[ADAPTER_KEY] = choice.adapter
    with state.catalog.hold(choice.adapter), \
            state.admission.ticket(started, len(prompts) * options.n, choice.model_id) as ticket:
        deltas = generate(state.engine, state.model.tokenizer, fmt.response_id, prompts,
                          options.stop, choice.adapter_id, choice.adapter_key,
                          constraint.grammar if constraint else "", options.n,
                          options.cache_prompt, strength, options.draft)
        deltas = state.metrics.observe(state.admission.bounded(deltas, ticket), choice.model_id,
                                       started)
        async with aclosing(deltas):
            if options.stream:
                return await stream_events(request, deltas, fmt, num_prompt)
            texts, entries, prompt_entries, ids, last, cached = {}, {}, {}, {}, {}, {}
            try:
                async for delta in deltas:
                    cached.setdefault(delta.prompt_index, delta.num_cached_tokens)
                    texts.setdefault(delta.index, []).append(delta.text)
                    entries.setdefault(delta.index, []).extend(delta.logprobs)
                    ids.setdefault(delta.index, []).extend(delta.token_ids)
                    prompt_entries.setdefault(delta.index, []).extend(delta.prompt_logprobs)
                    last[delta.index] = delta
            except GenerationError as exc:
                headers = ({"Retry-After": str(RETRY_AFTER_UNAVAILABLE_S)}
                           if exc.status == 503 else None)
                return error_response(exc.status, str(exc), code=exc.code, headers=headers)
        choices = [FullChoice(i, "".join(texts[i]), last[i].finish_reason, entries[i],
                              last[i].prompt_index, prompt_entries[i], ids[i])
                   for i in sorted(last)]
        return web.json_response(fmt.full(choices, num_prompt, sum(
            d.num_completion_tokens for d in last.values()), sum(cached.values())))


def _sampling(model: ServedModel, prompt_ids: list[int], options: SamplingOptions,
              prompt_param: str, echo: bool = False) -> SamplingParams:
    """One prompt's sampling; every prompt takes the request's seed, or draws its own. Echo
    with logprobs asks for the prompt's log probabilities too."""
    num_prompt, limit = len(prompt_ids), model.max_model_len
    if num_prompt == 0:
        raise bad_request("the prompt is empty after tokenization", prompt_param)
    scoring = options.max_tokens == 0  # echo only (schemas.py): the prompt may fill the context
    if num_prompt >= limit + scoring:
        raise bad_request(f"This model's maximum context length is {limit} tokens, but the prompt "
                          f"has {num_prompt} tokens" + ("." if scoring else
                                                        ", leaving no room for a completion."),
                          prompt_param, "context_length_exceeded")
    max_tokens = options.max_tokens if options.max_tokens is not None else limit - num_prompt
    if num_prompt + max_tokens > limit:
        raise bad_request(f"This model's maximum context length is {limit} tokens. However, you "
                          f"requested {num_prompt + max_tokens} tokens ({num_prompt} in the "
                          f"prompt, {max_tokens} for the completion).", "max_tokens",
                          "context_length_exceeded")
    if options.min_tokens > max_tokens:
        raise bad_request(f"min_tokens ({options.min_tokens}) exceeds the {max_tokens} tokens "
                          f"left for the completion", "min_tokens")
    check_vocabulary(options.logit_bias, options.stop_token_ids, model.vocab_size)
    seed = options.seed if options.seed is not None else secrets.randbits(63)
    return SamplingParams(temperature=options.temperature, top_p=options.top_p,
                          top_k=options.top_k, seed=seed, max_tokens=max_tokens,
                          stop_token_ids=list(model.stop_token_ids), ignore_eos=options.ignore_eos,
                          num_logprobs=(-1 if options.num_logprobs is None
                                        else options.num_logprobs),
                          presence_penalty=options.presence_penalty,
                          frequency_penalty=options.frequency_penalty,
                          repetition_penalty=options.repetition_penalty, min_p=options.min_p,
                          logit_bias=[TokenBias(t, b) for t, b in options.logit_bias],
                          request_stop_token_ids=list(options.stop_token_ids),
                          min_tokens=options.min_tokens,
                          prompt_logprobs=(options.num_logprobs if echo
                                           and options.num_logprobs is not None else -1))


def _check_token_ids(token_ids: list[int], vocab_size: int) -> list[int]:
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary (0..{vocab_size - 1})",
                          "prompt")
    return token_ids


def _model_cards(state: AppState) -> list[dict]:
    return model_cards(state.model.name, state.catalog.served(), state.created,
                       state.model.max_model_len)
