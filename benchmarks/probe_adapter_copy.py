#!/usr/bin/env python3
"""How long one adapter's copy into a device slot takes on a thread beside a busy step loop: the
copy alone, beside a thread spinning in Python (the worker loop polling with no timeout while
requests wait for their adapters), and beside one that polls with a 1 ms timeout. Each factor
is copied as the slot tables do (a slice from the safetensors file, copy_ on a side stream, the
rank and scale written into device tables). Prints one line per case.

    python -m benchmarks.probe_adapter_copy --model scripts/configs/llama3-8b --rank 16
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

import torch
from safetensors import safe_open


def copy_adapter(weights: Path, tables: dict, stream, device) -> float:
    began = time.perf_counter()
    with safe_open(str(weights), framework="pt", device="cpu") as f:
        ctx = torch.cuda.stream(stream) if stream is not None else None
        if ctx is not None:
            ctx.__enter__()
        for name in f.keys():
            t = f.get_slice(name)[:]
            table, ranks, scales = tables[t.shape]
            table[0, :t.shape[0], :t.shape[1]].copy_(t)
            ranks[0] = t.shape[0]
            scales[0] = 2.0
        if ctx is not None:
            ctx.__exit__(None, None, None)
            stream.synchronize()
    return (time.perf_counter() - began) * 1e3


def main() -> int:
    from benchmarks.bench_engine import write_adapter
    from lorad.config import ModelConfig

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="scripts/configs/llama3-8b")
    p.add_argument("--rank", type=int, default=16)
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    folder = Path(tempfile.mkdtemp(prefix="probe-copy-")) / "a"
    write_adapter(folder, ModelConfig.from_dir(args.model), args.rank)
    weights = folder / "adapter_model.safetensors"
    tables = {}
    with safe_open(str(weights), framework="pt", device="cpu") as f:
        for name in f.keys():
            shape = tuple(f.get_slice(name).get_shape())
            if shape not in tables:
                tables[shape] = (torch.empty((2, *shape), dtype=torch.bfloat16, device=device),
                                 torch.zeros(2, dtype=torch.int32, device=device),
                                 torch.zeros(2, dtype=torch.float32, device=device))
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    copy_adapter(weights, tables, stream, device)  # page cache, allocator
    stop = threading.Event()

    def spin():
        n = 0
        while not stop.is_set():
            n += 1

    def poll():
        while not stop.wait(0.001):
            pass

    for case, target in (("alone", None), ("beside a Python spin", spin),
                         ("beside a 1 ms poll", poll)):
        stop.clear()
        thread = threading.Thread(target=target) if target else None
        if thread:
            thread.start()
        times = [copy_adapter(weights, tables, stream, device) for _ in range(3)]
        stop.set()
        if thread:
            thread.join()
        print(f"{case}: {min(times):.1f} / {max(times):.1f} ms (min / max of 3), "
              f"{len(tables)} shapes, {weights.stat().st_size / 2**20:.0f} MiB", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
