#!/usr/bin/env python3
"""What n-gram drafting (--speculative-ngram K) buys and costs through HTTP (issue 33): one lorad
daemon that drafts, the same greedy chat requests sent with "draft": false and with drafting, on
an editing workload (fix a paragraph's spelling: the answer copies the prompt, drafts hit) and on
open questions (little to copy), at concurrency 1 and 8; a markdown table of output tokens/s, the
speedup, the acceptance rate (/metrics counters around the drafted runs) and the tokens each
decode step gave a stream (the token ids on its chunks), the verdicts against issue 33's targets,
and every drafted completion whose tokens differ from its undrafted run (none may).

    python -m benchmarks.bench_drafting                  (the demo model, SmolLM2-135M-Instruct)
    python -m benchmarks.bench_drafting --model scripts/configs/llama3-8b --load-format random \\
        --dtype bfloat16         (the GPU session: acceptance is a random model's loops there)

Each point runs each mode --rounds times, the order alternating by round and by point (A B B A,
then B A A B), so drift on a shared machine falls on both; every request sends "cache_prompt":
false, so every run computes every prompt. The table's last column is the mean step interval
(/metrics): a drafted step's cost. No TTFT: scripts/bench.py times that.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from benchmarks.common import (DEMO_MODEL, add_run_flags, conditions, open_work_dir, print_table,
                               say, served_models, start_lorad, stop_lorad)
from benchmarks.drafting_prompts import EDIT_INSTRUCTION, PARAGRAPHS, QUESTIONS

PORT = 8015
URL = f"http://127.0.0.1:{PORT}"
MODES = ("undrafted", "drafted")
TARGET_SPEEDUP = 1.8  # editing, one stream
TARGET_COST_PCT = 3.0  # chat, any concurrency


@dataclass
class Reply:
    token_ids: list[int]
    text: str
    num_steps: int  # chunks that brought token ids: the prefill's first token, then one a step


def body(model: str, workload: str, index: int, max_tokens: int) -> dict:
    if workload == "editing":
        content = f"{EDIT_INSTRUCTION}\n\n{PARAGRAPHS[index % len(PARAGRAPHS)]}"
    else:
        content = QUESTIONS[index % len(QUESTIONS)]
    # continuous_usage_stats: a chunk per step, whose token ids say how many tokens it took.
    return {"model": model, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "cache_prompt": False,
            "return_token_ids": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}


def stream_one(request: dict) -> Reply:
    data = json.dumps(request).encode()
    post = urllib.request.Request(f"{URL}/v1/chat/completions", data=data,
                                  headers={"Content-Type": "application/json"})
    reply = Reply([], "", 0)
    with urllib.request.urlopen(post, timeout=900) as response:
        for raw in response:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                raise RuntimeError(f"a stream failed: {chunk['error']}")
            for choice in chunk["choices"]:
                reply.text += choice["delta"].get("content") or ""
                if choice.get("token_ids"):
                    reply.token_ids += choice["token_ids"]
                    reply.num_steps += 1
    return reply


def burst(requests: list[dict], concurrency: int) -> tuple[float, list[Reply]]:
    """Every request over `concurrency` client threads (each sends its next when one ends) ->
    (seconds from the first sent to the last finished, the replies in request order)."""
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        replies = list(pool.map(stream_one, requests))
    return time.perf_counter() - start, replies


def counters() -> dict[str, float]:
    """The draft counters and the step interval histogram's sum and count, from /metrics."""
    with urllib.request.urlopen(f"{URL}/metrics", timeout=30) as response:
        text = response.read().decode()
    return {name: float(value) for name, value in re.findall(
        r"^lorad_(draft_tokens_total|draft_accepted_total|step_interval_seconds_sum|"
        r"step_interval_seconds_count) (\S+)$", text, re.M)}


