#!/usr/bin/env python3
"""The leader's sampler alone: milliseconds per step to pick one token per row from [batch, vocab]
fp32 logits, greedy and with the warpers, on the CPU (torch's ops) or a GPU (the Triton draw).

    python -m benchmarks.bench_sampler [--device cuda] [--batches 1,8,32,64] [--vocab 128256]
        [--profile "top-k 50"]

Every row of a step uses the same parameters; each figure is the median of --repeats steps
(after one untimed), the ids back on the host as the worker needs them. Prints a table and the
conditions; a benchmark, not a test. --profile CASE then prints, for each batch, torch's
profile of one more step of that case: host and device time per op, the host's first.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from lorad.protocol.messages import SamplingParams  # noqa: E402
from lorad.workers.sampler import Sampler  # noqa: E402
from benchmarks.common import conditions  # noqa: E402

CASES = {  # name -> (temperature, top_k, top_p)
    "greedy": (0.0, 0, 1.0),
    "temperature 1": (1.0, 0, 1.0),
    "top-k 50": (1.0, 50, 1.0),
    "top-p 0.9, t 0.8": (0.8, 0, 0.9),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--vocab", type=int, default=128256, help="Llama 3's by default")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (lorad: 1)")
    parser.add_argument("--profile", choices=sorted(CASES), help="profile one step of this case")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    batches = [int(b) for b in args.batches.split(",") if b]
    print(f"# sampler, {conditions(device)}; vocab "
          f"{args.vocab}, {args.threads} CPU thread(s); ms per step, median of {args.repeats}")
    print(f"{'batch':>5} " + " ".join(f"{case:>17}" for case in CASES))
    for batch in batches:
        sampler, logits, ids = step_inputs(device, batch, args.vocab)
        figures = []
        for case in CASES.values():
            params = case_params(case, batch)
            sampler.sample(logits, ids, params)
            times = []
            for _ in range(args.repeats):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                start = time.perf_counter()
                sampler.sample(logits, ids, params)  # ends with .tolist(): a sync
                times.append(time.perf_counter() - start)
            figures.append(statistics.median(times) * 1e3)
        print(f"{batch:>5} " + " ".join(f"{ms:>17.2f}" for ms in figures), flush=True)
    if args.profile:
        for batch in batches:
            profile_step(device, batch, args.vocab, CASES[args.profile], args.profile)
    return 0


def step_inputs(device: torch.device, batch: int,
                vocab: int) -> tuple[Sampler, torch.Tensor, list[str]]:
    """-> a sampler holding `batch` requests, their [batch, vocab] logits and their ids."""
    gen = torch.Generator().manual_seed(batch)
    logits = (torch.randn(batch, vocab, generator=gen) * 3).to(device)
    ids = [f"r{i}" for i in range(batch)]
    sampler = Sampler()
    for i, rid in enumerate(ids):
        sampler.add(rid, i)
    return sampler, logits, ids


def case_params(case: tuple, batch: int) -> list[SamplingParams]:
    temperature, top_k, top_p = case
    return [SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=0,
                           max_tokens=1, stop_token_ids=[], ignore_eos=False)] * batch


def profile_step(device: torch.device, batch: int, vocab: int, case: tuple, name: str) -> None:
    from torch.profiler import ProfilerActivity, profile
    sampler, logits, ids = step_inputs(device, batch, vocab)
    params = case_params(case, batch)
    sampler.sample(logits, ids, params)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                           if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        sampler.sample(logits, ids, params)
    print(f"\n# profile: {name}, batch {batch}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


if __name__ == "__main__":
    sys.exit(main())
