#!/usr/bin/env python3
"""Load a running lorad (or any OpenAI-compatible server) with concurrent streaming requests.

Prints a table of output tokens/s, requests/s, time to first token and inter-token latency
(p50/p99), then one of each model id's requests, with the conditions (date, machine, workload).
--workload chat-turns and few-shot share a prompt prefix for a prefix cache instead
(bench_prefix.py). Every request sets ignore_eos, so each one generates exactly --max-tokens
tokens. Tokens are timed by the usage lorad puts on every chunk when asked, so text held back
(random weights) does not hide them. Does not start or configure the server: say how it was
started with --note. Stdlib + aiohttp.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time

import aiohttp

from bench_clock import Outcome
from bench_models import ModelListError, ModelPicker, check_served, read_model_file
from bench_prefix import FirstRequestFailed, report_prefix, run_chat_turns, run_few_shot
from bench_stream import request_fields, stream
from bench_table import conditions, footer, p50_p99, percentile, record, ttfts_ms

CHAT_PROMPTS = (
    "Explain how a bicycle stays upright while moving.",
    "Write a short story about a lighthouse keeper and a storm.",
    "What are the main differences between a list and a tuple in Python?",
    "Describe the water cycle to a ten-year-old.",
    "Give me a recipe for a simple vegetable soup.",
    "Why is the sky blue? Answer in detail.",
    "Summarize the plot of a detective novel you make up.",
    "List some good habits for writing maintainable code and explain each one.",
)
# Random prompt ids are drawn from here: ordinary tokens in any BPE vocabulary of 1k+ entries.
PROMPT_ID_RANGE = (100, 1000)


def build_body(args: argparse.Namespace, index: int, model: str) -> tuple[str, dict]:
    common = request_fields(args, model, args.seed + index)
    if args.chat:
        prompt = CHAT_PROMPTS[index % len(CHAT_PROMPTS)]
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": prompt}]}
    # A fresh random prompt per request, so no request benefits from another's cached prefix.
    rng = random.Random(args.seed * 1_000_003 + index)
    prompt_ids = [rng.randrange(*PROMPT_ID_RANGE) for _ in range(args.prompt_len)]
    return "/v1/completions", {**common, "prompt": prompt_ids}


async def run_one(session: aiohttp.ClientSession, args: argparse.Namespace, index: int) -> Outcome:
    path, body = build_body(args, index, args.picker.pick(index))
    return await stream(session, args.url + path, body)


async def run_all(args: argparse.Namespace, num_requests: int,
                  first_index: int) -> tuple[list[Outcome], float]:
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(num_requests):
        queue.put_nowait(first_index + i)
    outcomes: list[Outcome] = []
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    connector = aiohttp.TCPConnector(limit=args.concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def client() -> None:
            while not queue.empty():
                outcomes.append(await run_one(session, args, queue.get_nowait()))

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(min(args.concurrency, num_requests))))
        return outcomes, time.perf_counter() - started


async def served_models(url: str) -> list[str]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        async with session.get(url + "/v1/models") as response:
            response.raise_for_status()
            return [card["id"] for card in (await response.json())["data"]]


def report(args: argparse.Namespace, outcomes: list[Outcome], wall_s: float) -> str:
    done = [o for o in outcomes if o.ok]
    failed = [o for o in outcomes if not o.ok]
    ttfts = ttfts_ms(done)
    gaps = [g * 1000 for o in done for g in o.gaps_s]
    num_output = sum(o.num_output_tokens for o in done)
    prompt_lens = sorted({o.num_prompt_tokens for o in done})
    itl = ("per token, by the usage on every chunk" if done and all(o.usage_per_chunk for o in done)
           else "per chunk with text (the server sent no usage per chunk)")

    prompts = "chat prompts" if args.chat else f"random {args.prompt_len}-token prompts"
    workload = f"{len(outcomes)} requests at concurrency {args.concurrency}, {prompts}"
    if prompt_lens:
        workload += f" ({prompt_lens[0]}-{prompt_lens[-1]} prompt tokens by usage)"
    if args.no_cache:
        workload += ", cache_prompt false"
    lines = [
        *conditions(args),
        f"workload:  {workload}, max_tokens {args.max_tokens}, ignore_eos, "
        f"temperature {args.temperature}",
        f"latency:   TTFT to the first token's chunk; ITL {itl}",
        "",
        "| metric | value |",
        "|---|---|",
        f"| output tokens/s | {num_output / wall_s:.1f} |",
        f"| requests/s | {len(done) / wall_s:.3f} |",
        f"| time to first token p50 / p99 (ms) | {p50_p99(ttfts)} |",
        f"| inter-token latency p50 / p99 (ms) | {p50_p99(gaps)} |",
        f"| completed / failed requests | {len(done)} / {len(failed)} |",
        f"| requests timed to first token / with any text | "
        f"{len(ttfts)} / {sum(o.num_text_chunks > 0 for o in done)} |",
        f"| wall time (s) | {wall_s:.1f} |",
        "",
        "| model | requests | failed | output tokens | TTFT p50 (ms) |",
        "|---|---|---|---|---|",
    ]
    for model in args.picker.models:  # list order: hot to cold under --zipf
        mine = [o for o in outcomes if o.model == model]
        ok = [o for o in mine if o.ok]
        ttft = [o.ttft_s * 1000 for o in ok if o.ttft_s is not None]
        p50 = f"{percentile(ttft, 50):.1f}" if ttft else "n/a"
        lines.append(f"| {model} | {len(mine)} | {len(mine) - len(ok)} | "
                     f"{sum(o.num_output_tokens for o in ok)} | {p50} |")
    return "\n".join(lines + footer(args, done, failed))


def add_prefix_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", choices=("independent", "chat-turns", "few-shot"),
                        default="independent",
                        help="independent: unrelated prompts (default); chat-turns: --concurrency "
                        "conversations of --turns turns sharing a system prompt; few-shot: "
                        "--requests prompts sharing --shots examples")
    parser.add_argument("--turns", type=int, default=4, help="chat-turns: turns per conversation")
    parser.add_argument("--system-tokens", type=int, default=512,
                        help="chat-turns: the shared system prompt's size, about (default: "
                        "%(default)s)")
    parser.add_argument("--shots", type=int, default=4, help="few-shot: examples per prompt")
    parser.add_argument("--shot-tokens", type=int, default=64,
                        help="few-shot: each example's size, about (default: %(default)s)")
    parser.add_argument("--no-cache", action="store_true",
                        help='send "cache_prompt": false (lorad\'s switch for its prefix cache) on '
                        "every request, to compare with the cache on the same server")
    parser.add_argument("--json", metavar="FILE",
                        help="also write the conditions and each measured request to FILE")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    models = parser.add_mutually_exclusive_group()
    models.add_argument("--model", help="model id (default: the first one /v1/models lists); "
                        "several ids separated by commas spread over the requests, e.g. "
                        "SmolLM2-135M-Instruct,pirate,uppercase for a mixed-adapter burst")
    models.add_argument("--models-from-file", metavar="FILE",
                        help="model ids to spread the requests over, one per line")
    parser.add_argument("--no-model-check", action="store_true",
                        help="send model ids the server does not list (lorad --adapter-dir "
                        "loads them on their first request)")
    parser.add_argument("--zipf", type=float, metavar="S",
                        help="pick each request's model id by a Zipf law of exponent S over the "
                        "list's order (seeded by --seed; 0 is uniform); default: round-robin")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    parser.add_argument("--requests", type=int, default=32, help="measured requests in all")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens generated per request")
    parser.add_argument("--prompt-len", type=int, default=128,
                        help="prompt length in tokens (random token ids, /v1/completions)")
    parser.add_argument("--chat", action="store_true",
                        help="use a fixed set of chat prompts (/v1/chat/completions) instead")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=2,
                        help="unmeasured requests sent first (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per request")
    parser.add_argument("--note", default="",
                        help="how the server was started, printed with the conditions")
    add_prefix_flags(parser)
    args = parser.parse_args(argv)
    for name in ("concurrency", "requests", "max_tokens", "prompt_len", "turns", "system_tokens",
                 "shots", "shot_tokens"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.chat and args.workload != "independent":
        parser.error(f"--chat is for --workload independent; {args.workload} sets its own prompts")
    if args.zipf is not None and not args.zipf >= 0:  # also refuses NaN
        parser.error(f"--zipf must be 0 or more, got {args.zipf}")
    args.url = args.url.rstrip("/")
    return args


async def main_async(args: argparse.Namespace) -> int:
    served = await served_models(args.url)
    if args.models_from_file:
        models = read_model_file(args.models_from_file)
    elif args.model:
        models = [m for m in args.model.split(",") if m]
    else:
        models = served[:1]
    if not args.no_model_check:
        check_served(models, served, args.url)
    args.picker = ModelPicker(models, args.zipf, args.seed)
    if args.workload != "independent":
        run = await (run_chat_turns if args.workload == "chat-turns" else run_few_shot)(args)
        text, measured = report_prefix(args, run), run.measured
        wall_s = None
    else:
        if args.warmup:
            warm, _ = await run_all(args, args.warmup, first_index=1_000_000)
            if not any(o.ok for o in warm):
                raise FirstRequestFailed("warm-up", warm[0].error)
        outcomes, wall_s = await run_all(args, args.requests, first_index=0)
        run = None
        text, measured = report(args, outcomes, wall_s), [({}, o) for o in outcomes]
    print(text)
    if args.json:
        start = min((o.sent_at for _, o in measured), default=0.0)
        try:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump({"workload": args.workload,
                           "conditions": text.split("\n\n")[0].splitlines(),
                           "shared_prompt_tokens": run.num_shared_tokens if run else None,
                           "concurrency": args.concurrency, "models": args.picker.models,
                           "wall_s": wall_s,  # the measured requests' burst (independent)
                           "requests": [record(o, start, **labels)
                                        for labels, o in measured]},
                          f, indent=1)
        except OSError as exc:
            print(f"bench: --json {args.json}: cannot write it: {exc}", file=sys.stderr)
            return 1
    return 0 if all(o.ok for _, o in measured) else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return asyncio.run(main_async(args))
    except ModelListError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    except FirstRequestFailed as exc:
        error = " ".join(exc.error.split())
        if args.no_cache and "cache_prompt" in error:
            print(f'bench: the server refused "cache_prompt": false, which --no-cache sends '
                  f"(lorad's switch for its prefix cache); run without --no-cache: {error}",
                  file=sys.stderr)
            return 2
        print(f"bench: {exc.what} failed: {error}", file=sys.stderr)
        return 1
    except (aiohttp.ClientError, OSError) as exc:
        print(f"bench: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
