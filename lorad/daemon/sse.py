"""Server-sent events: one generation's deltas as `data: {chunk}` events, then `data: [DONE]`.

The choices' chunks interleave, each naming its index. Headers go out with the first delta, and
each choice's opening chunk (with echo, then its prompt's chunk) with its first delta, i.e. when
its first token exists, even if its text is held back: a client times the first token by the
first event. A request that fails before that gets a plain JSON error (500, 503 or 504:
GenerationError's status); after it, a failure is a `data: {"error": ...}` event before [DONE].
Later deltas without text are sent only when the client asked for usage on every chunk; their
log probabilities and token ids ride with the choice's next chunk (at the latest its finishing
one). A client that hangs up raises out of the writes; the caller's aclosing() then cancels.
Mid-stream chunks come from a template cut once per choice (chunk_template.py); the usage chunk
or error and [DONE] go out in one write.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web

from lorad.daemon.chunk_template import ChunkTemplate, event_bytes as _event
from lorad.daemon.errors import error_body, error_response
from lorad.daemon.generation import Delta, GenerationError
from lorad.daemon.responses import CompletionFormat

DONE = b"data: [DONE]\n\n"


async def _open(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                           "Cache-Control": "no-cache"})
    await response.prepare(request)
    return response


async def stream_events(request: web.Request, deltas: AsyncIterator[Delta],
                        fmt: CompletionFormat, num_prompt: int) -> web.StreamResponse:
    """num_prompt: the request's prompt tokens (each prompt once), for its usage."""
    response = None
    completions: dict[int, int] = {}  # choice index -> its tokens so far; opened choices
    entries: dict[int, list] = {}  # log probabilities not yet sent: they ride with the next chunk
    ids: dict[int, list[int]] = {}  # token ids not yet sent (return_token_ids), likewise
    templates: dict[int, ChunkTemplate | None] = {}  # choice index -> its mid-stream chunks
    final = []  # the events that end the stream, written together
    cached: dict[int, int] = {}  # prompt index -> its tokens found in the prefix cache
    try:
        async for delta in deltas:
            cached.setdefault(delta.prompt_index, delta.num_cached_tokens)
            if response is None:
                response = await _open(request)
            index = delta.index
            if index not in completions:  # the choice's first token exists
                completions[index] = 0
                templates[index] = ChunkTemplate.of(fmt, index)
                await response.write(_event(fmt.opening_chunk(
                    num_prompt, sum(completions.values()), index)))
                if fmt.echo is not None:
                    await response.write(_event(fmt.echo_chunk(
                        num_prompt, sum(completions.values()), delta.prompt_logprobs, index,
                        delta.prompt_index)))
            completions[index] = delta.num_completion_tokens
            pending = entries.setdefault(index, [])
            pending.extend(delta.logprobs)
            pending_ids = ids.setdefault(index, [])
            pending_ids.extend(delta.token_ids)
            # Without per-chunk usage an empty chunk would tell the client nothing the opening
            # chunk did not; with it, each step's chunk lets the client count and time tokens.
            template = templates[index]
            if delta.finish_reason is None and template is not None:
                if delta.text or fmt.continuous_usage:
                    await response.write(template.render(delta.text, num_prompt,
                                                         sum(completions.values()), pending_ids))
                    ids[index] = []
            elif delta.text or delta.finish_reason is not None or fmt.continuous_usage:
                chunk = fmt.chunk(delta.text, delta.finish_reason, num_prompt,
                                  sum(completions.values()), pending, index, pending_ids)
                if chunk is not None:  # None: text that completes no tool call yet
                    await response.write(_event(chunk))
                    entries[index] = []
                    ids[index] = []
    except GenerationError as exc:
        if response is None:
            return error_response(exc.status, str(exc), code=exc.code)
        final.append(_event(error_body(exc.status, str(exc), code=exc.code)))
    else:
        if response is None:  # cannot happen: generate() always yields a final delta
            response = await _open(request)
        if fmt.include_usage:
            final.append(_event(fmt.usage_chunk(num_prompt, sum(completions.values()),
                                                sum(cached.values()))))
    final.append(DONE)
    await response.write(b"".join(final))
    await response.write_eof()
    return response
