#!/usr/bin/env python3
"""Where a decode graph replay's time goes: the kernels of captured replays of lorad's 8B-shaped
model (random weights, bf16) on a timeline, by stream.

profile_decode.py sums an eager step's kernels by name; a replay differs (PDL, the side stream
of the LoRA shrinks, no host between launches), and its time is the span from its first kernel's
start to its last kernel's end, kernels plus the gaps between them. Per case this prints the
span, the time no kernel runs, where those gaps fall (between which two kinds of kernel), how
much of the LoRA kernels' time runs beside a matmul (a replay gives each branch of the graph a
stream of its own, so streams say little), and each kind's
count and mean duration. Kernels are named by kind and, for the matmuls and the LoRA kernels, by
the projection they serve (their order in a layer). --trace-out writes each case's kernels as
JSON lines (kind, stream, start and duration in us) for a closer look.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# The projections in the order a layer launches its matmuls and its LoRA shrinks and expands.
PROJECTIONS = ("qkv", "o", "gate_up", "down")


def kind_of(name: str) -> str:
    """A kernel's kind, from its name: the Triton kernels by their function, cuBLAS's by role."""
    lowered = name.lower()
    if "splitkreduce" in lowered:
        return "matmul_reduce"
    if any(key in lowered for key in ("gemm", "nvjet", "xmma", "cutlass", "gemv")):
        return "matmul"
    for key in ("_shrink_kernel", "_expand_kernel", "_decode_split_kernel",
                "_decode_reduce_kernel", "rotary", "rms_norm", "silu", "argmax", "embedding",
                "index", "sort", "cumsum", "scan", "copy", "fill"):
        if key in lowered:
            return key.strip("_")
    return name[:40]


def label(kernels: list[dict]) -> list[dict]:
    """Kernels in start order, each given `kind` and, for the decoder layers' matmuls, shrinks
    and expands, `what` = kind/projection (the last matmul is the LM head)."""
    kernels = sorted(kernels, key=lambda k: k["ts"])
    counters: dict[str, int] = defaultdict(int)
    matmuls = [k for k in kernels if kind_of(k["name"]) == "matmul"]
    head = matmuls[-1] if matmuls else None
    for k in kernels:
        kind = kind_of(k["name"])
        k["kind"] = kind
        if k is head:
            k["what"] = "matmul/lm_head"
        elif kind in ("matmul", "shrink_kernel", "expand_kernel"):
            k["what"] = f"{kind}/{PROJECTIONS[counters[kind] % len(PROJECTIONS)]}"
            counters[kind] += 1
        else:
            k["what"] = kind
    return kernels


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def overlap_length(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Time during which some interval of a and some interval of b both run."""
    return union_length(a) + union_length(b) - union_length(a + b)


def summarize(kernels: list[dict]) -> dict:
    """One replay's kernels (name, stream, ts, dur in us) -> its figures (see the module doc)."""
    kernels = label(kernels)
    start = min(k["ts"] for k in kernels)
    span = max(k["ts"] + k["dur"] for k in kernels) - start
    def intervals(kinds: tuple[str, ...]) -> list[tuple[float, float]]:
        return [(k["ts"], k["ts"] + k["dur"]) for k in kernels if k["kind"] in kinds]

    busy = union_length([(k["ts"], k["ts"] + k["dur"]) for k in kernels])
    lora = intervals(("shrink_kernel", "expand_kernel"))
    # Gaps: time no kernel runs, charged to the pair of kinds around it (kernels of any stream
    # in start order; the running end is the latest end so far).
    gaps: dict[str, list[float]] = defaultdict(list)
    end, before = None, None
    for k in kernels:
        if end is not None and k["ts"] > end:
            gaps[f"{before} -> {k['what']}"].append(k["ts"] - end)
        if end is None or k["ts"] + k["dur"] >= end:
            end, before = k["ts"] + k["dur"], k["what"]
    per_what: dict[str, list[float]] = defaultdict(list)
    for k in kernels:
        per_what[k["what"]].append(k["dur"])
    return {
        "kernels": len(kernels), "span": span, "busy": busy, "idle": span - busy,
        "streams": len({k["stream"] for k in kernels}), "lora_total": union_length(lora),
        "lora_beside_matmul": overlap_length(lora, intervals(("matmul", "matmul_reduce"))),
        "gaps": gaps, "per_what": per_what,
    }


def report(case: str, summaries: list[dict], top: int) -> str:
    best = min(summaries, key=lambda s: s["span"])
    lines = [f"\n## {case}: span {best['span']:.1f} us (of {len(summaries)} replays: "
             + ", ".join(f"{s['span']:.1f}" for s in summaries) + ")",
             f"{best['kernels']} kernels; busy {best['busy']:.1f} us, no kernel running "
             f"{best['idle']:.1f} us; on {best['streams']} streams; LoRA kernels running "
             f"{best['lora_total']:.1f} us, {best['lora_beside_matmul']:.1f} of them beside a "
             "matmul"]
    lines += ["", "| gap between | count | total us | mean us |", "|---|---:|---:|---:|"]
    for pair, values in sorted(best["gaps"].items(), key=lambda kv: -sum(kv[1]))[:top]:
        lines.append(f"| {pair} | {len(values)} | {sum(values):.1f} | "
                     f"{sum(values) / len(values):.2f} |")
    lines += ["", "| kernel | count | total us | mean us |", "|---|---:|---:|---:|"]
    for what, values in sorted(best["per_what"].items(), key=lambda kv: -sum(kv[1]))[:top]:
        lines.append(f"| {what} | {len(values)} | {sum(values):.1f} | "
                     f"{sum(values) / len(values):.2f} |")
    return "\n".join(lines)


