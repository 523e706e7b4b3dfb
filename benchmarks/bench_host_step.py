#!/usr/bin/env python3
"""The worker's host work per decode step, without the model: what every step costs the leader's
CPU besides the forward and the sampling (on a GPU, time in which the GPU waits).

    python -m benchmarks.bench_host_step [--batches 1,8,32,64,128,256] [--steps 50]

`batch` sequences, each decoding after a 600-token prompt (blocks of 16; the prompts are
prefilled before timing, so every timed step is a decode of the whole batch), as the worker loop
runs them (with prefix caching, as lorad's default; --no-prefix-cache without): the live-set
digest (only computed at --parallel 2 and more), plan(), the plan's
chunks, apply() with one sampled id per sequence, and the StepResult frame the leader publishes;
then the coordinator's decode of that frame. "graph fill" is the decode graphs' host-side input
fill (DecodeInputs.fill with LoRA tiles, on the CPU here: numpy writes, the copies are CPU
copies), outside the worker total since eager steps skip it. Medians over --steps steps,
microseconds. Prints a table and the conditions; a benchmark, not a test. With
--async-scheduling, the loop's order when a lone rank runs decode steps ahead (loop.py): "plan"
is Planner.continue_decodes before the step before is applied, and the fill gathers the tokens
from that step's sampled ids; on a GPU all of it runs beside the device's step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from lorad.protocol import StepResult, decode, encode  # noqa: E402
from lorad.protocol.messages import SamplingParams  # noqa: E402
from lorad.workers.agreement import live_digest  # noqa: E402
from lorad.workers.block_manager import BlockManager  # noqa: E402
from lorad.workers.cuda_graph import DecodeInputs, bucket_sizes  # noqa: E402
from lorad.workers.planner import Planner, PlannerLimits  # noqa: E402
from lorad.workers.sequence import Sequence  # noqa: E402
from benchmarks.common import conditions  # noqa: E402

PARTS = ("digest", "plan", "chunks", "apply", "encode", "worker total", "coordinator decode",
         "graph fill")
MAX_MODEL_LEN = 8192
BLOCK_SIZE = 16
LORA_BLOCK_M = 16  # the decode tiles' rows (tuning.py's default on the H200)


def measure(batch: int, steps: int, prefix_cache: bool = True,
            run_ahead: bool = False) -> dict[str, float]:
    planner = Planner(PlannerLimits(max(batch, 1), 8192, MAX_MODEL_LEN),
                      BlockManager(1 << 16, BLOCK_SIZE), prefix_cache=prefix_cache)
    params = SamplingParams(temperature=0.0, top_p=1.0, top_k=0, seed=0, max_tokens=1 << 20,
                            stop_token_ids=[2], ignore_eos=False)
    for i in range(batch):
        planner.admit(Sequence(f"cmpl-{i:024x}", list(range(100, 700)), params, 1 + i % 4,
                               "0" * 64, arrival=i))
    while not all(seq.is_decoding for seq in planner.running) or planner.waiting:
        plan = planner.plan()  # the prompts, 8,192 tokens a step
        planner.apply(plan, [5] * len(plan.sampled_request_ids))
    bucket = bucket_sizes(max(batch, 1))[-1]
    sampled = torch.full((batch,), 7, dtype=torch.int64)  # a step's sampled ids, for the fill
    inputs = DecodeInputs(bucket, -(-MAX_MODEL_LEN // BLOCK_SIZE), BLOCK_SIZE,
                          torch.device("cpu"), LORA_BLOCK_M)
    times: dict[str, list[float]] = {part: [] for part in PARTS}
    prev = planner.plan() if run_ahead else None  # in flight: planned, not applied
    for _ in range(steps):
        t0 = time.perf_counter()
        live_digest(planner.live())
        t1 = time.perf_counter()
        plan = planner.plan() if prev is None else planner.continue_decodes(prev)
        t2 = time.perf_counter()
        chunks = plan.batch_chunks()
        t3 = time.perf_counter()
        applied = plan if prev is None else prev
        events = planner.apply(applied, [7] * len(applied.sampled_request_ids))
        prev = None if prev is None else plan
        t4 = time.perf_counter()
        frame = encode(StepResult(applied.step, events, len(planner.running), 0, 1000))
        t5 = time.perf_counter()
        decode(frame, (StepResult,))
        t6 = time.perf_counter()
        source = None if plan.token_rows is None else (sampled, plan.token_rows)
        inputs.fill(chunks, bucket, source)
        t7 = time.perf_counter()
        for part, seconds in zip(PARTS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t5 - t0,
                                         t6 - t5, t7 - t6)):
            times[part].append(seconds * 1e6)
    return {part: statistics.median(values) for part, values in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,8,32,64,128,256")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                        help="the planner without prefix caching (lorad's --no-prefix-cache)")
    parser.add_argument("--async-scheduling", dest="run_ahead", action="store_true",
                        help="the loop's order when decode steps run ahead (plan: "
                             "continue_decodes)")
    args = parser.parse_args()
    # As a worker's default (--threads 1): a multi-threaded copy of the inputs on a shared host
    # measured thread wake-ups (0.1 to 6 ms a fill), not the fill.
    torch.set_num_threads(1)
    print(f"# worker host work per decode step, {conditions('cpu')}; "
          f"us, median of {args.steps} steps; prefix cache {'on' if args.prefix_cache else 'off'}"
          f"{'; async scheduling (plan: continue_decodes)' if args.run_ahead else ''}")
    print(f"{'batch':>5} " + " ".join(f"{part:>18}" for part in PARTS))
    for batch in (int(b) for b in args.batches.split(",") if b):
        figures = measure(batch, args.steps, args.prefix_cache, args.run_ahead)
        print(f"{batch:>5} " + " ".join(f"{figures[part]:>18.0f}" for part in PARTS), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
