"""One rank of tests/unit/test_shm_reduce.py: python -m tests.unit.shm_reduce_rank RANK WORLD
STORE_FILE CASE; prints one JSON line of what it saw."""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from lorad.workers import shm_reduce
from lorad.workers.parallel import TensorParallel, init_tensor_parallel

# (shape, dtype) of the calls, in order: decode sizes, an odd one, one past the slot (gloo's).
CALLS = [((8, 576), torch.float32), ((3, 100), torch.bfloat16), ((1, 7), torch.float16),
         ((64, 1024), torch.float32), ((65, 1024), torch.float32), ((8, 576), torch.float32)]


def part(rank: int, call: int, shape, dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * call + rank)
    return (torch.randn(shape, generator=gen) * 3).to(dtype)


def main() -> int:
    rank, world, store, case = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    timeout_s = 0.5 if case == "late" else 60
    if case == "late":
        shm_reduce.PID_CHECK_S = 0.05
    tp = init_tensor_parallel(rank, world, f"file://{store}", "gloo", torch.device("cpu"),
                              timeout_s=timeout_s)
    report = {"shm": tp.shm is not None,
              "segment_left": os.path.exists(shm_reduce.segment_path(f"file://{store}"))}
    if case == "sums":
        plain = TensorParallel(rank, world, tp.device, tp.group, tp.cpu_group)  # gloo's path
        same, equal_gloo, took_shm = [], [], []
        for i in range(40):  # many calls: both buffers in turn, sizes changing
            shape, dtype = CALLS[i % len(CALLS)]
            x = part(rank, i, shape, dtype)
            expected = part(0, i, shape, dtype)
            for r in range(1, world):
                expected += part(r, i, shape, dtype)
            took_shm.append(tp.shm.applies(x))
            got = tp.all_reduce(x.clone())
            same.append(torch.equal(got, expected) and got.dtype == dtype)
            equal_gloo.append(torch.equal(plain.all_reduce(x.clone()), got))
        report.update(same=all(same), equal_gloo=all(equal_gloo), took_shm=took_shm)
    elif case in ("exit", "late"):
        if rank == 1:
            if case == "exit":
                os._exit(0)
            time.sleep(3)
            return 0
        started = time.monotonic()
        try:
            tp.all_reduce(torch.ones(4))
            report["error"] = None
        except RuntimeError as exc:
            report["error"] = str(exc)
        report["seconds"] = time.monotonic() - started
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