def run_point(args, model: str, workload: str, concurrency: int, first: int) -> dict:
    """Both modes, --rounds times, MODES[first] first in round 0 and the order turned each round
    -> {"runs": {mode: [each run's figures, token ids and texts]}}."""
    max_tokens = args.editing_max_tokens if workload == "editing" else args.chat_max_tokens
    requests = [body(model, workload, i, max_tokens) for i in range(args.requests)]
    runs = {mode: [] for mode in MODES}
    for round_ in range(args.rounds):
        for mode in (MODES if (round_ + first) % 2 == 0 else MODES[::-1]):
            before = counters()
            wall_s, got = burst([{**r, "draft": mode == "drafted"} for r in requests],
                                concurrency)
            delta = {name: value - before[name] for name, value in counters().items()}
            run = {"wall_s": wall_s, "num_tokens": sum(len(r.token_ids) for r in got),
                   "num_decode_tokens": sum(len(r.token_ids) - 1 for r in got),
                   "num_decode_steps": sum(r.num_steps - 1 for r in got),
                   "decode_steps_each": [r.num_steps - 1 for r in got],
                   "num_drafted": delta["draft_tokens_total"],
                   "num_accepted": delta["draft_accepted_total"],
                   "num_steps": delta["step_interval_seconds_count"],
                   "step_s": delta["step_interval_seconds_sum"],
                   "token_ids": [r.token_ids for r in got], "texts": [r.text for r in got]}
            runs[mode].append(run)
            say(f"{workload} c{concurrency} round {round_} {mode}: {run['num_tokens']} tokens in "
                f"{wall_s:.1f} s = {run['num_tokens'] / wall_s:.1f} tokens/s, "
                f"{run['num_decode_tokens'] / max(run['num_decode_steps'], 1):.2f} a decode step, "
                f"drafted {run['num_drafted']:.0f} accepted {run['num_accepted']:.0f}, "
                f"{run['num_steps']:.0f} steps, "
                f"{1e3 * run['step_s'] / max(run['num_steps'], 1):.0f} ms each")
    return {"runs": runs}


def summary(point: dict) -> dict:
    """A point's runs -> tokens/s of each mode (all rounds' tokens over all their seconds), the
    acceptance, tokens per decode step and the requests whose token ids differ from round 0's
    undrafted run."""
    runs = point["runs"]
    found = {}
    for mode in MODES:
        tokens = sum(r["num_tokens"] for r in runs[mode])
        found[f"{mode}_tokens_s"] = tokens / sum(r["wall_s"] for r in runs[mode])
        found[f"{mode}_per_step"] = (sum(r["num_decode_tokens"] for r in runs[mode])
                                     / max(sum(r["num_decode_steps"] for r in runs[mode]), 1))
        found[f"{mode}_drafted"] = sum(r["num_drafted"] for r in runs[mode])
        found[f"{mode}_accepted"] = sum(r["num_accepted"] for r in runs[mode])
        found[f"{mode}_step_ms"] = (1e3 * sum(r["step_s"] for r in runs[mode])
                                    / max(sum(r["num_steps"] for r in runs[mode]), 1))
    found["speedup"] = found["drafted_tokens_s"] / found["undrafted_tokens_s"]
    found["acceptance"] = found["drafted_accepted"] / max(found["drafted_drafted"], 1)
    reference = runs["undrafted"][0]["token_ids"]
    found["mismatches"] = [
        {"request": i, "mode": mode, "round": k, "first_diff": first_diff(ref, run["token_ids"][i])}
        for mode in MODES for k, run in enumerate(runs[mode]) for i, ref in enumerate(reference)
        if run["token_ids"][i] != ref]
    return found


