#!/usr/bin/env python3
"""scripts/capacity.py checked against measured bursts, in one command: the step table of this
machine (benchmarks.step_table on the CPU, bench_engine --json-out on a GPU), one lorad daemon,
--runs bursts of scripts/bench.py over the base model and its adapters, and `capacity.py burst
--check` on each. Prints measured against predicted output tokens/s and TTFT p50 / p99 with the
ratios, and whether each is within --tolerance (issue 35: throughput and TTFT p50 within 15%).
A request's fixed cost outside the steps is measured first, on the idle server (one request at a
time, against the simulation of the same), and added to every predicted TTFT. Beside each burst:
the daemon's own mean TTFT and step interval (/metrics), against the client's mean TTFT.

    python -m benchmarks.check_capacity                  (CPU: SmolLM2 and the demo adapters)
    python -m benchmarks.check_capacity --device cuda    (a GPU: random 8B-shape weights, bf16,
                                                          --random-adapters of rank 16)

Run it from the repository root; it starts and stops the daemon itself and keeps the table, the
daemon's log, bench.py's records and capacity.py's reports in --work.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import urllib.request
from pathlib import Path

import torch

from benchmarks.common import (DEMO_MODEL, REPO, add_run_flags, bench_py, conditions, health,
                               open_work_dir, print_table, say, served_models, start_lorad,
                               stop_lorad)

sys.path.insert(0, str(REPO / "scripts"))  # scripts/ tools import their siblings by name
import capacity  # noqa: E402

PORT = 8015
DEMO_ADAPTERS = [REPO / "demo/adapters/uppercase", REPO / "demo/adapters/pirate"]
GPU_MODEL = REPO / "scripts/configs/llama3-8b"
# Issue 35's two are checked; p99 and the TTFT p50 of the first wave (the first --concurrency
# requests, sent at once) and of the requests after it are shown.
FIGURES = ("output tokens/s", "TTFT p50 (ms)", "TTFT p99 (ms)", *capacity.WAVE_FIGURES)
CHECKED = ("output tokens/s", "TTFT p50 (ms)")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"),
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", help=f"model folder (default: {DEMO_MODEL} on the CPU, "
                   f"{GPU_MODEL.relative_to(REPO)} with random weights on a GPU)")
    p.add_argument("--adapter", action="append", type=Path, metavar="DIR",
                   help="adapter folders served beside the base (default on the CPU: the demo "
                        "adapters)")
    p.add_argument("--random-adapters", type=int, default=2,
                   help="on a GPU without --adapter: this many random adapters of rank 16 on "
                        "all seven projections, bf16")
    p.add_argument("--threads", type=int, default=1, help="CPU: torch threads, table and daemon")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--tolerance", type=float, default=0.15)
    p.add_argument("--table", type=Path, help="a step table to use instead of measuring one")
    add_run_flags(p, "the table, the daemon's log, bench.py's records and capacity.py's reports")
    args = p.parse_args(argv)
    on_gpu = args.device == "cuda"
    args.model = args.model or str(GPU_MODEL if on_gpu else DEMO_MODEL)
    if args.adapter is None:
        args.adapter = [] if on_gpu else DEMO_ADAPTERS
    return args


def measure_table(args, adapters: list[Path], out: Path, log: Path) -> None:
    """This machine's step table, by the tool of its device."""
    if args.device == "cpu":
        argv = ["-m", "benchmarks.step_table", "--model", args.model, "--threads",
                str(args.threads), "--prefill-chunk", str(args.prompt_len), "--out", str(out)]
        for folder in adapters:
            argv += ["--adapter", str(folder)]
    else:
        # The daemon's own arithmetic (matmul plans) and its adapters: "many" over as many
        # adapters as it serves gives the eager and prompt steps with adapters (a prompt step
        # with LoRA rows costs the host far more than one without).
        argv = ["-m", "benchmarks.bench_engine", "--config", args.model, "--cases",
                "base,one,many", "--num-adapters", str(max(len(adapters), 1)),
                "--batches", "1,2,4,8,16,32,64", "--eager-batches", "1,8,32",
                "--prefill", f"1x{args.prompt_len},4x{args.prompt_len}", "--hf-batches", "",
                "--deterministic", "--json-out", str(out)]
        if "--no-mixed-step-graphs" not in args.lorad_flag:  # as the daemon runs prompt steps
            argv.append("--mixed-step-graphs")
    with open(log, "wb") as f:
        done = subprocess.run([sys.executable, *argv], stdout=f, stderr=subprocess.STDOUT,
                              cwd=REPO)
    if done.returncode != 0:
        raise RuntimeError(f"the step table failed (exit {done.returncode}); see {log}")


