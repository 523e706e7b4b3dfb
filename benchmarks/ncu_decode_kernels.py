#!/usr/bin/env python3
"""Hardware counters of the decode step's kernels at the Llama-3-8B shape, from Nsight Compute.

Runs itself under `ncu` once per case (with `--drive CASE`, where each kernel of the case is
launched once, eagerly, on random inputs), reads ncu's CSV and prints one row per kernel: its
duration, DRAM throughput and L2 hit rate, achieved and theoretical occupancy, registers per
thread, dynamic shared memory, waves, the blocks an SM holds as registers and shared memory
allow, the share of cycles with no eligible warp, and SM throughput. ncu replays each kernel
with caches flushed, so every figure is of a cold L2, as the factor tables are in serving.

Cases:
  many64  the LoRA shrink and expand (into fp32 delta buffers, as the model runs them) of q/k/v,
          o, gate/up and down: 64 rows on 64 distinct adapters, rank 16, bf16 tables
  one32   the same, 32 rows on one adapter
  attn64  decode attention (split + reduce): 64 sequences of 512 tokens, a table of 8192
  mm64    cuBLAS's base matmuls (F.linear) of the four projections at 64 rows

    python -m benchmarks.ncu_decode_kernels [--cases many64,one32,attn64,mm64] [--csv-out DIR]

Needs a CUDA GPU, triton and ncu (on PATH or /usr/local/cuda/bin); ncu runs with
--clock-control none, so the GPU keeps its own clocks.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

from benchmarks.profile_graph import PROJECTIONS  # noqa: E402  (a layer's launch groups, in order)

CASES = ("many64", "one32", "attn64", "mm64")
KERNEL_FILTER = "regex:_shrink_kernel|_expand_kernel|_decode_|gemm|nvjet|xmma|splitK|cutlass"
SECTIONS = ("SpeedOfLight", "LaunchStats", "Occupancy", "WarpStateStats", "SchedulerStats",
            "MemoryWorkloadAnalysis")
# (ncu's metric name, the column's heading); ncu prints values with thousands separators.
COLUMNS = (("Duration", "us"), ("DRAM Throughput", "DRAM %"), ("L2 Hit Rate", "L2 hit %"),
           ("Achieved Occupancy", "occupancy %"), ("Theoretical Occupancy", "max occupancy %"),
           ("Registers Per Thread", "registers"),
           ("Dynamic Shared Memory Per Block", "shared B"), ("Waves Per SM", "waves"),
           ("Block Limit Registers", "blocks (regs)"),
           ("Block Limit Shared Mem", "blocks (shared)"), ("No Eligible", "no eligible %"),
           ("Compute (SM) Throughput", "SM %"))


# --- what runs under ncu ----------------------------------------------------------------------

def drive(case: str, device: str = "cuda") -> None:
    """Launch each kernel of `case` once (under ncu, which profiles the ones its filter names):
    one layer's tables as bench_lora_kernels.py makes them, KV as bench_paged_attention.py's."""
    import torch
    import torch.nn.functional as F
    from benchmarks.bench_lora_kernels import GROUPS, NUM_ADAPTERS, RANK, make_layers
    torch.manual_seed(0)
    if case in ("many64", "one32"):
        from lorad.workers.kernels.lora_expand import lora_expand
        from lorad.workers.kernels.lora_shrink import lora_shrink
        from lorad.workers.kernels.lora_tiles import LoraTiles, count_tiles
        slots = [1 + i for i in range(64)] if case == "many64" else [1] * 32
        tiles = LoraTiles.build(torch.tensor(slots, dtype=torch.int64, device=device),
                                count_tiles([slots.count(s) for s in sorted(set(slots))], 16))
        ranks = torch.full((NUM_ADAPTERS + 1,), RANK, dtype=torch.int32, device=device)
        ranks[0] = 0
        scales = torch.full((NUM_ADAPTERS + 1,), 2.0, device=device)
        (layer,) = make_layers(1, len(slots), torch.device(device), torch.bfloat16)
        for name in PROJECTIONS:
            group = layer[name]
            n = len(group.a)
            t = lora_shrink(group.x, group.a, [ranks] * n, tiles, pdl_rows=32)
            lora_expand(t, group.outs, group.b, [ranks] * n, [scales] * n, tiles, deltas=True,
                        pdl_rows=32)
    elif case == "attn64":
        from benchmarks.bench_paged_attention import (BLOCK_SIZE, DTYPE, HEAD_DIM, NUM_KV_HEADS,
                                                      NUM_Q_HEADS)
        from lorad.workers.kernels.paged_attention import paged_decode_attention
        batch, context, num_blocks, table_tokens = 64, 512, 8192, 8192
        k = torch.randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device=device,
                        dtype=DTYPE)
        v = torch.randn_like(k)
        tables = torch.zeros(batch, table_tokens // BLOCK_SIZE, dtype=torch.int32, device=device)
        used = context // BLOCK_SIZE
        tables[:, :used] = torch.randperm(num_blocks, device=device)[:batch * used].view(
            batch, used).int()
        lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        q = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, device=device, dtype=DTYPE)
        paged_decode_attention(q, k, v, tables, lens, HEAD_DIM ** -0.5, pdl_rows=32)
    elif case == "mm64":
        # Each projection group's weights as one matrix, as the model multiplies them.
        for name in PROJECTIONS:
            num_in, num_outs = GROUPS[name]
            F.linear(torch.randn(64, num_in, device=device).bfloat16(),
                     torch.randn(sum(num_outs), num_in, device=device).bfloat16())
    else:
        raise SystemExit(f"unknown case {case!r}: one of {', '.join(CASES)}")
    if device == "cuda":
        torch.cuda.synchronize()


# --- reading ncu's CSV ------------------------------------------------------------------------

def parse_details(text: str) -> list[dict]:
    """ncu --csv --page details output (its own ==PROF== lines mixed in) -> one dict per
    profiled kernel, in launch order: name, grid, block, metrics {name: value text} and units
    {name: unit}."""
    rows = csv.DictReader(io.StringIO("".join(line + "\n" for line in text.splitlines()
                                              if line.startswith('"'))))
    kernels: dict[str, dict] = {}
    for row in rows:
        kernel = kernels.setdefault(row["ID"], {"name": row["Kernel Name"],
                                                "grid": row["Grid Size"],
                                                "block": row["Block Size"], "metrics": {}})
        if row.get("Metric Name"):
            kernel["metrics"][row["Metric Name"]] = row["Metric Value"]
            kernel.setdefault("units", {})[row["Metric Name"]] = row.get("Metric Unit", "")
    return [kernels[i] for i in sorted(kernels, key=int)]


# ncu scales a duration's unit to its size.
MICROSECONDS_PER = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3,
                    "msecond": 1e3}


def kernel_labels(case: str, kernels: list[dict]) -> list[str]:
    """What each kernel of a case is, from the order the driver launches them in: LoRA cases
    a shrink then an expand per group, attention its split and reduce, matmuls one (with any
    split-K reduce of cuBLAS after it) per projection."""
    labels = []
    group = -1
    for kernel in kernels:
        name = kernel["name"]
        if case in ("many64", "one32"):
            if "_shrink_kernel" in name:
                group += 1
            kind = "shrink" if "_shrink_kernel" in name else "expand"
            labels.append(f"{PROJECTIONS[group % len(PROJECTIONS)]} {kind}")
        elif case == "mm64":
            if "splitKreduce" in name:
                labels.append(f"{PROJECTIONS[group % len(PROJECTIONS)]} split-K reduce")
            else:
                group += 1
                labels.append(f"{PROJECTIONS[group % len(PROJECTIONS)]} matmul")
        else:
            labels.append("attention " + ("reduce" if "reduce" in name else "split"))
    return labels


def number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except (AttributeError, ValueError):
        return None


def table_rows(case: str, kernels: list[dict]) -> list[list[str]]:
    """One row per kernel: case, label, grid, then COLUMNS (duration in us; '-' where ncu gave
    none)."""
    out = []
    for label, kernel in zip(kernel_labels(case, kernels), kernels):
        cells = [case, label, kernel["grid"].replace(" ", "")]
        for metric, _ in COLUMNS:
            value = number(kernel["metrics"].get(metric))
            if value is None:
                cells.append("-")
            elif metric == "Duration":
                unit = kernel.get("units", {}).get(metric, "ns")
                cells.append(f"{value * MICROSECONDS_PER[unit]:.1f}")
            else:
                cells.append(f"{value:g}")
        out.append(cells)
    return out


def find_ncu() -> str | None:
    """ncu on PATH, else CUDA's usual place, else None."""
    found = shutil.which("ncu")
    if found:
        return found
    fallback = "/usr/local/cuda/bin/ncu"
    return fallback if os.access(fallback, os.X_OK) else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--drive", help=argparse.SUPPRESS)  # the run under ncu
    p.add_argument("--csv-out", help="a folder for ncu's CSV of each case")
    args = p.parse_args()
    if args.drive:
        drive(args.drive)
        return 0
    ncu = find_ncu()
    if ncu is None:
        print("ncu_decode_kernels.py: ncu not found (PATH, /usr/local/cuda/bin)", file=sys.stderr)
        return 2
    heading = ["case", "kernel", "grid"] + [h for _, h in COLUMNS]
    print("| " + " | ".join(heading) + " |")
    print("|" + "---|" * len(heading))
    for case in [c for c in args.cases.split(",") if c]:
        command = [ncu, "--clock-control", "none", "-k", KERNEL_FILTER, "--csv", "--page",
                   "details"]
        for section in SECTIONS:
            command += ["--section", section]
        command += [sys.executable, "-m", "benchmarks.ncu_decode_kernels", "--drive", case]
        done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
        if args.csv_out:
            Path(args.csv_out).mkdir(parents=True, exist_ok=True)
            (Path(args.csv_out) / f"{case}.csv").write_text(done.stdout)
        kernels = parse_details(done.stdout)
        if done.returncode != 0 or not kernels:
            print(f"ncu_decode_kernels.py: {case}: ncu exited {done.returncode} with "
                  f"{len(kernels)} kernels: {done.stderr.strip()[-400:]}", file=sys.stderr)
            return 1
        for cells in table_rows(case, kernels):
            print("| " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
