#!/usr/bin/env python3
"""A fleet of lorad replicas on paper: how many replicas (and GPUs) a request rate needs at a
TTFT p99 target, under round-robin, least-loaded and adapter-affinity routing, simulated from a
step-time table (benchmarks/step_table.py on the CPU, benchmarks.bench_engine --json-out on a GPU).

    capacity.py fleet --table T.json --rate 1000 --ttft-p99 2 --adapters 10000 --zipf 1.0
    capacity.py burst --table T.json --check bench.json   (one replica against a measured burst)

Assumptions (docs/capacity.md says why each is safe or not):
- A step's time depends only on its decode rows, prompt tokens and distinct adapters, as the
  table says (interpolated); not on the KV context (the table's) nor on which rows carry adapters.
- The KV pool never binds: no preemption; --max-num-seqs and --max-num-batched-tokens do.
- Each replica plans as lorad's planner: decodes, then started prompts, then new ones first come
  first served; the head waits for its adapter's copy and nobody overtakes it. Copies run one
  at a time beside the steps, from the host cache (M most recent) or from disk, at the table's
  costs; a slot is taken back from the least recently used adapter no running sequence reads.
- The router sees each replica's exact state at arrival (the endpoint picker's scrapes lag).
- Arrivals are Poisson; adapters Zipf(s) over N (id 1 hottest), a --base-share on the base;
  prompt and output lengths fixed or lognormal around a median; every request runs to its length.
- Start cold (no adapter in a slot); requests arriving in the first --warmup seconds are served
  but not counted. A request with no first token 3 x --duration after the start counts as
  infinitely late. Replicas needed: the fewest with TTFT p99 <= the target, assuming monotony.
"""

from __future__ import annotations

import argparse
import bisect
import math
import random
import sys

from capacity_sim import Fleet, ReplicaConfig, Request
from capacity_table import StepTable, TableError


def length(rng: random.Random, median: int, sigma: float, cap: int) -> int:
    if sigma <= 0:
        return median
    return min(max(round(rng.lognormvariate(math.log(median), sigma)), 1), cap)


def poisson_requests(args: argparse.Namespace) -> list[Request]:
    """Arrivals over --duration seconds, each with its adapter and lengths (seeded)."""
    rng = random.Random(args.seed)
    cumulative = list(_cumulative_zipf(args.adapters, args.zipf))
    requests, now = [], 0.0
    while True:
        now += rng.expovariate(args.rate)
        if now >= args.duration:
            return requests
        adapter = 0
        if rng.random() >= args.base_share:
            adapter = 1 + bisect.bisect_left(cumulative, rng.random() * cumulative[-1])
        prompt = length(rng, args.prompt_len, args.prompt_sigma, 8 * args.prompt_len)
        output = length(rng, args.output_len, args.output_sigma, 8 * args.output_len)
        requests.append(Request(now, adapter, prompt, output))


def _cumulative_zipf(n: int, s: float):
    total = 0.0
    for k in range(1, n + 1):
        total += k ** -s
        yield total


def percentile(values: list[float], pct: float) -> float:
    """Linear between closest ranks (as scripts/bench_table.py); inf for late requests."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    pos = (len(ordered) - 1) * pct / 100
    low, high = int(pos), min(int(pos) + 1, len(ordered) - 1)
    if math.isinf(ordered[high]):
        return ordered[high] if pos > low else ordered[low]
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def simulate(args, table: StepTable, num_replicas: int, router: str) -> dict:
    requests = poisson_requests(args)
    fleet = Fleet(num_replicas, replica_config(args, table), table, router, args.slack)
    fleet.run(requests, until=3 * args.duration)
    counted = [r for r in requests if r.arrival >= args.warmup]
    ttfts = [math.inf if r.ttft is None else r.ttft for r in counted]
    copies = sum(args.warmup <= t < args.duration for t in fleet.copies)
    return {"replicas": num_replicas, "p50": percentile(ttfts, 50), "p99": percentile(ttfts, 99),
            "requests": len(counted), "loads": copies / max(len(counted), 1)}


def replica_config(args, table: StepTable) -> ReplicaConfig:
    return ReplicaConfig(args.max_num_seqs, args.max_num_batched_tokens, args.slots,
                         args.host_cache, args.overhead_ms, async_steps(args, table))


def async_steps(args, table: StepTable) -> bool:
    """--async-scheduling, else lorad's default: on for a lone rank on a GPU (the table's device
    and ranks, and fleet's --parallel)."""
    if args.async_scheduling is not None:
        return args.async_scheduling
    return table.on_gpu and table.data.get("parallel", 1) == 1 and getattr(args, "parallel", 1) == 1


def async_text(args, table: StepTable) -> str:
    """The reports' words for async_steps."""
    return f"async steps {'on' if async_steps(args, table) else 'off'}"


