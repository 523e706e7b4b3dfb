#!/usr/bin/env python3
"""Check that a burst of concurrent streams over a mixture of adapters gives each stream exactly
the tokens it gives alone, greedy and (with --seeded) sampled with a fixed seed.

Against a running lorad: first every (model id, prompt, mode) the burst will run goes solo, one
request at a time, with a fixed max_tokens, and the sha256 of its token ids is recorded (asked
with return_token_ids; a server that does not return them is compared by text, with a warning:
random-weight models hold most of their text back). Then a burst of concurrent streams rotates
the model ids over the prompts and modes, and every stream's hash must equal its own solo run's.
Modes: greedy (temperature 0) and seeded (temperature 0.8, top_p 0.95, a seed fixed per model id
and prompt). --prompt-lengths sends prompts of those many random token ids (completions only), so
long prompts are prefilled in chunks beside the other streams' decodes. Prints a table per model
id and mode; exits 1 naming every mismatch, 2 when a request fails. Standard library only
(threads and http.client), so it runs from any Python 3.9 or later.

A model id written NAME@S runs adapter NAME at strength S (the request's adapter_strength), so
one burst mixes strengths of one adapter. --reference-url takes the solo runs from another daemon
(e.g. --parallel 1 as the reference for --parallel 2, another --max-num-batched-tokens for a
re-chunked prompt, or the previous build). --resume runs the solo runs cold ("cache_prompt":
false) and, after the burst, every (model id, prompt, mode) once more on --url with the prefix
cache, its prompt's blocks cached by the burst: each resumed run must equal its cold one too.
--draft runs every (model id, prompt, mode) once more on --url with "draft": false (lorad's
switch for n-gram drafting, --speculative-ngram): on a drafting daemon each such run must equal
its solo run, drafted, by token hashes too.

Usage: adapter_mix.py --url http://127.0.0.1:8000 --models BASE,ADAPTER1,ADAPTER2 [options]
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import random
import re
import sys
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlparse

DEFAULT_PROMPTS = (
    "What is the capital of France?",
    "Name three colours.",
    "Write one sentence about the sea.",
    "How many legs does a cat have?",
)
SEEDED = {"temperature": 0.8, "top_p": 0.95}
PROMPT_SEED = 20_260_429  # the random token-id prompts depend on this and the vocabulary only

Key = tuple[str, int, str]  # a stream's (model id[@strength], prompt index, mode)


class RequestFailed(RuntimeError):
    """A request did not finish with a finish_reason (HTTP error, error event, broken stream)."""


@dataclass(frozen=True)
class Run:
    """One finished stream."""

    key: Key
    text: str
    token_ids: tuple[int, ...] | None  # None: the server returned none
    num_tokens: int

    def digest(self, by_ids: bool) -> str:
        data = json.dumps(self.token_ids) if by_ids else self.text
        return hashlib.sha256(data.encode()).hexdigest()


def split_spec(spec: str) -> tuple[str, float | None]:
    """NAME@S -> (NAME, S); NAME -> (NAME, None)."""
    name, at, strength = spec.partition("@")
    return name, (float(strength) if at else None)


def pair_seed(model: str, prompt_index: int) -> int:
    """The seeded mode's seed: fixed per (model id, prompt), whatever --models' order."""
    return int.from_bytes(hashlib.sha256(f"{model}\n{prompt_index}".encode()).digest()[:4], "big")


def post(url: str, route: str, body: dict, timeout: float) -> tuple[http.client.HTTPConnection,
                                                                    http.client.HTTPResponse]:
    parsed = urlparse(url)
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port or 80, timeout=timeout)
    conn.request("POST", route, json.dumps(body), {"Content-Type": "application/json"})
    return conn, conn.getresponse()


def stream_run(url: str, key: Key, prompts: list[str | list[int]], args: argparse.Namespace,
               cache_prompt: bool = True, draft: bool = True) -> Run:
    """POST one streamed request; its text, token ids and completion token count."""
    spec, prompt_index, mode = key
    model, strength = split_spec(spec)
    body = {"model": model, "max_tokens": args.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": args.ignore_eos,
            "return_token_ids": True}
    if strength is not None:
        body["adapter_strength"] = strength
    if not cache_prompt:
        body["cache_prompt"] = False
    if not draft:
        body["draft"] = False
    body |= ({"temperature": 0} if mode == "greedy"
             else {**SEEDED, "seed": pair_seed(spec, prompt_index)})
    prompt = prompts[prompt_index]
    if args.chat:
        route, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
    else:
        route, body["prompt"] = "/v1/completions", prompt
    conn = None
    try:
        conn, resp = post(url, route, body, args.timeout)
        if resp.status != 200:
            raise RequestFailed(f"{model}: HTTP {resp.status}: {resp.read()[:300]!r}")
        return Run(key, *read_events(resp, model, args.chat))
    except (OSError, http.client.HTTPException) as exc:
        raise RequestFailed(f"{model}: {exc!r}") from None
    finally:
        if conn is not None:
            conn.close()


def read_events(lines, model: str, chat: bool) -> tuple[str, tuple[int, ...] | None, int]:
    """An SSE body's lines -> (text, token ids or None if any chunk lacked them, tokens)."""
    texts, ids, finish, num_tokens = [], [], None, 0
    for line in lines:
        if not line.startswith(b"data: "):
            continue
        payload = line[6:].strip()
        if payload == b"[DONE]":
            break
        event = json.loads(payload)
        if "error" in event:
            raise RequestFailed(f"{model}: error event: {event['error'].get('message')}")
        if event.get("model") != model:
            raise RequestFailed(f"{model}: the stream reports model {event.get('model')!r}")
        for choice in event.get("choices", []):
            texts.append((choice.get("delta", {}).get("content") if chat else choice.get("text"))
                         or "")
            chunk_ids = choice.get("token_ids")
            if ids is not None and isinstance(chunk_ids, list):
                ids.extend(chunk_ids)
            else:
                ids = None
            finish = choice.get("finish_reason") or finish
        if event.get("usage"):
            num_tokens = event["usage"]["completion_tokens"]
    if finish is None:
        raise RequestFailed(f"{model}: the stream ended without a finish_reason")
    return "".join(texts), None if ids is None else tuple(ids), num_tokens


