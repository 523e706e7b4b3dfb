#!/usr/bin/env python3
"""The coordinator's CPU time per streamed token: a real `lorad` on a tiny random model on the
CPU, N concurrent HTTP requests at once, and the coordinator process's own CPU time (user +
system, all its threads, from /proc) across the burst, divided by the tokens delivered.

    python -m benchmarks.bench_coordinator [--streams 64,256] [--max-tokens 256]
        [--shapes usage,plain,full] [--repeats 2] [--profile FILE]

Shapes: `usage` is scripts/bench.py's request (stream, include_usage + continuous_usage_stats:
a chunk per token, each with usage), `plain` streams without stream_options, `full` is
stream=false. Every request has a 16-token prompt and ignore_eos, so it generates exactly
--max-tokens tokens. The workers' time is not counted (they are other processes), nor the
clients' (this process). Per-request work (parsing, tokenizing, admission) is in the figure,
spread over the request's tokens. The model is tiny so that the workers keep up; what it says
in its text does not matter. --profile runs the coordinator under cProfile and writes its stats
to FILE when it stops. Prints a table and the conditions; a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp

from benchmarks.common import REPO, conditions, process_cpu
from tests.tiny_models import make_tiny_llama

PROMPT_LEN = 16
BLOCK_SIZE = 16


# The coordinator under cProfile on its main thread's CPU clock (a wall-clock profile would
# charge it the time it waits for a core on a shared host).
PROFILED = ("import cProfile, runpy, sys, time\n"
            "out = sys.argv.pop(1)\n"
            "profile = cProfile.Profile(time.thread_time)\n"
            "try:\n"
            "    profile.runcall(runpy.run_module, 'lorad.daemon', run_name='__main__',\n"
            "                    alter_sys=True)\n"
            "except SystemExit:\n"
            "    pass\n"
            "finally:\n"
            "    profile.dump_stats(out)\n")


def start(model_dir: Path, port: int, max_streams: int, max_tokens: int,
          profile: str | None, log_path: Path) -> subprocess.Popen:
    blocks = max_streams * -(-(PROMPT_LEN + max_tokens) // BLOCK_SIZE) + 64
    entry = [sys.executable, "-m", "lorad.daemon"]
    if profile:
        entry = [sys.executable, "-c", PROFILED, profile]
    argv = [*entry, "--model", str(model_dir), "--name", "tiny", "--port", str(port),
            "--device", "cpu", "--max-model-len", str(PROMPT_LEN + max_tokens),
            "--max-num-seqs", str(max_streams), "--kv-cache-blocks", str(blocks),
            "--max-num-batched-tokens", str(max_streams * PROMPT_LEN),
            "--max-queued-requests", str(4 * max_streams), "--log-level", "warning",
            "--runtime-dir", tempfile.mkdtemp(prefix="lrdb-")]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"lorad exited during start-up:\n{log_path.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
                if resp.status == 200:
                    return proc
        except OSError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise SystemExit("lorad did not become healthy in 300 s")


def body(shape: str, index: int, max_tokens: int) -> dict:
    prompt = [100 + (index * 7 + i * 13) % 250 for i in range(PROMPT_LEN)]
    out = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
           "ignore_eos": True, "stream": shape != "full"}
    if shape == "usage":
        out["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return out


async def one(session: aiohttp.ClientSession, url: str, shape: str, index: int,
              max_tokens: int) -> int:
    """-> the number of SSE events received (1 for a JSON body); raises on a failure."""
    async with session.post(url, json=body(shape, index, max_tokens)) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:300]}")
        if shape == "full":
            await response.read()
            return 1
        num_events, last = 0, b""
        async for line in response.content:
            if line.startswith(b"data:"):
                num_events += 1
                last = line
        if last.strip() != b"data: [DONE]":
            raise RuntimeError(f"stream did not end with [DONE]: {last[:200]!r}")
        return num_events


async def burst(url: str, shape: str, num_streams: int, max_tokens: int) -> int:
    connector = aiohttp.TCPConnector(limit=num_streams)
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        counts = await asyncio.gather(*(one(session, url, shape, i, max_tokens)
                                        for i in range(num_streams)))
    return sum(counts)


def measure(pid: int, url: str, shape: str, num_streams: int, max_tokens: int) -> dict:
    (user, system), wall = process_cpu(pid), time.perf_counter()
    num_events = asyncio.run(burst(url, shape, num_streams, max_tokens))
    wall = time.perf_counter() - wall
    user_after, system_after = process_cpu(pid)
    user, system = user_after - user, system_after - system
    num_tokens = num_streams * max_tokens  # ignore_eos: each request generates max_tokens
    return {"cpu_s": user + system, "us_per_token": (user + system) / num_tokens * 1e6,
            "system_us": system / num_tokens * 1e6, "events": num_events,
            "tokens": num_tokens, "wall_s": wall}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", default="64,256")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--shapes", default="usage,plain,full")
    parser.add_argument("--repeats", type=int, default=2, help="bursts per case; the least "
                        "CPU time is reported (others on the host only add to it)")
    parser.add_argument("--profile", metavar="FILE", help="cProfile the coordinator into FILE")
    args = parser.parse_args()
    streams = [int(s) for s in args.streams.split(",") if s]
    shapes = [s for s in args.shapes.split(",") if s]
    folder = Path(tempfile.mkdtemp(prefix="bench-coord-"))
    model_dir = make_tiny_llama(folder / "tiny", max_position_embeddings=2048)
    port = 20000 + os.getpid() % 10000
    proc = start(model_dir, port, max(streams), args.max_tokens, args.profile,
                 folder / "lorad.log")
    url = f"http://127.0.0.1:{port}/v1/completions"
    try:
        measure(proc.pid, url, "usage", 8, 16)  # warm-up: first requests, imports, caches
        print(f"# coordinator CPU per streamed token, {conditions()}")
        print(f"# tiny random Llama on the CPU, {PROMPT_LEN} in / {args.max_tokens} out, "
              f"ignore_eos, greedy; least coordinator CPU of {args.repeats} bursts; "
              f"{os.cpu_count()} cores")
        print("| streams | shape | coordinator us/token | of which system | SSE events | tokens "
              "| wall s |")
        print("|---|---|---|---|---|---|---|")
        for num_streams in streams:
            for shape in shapes:
                runs = [measure(proc.pid, url, shape, num_streams, args.max_tokens)
                        for _ in range(args.repeats)]
                best = min(runs, key=lambda r: r["cpu_s"])
                print(f"| {num_streams} | {shape} | {best['us_per_token']:.1f} | "
                      f"{best['system_us']:.1f} | {best['events']} | {best['tokens']} | "
                      f"{best['wall_s']:.1f} |",
                      flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
