#!/usr/bin/env python3
"""Where a prefill step's GPU time goes: eager prompt steps of lorad's 8B-shaped model (random
weights, bf16, 64 adapters of rank 16 on all seven projections loaded), each timed (CUDA events,
median of 3) and profiled once, its kernels grouped (base matmuls, LoRA, attention, the rest)
and the top ones listed.

Cases: `--cases base:1x512,one:1x512,base:1x2048,one:1x2048,many:8x256` = SLOTS:SEQSxTOKENS,
SLOTS one of base (slot 0), one (slot 1 on every prompt), many (prompt i on slot 1 + i).
Each case also reports the host's time to queue the step and its busiest host ops.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.bench_engine import (BLOCK_SIZE, CUDA, PROMPT_ID_RANGE, build_lorad,
                                     load_adapters, tuning_variants, write_adapter)
from benchmarks.common import REPO, conditions, time_cuda
from lorad.config import ModelConfig
from lorad.workers.batch import MIN_ROWS, ForwardBatch

GROUPS = (("lora", ("lora", "_shrink", "_expand")), ("attention", ("attention", "prefill")),
          ("matmul", ("gemm", "xmma", "cutlass", "sm90", "gemv", "matmul")))


def group_of(name: str) -> str:
    lowered = name.lower()
    for group, keys in GROUPS:
        if any(key in lowered for key in keys):
            return group
    return "other"


def prefill_chunks(case: str, blocks_per_seq: int) -> list[tuple]:
    slots_name, shape = case.split(":")
    num_seqs, length = (int(x) for x in shape.split("x"))
    slots = {"base": [0] * num_seqs, "one": [1] * num_seqs,
             "many": [1 + i for i in range(num_seqs)]}[slots_name]
    gen = torch.Generator().manual_seed(3)
    return [(torch.randint(*PROMPT_ID_RANGE, (length,), generator=gen).tolist(), 0,
             list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq)), True, slot)
            for i, slot in enumerate(slots)]


def host_seconds(fn, repeats: int) -> float:
    """Median seconds until fn() returns, the device's work synced before each run but not in
    it: the host's cost of queueing an eager step (as long as the step when the host is the
    bottleneck)."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    torch.cuda.synchronize()
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(REPO / "scripts/configs/llama3-8b"))
    p.add_argument("--cases", default="base:1x512,one:1x512,base:1x2048,one:1x2048,"
                                      "base:8x256,many:8x256")
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--trace-out", type=Path, help="a folder: each case's Chrome trace (host "
                   "and device, gzipped) written there")
    p.add_argument("--mixed-step-graphs", action="store_true",
                   help="also time each case through the piecewise graphs of steps with prompt "
                        "chunks (workers/mixed_graph.py), as lorad --mixed-step-graphs runs it")
    p.add_argument("--variant", default="",
                   help="';'-separated variants of lorad's Tuning (bench_engine --variant's "
                        "syntax, e.g. 'expand.in_place_rows=0;main'): each case's step timed "
                        "again on each, eagerly and (with --mixed-step-graphs) in pieces "
                        "captured again, in a table last")
    p.add_argument("--deterministic", action="store_true",
                   help="matmul plans first, as bench_engine --deterministic (lorad's default)")
    args = p.parse_args()
    print(conditions(CUDA))
    config = ModelConfig.from_dir(args.config)
    cases = [c for c in args.cases.split(",") if c]
    most_tokens = max(int(c.split("x")[1]) for c in cases)
    most_seqs = max(int(c.split(":")[1].split("x")[0]) for c in cases)
    blocks_per_seq = -(-most_tokens // BLOCK_SIZE)
    model = build_lorad(config, most_seqs, blocks_per_seq)
    if args.deterministic:
        model.plan_matmuls(max(most_seqs * most_tokens, MIN_ROWS))
    print(f"matmul plans: {'measured (--deterministic)' if args.deterministic else 'none'}")
    with tempfile.TemporaryDirectory() as tmp:
        load_adapters(model, write_adapter(Path(tmp), config, 16), 64)
    mixed = None
    if args.mixed_step_graphs:
        from lorad.workers.mixed_graph import MixedGraphs
        mixed = MixedGraphs(model, most_seqs * most_tokens, BLOCK_SIZE, 64)
        mixed.capture()
    summary = []
    for case in cases:
        chunks = prefill_chunks(case, blocks_per_seq)
        batch = ForwardBatch.build(chunks, BLOCK_SIZE, CUDA)
        pieces = None
        if mixed is not None:
            pieces = (time_cuda(lambda: mixed.run(chunks), 5, warmup=2),
                      host_seconds(lambda: mixed.run(chunks), 5))
        with torch.inference_mode():
            seconds = time_cuda(lambda: model.forward(batch), 3, warmup=1)
            host = host_seconds(lambda: model.forward(batch), 3)
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                model.forward(batch)
                torch.cuda.synchronize()
        if args.trace_out:
            args.trace_out.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(args.trace_out / f"{case.replace(':', '-')}.json.gz"))
        events = prof.key_averages()
        # Kernels only: an aten op's device time is its kernels' again.
        kernels = [e for e in events if e.device_time_total > 0
                   and not e.key.startswith(("aten::", "cuda", "cuLaunch"))]
        by_group: dict[str, float] = {}
        for e in kernels:
            by_group[group_of(e.key)] = by_group.get(group_of(e.key), 0.0) + e.device_time_total
        total = sum(by_group.values())
        summary.append((case, seconds * 1e3, host * 1e3, total / 1e3, by_group, pieces))
        print(f"\n{case}: step {seconds * 1e3:.2f} ms, host {host * 1e3:.2f} ms (forward's "
              f"return, no sync), kernels {total / 1e3:.2f} ms")
        print("| host op | calls | self CPU us | mean us |\n|---|---|---|---|")
        for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:args.top]:
            print(f"| {e.key[:80]} | {e.count} | {e.self_cpu_time_total:.0f} | "
                  f"{e.self_cpu_time_total / e.count:.1f} |")
        print("| kernel | calls | total us | mean us |\n|---|---|---|---|")
        for e in sorted(kernels, key=lambda e: -e.device_time_total)[:args.top]:
            print(f"| {e.key[:80]} | {e.count} | {e.device_time_total:.0f} | "
                  f"{e.device_time_total / e.count:.1f} |")
    print("\n| case | step ms | host ms | kernels ms | matmul | lora | attention | other | "
          "pieces: step ms | pieces: host ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for case, step_ms, host_ms, kernel_ms, by_group, pieces in summary:
        cells = " | ".join(f"{by_group.get(g, 0.0) / 1e3:.2f}"
                           for g in ("matmul", "lora", "attention", "other"))
        graphs = " | ".join(f"{x * 1e3:.2f}" for x in pieces) if pieces else " | "
        print(f"| {case} | {step_ms:.2f} | {host_ms:.2f} | {kernel_ms:.2f} | {cells} | "
              f"{graphs} |")
    variants = tuning_variants(args.variant)
    if variants:
        print("\n| case | variant | step ms | pieces: step ms |\n|---|---|---|---|")
    for variant, tuning in variants:
        model.tune(tuning)
        if mixed is not None:
            # The old graphs freed now: a collection during the next capture would destroy
            # them there, which invalidates the capture.
            del mixed
            gc.collect()
            torch.cuda.empty_cache()
            from lorad.workers.mixed_graph import MixedGraphs
            mixed = MixedGraphs(model, most_seqs * most_tokens, BLOCK_SIZE, 64)
            mixed.capture()
        for case in cases:
            chunks = prefill_chunks(case, blocks_per_seq)
            batch = ForwardBatch.build(chunks, BLOCK_SIZE, CUDA)
            with torch.inference_mode():
                seconds = time_cuda(lambda: model.forward(batch), 3, warmup=1)
            pieces = (f"{time_cuda(lambda: mixed.run(chunks), 5, warmup=2) * 1e3:.2f}"
                      if mixed is not None else "")
            print(f"| {case} | {variant} | {seconds * 1e3:.2f} | {pieces} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
