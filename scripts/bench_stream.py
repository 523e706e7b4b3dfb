"""One streaming request of bench.py over aiohttp: the fields every workload's body shares, and
the stream read into an Outcome (bench_clock.py times it). No retries: a request that fails
is an outcome with its error, for the caller to count or report.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import aiohttp

from bench_clock import Outcome, TokenClock, read_usage


def request_fields(args: argparse.Namespace, model: str, seed: int) -> dict:
    # continuous_usage_stats: lorad (and vLLM) then count the tokens on every chunk and send a
    # chunk per step even when its text is held back; other servers ignore it.
    fields = {"model": model, "max_tokens": args.max_tokens, "temperature": args.temperature,
              "stream": True, "ignore_eos": True, "seed": seed,
              "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if args.no_cache:
        fields["cache_prompt"] = False  # lorad's switch for its prefix cache, per request
    return fields


async def stream(session: aiohttp.ClientSession, url: str, body: dict) -> Outcome:
    outcome = Outcome(body["model"])
    outcome.sent_at = time.perf_counter()
    clock = TokenClock(outcome, outcome.sent_at)
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                outcome.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return outcome
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    outcome.ok = not outcome.error
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    outcome.error = str(chunk["error"].get("message", chunk["error"]))[:200]
                    continue
                clock.chunk(chunk, now)
                if chunk.get("usage"):
                    read_usage(outcome, chunk["usage"])
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, TypeError) as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"[:200]
    outcome.done_at = time.perf_counter()
    if outcome.ok and not outcome.num_output_tokens:
        outcome.num_output_tokens = clock.num_tokens  # the server sent no usage at all
    return outcome