def daemon_flags(args, adapters: list[Path]) -> list[str]:
    flags = ["--model", args.model, "--max-num-seqs", str(args.concurrency)]
    if args.device == "cpu":
        flags += ["--threads", str(args.threads)]
    else:
        flags += ["--load-format", "random", "--dtype", "bfloat16"]
    for folder in adapters:
        flags += ["--adapter", f"{folder.name}={folder}"]
    return flags + args.lorad_flag


def server_sums(port: int) -> dict[str, float]:
    """metric_sums of the daemon's /metrics now."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        return metric_sums(response.read().decode())


def metric_sums(text: str) -> dict[str, float]:
    """The sums and counts, over every label, of the daemon's time to first token (arrival to
    the first token at the coordinator) and step interval (a step plus its transport), from a
    Prometheus text exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name in ("lorad_time_to_first_token_seconds", "lorad_step_interval_seconds"):
            for sample in family.samples:
                if sample.name.endswith(("_sum", "_count")):
                    sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    return sums


def server_means(before: dict, after: dict) -> str:
    """What the daemon saw during one burst: its mean TTFT and mean step interval, in ms."""
    def mean(name: str) -> float:
        count = after.get(name + "_count", 0) - before.get(name + "_count", 0)
        total = after.get(name + "_sum", 0) - before.get(name + "_sum", 0)
        return 1e3 * total / count if count else float("nan")
    return (f"{mean('lorad_time_to_first_token_seconds'):,.1f} / "
            f"{mean('lorad_step_interval_seconds'):,.2f}")


def async_flag(lorad_flags: list[str]) -> list[str]:
    """capacity.py's flag for the daemon's --(no-)async-scheduling, the last one given; none
    (the table's device decides, as lorad's default does) when neither is."""
    given = [f for f in lorad_flags if f in ("--async-scheduling", "--no-async-scheduling")]
    return given[-1:]


def check(args, table: Path, record: Path, base: str, slots: int, overhead_ms: float = 0.0,
          steps: capacity.StepTable | None = None) -> tuple[dict, dict, str]:
    """capacity.py burst --check, in this process -> (measured, predicted, its report); slots:
    the daemon's device slots for adapters (its /health); steps: the table's contents, read
    once by a caller that checks several records (None: read)."""
    flags = capacity.parse_args(["burst", "--table", str(table), "--check", str(record),
                                 "--base-model", base, "--max-num-seqs", str(args.concurrency),
                                 "--slots", str(slots), "--tolerance", str(args.tolerance),
                                 "--overhead-ms", f"{overhead_ms:.3f}",
                                 *async_flag(args.lorad_flag)])
    steps = steps or capacity.StepTable.from_file(str(table))
    run = capacity.burst_check(flags, steps)
    report, _ = capacity.burst_report(flags, steps, run)
    return {name: run["measured"][name] for name in FIGURES}, run["predicted"], report