def first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def report(args, points: dict[tuple[str, int], dict]) -> list[str]:
    lines = ["| workload | concurrency | undrafted tok/s | drafted tok/s | speedup | acceptance | "
             "tokens per decode step, drafted (undrafted) | ms a step, drafted (undrafted) |",
             "|---|---|---|---|---|---|---|---|"]
    for (workload, concurrency), point in points.items():
        s = point["summary"]
        lines.append(f"| {workload} | {concurrency} | {s['undrafted_tokens_s']:.1f} | "
                     f"{s['drafted_tokens_s']:.1f} | {s['speedup']:.2f}x | "
                     f"{100 * s['acceptance']:.0f}% ({s['drafted_accepted']:.0f} of "
                     f"{s['drafted_drafted']:.0f}) | {s['drafted_per_step']:.2f} "
                     f"({s['undrafted_per_step']:.2f}) | {s['drafted_step_ms']:.1f} "
                     f"({s['undrafted_step_ms']:.1f}) |")
    lines.append("")
    editing = points.get(("editing", 1))
    if editing:
        speedup = editing["summary"]["speedup"]
        lines.append(f"verdict editing, one stream: {speedup:.2f}x, "
                     f"{'MET' if speedup >= TARGET_SPEEDUP else 'MISSED'} (target >= "
                     f"{TARGET_SPEEDUP:g}x)")
    chat = {c: p["summary"]["speedup"] for (w, c), p in points.items() if w == "chat"}
    if chat:
        worst = min(chat, key=chat.get)
        cost = 100 * (1 - chat[worst])
        met = "MET" if cost <= TARGET_COST_PCT else "MISSED"
        lines.append(f"verdict chat: largest cost {cost:+.1f}% at concurrency {worst} (1 - "
                     f"drafted/undrafted tokens/s), {met} (target <= {TARGET_COST_PCT:g}%)")
    leaks = [key for key, p in points.items() if p["summary"]["undrafted_drafted"]]
    if leaks:
        lines.append(f"WARNING: \"draft\": false runs drafted at {leaks}")
    num_compared = sum((2 * args.rounds - 1) * args.requests for _ in points)
    mismatches = [(key, m) for key, p in points.items() for m in p["summary"]["mismatches"]]
    lines.append(f"outputs: {len(mismatches)} of {num_compared} completions differ from the "
                 f"first undrafted run's token ids (greedy: none may)")
    for (workload, concurrency), m in mismatches[:20]:
        runs = points[(workload, concurrency)]["runs"]
        ref = runs["undrafted"][0]["texts"][m["request"]]
        mine = runs[m["mode"]][m["round"]]["texts"][m["request"]]
        lines.append(f"  {workload} c{concurrency} request {m['request']} {m['mode']} round "
                     f"{m['round']}: tokens differ from token {m['first_diff']}; undrafted "
                     f"{ref[:120]!r}, {m['mode']} {mine[:120]!r}")
    return lines


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEMO_MODEL))
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--ngram", type=int, default=4, help="--speculative-ngram K (default 4)")
    parser.add_argument("--workloads", default="editing,chat", help="editing, chat or both")
    parser.add_argument("--concurrency", default="1,8", help="comma-separated (default 1,8)")
    parser.add_argument("--requests", type=int, default=8, help="requests a run (default 8)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="runs of each mode a point, A B B A (default 2)")
    parser.add_argument("--editing-max-tokens", type=int, default=192)
    parser.add_argument("--chat-max-tokens", type=int, default=128)
    add_run_flags(parser, "the daemon's log and results.json")
    args = parser.parse_args()
    args.workloads = args.workloads.split(",")
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    if set(args.workloads) - {"editing", "chat"} or min(args.concurrency) <= 0:
        parser.error("--workloads takes editing and chat, --concurrency positive counts")
    if min(args.ngram, args.requests, args.rounds) <= 0:
        parser.error("--ngram, --requests and --rounds must be positive")
    return args


def main() -> int:
    args = parse_args()
    args.work = open_work_dir(args.work, "lorad-drafting-")
    log = args.work / "lorad.log"
    flags = ["--model", args.model, "--load-format", args.load_format, "--dtype", args.dtype,
             "--speculative-ngram", str(args.ngram), *args.lorad_flag]
    say(f"starting lorad {' '.join(flags)} (log {log})")
    proc = start_lorad(flags, PORT, log)
    points = {}
    try:
        ready = re.search(r"ready in .*", log.read_text(errors="replace"))
        say(ready.group(0) if ready else "ready")
        model = served_models(PORT)[0]
        widest = max(args.concurrency)
        for workload in args.workloads:  # unmeasured: the first requests of each shape
            for draft in (False, True):
                burst([{**body(model, workload, i, 8), "draft": draft} for i in range(widest)],
                      widest)
        say(f"warm-up done ({widest} requests of each workload, 8 tokens, both modes)")
        for workload in args.workloads:
            for concurrency in args.concurrency:
                point = run_point(args, model, workload, concurrency, len(points) % 2)
                point["summary"] = summary(point)
                points[(workload, concurrency)] = point
    finally:
        say(f"lorad stopped (exit {stop_lorad(proc)})")
    results = {f"{w}-c{c}": p for (w, c), p in points.items()}
    (args.work / "results.json").write_text(json.dumps(results, indent=1))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    lines = [conditions(device), f"lorad {' '.join(flags)}; chat completions, greedy, "
             f"cache_prompt false, {args.requests} requests a run, {args.rounds} run(s) of each "
             f"mode a point, alternating; max_tokens {args.editing_max_tokens} editing, "
             f"{args.chat_max_tokens} chat; log and results.json in {args.work}", "",
             *report(args, points)]
    print_table(lines, args.table_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
