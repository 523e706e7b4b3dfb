#!/usr/bin/env python3
"""Check that a burst of concurrent greedy streams over a mixture of adapters gives each stream
exactly the text it gives alone.

Against a running lorad: first every (model id, prompt) pair runs solo, one request at a time,
greedy (temperature 0) with a fixed max_tokens, and the sha256 of its text is recorded. Then a
burst of concurrent streams rotates the model ids over the prompts, and every stream's hash must
equal its own solo run's. Prints a table per model id; exits 1 naming every mismatch, 2 when a
request fails. Standard library only (threads and http.client), so it runs from any Python 3.

--reference-url takes the solo runs from another daemon (e.g. --parallel 1 as the reference for
--parallel 2, or the previous build).

Usage: adapter_mix.py --url http://127.0.0.1:8000 --models BASE,ADAPTER1,ADAPTER2 [options]
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
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


class RequestFailed(RuntimeError):
    """A request did not finish with a finish_reason (HTTP error, error event, broken stream)."""


@dataclass(frozen=True)
class Run:
    """One finished greedy stream."""

    model: str
    prompt_index: int
    text: str
    num_tokens: int

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()


def stream_text(url: str, model: str, prompt: str, args: argparse.Namespace) -> tuple[str, int]:
    """POST one streamed greedy request; the concatenated text and the completion token count."""
    parsed = urlparse(url)
    body = {"model": model, "max_tokens": args.max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": args.ignore_eos}
    if args.chat:
        route, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
    else:
        route, body["prompt"] = "/v1/completions", prompt
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port or 80, timeout=args.timeout)
    try:
        conn.request("POST", route, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RequestFailed(f"{model}: HTTP {resp.status}: {resp.read()[:300]!r}")
        return _read_events(resp, model, args.chat)
    except (OSError, http.client.HTTPException) as exc:
        raise RequestFailed(f"{model}: {exc!r}") from None
    finally:
        conn.close()


def _read_events(resp: http.client.HTTPResponse, model: str, chat: bool) -> tuple[str, int]:
    texts, finish, num_tokens = [], None, 0
    for line in resp:
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
            finish = choice.get("finish_reason") or finish
        if event.get("usage"):
            num_tokens = event["usage"]["completion_tokens"]
    if finish is None:
        raise RequestFailed(f"{model}: the stream ended without a finish_reason")
    return "".join(texts), num_tokens


def solo_runs(url: str, models: list[str], prompts: list[str],
              args: argparse.Namespace) -> dict[tuple[str, int], Run]:
    runs = {}
    for model in models:
        for i, prompt in enumerate(prompts):
            text, num_tokens = stream_text(url, model, prompt, args)
            runs[model, i] = Run(model, i, text, num_tokens)
    return runs


def burst_plan(models: list[str], num_prompts: int, size: int) -> list[tuple[str, int]]:
    """Stream k asks prompt k mod P of model (k + k div P) mod M: every model meets every prompt,
    and neighbours in the burst use different adapters."""
    return [(models[(k + k // num_prompts) % len(models)], k % num_prompts) for k in range(size)]


def burst_runs(url: str, plan: list[tuple[str, int]], prompts: list[str],
               args: argparse.Namespace) -> tuple[list[Run | None], list[str]]:
    """Fire every stream of the plan at once (released together by a barrier)."""
    results: list[Run | None] = [None] * len(plan)
    errors: list[str] = []
    barrier = threading.Barrier(len(plan))

    def one(k: int, model: str, prompt_index: int) -> None:
        barrier.wait()
        try:
            text, num_tokens = stream_text(url, model, prompts[prompt_index], args)
            results[k] = Run(model, prompt_index, text, num_tokens)
        except RequestFailed as exc:
            errors.append(f"burst stream {k}: {exc}")

    threads = [threading.Thread(target=one, args=(k, m, p), daemon=True)
               for k, (m, p) in enumerate(plan)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results, errors


def mismatches(solo: dict[tuple[str, int], Run], burst: list[Run | None]) -> list[str]:
    found = []
    for k, run in enumerate(burst):
        if run is None:
            continue
        expected = solo[run.model, run.prompt_index]
        if run.digest != expected.digest:
            at = next((i for i, (a, b) in enumerate(zip(run.text, expected.text)) if a != b),
                      min(len(run.text), len(expected.text)))
            found.append(f"MISMATCH {run.model} prompt {run.prompt_index} (burst stream {k}): "
                         f"solo {expected.digest[:12]} != burst {run.digest[:12]}, texts differ "
                         f"from character {at}: solo {expected.text[at:at + 30]!r}, "
                         f"burst {run.text[at:at + 30]!r}")
    return found


def summary(models: list[str], solo: dict[tuple[str, int], Run], burst: list[Run | None],
            bad: list[str]) -> str:
    width = max(len("model"), *(len(m) for m in models))
    lines = [f"{'model':<{width}}  solo  burst  match  mismatch  tokens/stream"]
    for model in models:
        mine = [r for r in burst if r is not None and r.model == model]
        num_bad = sum(1 for line in bad if line.startswith(f"MISMATCH {model} prompt "))
        tokens = sorted({r.num_tokens for (m, _), r in solo.items() if m == model})
        lines.append(f"{model:<{width}}  {sum(m == model for m, _ in solo):>4}  {len(mine):>5}  "
                     f"{len(mine) - num_bad:>5}  {num_bad:>8}  "
                     f"{','.join(map(str, tokens))}")
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
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--burst", type=int, default=0,
                        help="concurrent streams (default: 2 x models x prompts)")
    parser.add_argument("--chat", action="store_true", help="use /v1/chat/completions")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="generate exactly --max-tokens tokens every time")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    args = parser.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.prompts = args.prompts or list(DEFAULT_PROMPTS)
    if not args.models or args.max_tokens < 1 or args.burst < 0:
        parser.error("--models needs at least one id; --max-tokens and --burst must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    models, prompts = args.models, args.prompts
    size = args.burst or 2 * len(models) * len(prompts)
    started = time.monotonic()
    try:
        solo = solo_runs(args.reference_url or args.url, models, prompts, args)
    except RequestFailed as exc:
        print(f"adapter_mix: a solo run failed: {exc}", file=sys.stderr)
        return 2
    solo_s = time.monotonic() - started
    burst, errors = burst_runs(args.url, burst_plan(models, len(prompts), size), prompts, args)
    burst_s = time.monotonic() - started - solo_s
    bad = mismatches(solo, burst)
    print(f"adapter_mix: {args.url} (solo runs from {args.reference_url or args.url}), "
          f"{'chat' if args.chat else 'completions'}, greedy, max_tokens {args.max_tokens}"
          f"{', ignore_eos' if args.ignore_eos else ''}; {len(solo)} solo runs in {solo_s:.1f} s, "
          f"a burst of {size} concurrent streams in {burst_s:.1f} s")
    print(summary(models, solo, burst, bad))
    for line in bad + errors:
        print(line)
    if errors:
        print(f"adapter_mix: FAILED: {len(errors)} burst request(s) failed", file=sys.stderr)
        return 2
    if bad:
        names = sorted({line.split()[1] for line in bad})
        print(f"adapter_mix: FAILED: {len(bad)} of {size} streams differ from their solo run "
              f"(models: {', '.join(names)})", file=sys.stderr)
        return 1
    print(f"adapter_mix: OK: all {size} streams equal their solo runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
