#!/usr/bin/env python3
"""How long one adapter's copy into a device slot takes on a thread beside the step loop: alone,
beside a thread spinning in Python (a worker loop that polls with no timeout while its requests
wait for their adapters), and beside one that polls with a 1 ms timeout (what the loop does
now). The copy is the adapter jobs' own, into real slot tables of the model's shape (one slot
each, the rank given): from the file's pageable shards through safetensors and fill_slot, as
before the host cache (`--source file`); through the host cache from disk (`disk`: one read, a
put into a host slot, the copy; what a cache miss costs); or from a cached entry (`cache`: the
copy alone; page-locked on CUDA). `--per-table` copies the file's shards table by table (six
torch calls a table). Prints one line per case.

    python -m benchmarks.probe_adapter_copy --model scripts/configs/llama3-8b --rank 16
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

import torch

from benchmarks.bench_engine import write_adapter
from lorad.config import ModelConfig
from lorad.config.adapters import layer_modules, projection_features, read_adapter
from lorad.workers.adapter_host_cache import HostCache
from lorad.workers.loader import fill_slot, read_shards
from lorad.workers.lora import LoraSlots


def make_tables(config: ModelConfig, rank: int, device: torch.device,
                dtype: torch.dtype) -> dict:
    """{(layer, module): LoraSlots} of two slots, unsplit (one rank)."""
    tables = {}
    for layer in range(config.num_hidden_layers):
        for module in layer_modules(config, layer):
            num_in, num_out = projection_features(config, module)
            tables[(layer, module)] = LoraSlots(2, rank, num_in, num_out, (0, num_in),
                                                (0, num_out), device, dtype)
    return tables


def copy_once(tables: dict, spec, stream, per_table: bool, source: str,
              cache: HostCache) -> float:
    began = time.perf_counter()
    if source == "file" or per_table:
        shards = read_shards(tables, spec)
    elif source == "disk":
        cache.drop(spec.adapter_id)
        host_slot = cache.put(spec.adapter_id, cache.read(spec))
    else:
        host_slot = cache.get(spec.adapter_id)
        if host_slot is None:
            host_slot = cache.put(spec.adapter_id, cache.read(spec))
        began = time.perf_counter()  # a hit: the copy alone
    with torch.cuda.stream(stream) if stream is not None else _nothing():
        if per_table:
            for m in spec.modules:
                tables[(m.layer, m.module)].fill(1, m, *shards[(m.layer, m.module)])
        elif source == "file":
            fill_slot(tables, 1, spec, shards)
        else:
            cache.fill(1, spec, host_slot)
    if stream is not None:
        stream.synchronize()
    return (time.perf_counter() - began) * 1e3


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="scripts/configs/llama3-8b")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--per-table", action="store_true", help="copy table by table (as before)")
    p.add_argument("--source", choices=("file", "disk", "cache"), default="cache",
                   help="where the shards come from (see above)")
    p.add_argument("--table-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="the slot tables' dtype (fp32: what run-time adapters get)")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = ModelConfig.from_dir(args.model)
    folder = write_adapter(Path(tempfile.mkdtemp(prefix="probe-copy-")) / "a", config, args.rank)
    spec = read_adapter(folder, "a", 1.0, 1, config)
    tables = make_tables(config, args.rank, device,
                         torch.float32 if args.table_dtype == "fp32" else torch.bfloat16)
    cache = HostCache(tables, 1, pin=device.type == "cuda")
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    # The page cache, the allocator, the host slot
    copy_once(tables, spec, stream, args.per_table, args.source, cache)
    stop = threading.Event()

    def spin():
        n = 0
        while not stop.is_set():
            n += 1

    def poll():
        while not stop.wait(0.001):
            pass

    size = (folder / "adapter_model.safetensors").stat().st_size / 2**20
    for case, target, repeats in (("alone", None, 3), ("beside a Python spin", spin, 1),
                                  ("beside a 1 ms poll", poll, 3)):
        stop.clear()
        thread = threading.Thread(target=target) if target else None
        if thread:
            thread.start()
        times = [copy_once(tables, spec, stream, args.per_table, args.source, cache)
                 for _ in range(repeats)]
        stop.set()
        if thread:
            thread.join()
        print(f"{case}: {min(times):.1f} / {max(times):.1f} ms (min / max of {repeats}); "
              f"{len(spec.modules)} factor pairs, {size:.0f} MiB, "
              f"{'table by table' if args.per_table else 'all tables at once'}, source "
              f"{args.source}, "
              f"{args.table_dtype} tables", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
