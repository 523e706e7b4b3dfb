#!/usr/bin/env python3
"""The step table scripts/capacity.py simulates from, on the CPU: lorad's model in-process timed
per step (inputs, forward, argmax) by decode rows, prompt tokens and distinct adapters, and an
adapter's copy into a slot; writes the JSON (--out) and prints a table. No HTTP, no planner, no
coordinator: what they add per step is not in it.

    python -m benchmarks.step_table --out cpu.json           (the demo model and adapters)
    python -m benchmarks.step_table --runtime --out cpu.json (slot tables as with --adapter-dir)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import DEMO_MODEL, REPO, conditions
from lorad.config import ModelConfig
from lorad.config.adapter_capacity import LoraCapacity
from lorad.config.adapters import AdapterArg, load_adapter
from lorad.workers.batch import MIN_ROWS, ForwardBatch
from lorad.workers.loader import fill_slot, read_shards
from lorad.workers.models import model_class
from lorad.workers.parallel import TensorParallel
from lorad.workers.tuning import Tuning

CPU = torch.device("cpu")
BLOCK_SIZE = 16
PROMPT_ID_RANGE = (100, 1000)
DEMO_ADAPTERS = [str(REPO / "demo/adapters/uppercase"), str(REPO / "demo/adapters/pirate")]


def parse_args() -> argparse.Namespace:
    def ints(text: str) -> list[int]:
        return [int(x) for x in text.split(",") if x]

    def pairs(text: str) -> list[tuple[int, int]]:
        return [tuple(int(v) for v in x.split("x")) for x in text.split(",") if x]

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(DEMO_MODEL), help="model folder (default: %(default)s)")
    p.add_argument("--adapter", action="append", metavar="DIR",
                   help="adapter folders, cycled over the slots (default: the demo adapters)")
    p.add_argument("--slots", type=int, default=4, help="device slots (the largest level)")
    p.add_argument("--runtime", action="store_true",
                   help="slot tables on every projection at --max-lora-rank, as with "
                        "--adapter-dir or --admin-key-file")
    p.add_argument("--max-lora-rank", type=int, default=16)
    p.add_argument("--threads", type=int, default=1, help="torch threads (lorad --threads)")
    p.add_argument("--batches", type=ints, default=[1, 2, 4, 8, 16, 32], help="decode rows")
    p.add_argument("--prefill", type=ints, default=[32, 128, 256, 512], help="prompt tokens")
    p.add_argument("--mixed", type=pairs, default=[(4, 128), (8, 256), (2, 512)],
                   help="ROWSxTOKENS steps of decodes and prompt tokens together")
    p.add_argument("--levels", type=ints, default=[0, 1, 2, 4],
                   help="distinct adapters in a step (rows cycle over slots 1..A)")
    p.add_argument("--context", type=int, default=192, help="KV tokens behind each decode row")
    p.add_argument("--prefill-chunk", type=int, default=128,
                   help="prompt tokens per sequence in a step (the workload's prompt length)")
    p.add_argument("--repeats", type=int, default=3, help="timed steps per point (median)")
    p.add_argument("--out", help="write the table's JSON here")
    return p.parse_args()


def build(args):
    """-> (model, slot tables, specs by slot) with the adapters copied into slots 1..--slots."""
    config = ModelConfig.from_dir(args.model)
    model = model_class(config)(config, TensorParallel(0, 1, CPU), torch.float32, CPU, Tuning())
    model.load_weights(args.model)
    folders = args.adapter or DEMO_ADAPTERS
    loaded = [load_adapter(AdapterArg(f"a{i + 1}", d), i + 1, config)
              for i, d in enumerate(folders)]
    specs = tuple(dataclasses.replace(loaded[i % len(loaded)], name=f"a{i + 1}", adapter_id=i + 1)
                  for i in range(args.slots))
    capacity = LoraCapacity.resolve([s.modules for s in specs], args.runtime, args.slots,
                                    args.max_lora_rank if args.runtime else None)
    tables = model.add_lora_tables(specs, capacity)
    for spec in specs:
        fill_slot(tables, spec.adapter_id, spec, read_shards(tables, spec))
    return model, tables, specs


def step_chunks(rows: int, tokens: int, level: int, args, gen: torch.Generator) -> list:
    """`rows` decode rows at --context, then `tokens` prompt tokens in chunks of
    --prefill-chunk, each its own sequence from position 0; row i on slot 1 + i % level."""
    per_seq = -(-max(args.context + 1, args.prefill_chunk) // BLOCK_SIZE)
    chunks, seq = [], 0

    def slot() -> int:
        return 1 + seq % level if level else 0

    for _ in range(rows):
        table = list(range(1 + seq * per_seq, 1 + (seq + 1) * per_seq))
        token = torch.randint(*PROMPT_ID_RANGE, (1,), generator=gen).tolist()
        chunks.append((token, args.context, table[:args.context // BLOCK_SIZE + 1], True, slot()))
        seq += 1
    while tokens > 0:
        num = min(tokens, args.prefill_chunk)
        table = list(range(1 + seq * per_seq, 1 + (seq + 1) * per_seq))
        ids = torch.randint(*PROMPT_ID_RANGE, (num,), generator=gen).tolist()
        chunks.append((ids, 0, table[:-(-num // BLOCK_SIZE)], True, slot()))
        tokens, seq = tokens - num, seq + 1
    return chunks


def time_step(model, chunks: list, repeats: int) -> float:
    """Median seconds of a step as the worker runs it: inputs, forward, argmax to the host."""
    def once() -> None:
        batch = ForwardBatch.build(chunks, BLOCK_SIZE, CPU, min_rows=MIN_ROWS)
        model.forward(batch).argmax(-1).tolist()

    once()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        once()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_adapter_copy(tables: dict, spec, repeats: int, device: torch.device = CPU) -> dict:
    """Milliseconds of one copy into the spec's slot, as adapter_store.py makes it: read from
    its folder (page cache warm) and filled, and filled alone (a host-cache hit)."""
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    disk, host = [], []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        shards = read_shards(tables, spec)
        middle = time.perf_counter()
        fill_slot(tables, spec.adapter_id, spec, shards)
        sync()
        end = time.perf_counter()
        disk.append(end - start)
        host.append(end - middle)
    return {"disk": round(1e3 * statistics.median(disk), 3),
            "host": round(1e3 * statistics.median(host), 3)}


def table_json(conditions_line: str, model: str, device: str, parallel: int, context: int,
               prefill_chunk: int, steps: list[dict], loads: dict, **extra) -> dict:
    """A lorad-step-table/1 document (scripts/capacity_table.py reads it)."""
    return {"format": "lorad-step-table/1", "conditions": conditions_line, "model": model,
            "device": device, "parallel": parallel, "context": context,
            "prefill_chunk": prefill_chunk, **extra, "steps": steps, "adapter_load_ms": loads}


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    started = time.monotonic()
    model, tables, specs = build(args)
    max_seqs = max(args.batches + [b for b, _ in args.mixed], default=0) + 2 + -(-max(
        args.prefill + [p for _, p in args.mixed], default=0) // args.prefill_chunk)
    per_seq = -(-max(args.context + 1, args.prefill_chunk) // BLOCK_SIZE)
    model.allocate_kv_cache(1 + max_seqs * per_seq, BLOCK_SIZE)
    for cache in model.kv_caches():  # random KV: never time attention on zeros
        cache.k.normal_()
        cache.v.normal_()
    gen = torch.Generator().manual_seed(0)
    points = [(b, 0) for b in args.batches if b] + [(0, p) for p in args.prefill if p]
    points += [(b, p) for b, p in args.mixed if b + p]
    steps, seen = [], set()
    for level in [lv for lv in args.levels if lv <= args.slots]:
        for rows, tokens in points:
            chunks = step_chunks(rows, tokens, level, args, gen)
            distinct = len({c[4] for c in chunks} - {0})
            if (rows, tokens, distinct) in seen:
                continue  # fewer rows than the level: the point of a lower level
            seen.add((rows, tokens, distinct))
            ms = 1e3 * time_step(model, chunks, args.repeats)
            steps.append({"decode_rows": rows, "prefill_tokens": tokens, "adapters": distinct,
                          "step_ms": round(ms, 3)})
            print(json.dumps(steps[-1]), flush=True)
    loads = time_adapter_copy(tables, specs[0], max(args.repeats, 5))
    kind = (f"run-time (every projection, rank {args.max_lora_rank})" if args.runtime
            else "start adapters' projections")
    table = table_json(conditions(CPU), Path(args.model).name, f"cpu, {args.threads} thread(s)",
                       1, args.context, args.prefill_chunk, steps, loads, tables=kind)
    if args.out:
        Path(args.out).write_text(json.dumps(table, indent=1) + "\n")
    print(f"\n{table['conditions']}\nmodel {table['model']}, float32, world size 1, "
          f"{args.threads} thread(s), rows padded to {MIN_ROWS}; {table['tables']}, adapters "
          f"{', '.join(Path(f).name for f in args.adapter or DEMO_ADAPTERS)} cycled over "
          f"{args.slots} slots; decode rows at {args.context} tokens of KV, prompts in chunks "
          f"of {args.prefill_chunk} from position 0; median of {args.repeats} steps after 1; "
          f"whole run {time.monotonic() - started:.0f} s\n")
    print("| decode rows | prompt tokens | adapters | step ms | ms per token |")
    print("|---|---|---|---|---|")
    for s in steps:
        per_token = s["step_ms"] / (s["decode_rows"] + s["prefill_tokens"])
        print(f"| {s['decode_rows']} | {s['prefill_tokens']} | {s['adapters']} | "
              f"{s['step_ms']:.1f} | {per_token:.2f} |")
    print(f"\nadapter copy into a slot: {loads['disk']:.2f} ms from its folder, "
          f"{loads['host']:.2f} ms from the host cache")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
