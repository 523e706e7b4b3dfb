#!/usr/bin/env python3
"""Where a decode step's GPU time goes: the kernels of one eager step of lorad's 8B-shaped model
(random weights, bf16), by total time, at batch 1 on the base model, batch 32 with one adapter
on every row and batch 64 with a distinct adapter per row. Prints a short table per case: kernel
name, calls, total and mean microseconds.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

REPO = Path(__file__).resolve().parent.parent

from benchmarks.bench_engine import (BLOCK_SIZE, CUDA, build_lorad, decode_steps,  # noqa: E402
                                     load_adapters, write_adapter)
from lorad.config import ModelConfig  # noqa: E402
from lorad.workers.batch import ForwardBatch  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(REPO / "scripts/configs/llama3-8b"))
    p.add_argument("--top", type=int, default=14)
    args = p.parse_args()
    config = ModelConfig.from_dir(args.config)
    blocks_per_seq = -(-600 // BLOCK_SIZE)
    model = build_lorad(config, 64, blocks_per_seq)
    with tempfile.TemporaryDirectory() as tmp:
        load_adapters(model, write_adapter(Path(tmp), config, 16), 64)
    cases = (("base b1", [0]), ("one adapter b32", [1] * 32),
             ("64 distinct adapters b64", list(range(1, 65))))
    for name, slots in cases:
        steps = list(decode_steps(slots, 512, blocks_per_seq, 4))
        with torch.inference_mode():
            for chunks in steps[:3]:
                model.forward(ForwardBatch.build(chunks, BLOCK_SIZE, CUDA))
            torch.cuda.synchronize()
            batch_obj = ForwardBatch.build(steps[3], BLOCK_SIZE, CUDA)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                model.forward(batch_obj)
                torch.cuda.synchronize()
        kernels = [e for e in prof.key_averages() if e.device_time_total > 0]
        total = sum(e.device_time_total for e in kernels)
        calls = sum(e.count for e in kernels)
        print(f"\n{name}: {calls} kernels, {total / 1e3:.2f} ms of kernel time")
        print("| kernel | calls | total us | mean us |\n|---|---|---|---|")
        for e in sorted(kernels, key=lambda e: -e.device_time_total)[:args.top]:
            print(f"| {e.key[:70]} | {e.count} | {e.device_time_total:.0f} | "
                  f"{e.device_time_total / e.count:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
