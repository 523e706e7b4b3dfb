"""Server-sent events: one generation's deltas as `data: {chunk}` events, then `data: [DONE]`.

Headers and the opening chunk (with echo, then the prompt's chunk) go out with the first delta,
i.e. when the first token exists, even if its text is held back: a client times the first token
by the first event. A request that fails before that gets a plain JSON error (500, 503 or 504: GenerationError's status); after it, a
failure is a `data: {"error": ...}` event before [DONE]. Later deltas without text are sent only
when the client asked for usage on every chunk. A client that hangs up raises out of the writes;
the caller's aclosing() then cancels.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from aiohttp import web

from lorad.daemon.errors import error_body, error_response
from lorad.daemon.generation import Delta, GenerationError
from lorad.daemon.responses import CompletionFormat

DONE = b"data: [DONE]\n\n"


def _event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


async def _open(request: web.Request, fmt: CompletionFormat,
                num_prompt: int) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                           "Cache-Control": "no-cache"})
    await response.prepare(request)
    await response.write(_event(fmt.opening_chunk(num_prompt)))
    return response


async def stream_events(request: web.Request, deltas: AsyncIterator[Delta],
                        fmt: CompletionFormat) -> web.StreamResponse:
    response = None
    last: Delta | None = None
    entries = []  # log probabilities of tokens not yet sent: they ride with the next chunk
    try:
        async for delta in deltas:
            if response is None:
                response = await _open(request, fmt, delta.num_prompt_tokens)
                if fmt.echo is not None:
                    await response.write(_event(fmt.echo_chunk(delta.num_prompt_tokens,
                                                                delta.prompt_logprobs)))
            last = delta
            entries.extend(delta.logprobs)
            # Without per-chunk usage an empty chunk would tell the client nothing the opening
            # chunk did not; with it, each step's chunk lets the client count and time tokens.
            if delta.text or delta.finish_reason is not None or fmt.continuous_usage:
                await response.write(_event(fmt.chunk(delta.text, delta.finish_reason,
                                                      delta.num_prompt_tokens,
                                                      delta.num_completion_tokens, entries)))
                entries = []
    except GenerationError as exc:
        if response is None:
            return error_response(exc.status, str(exc), code=exc.code)
        await response.write(_event(error_body(exc.status, str(exc), code=exc.code)))
    else:
        if response is None:  # cannot happen: generate() always yields a final delta
            response = await _open(request, fmt, 0)
        if fmt.include_usage and last is not None:
            usage = fmt.usage_chunk(last.num_prompt_tokens, last.num_completion_tokens)
            await response.write(_event(usage))
    await response.write(DONE)
    await response.write_eof()
    return response
