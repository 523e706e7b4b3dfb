"""What every bench.py report shares: the conditions lines (date, machine, server, model ids),
percentiles and their table cells, the prompt cache's hit rate, and the run as JSON records.
Pure but for the clock and /proc/cpuinfo; knows nothing of HTTP.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

from bench_clock import Outcome


def percentile(values: list[float], pct: float) -> float | None:
    """Linear interpolation between closest ranks, as numpy's default."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * pct / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def p50_p99(values: list[float]) -> str:
    if not values:
        return "n/a"
    return f"{percentile(values, 50):.1f} / {percentile(values, 99):.1f}"


def ttfts_ms(outcomes: list[Outcome]) -> list[float]:
    return [o.ttft_s * 1000 for o in outcomes if o.ok and o.ttft_s is not None]


def footer(args: argparse.Namespace, done: list[Outcome], failed: list[Outcome]) -> list[str]:
    """A report's closing lines: requests short of max_tokens, the first failure."""
    lines = []
    if any(o.num_output_tokens != args.max_tokens for o in done):
        lines.append("note: some requests generated fewer than max_tokens tokens "
                     "(the server may not honour ignore_eos)")
    if failed:
        lines.append(f"first failure: {failed[0].error}")
    return lines


def hit_rate(outcomes: list[Outcome]) -> float | None:
    """Cached over prompt tokens, summed over the completed requests; None without any."""
    num_prompt = sum(o.num_prompt_tokens for o in outcomes if o.ok)
    num_cached = sum(o.num_cached_tokens for o in outcomes if o.ok)
    return num_cached / num_prompt if num_prompt else None


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def conditions(args: argparse.Namespace) -> list[str]:
    """The lines every report opens with; each workload adds its own after them."""
    return [
        f"date:      {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
        f"machine:   {os.cpu_count()} cores, {cpu_name()}, {platform.system()} "
        f"{platform.machine()}",
        f"server:    {args.url}" + (f", {args.note}" if args.note else ""),
        f"models:    {args.picker.describe()}"
        + (f" (from {args.models_from_file})" if args.models_from_file else ""),
    ]


def record(outcome: Outcome, start: float, **labels: int) -> dict:
    """One measured request for --json; labels say which (conversation, turn, request); start:
    the perf_counter() its sent_s and done_s count from (the first measured request's send)."""
    return {**labels, "model": outcome.model, "ok": outcome.ok, "error": outcome.error,
            "sent_s": outcome.sent_at - start, "done_s": outcome.done_at - start,
            "ttft_ms": None if outcome.ttft_s is None else outcome.ttft_s * 1000,
            "prompt_tokens": outcome.num_prompt_tokens,
            "cached_tokens": outcome.num_cached_tokens if outcome.cached_reported else None,
            "output_tokens": outcome.num_output_tokens}