def main(argv=None) -> int:
    args = parse_args(argv)
    work = open_work_dir(args.work, "lorad-capacity-check-")
    adapters = list(args.adapter)
    if args.device == "cuda" and not adapters and args.random_adapters:
        from benchmarks.bench_engine import write_adapter
        from lorad.config import ModelConfig

        config = ModelConfig.from_dir(args.model)
        for i in range(args.random_adapters):
            folder = work / "adapters" / f"r{i}"
            if not folder.exists():
                write_adapter(folder, config, 16, seed=1 + i)
            adapters.append(folder)
    table = args.table
    if table is None:
        table = work / "table.json"
        measure_table(args, adapters, table, work / "table.log")
        say(f"step table in {table}")
    proc = start_lorad(daemon_flags(args, adapters), PORT, work / "lorad.log")
    records, client_ttft = [], []  # per burst: its bench.py record, the client's mean TTFT
    try:
        ids = served_models(PORT)
        # The simulation must hold the daemon's slots: with fewer, every request of a burst
        # rotating over more adapters than slots would wait for a copy that never happens.
        slots = health(PORT)["adapter_slots"]
        say(f"lorad ready, serving {', '.join(ids)} ({slots} adapter slots)")
        # A request's cost outside the steps (HTTP, tokenizer, admission, the first token's way
        # back), which the step table cannot hold: one request at a time on the idle server,
        # its TTFT against the simulation of the same requests.
        idle = work / "idle.json"
        bench_py(["--url", f"http://127.0.0.1:{PORT}", "--model", ",".join(ids),
                  "--concurrency", "1", "--requests", str(4 * len(ids)), "--prompt-len",
                  str(args.prompt_len), "--max-tokens", "2", "--seed", "99"], idle)
        server = []  # per burst: the daemon's own mean TTFT and step interval
        for run in range(args.runs):
            record = work / f"burst{run}.json"
            before = server_sums(PORT)
            done = bench_py(["--url", f"http://127.0.0.1:{PORT}", "--model", ",".join(ids),
                             "--concurrency", str(args.concurrency), "--requests",
                             str(args.requests), "--prompt-len", str(args.prompt_len),
                             "--max-tokens", str(args.max_tokens), "--seed", str(run)], record)
            ttfts = [r["ttft_ms"] for r in done["requests"]
                     if r["ok"] and r["ttft_ms"] is not None]
            client_ttft.append(sum(ttfts) / len(ttfts))
            records.append(record)
            server.append(server_means(before, server_sums(PORT)))
            say(f"burst {run + 1} of {args.runs} done")
    finally:
        stop_lorad(proc)
    steps = capacity.StepTable.from_file(str(table))
    idle_measured, idle_predicted, _ = check(args, table, idle, ids[0], slots, steps=steps)
    overhead_ms = max(0.0, idle_measured["TTFT p50 (ms)"] - idle_predicted["TTFT p50 (ms)"])
    lines = [f"{conditions(args.device if args.device == 'cuda' else None)}",
             f"model {args.model} ({args.device}) with {len(adapters)} adapter(s); bench.py "
             f"--concurrency {args.concurrency} --requests {args.requests} --prompt-len "
             f"{args.prompt_len} --max-tokens {args.max_tokens} over {len(ids)} model ids; "
             f"table {table}; work in {work}",
             f"per-request overhead: {overhead_ms:.1f} ms (one request at a time on the idle "
             f"server: TTFT p50 {idle_measured['TTFT p50 (ms)']:.1f} ms measured, "
             f"{idle_predicted['TTFT p50 (ms)']:.1f} ms simulated), added to every predicted "
             "TTFT", "",
             "| run | " + " | ".join(f"{f}: measured / predicted (ratio)" for f in FIGURES) +
             " | the daemon's mean TTFT / step interval (ms) | client's mean TTFT (ms) |",
             "|---|" + "---|" * (len(FIGURES) + 2)]
    misses = 0
    for run, record in enumerate(records):
        measured, predicted, report = check(args, table, record, ids[0], slots, overhead_ms,
                                            steps)
        (work / f"check{run}.txt").write_text(report)
        cells = []
        for name in FIGURES:
            if measured[name] is None or predicted[name] is None:
                cells.append("")
                continue
            ratio = predicted[name] / measured[name]
            cells.append(f"{measured[name]:,.1f} / {predicted[name]:,.1f} ({ratio:.2f})")
            if name in CHECKED and abs(ratio - 1) > args.tolerance:
                misses += 1
        cells += [server[run], f"{client_ttft[run]:,.1f}"]
        lines.append(f"| {run + 1} | " + " | ".join(cells) + " |")
    lines += ["", f"verdict: {'within' if not misses else 'NOT within'} {args.tolerance:.0%} "
              f"for {' and '.join(CHECKED)} in every run ({misses} figure(s) outside)"]
    print_table(lines, args.table_out)
    return 0 if not misses else 1


if __name__ == "__main__":
    sys.exit(main())