def needed(args, table: StepTable, router: str, start: int) -> dict:
    """The fewest replicas that meet the target, to --precision (searching up from `start` by a
    quarter at a time, then halving the gap), with that run's figures."""
    runs: dict[int, dict] = {}

    def ok(n: int) -> bool:
        if n not in runs:
            runs[n] = simulate(args, table, n, router)
        return runs[n]["p99"] <= args.ttft_p99

    lo, hi = 0, max(start, 1)  # lo fails (0 replicas serve nothing), hi is tried
    while not ok(hi):
        lo, hi = hi, max(hi + 1, math.ceil(hi * 1.25))
        if hi > args.max_replicas:
            return {"replicas": None, "tried": hi}
    while hi - lo > max(1, math.ceil(args.precision * hi)):
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return runs[hi]


def one_replica_rate(args, table: StepTable) -> float:
    """Requests/s one replica finishes when always full (a closed loop at --max-num-seqs, base
    model): the start of the search is rate / this."""
    out = burst(table, replica_config(args, table), 4 * args.max_num_seqs, args.max_num_seqs,
                args.prompt_len, args.output_len, [0])
    return len(out["requests"]) / out["wall_s"]


def burst(table: StepTable, config: ReplicaConfig, num_requests: int, concurrency: int,
          prompt_len: int, output_len: int, adapters: list[int]) -> dict:
    """scripts/bench.py's closed loop on one replica: `concurrency` clients, each sending its
    next request when one ends; request i on adapters[i % len]; those adapters start in slots."""
    fleet = Fleet(1, config, table, "round-robin")
    for adapter in list(dict.fromkeys(a for a in adapters if a))[:config.num_slots]:
        fleet.replicas[0].slots[adapter] = 0.0
        fleet.holders.setdefault(adapter, set()).add(0)
    made = [Request(0.0, adapters[i % len(adapters)], prompt_len, output_len)
            for i in range(min(concurrency, num_requests))]

    def next_request(_done: Request, now: float) -> None:
        if len(made) < num_requests:
            made.append(Request(now, adapters[len(made) % len(adapters)], prompt_len, output_len))
            fleet.push(now, "arrive", (made[-1], -1))

    fleet.on_finish = next_request
    wall = fleet.run(list(made))
    return {"requests": made, "wall_s": wall}


def fleet_report(args, table: StepTable) -> str:
    mu = one_replica_rate(args, table)
    start = max(1, math.ceil(args.rate / mu))
    lines = [f"table:     {table.describe()}",
             f"workload:  Poisson {args.rate:g} requests/s for {args.duration:g} s (first "
             f"{args.warmup:g} s not counted), Zipf {args.zipf:g} over {args.adapters} adapters, "
             f"{args.base_share:.0%} on the base; prompt "
             f"{_lengths(args.prompt_len, args.prompt_sigma)}, output "
             f"{_lengths(args.output_len, args.output_sigma)} tokens; seed {args.seed}",
             f"replica:   --max-num-seqs {args.max_num_seqs} --max-num-batched-tokens "
             f"{args.max_num_batched_tokens} --max-gpu-adapters {args.slots} --max-cpu-adapters "
             f"{args.host_cache} --parallel {args.parallel}; copy {table.load_ms['host']:.1f} ms "
             f"from the host cache, {table.load_ms['disk']:.1f} ms from disk; TTFT + "
             f"{args.overhead_ms:g} ms; {async_text(args, table)}; one replica always full: "
             f"{mu:.2f} requests/s",
             f"target:    TTFT p99 <= {args.ttft_p99:g} s; affinity slack {args.slack} open "
             "requests", "",
             "| router | replicas | GPUs | TTFT p50 / p99 (s) | copies per request |",
             "|---|---|---|---|---|"]
    found = {}
    for router in args.routers:
        run = needed(args, table, router, start)
        found[router] = run["replicas"]
        if run["replicas"] is None:
            lines.append(f"| {router} | > {args.max_replicas} | | | |")
            continue
        lines.append(f"| {router} | {run['replicas']:,} | {run['replicas'] * args.parallel:,} | "
                     f"{run['p50']:.2f} / {run['p99']:.2f} | {run['loads']:.3f} |")
    rr, aff = found.get("round-robin"), found.get("affinity")
    if rr and aff:
        lines += ["", f"gain of affinity over round-robin: {rr:,} -> {aff:,} replicas "
                  f"({(rr - aff) / rr:.1%} fewer, {rr / aff:.2f}x)"]
    return "\n".join(lines)


def _lengths(median: int, sigma: float) -> str:
    return f"{median}" if sigma <= 0 else f"lognormal (median {median}, sigma {sigma:g})"


