#!/usr/bin/env python3
"""What `--threads` buys on the CPU, and that it changes no bit (issue 33): lorad on the demo
model with both demo adapters, started at `--threads 1` and at `--threads auto` (the default)
in turn, each driven by scripts/bench.py with --concurrency chat streams over the base model and
both adapters; and on each daemon the same greedy chat requests (every model id, a few
prompts), whose token ids must be equal at every thread count. Prints a markdown table of output
tokens/s, TTFT and ITL per run, the speedup against one thread (issue 33's target: >= 1.8x at
the default threads), the cores each party kept busy during the burst (the coordinator, the
workers, bench.py: whether the client or the coordinator take cores from the workers' threads
on a machine of few cores) and the token ids that differ (none may).

    python -m benchmarks.bench_threads [--rounds 2] [--threads 1,auto]

Runs alternate by round (1 auto, then auto 1) so drift on a shared machine falls on both.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
import urllib.request
from pathlib import Path

from benchmarks.common import (DEMO_MODEL, REPO, add_run_flags, bench_py, conditions, figures,
                               open_work_dir, print_table, say, served_models, start_lorad,
                               stop_lorad, tree_cpu_seconds)

PORT = 8016
URL = f"http://127.0.0.1:{PORT}"
ADAPTERS = ("uppercase", "pirate")
TARGET_SPEEDUP = 1.8
QUESTIONS = ("Why is the sky blue?", "Name three uses of a paperclip.",
             "How do bees make honey?", "What is a prime number?")


def greedy_ids(model_ids: list[str], max_tokens: int) -> dict[str, list[int]]:
    """Each (model id, question) once, greedy -> "model|question" -> its token ids."""
    out = {}
    for model in model_ids:
        for question in QUESTIONS:
            body = {"model": model, "messages": [{"role": "user", "content": question}],
                    "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True,
                    "cache_prompt": False}
            post = urllib.request.Request(f"{URL}/v1/chat/completions",
                                          data=json.dumps(body).encode(),
                                          headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(post, timeout=600) as response:
                out[f"{model}|{question}"] = json.load(response)["choices"][0]["token_ids"]
    return out


def _cpu(usage) -> float:
    return usage.ru_utime + usage.ru_stime


def run_one(args, threads: str, round_: int) -> dict:
    log = args.work / f"lorad-{threads}-{round_}.log"
    flags = ["--model", args.model, "--threads", threads,
             *[flag for name in ADAPTERS
               for flag in ("--adapter", f"{name}={REPO}/demo/adapters/{name}")],
             *args.lorad_flag]
    proc = start_lorad(flags, PORT, log)
    try:
        model_ids = served_models(PORT)
        before = (time.monotonic(), *tree_cpu_seconds(proc.pid),
                  _cpu(resource.getrusage(resource.RUSAGE_CHILDREN)))
        record = bench_py(["--url", URL, "--model", ",".join(model_ids), "--chat",
                           "--concurrency", str(args.concurrency), "--requests",
                           str(args.requests), "--max-tokens", str(args.max_tokens),
                           "--note", f"lorad --threads {threads}"],
                          args.work / f"bench-{threads}-{round_}.json")
        after = (time.monotonic(), *tree_cpu_seconds(proc.pid),
                 _cpu(resource.getrusage(resource.RUSAGE_CHILDREN)))
        found = figures(record)
        # cores each party kept busy over the burst (warm-up requests included)
        wall, *used = (b - a for a, b in zip(before, after))
        found["cores"] = [u / wall for u in used]  # coordinator, workers, bench.py
        found["ids"] = greedy_ids(model_ids, args.check_tokens)
        found["log"] = next((line for line in log.read_text(errors="replace").splitlines()
                             if "fp32 products" in line), "")
    finally:
        stop_lorad(proc)
    say(f"--threads {threads} round {round_}: {found['tokens_s']:.1f} tokens/s, TTFT "
        f"{found['ttft']} ms, ITL {found['itl']} ms")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEMO_MODEL))
    parser.add_argument("--threads", default="1,auto", help="the counts, the first the baseline")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--check-tokens", type=int, default=48,
                        help="tokens of each greedy request compared across thread counts")
    add_run_flags(parser, "the daemons' logs and bench.py's JSON")
    args = parser.parse_args()
    args.work = open_work_dir(args.work, "lorad-threads-")
    counts = args.threads.split(",")
    runs: dict[str, list[dict]] = {t: [] for t in counts}
    for round_ in range(args.rounds):
        for threads in (counts if round_ % 2 == 0 else counts[::-1]):
            runs[threads].append(run_one(args, threads, round_))
    base = statistics.mean(r["tokens_s"] for r in runs[counts[0]])
    reference = runs[counts[0]][0]["ids"]
    lines = [conditions("cpu"), f"lorad --model {Path(args.model).name}, adapters "
             f"{' and '.join(ADAPTERS)}; "
             f"bench.py --chat --concurrency {args.concurrency} --requests {args.requests} "
             f"--max-tokens {args.max_tokens} over every model id; {args.rounds} round(s), "
             f"alternating; logs in {args.work}", "",
             "| --threads | output tokens/s (each run) | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) "
             "| speedup | cores busy: coordinator / workers / bench.py |",
             "|---|---|---|---|---|---|"]
    differ = []
    for threads, found in runs.items():
        mean = statistics.mean(r["tokens_s"] for r in found)
        each = ", ".join(f"{r['tokens_s']:.1f}" for r in found)
        cores = " / ".join(f"{statistics.mean(r['cores'][i] for r in found):.2f}"
                           for i in range(3))
        lines.append(f"| {threads} | {mean:.1f} ({each}) | {found[-1]['ttft']} | "
                     f"{found[-1]['itl']} | {mean / base:.2f}x | {cores} |")
        differ += [f"--threads {threads} round {i}: {key}" for i, r in enumerate(found)
                   for key, ids in r["ids"].items() if ids != reference[key]]
    lines += ["", *(f"{t}: {runs[t][0]['log'].split('INFO ')[-1]}" for t in counts[1:])]
    best = max((statistics.mean(r["tokens_s"] for r in runs[t]) for t in counts[1:]),
               default=base) / base
    lines.append(f"verdict: {best:.2f}x one thread, "
                 f"{'MET' if best >= TARGET_SPEEDUP else 'MISSED'} (target >= {TARGET_SPEEDUP}x)")
    num = sum(len(r["ids"]) for found in runs.values() for r in found)
    lines.append(f"token ids: {len(differ)} of {num} greedy completions differ from the first "
                 f"--threads {counts[0]} run's (none may)")
    lines += [f"  {d}" for d in differ[:20]]
    print_table(lines, args.table_out)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
