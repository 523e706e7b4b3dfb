#!/usr/bin/env python3
"""More adapters than device slots, through HTTP: a Zipf burst over N adapters under
--adapter-dir with S device slots, against the same burst with every adapter it uses resident;
and the time one adapter takes to come in (first use: register and copy; evicted: copy back from
the host cache or disk). Prints a markdown table with the conditions.

    python -m benchmarks.bench_adapter_paging --model scripts/configs/llama3-8b \\
        --load-format random --adapters 1000 --distinct 200 --rank 16 --slots 64 --zipf 1.0
    python -m benchmarks.bench_adapter_paging --model ~/.cache/lorad/SmolLM2-135M-Instruct \\
        --adapters 1000 --distinct 50 --rank 8 --slots 8 --requests 128 --concurrency 8 \\
        --max-tokens 32 --prompt-len 64                      (the CPU run of docs/benchmarks.md)

Adapters are random PEFT folders of `--rank` on all seven projections (bf16), `--distinct` of
them written and the others hard links to those files (each still its own name, registry id
and slot: 1,000 8B-shape adapters of rank 16 would need 84 GB of disk). Each burst runs twice
with the same seed: the first registers every adapter it names, the second is measured. Run it
from the repository root; it starts and stops the daemons itself, prints a line with the
elapsed time as each phase ends (a run cut by a time limit shows where it was), and keeps the
daemons' logs and bench.py's records in --work.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.common import (add_run_flags, bench_py, conditions, figures, health,
                               open_work_dir, print_table, say, start_lorad, stop_lorad)

REPO = Path(__file__).resolve().parent.parent
PORT = 8013


def write_library(root: Path, model: str, num: int, distinct: int, rank: int) -> Path:
    """root/a0000..: `distinct` random adapters, the rest hard links to their files. The distinct
    ones are drawn on threads (torch's random draws and the file writes release the GIL): 64 of
    the 8B shape at rank 16 take ~3 s each on one core."""
    from benchmarks.bench_engine import write_adapter
    from lorad.config import ModelConfig

    config = ModelConfig.from_dir(model)
    missing = [i for i in range(distinct) if not (root / f"a{i:04d}").exists()]
    with ThreadPoolExecutor(max(1, min(8, (os.cpu_count() or 1) // 2))) as pool:
        list(pool.map(lambda i: write_adapter(root / f"a{i:04d}", config, rank, seed=1 + i),
                      missing))
    for i in range(distinct, num):
        folder = root / f"a{i:04d}"
        if folder.exists():
            continue
        folder.mkdir(parents=True)
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            os.link(root / f"a{i % distinct:04d}" / name, folder / name)
    return root


def start(args, library: Path, slots: int, log: Path) -> subprocess.Popen:
    return start_lorad(["--model", args.model, "--adapter-dir", str(library),
                        "--max-gpu-adapters", str(slots), "--max-cpu-adapters",
                        str(args.host_cache), "--max-lora-rank", str(args.rank),
                        "--load-format", args.load_format, "--parallel", str(args.parallel),
                        *args.lorad_flag], PORT, log)


def bench(args, models: Path, out: Path, **overrides) -> dict:
    """scripts/bench.py once -> its --json record, plus its printed table."""
    flags = {"requests": args.requests, "concurrency": args.concurrency,
             "max_tokens": args.max_tokens, "prompt_len": args.prompt_len, **overrides}
    argv = ["--url", f"http://127.0.0.1:{PORT}", "--no-model-check", "--warmup", "0",
            "--seed", str(args.seed)]
    if "model" in overrides:
        argv += ["--model", flags.pop("model")]
    else:
        argv += ["--models-from-file", str(models), "--zipf", str(args.zipf)]
    for name, value in flags.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    return bench_py(argv, out)


def run_daemon(args, library: Path, models: Path, slots: int, work: Path, tag: str) -> dict:
    proc = start(args, library, slots, work / f"{tag}.log")
    say(f"{tag}: ready ({slots} slots)")
    try:
        bench(args, models, work / f"{tag}-first.json")  # registers every adapter it names
        say(f"{tag}: first burst done (registers its adapters)")
        before = slot_counters()
        result = figures(bench(args, models, work / f"{tag}.json"))
        result["counters"] = {name: value - before[name]
                              for name, value in slot_counters().items()}
        say(f"{tag}: the measured burst's slot counters (rank 0): {result['counters']}")
        say(f"{tag}: measured burst: {result['tokens_s']:.1f} tokens/s, TTFT p50 / p99 "
                 f"{result['ttft']} ms")
        if tag == "paged":
            result["load"] = load_times(args, models)
            say(f"{tag}: load times {result['load']}")
        return result
    finally:
        stop_lorad(proc)


COUNTERS = ("adapter_loads", "adapter_host_hits", "adapter_disk_reads", "adapter_evictions")


def slot_counters() -> dict:
    """Rank 0's adapter slot and cache counters, from /health (docs/adapters.md)."""
    rank = health(PORT)["ranks"][0]
    return {name: rank[name] for name in COUNTERS}


def load_times(args, models: Path) -> dict:
    """Time of a request for one token (alone, not streamed) on an adapter never used, then
    resident, then evicted by args.slots + 1 others (back from the host cache)."""
    names = models.read_text().split()
    fresh = names[-1]
    prompt = " ".join(["hello"] * args.prompt_len)

    def one_token(name: str) -> float:
        body = json.dumps({"model": name, "prompt": prompt, "max_tokens": 1,
                           "cache_prompt": False}).encode()  # a whole prefill each time
        request = urllib.request.Request(f"http://127.0.0.1:{PORT}/v1/completions", body,
                                         {"Content-Type": "application/json"})
        began = time.perf_counter()
        with urllib.request.urlopen(request, timeout=600) as response:
            response.read()
        return (time.perf_counter() - began) * 1e3

    first = one_token(fresh)
    resident = one_token(fresh)
    for name in names[:args.slots + 1]:  # push `fresh` out of its slot
        one_token(name)
    return {"first use": first, "resident": resident, "evicted": one_token(fresh)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--parallel", type=int, default=1)
    parser.add_argument("--adapters", type=int, default=1000)
    parser.add_argument("--distinct", type=int, default=200)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--host-cache", default="auto",
                        help="--max-cpu-adapters of the paged daemon: N or auto (lorad's default)")
    parser.add_argument("--zipf", type=float, default=1.0)
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--library", type=Path, help="where the adapters go (kept for reuse)")
    add_run_flags(parser, "the daemons' logs and bench.py's records")
    args = parser.parse_args()
    work = open_work_dir(args.work, "lorad-paging-")
    library = args.library or Path(tempfile.gettempdir()) / (
        f"lorad-paging-{Path(args.model).name}-r{args.rank}-{args.distinct}")
    library.mkdir(parents=True, exist_ok=True)
    write_library(library, args.model, args.adapters, args.distinct, args.rank)
    say(f"library of {args.adapters} adapters in {library}")
    models = work / "models.txt"
    models.write_text("".join(f"a{i:04d}\n" for i in range(args.adapters)))
    paged = run_daemon(args, library, models, args.slots, work, "paged")
    resident = run_daemon(args, library, models, max(args.slots, len(paged["used"])), work,
                          "resident")
    load = paged["load"]
    lines = [f"{conditions()}\nworkload: {args.requests} requests at concurrency "
             f"{args.concurrency}, Zipf {args.zipf:g} over {args.adapters} adapters "
             f"({args.distinct} distinct files) of rank {args.rank}; {len(paged['used'])} used; "
             f"{args.prompt_len} in / {args.max_tokens} out; paged: --max-cpu-adapters "
             f"{args.host_cache}; logs in {work}\n",
             "| run | slots | output tokens/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) |",
             "|---|---|---|---|---|"]
    for tag, result, slots in (("paged", paged, args.slots),
                               ("all used resident", resident, len(paged["used"]))):
        lines.append(f"| {tag} | {slots} | {result['tokens_s']:.1f} | {result['ttft']} | "
                     f"{result['itl']} |")
    counters = paged["counters"]
    lines += [f"\npaged / resident throughput: {paged['tokens_s'] / resident['tokens_s']:.2f}",
              f"paged, the measured burst (rank 0): {counters['adapter_loads']} copies into a "
              f"slot ({counters['adapter_host_hits']} from the host cache, "
              f"{counters['adapter_disk_reads']} from disk), "
              f"{counters['adapter_evictions']} evictions",
              f"one adapter alone, a request for 1 token (ms): first use "
              f"{load['first use']:.1f} (registration and a copy from disk), evicted and back "
              f"{load['evicted']:.1f} (a copy from the host cache), resident "
              f"{load['resident']:.1f}"]
    print_table(lines, args.table_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
