"""bench.py's prefix workloads, for a server's prefix cache. chat-turns: --concurrency
conversations of --turns turns, all opening with one system prompt, each turn's prompt the last
one's with its answer and a new question appended. few-shot: --requests completions, each the
same --shots examples before its own question. Reports TTFT, prompt and cached tokens and the
hit rate (per turn for chat-turns). Before measuring, each model id gets the shared prefix alone
(max_tokens 1): its usage says how many tokens the prefix is, and a cache then holds it, as on a
server where that prompt is in use.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass

import aiohttp

from bench_clock import Outcome
from bench_prompts import (Conversation, few_shot_examples, few_shot_prompt, system_prompt,
                           warm_up_message)
from bench_stream import request_fields, stream
from bench_table import conditions, footer, hit_rate, p50_p99, ttfts_ms

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


class FirstRequestFailed(Exception):
    """An unmeasured request failed (warm-up, or the shared prefix alone): no load is sent."""

    def __init__(self, what: str, error: str) -> None:
        super().__init__(f"{what} failed: {error}")
        self.what = what
        self.error = error


@dataclass
class Run:
    num_shared_tokens: int  # the shared prefix alone, by the server's usage
    measured: list[tuple[dict, Outcome]]  # (labels for --json, outcome) in the order finished
    wall_s: float


def open_session(args: argparse.Namespace) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=args.timeout),
                                 connector=aiohttp.TCPConnector(limit=args.concurrency))


async def prepare(session: aiohttp.ClientSession, args: argparse.Namespace, path: str,
                  prefix: dict, models: list[str]) -> int:
    """Warm up on unrelated text (which leaves nothing of the prefix in a cache), then send the
    shared prefix alone once per model id; returns its prompt tokens. Raises FirstRequestFailed."""
    def warm_up(i: int) -> dict:
        text = warm_up_message(i)
        if path == CHAT_PATH:
            content = {"messages": [{"role": "user", "content": text}]}
        else:
            content = {"prompt": text}
        return {**request_fields(args, models[i % len(models)], args.seed + i), **content}

    if args.warmup:
        warm = await asyncio.gather(*(stream(session, args.url + path, warm_up(i))
                                      for i in range(args.warmup)))
        if not any(o.ok for o in warm):
            raise FirstRequestFailed("warm-up", warm[0].error)
    num_tokens = 0
    for model in dict.fromkeys(models):  # each id once, in order
        body = {**request_fields(args, model, args.seed), "max_tokens": 1, **prefix}
        outcome = await stream(session, args.url + path, body)
        if not outcome.ok:
            raise FirstRequestFailed(f"the shared prefix alone ({model})", outcome.error)
        num_tokens = num_tokens or outcome.num_prompt_tokens
    return num_tokens


async def run_chat_turns(args: argparse.Namespace) -> Run:
    system = system_prompt(args.system_tokens, args.seed)
    models = [args.picker.pick(c) for c in range(args.concurrency)]  # one id per conversation
    measured: list[tuple[dict, Outcome]] = []
    async with open_session(args) as session:
        num_shared = await prepare(session, args, CHAT_PATH,
                                   {"messages": [{"role": "system", "content": system}]}, models)

        async def converse(c: int) -> None:
            conversation = Conversation(system, c + 1, args.seed)
            for turn in range(1, args.turns + 1):
                body = {**request_fields(args, models[c], args.seed + c * args.turns + turn),
                        "messages": conversation.next_turn()}
                outcome = await stream(session, args.url + CHAT_PATH, body)
                measured.append(({"conversation": c + 1, "turn": turn}, outcome))
                if not outcome.ok:
                    return  # without its answer the conversation cannot go on
                conversation.answer(outcome.text)

        started = time.perf_counter()
        await asyncio.gather(*(converse(c) for c in range(args.concurrency)))
        return Run(num_shared, measured, time.perf_counter() - started)


async def run_few_shot(args: argparse.Namespace) -> Run:
    examples = few_shot_examples(args.shots, args.shot_tokens, args.seed)
    models = [args.picker.pick(i) for i in range(args.requests)]
    measured: list[tuple[dict, Outcome]] = []
    async with open_session(args) as session:
        num_shared = await prepare(session, args, COMPLETIONS_PATH, {"prompt": examples}, models)
        indices = iter(range(args.requests))  # shared by the clients: each takes the next

        async def client() -> None:
            for i in indices:
                body = {**request_fields(args, models[i], args.seed + i),
                        "prompt": few_shot_prompt(examples, i + 1, args.seed)}
                measured.append(({"request": i + 1},
                                 await stream(session, args.url + COMPLETIONS_PATH, body)))

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(min(args.concurrency, args.requests))))
        return Run(num_shared, measured, time.perf_counter() - started)


def rate_cell(outcomes: list[Outcome]) -> str:
    rate = hit_rate(outcomes)
    return "n/a" if rate is None else f"{rate:.3f}"


def mean_cell(values: list[int]) -> str:
    return f"{sum(values) / len(values):.1f}" if values else "n/a"


def prefix_conditions(args: argparse.Namespace, run: Run, done: list[Outcome]) -> list[str]:
    """The lines after the common conditions: the workload, its shared prefix, the cache."""
    common = f"max_tokens {args.max_tokens}, ignore_eos, temperature {args.temperature}"
    if args.workload == "chat-turns":
        workload = (f"chat-turns: {args.concurrency} conversations of {args.turns} turns on "
                    f"{CHAT_PATH}, {common}")
        prefix = (f"a system prompt of {run.num_shared_tokens} tokens by usage (--system-tokens "
                  f"{args.system_tokens}), the same in every conversation")
    else:
        workload = (f"few-shot: {args.requests} requests at concurrency {args.concurrency} on "
                    f"{COMPLETIONS_PATH}, {common}")
        prefix = (f"{args.shots} examples of about {args.shot_tokens} tokens, "
                  f"{run.num_shared_tokens} tokens by usage, before each request's question")
    cache = ("cache_prompt false on every request (--no-cache)" if args.no_cache
             else "the server's default (no cache_prompt field)")
    if any(o.cached_reported for o in done):
        cache += "; usage reports cached tokens (prompt_tokens_details.cached_tokens)"
    else:
        cache += ("; usage reports no cached tokens (no prompt_tokens_details.cached_tokens), "
                  "so hits read 0")
    first_token = ("the first chunk whose usage counts a token"
                   if done and all(o.usage_per_chunk for o in done)
                   else "the first chunk with choices (the server sent no usage per chunk)")
    return [f"workload:  {workload}, seed {args.seed}", f"prefix:    {prefix}",
            f"cache:     {cache}", f"latency:   TTFT to {first_token}"]


def turn_rows(args: argparse.Namespace, run: Run) -> list[str]:
    """chat-turns' table by turn: every conversation's turn k in one row."""
    lines = ["| turn | requests | prompt tokens (mean) | cached tokens (mean) | hit rate "
             "| TTFT p50 / p99 (ms) |", "|---|---|---|---|---|---|"]
    for turn in range(1, args.turns + 1):
        sent = [o for labels, o in run.measured if labels["turn"] == turn]
        ok = [o for o in sent if o.ok]
        lines.append(f"| {turn} | {len(sent)} | {mean_cell([o.num_prompt_tokens for o in ok])} | "
                     f"{mean_cell([o.num_cached_tokens for o in ok])} | {rate_cell(ok)} | "
                     f"{p50_p99(ttfts_ms(ok))} |")
    return lines


def report_prefix(args: argparse.Namespace, run: Run) -> str:
    outcomes = [o for _, o in run.measured]
    done = [o for o in outcomes if o.ok]
    failed = [o for o in outcomes if not o.ok]
    num_prompt = sum(o.num_prompt_tokens for o in done)
    num_cached = sum(o.num_cached_tokens for o in done)
    lines = [
        *conditions(args),
        *prefix_conditions(args, run, done),
        "",
        "| metric | value |",
        "|---|---|",
        f"| output tokens/s | {sum(o.num_output_tokens for o in done) / run.wall_s:.1f} |",
        f"| requests/s | {len(done) / run.wall_s:.3f} |",
        f"| time to first token p50 / p99 (ms) | {p50_p99(ttfts_ms(done))} |",
        f"| hit rate (cached / prompt tokens) | {rate_cell(done)} ({num_cached} / {num_prompt}) |",
        f"| completed / failed requests | {len(done)} / {len(failed)} |",
        f"| wall time (s) | {run.wall_s:.1f} |",
    ]
    if args.workload == "chat-turns":
        lines += ["", *turn_rows(args, run)]
    return "\n".join(lines + footer(args, done, failed))
