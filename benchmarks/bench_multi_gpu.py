#!/usr/bin/env python3
"""lorad's decode step at world 1, 2 and 4 (those the GPU count allows) over NCCL: the 8B shape
(scripts/configs/llama3-8b, random weights, bf16) at batch 1, 32 and 64, through the decode CUDA
graphs and eagerly, and the step's collectives alone (in a loop, and captured in a graph) for
their share of the step; with --all-reduce nccl,oneshot both all-reduces in one run (world 1
once). Prints a markdown table with the conditions; one process per rank.

    python -m benchmarks.bench_multi_gpu [--worlds 1,2,4] [--batches 1,32,64]
        [--all-reduce nccl,oneshot] [--table-out FILE]
    python -m benchmarks.bench_multi_gpu --device cpu --backend gloo --dtype float32 \
        --config TINY_MODEL_DIR --worlds 1,2 --eager-only     (the CPU path, for a smoke run)

Run it from the repository root (on a lent multi-GPU machine: benchmarks/gpu_session.sh runs it
when it sees two GPUs). The multi-GPU correctness checks are tests/gpu/test_multi_gpu_*.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import conditions

REPO = Path(__file__).resolve().parent.parent


def cmd_rank(args) -> int:
    """One benchmark rank: eager decode steps, then the step's collectives alone."""
    import torch
    import torch.distributed as dist

    from lorad.config import ModelConfig
    from lorad.workers.batch import MIN_ROWS, ForwardBatch
    from lorad.workers.models.llama import LlamaForCausalLM
    from lorad.workers.parallel import init_tensor_parallel
    from lorad.workers.tuning import Tuning

    torch.set_num_threads(1 if args.device == "cpu" else 4)
    cuda = args.device == "cuda"
    device = torch.device("cuda", args.rank) if cuda else torch.device("cpu")
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    tp = init_tensor_parallel(args.rank, args.world, f"file://{args.init_file}", args.backend,
                              device, timeout_s=120, all_reduce=args.all_reduce,
                              oneshot_config=Tuning().oneshot)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    config = ModelConfig.from_dir(args.config)
    t0 = time.monotonic()
    model = LlamaForCausalLM(config, tp, dtype, device)
    model.load_random_weights(0)
    block, batches = 16, [int(b) for b in args.batches.split(",")]
    blocks_per_seq = -(-(args.context + args.warmup + args.steps + 1) // block)
    model.allocate_kv_cache(1 + max(batches) * blocks_per_seq, block)
    for layer in model.model.layers:
        layer.self_attn.kv_cache.k.normal_()
        layer.self_attn.kv_cache.v.normal_()
    sync()
    load_s = time.monotonic() - t0
    out = {"world": args.world, "rank": args.rank, "load_s": load_s, "rows": [],
           "all_reduce": "oneshot" if tp.oneshot is not None else tp.backend,
           "layers": config.num_hidden_layers}
    graphs = None
    if cuda and not args.eager_only:
        from lorad.workers.cuda_graph import DecodeGraphs
        # NCCL collectives inside the graphs; gloo's between graph segments (as the engine does).
        graphs = DecodeGraphs(model, max(batches), blocks_per_seq * block, block, 0,
                              segmented=args.world > 1 and args.backend == "gloo")
        graphs.capture()
    hidden, layers = config.hidden_size, config.num_hidden_layers
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for batch in batches:
            tables = [list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq))
                      for i in range(batch)]
            step_s = []
            for step in range(args.warmup + args.steps):
                pos = args.context + step
                ids = torch.randint(3, min(1000, config.vocab_size), (batch,),
                                    generator=gen).tolist()
                chunks = [([ids[i]], pos, tables[i][:pos // block + 1], True, 0)
                          for i in range(batch)]
                if tp.world_size > 1:
                    dist.barrier(group=tp.cpu_group)  # start every step together
                start = time.perf_counter()
                logits = model.forward(ForwardBatch.build(chunks, block, device,
                                                          min_rows=MIN_ROWS))
                logits.argmax(-1).tolist()  # the leader's host sync each step
                step_s.append(time.perf_counter() - start)
            step = statistics.median(step_s[args.warmup:])
            graph_step = None
            if graphs is not None:
                graph_s = []
                for step_i in range(args.warmup + args.steps):
                    pos = args.context + step_i
                    chunks = [([5], pos, tables[i][:pos // block + 1], True, 0)
                              for i in range(batch)]
                    if tp.world_size > 1:
                        dist.barrier(group=tp.cpu_group)
                    start = time.perf_counter()
                    graphs.run(chunks).argmax(-1).tolist()
                    graph_s.append(time.perf_counter() - start)
                graph_step = statistics.median(graph_s[args.warmup:])
            # The step's collectives alone: 2 all-reduces per layer + the embedding's one of
            # [rows, hidden] in the model dtype, and the logits' all-gather of [batch, vocab/N].
            rows = max(batch, MIN_ROWS)
            comm = {}
            if tp.world_size > 1:
                for name, dt in (("ar_model_dtype", dtype), ("ar_fp32", torch.float32)):
                    xs = [torch.randn(rows, hidden, device=device).to(dt)
                          for _ in range(2 * layers + 1)]
                    shard = -(-config.vocab_size // tp.world_size)
                    logit_part = torch.randn(batch, shard, device=device)
                    sizes = [shard] * tp.world_size

                    def collectives():
                        for x in xs:
                            tp.all_reduce(x)
                        if name == "ar_model_dtype":
                            tp.all_gather_last_dim(logit_part, sizes)
                    for _ in range(args.warmup):
                        collectives()
                    sync()
                    times = []
                    for _ in range(args.steps):
                        dist.barrier(group=tp.cpu_group)
                        start = time.perf_counter()
                        collectives()
                        sync()
                        times.append(time.perf_counter() - start)
                    comm[name] = statistics.median(times)
                if graphs is not None and args.backend == "nccl":
                    comm["graph_collectives"] = time_collectives_graph(
                        tp, rows, hidden, layers, dtype, batch, config.vocab_size, args)
            out["rows"].append({"batch": batch, "step_s": step, "min_step_s": min(step_s),
                                "graph_step_s": graph_step, **comm})
    Path(args.out).write_text(json.dumps(out))
    print(f"rank {args.rank}/{args.world} done: {json.dumps(out)}", flush=True)
    if tp.world_size > 1:
        dist.barrier(group=tp.cpu_group)
    # No destroy_process_group: its teardown can abort a rank after the results are written
    # (seen with gloo); the process ends here without running finalizers.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def time_collectives_graph(tp, rows: int, hidden: int, layers: int, dtype, batch: int,
                           vocab_size: int, args) -> float:
    """The step's collectives as the decode graph holds them (2 fp32 all-reduces per layer, the
    embedding's in the model dtype, the logits' all-gather), captured alone in a CUDA graph:
    median seconds per replay."""
    import torch
    import torch.distributed as dist

    device = tp.device
    xs = [torch.randn(rows, hidden, device=device) for _ in range(2 * layers)]
    xs.append(torch.randn(rows, hidden, device=device).to(dtype))
    shard = -(-vocab_size // tp.world_size)
    logit_part = torch.randn(batch, shard, device=device)

    def collectives():
        for x in xs:
            tp.all_reduce(x)
        tp.all_gather_last_dim(logit_part, [shard] * tp.world_size)

    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            collectives()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        collectives()
    times = []
    for _ in range(args.warmup + args.steps):
        dist.barrier(group=tp.cpu_group)
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[args.warmup:])


def runs_of(worlds: list[int], modes: list[str]) -> list[tuple[str, int]]:
    """(all-reduce, world) pairs to run: world 1 once (nothing to reduce), then each world of
    2 or more under each all-reduce."""
    runs = [(modes[0], 1)] if 1 in worlds else []
    return runs + [(mode, w) for w in worlds if w > 1 for mode in modes]


def cmd_bench(args) -> int:
    root = Path(args.work)
    rows, failed = {}, []
    worlds = [int(w) for w in args.worlds.split(",")]
    if max(worlds) > 1 and args.device == "cuda" and args.backend == "nccl":
        import torch
        worlds = [w for w in worlds if w <= torch.cuda.device_count()]
    for mode, world in runs_of(worlds, args.all_reduce.split(",")):
        name = f"{mode}{world}"
        procs = []
        env = {**os.environ, "OMP_NUM_THREADS": "4"}
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        for rank in range(world):
            cmd = [sys.executable, "-m", "benchmarks.bench_multi_gpu", "rank", "--rank",
                   str(rank), "--world", str(world),
                   "--init-file", str(root / f"store{name}"), "--out",
                   str(root / f"bench{name}.rank{rank}.json"), "--config", args.config,
                   "--all-reduce", "nccl" if world == 1 else mode,
                   "--device", args.device, "--backend", args.backend, "--dtype", args.dtype,
                   "--batches", args.batches, "--context", str(args.context),
                   "--steps", str(args.steps), "--warmup", str(args.warmup)] + (
                       ["--eager-only"] if args.eager_only else [])
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, cwd=REPO,
                                          stderr=subprocess.STDOUT, text=True))
        ok = True
        for rank, proc in enumerate(procs):
            try:
                output, _ = proc.communicate(timeout=args.world_timeout)
            except subprocess.TimeoutExpired:
                for p in procs:
                    p.kill()
                output, _ = proc.communicate()
                output += "\n(timed out)"
            print(f"--- bench {mode} world {world} rank {rank} (exit {proc.returncode}):\n"
                  + "\n".join(output.splitlines()[-15:]), flush=True)
            ok &= proc.returncode == 0 or (root / f"bench{name}.rank{rank}.json").exists()
        if ok:
            rows[(mode, world)] = json.loads((root / f"bench{name}.rank0.json").read_text())
        else:
            failed.append(name)
    if not rows:
        print(f"bench_multi_gpu: no world size ran ({failed})", file=sys.stderr)
        return 1
    print(f"\n# {conditions(args.device)}; backend {args.backend}")
    print(f"{Path(args.config).name} decode, {args.dtype}, random weights, context "
          f"{args.context}, median of {args.steps} steps (rank 0, host-synced step incl. batch "
          "build + argmax); "
          f"collectives alone: {2 * next(iter(rows.values()))['layers'] + 1} all-reduces of "
          "[max(batch, 8), hidden] + the logits "
          "all-gather, timed in a loop on the same ranks.\n")
    table = ["| all-reduce | world | batch | eager step ms | graph step ms | graph tok/s | "
             "collectives "
             "alone ms (eager) | all-reduce share of eager step | collectives in a graph ms | "
             "their share of the graph step | scaling efficiency |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    solo = [data for (_, world), data in rows.items() if world == 1]
    base = {r["batch"]: r for r in (solo[0]["rows"] if solo else [])}
    for (mode, world), data in sorted(rows.items(), key=lambda item: (item[0][1], item[0][0])):
        ran = data["all_reduce"] + ("" if data["all_reduce"] == mode or world == 1
                                    else f" ({mode})")
        for r in data["rows"]:
            comm = r.get("ar_model_dtype")
            share = f"{100 * comm / r['step_s']:.0f}%" if comm else "-"
            graph = r.get("graph_step_s")
            best = graph or r["step_s"]
            one = base.get(r["batch"])
            one_best = one and (one.get("graph_step_s") or one["step_s"])
            # Speed-up over world 1 divided by the world size (1.0 = linear scaling).
            eff = f"{one_best / best / world:.2f}" if one_best and world > 1 else "-"
            in_graph = r.get("graph_collectives")
            graph_share = f"{100 * in_graph / graph:.0f}%" if in_graph and graph else "-"
            # The path the ranks ran (auto/oneshot falls back to NCCL where it cannot run).
            table.append(f"| {ran} | {world} | {r['batch']} | {1e3 * r['step_s']:.2f} | "
                         f"{f'{1e3 * graph:.2f}' if graph else '-'} | "
                         f"{r['batch'] / best:.0f} | "
                         f"{f'{1e3 * comm:.2f}' if comm else '-'} | {share} | "
                         f"{f'{1e3 * in_graph:.2f}' if in_graph else '-'} | {graph_share} | "
                         f"{eff} |")
    text = "\n".join(table)
    print(text)
    if args.table_out:
        Path(args.table_out).write_text(text + "\n")
    if failed:
        print(f"bench_multi_gpu: world size(s) {failed} failed (their ranks' output above)",
              file=sys.stderr)
    return 1 if failed else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    sub = p.add_subparsers(dest="cmd")
    rp = sub.add_parser("rank", help="one rank (started by the benchmark itself)")
    for sp in (p, rp):
        sp.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
        sp.add_argument("--backend", default="nccl", choices=("gloo", "nccl"))
        sp.add_argument("--eager-only", action="store_true", help="no CUDA graphs")
        sp.add_argument("--config", default=str(REPO / "scripts/configs/llama3-8b"))
        sp.add_argument("--dtype", default="bfloat16")
        sp.add_argument("--batches", default="1,32,64")
        sp.add_argument("--context", type=int, default=512)
        sp.add_argument("--steps", type=int, default=30)
        sp.add_argument("--warmup", type=int, default=5)
    p.add_argument("--all-reduce", default="nccl",
                   help="comma-separated --all-reduce values to compare (nccl,oneshot): each "
                        "world of 2 or more runs under each; world 1 once")
    rp.add_argument("--all-reduce", default="nccl")
    p.add_argument("--worlds", default="1,2,4",
                   help="world sizes to run (NCCL: those above the GPU count are skipped)")
    p.add_argument("--world-timeout", type=float, default=150)
    p.add_argument("--table-out")
    p.add_argument("--work", default=None, help="scratch folder (default: a new temp one)")
    for name in ("rank", "world", "init-file", "out"):
        rp.add_argument(f"--{name}", required=True, type=int if name in ("rank", "world") else str)
    args = p.parse_args()
    if args.cmd == "rank":
        return cmd_rank(args)
    args.work = args.work or tempfile.mkdtemp(prefix="bench-multi-gpu-")
    Path(args.work).mkdir(parents=True, exist_ok=True)
    return cmd_bench(args)


if __name__ == "__main__":
    sys.exit(main())