def split_replays(kernels: list[dict], count: int) -> list[list[dict]]:
    """The kernels of `count` replays, each synchronized before the next starts, cut at the
    count - 1 widest gaps between the latest end so far and the next start."""
    kernels = sorted(kernels, key=lambda k: k["ts"])
    if count <= 1 or len(kernels) < count:
        return [kernels]
    gaps, end = [], kernels[0]["ts"] + kernels[0]["dur"]
    for i in range(1, len(kernels)):
        gaps.append((kernels[i]["ts"] - end, i))
        end = max(end, kernels[i]["ts"] + kernels[i]["dur"])
    cuts = [0] + sorted(i for _, i in sorted(gaps, reverse=True)[:count - 1]) + [len(kernels)]
    return [kernels[a:b] for a, b in zip(cuts, cuts[1:])]


def trace_kernels(path: Path) -> list[dict]:
    """The GPU kernels of a torch.profiler chrome trace: name, stream, ts, dur (us)."""
    events = json.loads(path.read_text())["traceEvents"]
    return [{"name": e["name"], "stream": e.get("args", {}).get("stream", 0),
             "ts": float(e["ts"]), "dur": float(e["dur"])}
            for e in events if e.get("cat") == "kernel" and "dur" in e]


def main() -> int:
    import torch

    from benchmarks.bench_engine import (BLOCK_SIZE, build_lorad, load_adapters, tuned,
                                         tuning_variants, write_adapter)
    from lorad.config import ModelConfig
    from lorad.workers.cuda_graph import DecodeGraphs

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(REPO / "scripts/configs/llama3-8b"))
    p.add_argument("--cases", default="base:1,one:32,mixed4:32,many:64",
                   help="case:batch, comma-separated (cases as bench_engine.py's)")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--replays", type=int, default=3)
    p.add_argument("--num-adapters", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--top", type=int, default=16)
    p.add_argument("--trace-out", help="a folder for each case's kernels (JSON lines, gzip)")
    p.add_argument("--variant", default="main",
                   help="';'-separated tuning variants as bench_engine.py --variant takes "
                        "them, each profiled with graphs captured again ('main': lorad's "
                        "Tuning())")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("profile_graph.py needs a CUDA GPU", file=sys.stderr)
        return 2
    cases = [(c.split(":")[0], int(c.split(":")[1])) for c in args.cases.split(",") if c]
    config = ModelConfig.from_dir(args.config)
    max_batch = max(b for _, b in cases)
    blocks_per_seq = -(-(args.context + 8) // BLOCK_SIZE)
    model = build_lorad(config, max_batch, blocks_per_seq)
    with tempfile.TemporaryDirectory() as tmp:
        load_adapters(model, write_adapter(Path(tmp), config, 16), args.num_adapters)
    out_dir = Path(args.trace_out) if args.trace_out else None
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
    for variant, tuning in tuning_variants(args.variant):
        with tuned(model, tuning):
            graphs = DecodeGraphs(model, max_batch, args.max_model_len, BLOCK_SIZE,
                                  args.num_adapters)
            graphs.capture()
            profile_cases(graphs, cases, args, blocks_per_seq, out_dir,
                          "" if variant == "main" else f" ({variant})")
        del graphs
        torch.cuda.empty_cache()
    return 0


def profile_cases(graphs, cases: list[tuple[str, int]], args, blocks_per_seq: int,
                  out_dir: Path | None, label_text: str) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.bench_engine import decode_steps, slots_for
    for case, batch in cases:
        slots = slots_for(case, batch, args.num_adapters)
        steps = list(decode_steps(slots, args.context, blocks_per_seq, 3))
        for chunks in steps:
            graphs.run(chunks)  # fills the inputs; the last step's stay for the replays
        graph = graphs.graph_for(batch, any(slots))
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.replays):
                graph.replay()
                torch.cuda.synchronize()
        with tempfile.TemporaryDirectory() as tmp:
            trace = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(trace))
            kernels = trace_kernels(trace)
        replays = split_replays(kernels, args.replays)
        name = f"{case} b{batch}{label_text}"
        print(report(name, [summarize(r) for r in replays], args.top), flush=True)
        if out_dir:
            best = min(replays, key=lambda r: max(k["ts"] + k["dur"] for k in r) - r[0]["ts"])
            t0 = best[0]["ts"]
            # Letters, digits and -_. only: the variant's text may hold quotes and '+'.
            tag = re.sub(r"[^A-Za-z0-9_.-]+", "_", label_text.strip(" ()"))
            file_name = f"{case}-b{batch}{'-' + tag if tag else ''}.jsonl.gz"
            with gzip.open(out_dir / file_name, "wt") as f:
                for k in label(best):
                    f.write(json.dumps({"what": k["what"], "name": k["name"][:80],
                                        "stream": k["stream"], "start": round(k["ts"] - t0, 3),
                                        "dur": k["dur"]}) + "\n")


if __name__ == "__main__":
    sys.exit(main())