def burst_check(args, table: StepTable) -> dict:
    """The burst simulated: --check's (a bench.py record, whose workload then sets args' burst
    fields) or the flags' -> {"adapters", "measured" (None without --check), "predicted"}."""
    measured = None
    if args.check:
        measured = read_bench(args.check, args.base_model)
        args.requests, args.concurrency = measured["requests"], measured["concurrency"]
        args.prompt_len, args.max_tokens = measured["prompt_len"], measured["output_len"]
        adapters = measured["adapters"]
    else:
        adapters = list(range(1, args.burst_adapters + 1)) or [0]
        if args.with_base and args.burst_adapters:
            adapters = [0] + adapters
    out = burst(table, replica_config(args, table), args.requests, args.concurrency,
                args.prompt_len, args.max_tokens, adapters)
    done = out["requests"]  # in the order they were sent
    ttfts = [1e3 * r.ttft for r in done]
    predicted = {"output tokens/s": sum(r.num_output for r in done) / out["wall_s"],
                 "TTFT p50 (ms)": percentile(ttfts, 50), "TTFT p99 (ms)": percentile(ttfts, 99),
                 **wave_ttfts(ttfts, args.concurrency)}
    return {"adapters": adapters, "measured": measured, "predicted": predicted}


WAVE_FIGURES = ("TTFT p50, first wave (ms)", "TTFT p50, after it (ms)")


def wave_ttfts(ttfts: list[float], concurrency: int) -> dict:
    """TTFT p50 of the first `concurrency` requests sent (they start at once) and of the rest
    (sent as others end): where a prediction of TTFT goes wrong. ttfts in the order sent."""
    first, rest = ttfts[:concurrency], ttfts[concurrency:]
    return {WAVE_FIGURES[0]: percentile(first, 50) if first else None,
            WAVE_FIGURES[1]: percentile(rest, 50) if rest else None}


def burst_report(args, table: StepTable, run: dict | None = None) -> tuple[str, bool]:
    """burst_check's figures (`run`, else simulated now) as capacity.py prints them, and whether
    the prediction is within --tolerance of a --check record."""
    run = run or burst_check(args, table)
    adapters, measured, predicted = run["adapters"], run["measured"], run["predicted"]
    lines = [f"table:     {table.describe()}",
             f"burst:     {args.requests} requests at concurrency {args.concurrency}, prompt "
             f"{args.prompt_len}, output {args.max_tokens}, rotating over adapters {adapters} "
             f"(0: base); --max-num-seqs {args.max_num_seqs} --max-num-batched-tokens "
             f"{args.max_num_batched_tokens} --max-gpu-adapters {args.slots} "
             f"--max-cpu-adapters {args.host_cache}; TTFT + {args.overhead_ms:g} ms; "
             f"{async_text(args, table)}", ""]
    if measured is None:
        lines += ["| metric | predicted |", "|---|---|"]
        lines += [f"| {k} | {v:,.1f} |" for k, v in predicted.items()]
        return "\n".join(lines), True
    lines += [f"measured:  {args.check}", "", "| metric | measured | predicted | ratio |",
              "|---|---|---|---|"]
    within = True
    for name, value in predicted.items():
        if measured.get(name) is None or value is None:  # a record without send times
            continue
        ratio = value / measured[name]
        lines.append(f"| {name} | {measured[name]:,.1f} | {value:,.1f} | {ratio:.2f} |")
        if name in ("output tokens/s", "TTFT p50 (ms)"):  # the check's two figures
            within &= abs(ratio - 1) <= args.tolerance
    lines += ["", f"throughput and TTFT p50 within {args.tolerance:.0%}: "
              f"{'yes' if within else 'no'}"]
    return "\n".join(lines), within


