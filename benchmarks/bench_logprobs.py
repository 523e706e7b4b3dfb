#!/usr/bin/env python3
"""The leader's log-probability work per step (lorad/workers/logprobs.py: compute before the
mask, complete after the draw, with its copies to the host), on [batch, vocab] fp32 logits.

    python -m benchmarks.bench_logprobs [--device cuda] [--vocab 128256] [--batches 8,32,64]

For each batch: none, one or every row asking, with k = 0, 5 or 20 alternatives; the figure is
the median wall time over --steps steps (the device synchronized at the end of each), in ms.
A benchmark, not a test: prints a table and the conditions.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import conditions
from lorad.protocol.messages import SamplingParams
from lorad.workers import logprobs


def params(num_logprobs: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, top_p=1.0, top_k=0, seed=0, max_tokens=16,
                          stop_token_ids=[], ignore_eos=True, num_logprobs=num_logprobs)


def step_ms(logits: torch.Tensor, asking: int, k: int, steps: int) -> float:
    batch = logits.shape[0]
    rows = [params(k) if i < asking else params(-1) for i in range(batch)]
    ids = [f"r{i}" for i in range(batch)]
    sampled = logits.argmax(dim=-1).tolist()
    times = []
    for _ in range(steps + 3):
        started = time.perf_counter()
        pending = logprobs.compute(logits, rows)
        logprobs.complete(pending, ids, sampled)
        if logits.device.type == "cuda":
            torch.cuda.synchronize(logits.device)
        times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times[3:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--batches", default="8,32,64")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    device = torch.device(args.device)
    print(conditions(args.device))
    print(f"leader's logprobs work per step, ms (vocab {args.vocab}, {device})")
    print("| batch | none asking | one, k=5 | all, k=0 | all, k=5 | all, k=20 |")
    print("|---|---|---|---|---|---|")
    torch.manual_seed(0)
    for batch in (int(b) for b in args.batches.split(",")):
        logits = torch.randn(batch, args.vocab, device=device)
        cells = [step_ms(logits, 0, 0, args.steps), step_ms(logits, 1, 5, args.steps)]
        cells += [step_ms(logits, batch, k, args.steps) for k in (0, 5, 20)]
        print(f"| {batch} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
