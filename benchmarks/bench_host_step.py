#!/usr/bin/env python3
"""The worker's host work per decode step, without the model: what every step costs the leader's
CPU besides the forward and the sampling (on a GPU, time in which the GPU waits).

    python -m benchmarks.bench_host_step [--batches 1,8,32,64,128] [--steps 50]

`batch` sequences, each decoding after a 600-token prompt (blocks of 16), as the worker loop
runs them: the live-set digest (only computed at --parallel 2 and more), plan(), the plan's
chunks, apply() with one sampled id per sequence, and the StepResult frame the leader publishes;
then the coordinator's decode of that frame. Medians over --steps steps, microseconds. Prints a
table and the conditions; a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from lorad.protocol import StepResult, decode, encode  # noqa: E402
from lorad.protocol.messages import SamplingParams  # noqa: E402
from lorad.workers.agreement import live_digest  # noqa: E402
from lorad.workers.block_manager import BlockManager  # noqa: E402
from lorad.workers.planner import Planner, PlannerLimits  # noqa: E402
from lorad.workers.sequence import Sequence  # noqa: E402
from benchmarks.common import conditions  # noqa: E402

PARTS = ("digest", "plan", "chunks", "apply", "encode", "worker total", "coordinator decode")


def measure(batch: int, steps: int) -> dict[str, float]:
    planner = Planner(PlannerLimits(max(batch, 1), 8192, 8192), BlockManager(1 << 16, 16))
    params = SamplingParams(temperature=0.0, top_p=1.0, top_k=0, seed=0, max_tokens=1 << 20,
                            stop_token_ids=[2], ignore_eos=False)
    for i in range(batch):
        planner.admit(Sequence(f"cmpl-{i:024x}", list(range(100, 700)), params, 1 + i % 4,
                               "0" * 64, arrival=i))
    plan = planner.plan()  # the prompts
    planner.apply(plan, [5] * len(plan.sampled_request_ids))
    times: dict[str, list[float]] = {part: [] for part in PARTS}
    for _ in range(steps):
        t0 = time.perf_counter()
        live_digest(planner.live())
        t1 = time.perf_counter()
        plan = planner.plan()
        t2 = time.perf_counter()
        plan.batch_chunks()
        t3 = time.perf_counter()
        events = planner.apply(plan, [7] * len(plan.sampled_request_ids))
        t4 = time.perf_counter()
        frame = encode(StepResult(plan.step, events, len(planner.running), 0, 1000))
        t5 = time.perf_counter()
        decode(frame, (StepResult,))
        t6 = time.perf_counter()
        for part, seconds in zip(PARTS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t5 - t0,
                                         t6 - t5)):
            times[part].append(seconds * 1e6)
    return {part: statistics.median(values) for part, values in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,8,32,64,128")
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    print(f"# worker host work per decode step, {conditions('cpu')}; "
          f"us, median of {args.steps} steps")
    print(f"{'batch':>5} " + " ".join(f"{part:>18}" for part in PARTS))
    for batch in (int(b) for b in args.batches.split(",") if b):
        figures = measure(batch, args.steps)
        print(f"{batch:>5} " + " ".join(f"{figures[part]:>18.0f}" for part in PARTS), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