def read_bench(path: str, base_model: str) -> dict:
    """A scripts/bench.py --json record of the independent workload -> its figures."""
    import json

    with open(path, encoding="utf-8") as f:
        record = json.load(f)
    if record.get("wall_s") is None or not record.get("models"):
        raise TableError(f"{path}: no wall_s or models (a bench.py --json record of the "
                         "independent workload is needed)")
    done = [r for r in record["requests"] if r["ok"]]
    ttfts = [r["ttft_ms"] for r in done if r["ttft_ms"] is not None]
    waves = dict.fromkeys(WAVE_FIGURES)
    if all("sent_s" in r for r in record["requests"]):  # bench.py's records from 2026-12-06
        sent = sorted((r for r in record["requests"] if r["ttft_ms"] is not None),
                      key=lambda r: r["sent_s"])
        waves = wave_ttfts([r["ttft_ms"] for r in sent], record["concurrency"])
    models = record["models"]
    ids = {m: 0 if m == base_model else 1 + [x for x in models if x != base_model].index(m)
           for m in models}
    return {"requests": len(done), "concurrency": record["concurrency"],
            "prompt_len": sorted(r["prompt_tokens"] for r in done)[len(done) // 2],
            "output_len": sorted(r["output_tokens"] for r in done)[len(done) // 2],
            "adapters": [ids[m] for m in models],
            "output tokens/s": sum(r["output_tokens"] for r in done) / record["wall_s"],
            "TTFT p50 (ms)": percentile(ttfts, 50), "TTFT p99 (ms)": percentile(ttfts, 99),
            **waves}


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    fleet = sub.add_parser("fleet", help="replicas needed for --rate at --ttft-p99")
    burst_ = sub.add_parser("burst", help="one replica, bench.py's closed loop (--check: "
                            "against a bench.py --json record)")
    for p in (fleet, burst_):
        p.add_argument("--table", required=True, help="a lorad-step-table/1 JSON file")
        p.add_argument("--max-num-seqs", type=int, default=64)
        p.add_argument("--max-num-batched-tokens", type=int, default=512)
        p.add_argument("--slots", type=int, default=8, help="--max-gpu-adapters")
        p.add_argument("--host-cache", type=int, default=64, help="--max-cpu-adapters")
        p.add_argument("--overhead-ms", type=float, default=0.0,
                       help="added to every TTFT: HTTP, tokenizer, coordinator")
        p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                       help="the replicas run a plain decode step's successor ahead, as lorad "
                       "--async-scheduling (default: as lorad, on for one rank on a GPU)")
        p.add_argument("--copy-ms", metavar="HOST,DISK",
                       help="an adapter's copy into a slot from the host cache and from disk, in "
                       "place of the table's (a what-if, or a table without them)")
    fleet.add_argument("--rate", type=float, default=1000.0, help="requests/s")
    fleet.add_argument("--ttft-p99", type=float, default=2.0, help="target, seconds")
    fleet.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals")
    fleet.add_argument("--warmup", type=float, help="seconds not counted (default: a third)")
    fleet.add_argument("--adapters", type=int, default=10_000)
    fleet.add_argument("--zipf", type=float, default=1.0)
    fleet.add_argument("--base-share", type=float, default=0.0)
    fleet.add_argument("--prompt-len", type=int, default=128, help="median")
    fleet.add_argument("--prompt-sigma", type=float, default=0.0, help="lognormal; 0: fixed")
    fleet.add_argument("--output-len", type=int, default=128, help="median")
    fleet.add_argument("--output-sigma", type=float, default=0.0)
    fleet.add_argument("--parallel", type=int, default=1, help="GPUs per replica")
    fleet.add_argument("--routers", default="round-robin,least-loaded,affinity")
    fleet.add_argument("--slack", type=int, default=4,
                       help="affinity: open requests a holder may have over the least loaded")
    fleet.add_argument("--max-replicas", type=int, default=100_000)
    fleet.add_argument("--precision", type=float, default=0.01,
                       help="the search stops within this share of the answer (0: exact)")
    fleet.add_argument("--seed", type=int, default=0)
    burst_.add_argument("--check", metavar="BENCH_JSON", help="compare with this measured burst")
    burst_.add_argument("--base-model", default="SmolLM2-135M-Instruct",
                        help="--check: the model id that is the base (others are adapters)")
    burst_.add_argument("--tolerance", type=float, default=0.15)
    burst_.add_argument("--requests", type=int, default=32)
    burst_.add_argument("--concurrency", type=int, default=8)
    burst_.add_argument("--prompt-len", type=int, default=128)
    burst_.add_argument("--max-tokens", type=int, default=128)
    burst_.add_argument("--burst-adapters", type=int, default=0,
                        help="requests rotate over this many adapters (0: all on the base)")
    burst_.add_argument("--with-base", action="store_true",
                        help="the base model joins the rotation, first")
    args = parser.parse_args(argv)
    if args.command == "fleet":
        args.routers = [r for r in args.routers.split(",") if r]
        bad = [r for r in args.routers if r not in Fleet.ROUTERS]
        if bad:
            parser.error(f"--routers: {bad[0]!r} is not one of {', '.join(Fleet.ROUTERS)}")
        if args.warmup is None:
            args.warmup = args.duration / 3
        if not (args.rate > 0 and args.duration > args.warmup >= 0 and 0 <= args.base_share <= 1):
            parser.error("--rate must be positive, --warmup below --duration, --base-share 0..1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        table = StepTable.from_file(args.table)
        if args.copy_ms:
            host, disk = (float(x) for x in args.copy_ms.split(","))
            table.load_ms = {"host": host, "disk": disk}
        if args.command == "fleet":
            print(fleet_report(args, table))
            return 0
        text, within = burst_report(args, table)
    except (TableError, ValueError) as exc:
        print(f"capacity: {exc}", file=sys.stderr)
        return 2
    print(text)
    return 0 if within else 1


if __name__ == "__main__":
    sys.exit(main())