def vocab_size(url: str, model: str, timeout: float) -> int:
    """The server's vocabulary size, from the 400 that a token id past any vocabulary gets
    (lorad's message names the range, `(0..V-1)`)."""
    body = {"model": model, "prompt": [2**31 - 1], "max_tokens": 1}
    try:
        conn, resp = post(url, "/v1/completions", body, timeout)
        reply = resp.read().decode(errors="replace")
        conn.close()
    except (OSError, http.client.HTTPException) as exc:
        raise RequestFailed(f"the vocabulary probe: {exc!r}") from None
    found = re.search(r"\(0\.\.(\d+)\)", reply) if resp.status == 400 else None
    if found is None:
        raise RequestFailed(f"cannot read the vocabulary size from {url} (HTTP {resp.status}: "
                            f"{reply[:200]!r}); pass --vocab-size")
    return int(found.group(1)) + 1


def token_prompts(lengths: list[int], vocab: int) -> list[list[int]]:
    """One prompt of random ids below `vocab` per length, the same for every server."""
    rng = random.Random(PROMPT_SEED)
    return [[rng.randrange(vocab) for _ in range(length)] for length in lengths]


def burst_plan(models: list[str], num_prompts: int, modes: list[str], size: int) -> list[Key]:
    """Stream k = r * M + m runs model m with prompt (m + r) mod P in mode
    (m div P + r div P) mod D: neighbours use different model ids, every M streams in a row mix
    the prompts (and the modes, given more model ids than prompts), and the first M * P * D
    streams run every (model, prompt, mode) once."""
    plan = []
    for k in range(size):
        r, m = divmod(k, len(models))
        plan.append((models[m], (m + r) % num_prompts,
                     modes[(m // num_prompts + r // num_prompts) % len(modes)]))
    return plan


def solo_runs(url: str, plan: list[Key], prompts: list[str | list[int]],
              args: argparse.Namespace, cache_prompt: bool = True,
              draft: bool = True) -> dict[Key, Run]:
    """Each key of the plan once, one request at a time."""
    return {key: stream_run(url, key, prompts, args, cache_prompt, draft)
            for key in dict.fromkeys(plan)}


def burst_runs(url: str, plan: list[Key], prompts: list[str | list[int]],
               args: argparse.Namespace) -> tuple[list[Run | None], list[str]]:
    """Fire every stream of the plan at once (released together by a barrier)."""
    results: list[Run | None] = [None] * len(plan)
    errors: list[str] = []
    barrier = threading.Barrier(len(plan))

    def one(k: int, key: Key) -> None:
        barrier.wait()
        try:
            results[k] = stream_run(url, key, prompts, args)
        except RequestFailed as exc:
            errors.append(f"burst stream {k}: {exc}")

    threads = [threading.Thread(target=one, args=(k, key), daemon=True)
               for k, key in enumerate(plan)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results, errors


def mismatches(solo: dict[Key, Run], burst: list[Run | None], by_ids: bool,
               what: str = "burst stream") -> list[str]:
    found = []
    for k, run in enumerate(burst):
        if run is None:
            continue
        expected = solo[run.key]
        if run.digest(by_ids) == expected.digest(by_ids):
            continue
        a, b = (expected.token_ids, run.token_ids) if by_ids else (expected.text, run.text)
        at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        end = at + (8 if by_ids else 30)
        model, prompt_index, mode = run.key
        found.append(f"MISMATCH {model} {mode} prompt {prompt_index} ({what} {k}): solo "
                     f"{expected.digest(by_ids)[:12]} != {run.digest(by_ids)[:12]}, "
                     f"{'ids differ from token' if by_ids else 'texts differ from character'} "
                     f"{at}: solo {a[at:end]!r}, burst {b[at:end]!r}")
    return found


def summary(models: list[str], modes: list[str], solo: dict[Key, Run], burst: list[Run | None],
            bad: list[str]) -> str:
    width = max(len("model"), *(len(m) for m in models))
    lines = [f"{'model':<{width}}  mode    solo  burst  match  mismatch  tokens/stream"]
    for model in models:
        for mode in modes:
            mine = [r for r in burst if r is not None and (r.key[0], r.key[2]) == (model, mode)]
            num_bad = sum(1 for line in bad if line.startswith(f"MISMATCH {model} {mode} "))
            runs = [r for (m, _, d), r in solo.items() if (m, d) == (model, mode)]
            tokens = sorted({r.num_tokens for r in runs})
            lines.append(f"{model:<{width}}  {mode:<6}  {len(runs):>4}  {len(mine):>5}  "
                         f"{len(mine) - num_bad:>5}  {num_bad:>8}  "
                         f"{','.join(map(str, tokens)) or '-'}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the daemon under test")
    parser.add_argument("--reference-url", help="where the solo runs happen (default: --url)")
    parser.add_argument("--models", required=True,
                        help="comma-separated model ids: the base model's and adapters' names")
    parser.add_argument("--prompt", action="append", dest="prompts",
                        help="a prompt (repeat the flag for more; default: four built in)")
    parser.add_argument("--prompt-lengths",
                        help="comma-separated token counts, e.g. 8,200,700: one prompt of that "
                             "many random token ids each, instead of text (completions only)")
    parser.add_argument("--vocab-size", type=int,
                        help="bound of --prompt-lengths' ids (default: asked of --url)")
    parser.add_argument("--seeded", action="store_true",
                        help="also run every pair sampled: temperature 0.8, top_p 0.95, a seed "
                             "fixed per model id and prompt")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--burst", type=int, default=0,
                        help="concurrent streams (default: 2 x models x prompts x modes)")
    parser.add_argument("--chat", action="store_true", help="use /v1/chat/completions")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="generate exactly --max-tokens tokens every time")
    parser.add_argument("--resume", action="store_true",
                        help="solo runs cold (cache_prompt false); after the burst each pair "
                             "once more with the prefix cache, compared with its cold run")
    parser.add_argument("--draft", action="store_true",
                        help='after the burst each pair once more with "draft": false, compared '
                             "with its solo run (n-gram drafting off for that request)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    args = parser.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.modes = ["greedy", "seeded"] if args.seeded else ["greedy"]
    if not args.models or args.max_tokens < 1 or args.burst < 0:
        parser.error("--models needs at least one id; --max-tokens and --burst must be positive")
    for spec in args.models:
        try:
            split_spec(spec)
        except ValueError:
            parser.error(f"--models: {spec!r} is not NAME or NAME@STRENGTH")
    if args.prompt_lengths is not None:
        if args.prompts or args.chat:
            parser.error("--prompt-lengths makes token-id prompts: not with --prompt or --chat")
        try:
            args.prompt_lengths = [int(n) for n in args.prompt_lengths.split(",")]
        except ValueError:
            parser.error(f"--prompt-lengths takes integers, got {args.prompt_lengths!r}")
        if not args.prompt_lengths or min(args.prompt_lengths) < 1:
            parser.error("--prompt-lengths must be positive")
    args.prompts = args.prompts or list(DEFAULT_PROMPTS)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    models, modes, prompts = args.models, args.modes, args.prompts
    described = f"{len(prompts)} text prompts"
    if args.prompt_lengths is not None:
        try:
            vocab = args.vocab_size or vocab_size(args.url, models[0], args.timeout)
        except RequestFailed as exc:
            print(f"adapter_mix: {exc}", file=sys.stderr)
            return 2
        prompts = token_prompts(args.prompt_lengths, vocab)
        described = f"prompts of {'/'.join(map(str, args.prompt_lengths))} token ids < {vocab}"
    size = args.burst or 2 * len(models) * len(prompts) * len(modes)
    plan = burst_plan(models, len(prompts), modes, size)
    started = time.monotonic()
    try:
        solo = solo_runs(args.reference_url or args.url, plan, prompts, args,
                         cache_prompt=not args.resume)
    except RequestFailed as exc:
        print(f"adapter_mix: a solo run failed: {exc}", file=sys.stderr)
        return 2
    solo_s = time.monotonic() - started
    burst, errors = burst_runs(args.url, plan, prompts, args)
    burst_s = time.monotonic() - started - solo_s
    resumed: list[Run | None] = []
    if args.resume:
        try:
            resumed = list(solo_runs(args.url, plan, prompts, args).values())
        except RequestFailed as exc:
            errors.append(f"a resumed run: {exc}")
    undrafted: list[Run | None] = []
    if args.draft:
        try:
            undrafted = list(solo_runs(args.url, plan, prompts, args, draft=False).values())
        except RequestFailed as exc:
            errors.append(f"an undrafted run: {exc}")
    by_ids = all(r.token_ids is not None for r in [*solo.values(), *burst, *resumed, *undrafted]
                 if r is not None)
    if not by_ids:
        print("adapter_mix: warning: a server returned no token_ids (return_token_ids); "
              "comparing text instead, which random-weight models mostly hold back",
              file=sys.stderr)
    bad = mismatches(solo, burst, by_ids)
    bad_resumed = mismatches(solo, resumed, by_ids, "resumed run")
    bad_resumed += mismatches(solo, undrafted, by_ids, "undrafted run")
    sampling = " and seeded (temperature 0.8, top_p 0.95)" if args.seeded else ""
    print(f"adapter_mix: {args.url} (solo runs from {args.reference_url or args.url}), "
          f"{'chat' if args.chat else 'completions'}, greedy{sampling}, {described}, "
          f"max_tokens {args.max_tokens}{', ignore_eos' if args.ignore_eos else ''}; compared by "
          f"{'token ids' if by_ids else 'text'}; {len(solo)} solo runs in {solo_s:.1f} s, "
          f"a burst of {size} concurrent streams in {burst_s:.1f} s"
          f"{f', then {len(resumed)} resumed runs' if args.resume else ''}"
          f"{f', then {len(undrafted)} undrafted runs' if args.draft else ''}")
    print(summary(models, modes, solo, burst, bad))
    for line in bad + bad_resumed + errors:
        print(line)
    if errors:
        print(f"adapter_mix: FAILED: {len(errors)} burst request(s) failed", file=sys.stderr)
        return 2
    if bad or bad_resumed:
        names = sorted({line.split()[1] for line in bad + bad_resumed})
        print(f"adapter_mix: FAILED: {len(bad)} of {size} streams differ from their solo run, "
              f"{len(bad_resumed)} of {len(resumed) + len(undrafted)} resumed or undrafted runs "
              f"from their cold or solo run (models: {', '.join(names)})", file=sys.stderr)
        return 1
    print(f"adapter_mix: OK: all {size} streams equal their solo runs"
          f"{f', all {len(resumed)} resumed runs their cold runs' if args.resume else ''}"
          f"{f', all {len(undrafted)} undrafted runs their solo runs' if args.draft else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
