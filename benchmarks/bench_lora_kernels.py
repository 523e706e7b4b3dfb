#!/usr/bin/env python3
"""Time the LoRA shrink+expand kernels for a whole decode step at the Llama-3-8B shape.

One step = the row tiles built once, then per layer four shrink+expand pairs: q/k/v (fused),
o, gate/up (fused), down; hidden 4096, intermediate 14336, rank 16, 32 layers each with its own
tables of 64 adapters (so the factors stream from memory as in serving, not from L2). For each
batch (1, 8, 32, 64, 128) and mixture (every row on one adapter; rows on distinct adapters,
cycling over 64), prints the step's time replayed as a CUDA graph, with exact tiles and with the
bound a graph for any mixture uses, and eagerly; and GB/s against the bytes the step must move:
each distinct adapter's A and B rows of its rank, x once per launch, out read and written for
adapter rows, the shrink's per-chunk partial sums t written and read once. Needs CUDA and
triton; prints the conditions with the table.

--per-kernel also times each projection's shrink and expand on their own (a graph of that one
kernel over every layer), against the bytes that kernel alone must read, and the expand adding
in place into bf16 outputs ("into") beside the fp32 deltas the model's consumers add.

Usage: python -m benchmarks.bench_lora_kernels [--layers 32] [--batches 1,8,32,64,128] [--sweep]
       [--sweep-batches 1,32,128] [--sweep-kernels shrink,expand] [--programs-per-sm 4,8,32]
       [--table-dtype bf16|fp32] [--per-kernel]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch


from lorad.workers.kernels import lora_expand as expand  # noqa: E402
from lorad.workers.kernels import lora_shrink as shrink  # noqa: E402
from lorad.workers.kernels.configs import (ExpandConfig, ExpandSteps, PdlConfig,  # noqa: E402
                                           ShrinkConfig, TileConfig)
from lorad.workers.kernels.lora_tiles import LoraTiles, count_tiles  # noqa: E402
from benchmarks.common import conditions, time_cuda, time_graph  # noqa: E402

PDL_ROWS = PdlConfig().max_rows  # with PDL up to 32 rows, as these timings always had

HIDDEN, INTERMEDIATE, RANK, NUM_ADAPTERS = 4096, 14336, 16, 64
# Launch groups of one layer: (input features, output features of each table sharing x).
GROUPS = {"qkv": (HIDDEN, (HIDDEN, 1024, 1024)), "o": (HIDDEN, (HIDDEN,)),
          "gate_up": (HIDDEN, (INTERMEDIATE, INTERMEDIATE)), "down": (INTERMEDIATE, (HIDDEN,))}


@dataclass
class Group:
    x: torch.Tensor  # [max_rows, in] bf16
    a: list[torch.Tensor]  # [num_slots, RANK, in], the table dtype
    b: list[torch.Tensor]  # [num_slots, out, RANK], the table dtype
    outs: list[torch.Tensor]  # [max_rows, out] fp32


TABLE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def make_layers(num_layers: int, max_rows: int, device: torch.device,
                dtype: torch.dtype = torch.float32) -> list[dict[str, Group]]:
    num_slots = NUM_ADAPTERS + 1
    layers = []
    for _ in range(num_layers):
        layer = {}
        for name, (num_in, num_outs) in GROUPS.items():
            a = [(torch.randn(num_slots, RANK, num_in, device=device) / num_in ** 0.5).to(dtype)
                 for _ in num_outs]
            b = [torch.randn(num_slots, n, RANK, device=device).to(dtype) for n in num_outs]
            layer[name] = Group(torch.randn(max_rows, num_in, device=device).bfloat16(), a, b,
                                [torch.zeros(max_rows, n, device=device) for n in num_outs])
        layers.append(layer)
    return layers


def run_step(layers, ranks, scales, row_slots, max_tiles, num_rows, shrink_config,
             expand_config, tile_config: TileConfig = TileConfig()) -> None:
    """One decode step's LoRA launches; shrink_config None: lorad's, expand_config None: the
    tile lorad's ExpandSteps picks for the step's rows."""
    tiles = LoraTiles.build(row_slots, max_tiles, tile_config)
    for layer in layers:
        for group in layer.values():
            n = len(group.a)
            # t allocated by the shrink (its chunk count follows the config): inside a graph
            # from the graph's pool, eagerly from the caching allocator.
            t = shrink.lora_shrink(group.x[:num_rows], group.a, [ranks] * n, tiles,
                                   config=shrink_config or ShrinkConfig(), pdl_rows=PDL_ROWS)
            expand.lora_expand(t, [o[:num_rows] for o in group.outs], group.b, [ranks] * n,
                               [scales] * n, tiles, config=expand_config, pdl_rows=PDL_ROWS)


def step_bytes(num_layers: int, num_rows: int, num_distinct: int, itemsize: int = 4) -> int:
    total = 0
    for num_in, num_outs in GROUPS.values():
        num_chunks = shrink.num_k_chunks(num_in)
        for num_out in num_outs:
            total += num_distinct * RANK * (num_in + num_out) * itemsize  # A and B rows
            total += num_rows * num_out * 4 * 2  # out read and written
            total += num_rows * num_chunks * RANK * 4 * 2  # t's partials written and read
        total += num_rows * num_in * 2  # x (bf16), once per launch
    return total * num_layers


def mixtures(num_rows: int) -> dict[str, list[int]]:
    return {"1 adapter": [1] * num_rows,
            "distinct": [1 + i % NUM_ADAPTERS for i in range(num_rows)]}


def bench(layers, ranks, scales, batches, shrink_config, expand_config, eager: bool = True,
          tile_config: TileConfig = TileConfig()):
    device = ranks.device
    rows = []
    for num_rows in batches:
        for mixture, slots in mixtures(num_rows).items():
            row_slots = torch.tensor(slots, dtype=torch.int64, device=device)
            exact = count_tiles([slots.count(s) for s in sorted(set(slots))],
                                tile_config.block_m)

            def step(max_tiles: int) -> None:
                run_step(layers, ranks, scales, row_slots, max_tiles, num_rows, shrink_config,
                         expand_config, tile_config)

            graph_exact = time_graph(lambda: step(exact))
            graph_any = time_graph(lambda: step(num_rows))
            eager_s = time_cuda(lambda: step(exact), 5, warmup=3) if eager else float("nan")
            itemsize = layers[0]["o"].a[0].element_size()
            moved = step_bytes(len(layers), num_rows, len(set(slots)), itemsize)
            rows.append((num_rows, mixture, graph_exact, graph_any, eager_s, moved))
    return rows


def bench_per_kernel(layers, ranks, scales, batches) -> None:
    """Each projection's shrink and expand on their own: a graph of that kernel over every
    layer, the model's configs (None: each kernel's choice for the step's rows), exact tiles;
    GB/s = the factor bytes of the batch's distinct adapters (A for the shrink, B for the
    expand) and t, x or out, over the graph's time; "into": the expand adding in place into bf16
    outputs (read and written) instead of writing fp32 deltas."""
    print(f"{'batch':>5} {'mixture':>9} {'group':>7} {'kernel':>6} {'us/layer':>9} "
          f"{'GB/s':>7} {'MB/layer':>9}")
    device = ranks.device
    itemsize = layers[0]["o"].a[0].element_size()
    for num_rows in batches:
        for mixture, slots in mixtures(num_rows).items():
            row_slots = torch.tensor(slots, dtype=torch.int64, device=device)
            tiles = LoraTiles.build(row_slots,
                                    count_tiles([slots.count(s) for s in sorted(set(slots))],
                                                TileConfig().block_m))
            distinct = len(set(slots))
            for name, (num_in, num_outs) in GROUPS.items():
                n = len(num_outs)
                ts = [shrink.lora_shrink(layer[name].x[:num_rows], layer[name].a, [ranks] * n,
                                         tiles, pdl_rows=PDL_ROWS) for layer in layers]
                chunks = shrink.num_k_chunks(num_in)

                def run_shrink() -> None:
                    for layer, t in zip(layers, ts):
                        g = layer[name]
                        shrink.lora_shrink(g.x[:num_rows], g.a, [ranks] * n, tiles, out=t,
                                           pdl_rows=PDL_ROWS)

                def run_expand() -> None:
                    for layer, t in zip(layers, ts):
                        g = layer[name]
                        expand.lora_expand(t, [o[:num_rows] for o in g.outs], g.b, [ranks] * n,
                                           [scales] * n, tiles, deltas=True, pdl_rows=PDL_ROWS)

                bf16_outs = [[torch.zeros(num_rows, o.shape[1], dtype=torch.bfloat16,
                                          device=device) for o in layer[name].outs]
                             for layer in layers]

                def run_expand_into() -> None:
                    for layer, t, outs in zip(layers, ts, bf16_outs):
                        expand.lora_expand(t, outs, layer[name].b, [ranks] * n, [scales] * n,
                                           tiles, pdl_rows=PDL_ROWS)

                t_bytes = n * num_rows * chunks * RANK * 4
                shrink_mb = (distinct * RANK * num_in * n * itemsize + num_rows * num_in * 2
                             + t_bytes) / 1e6
                expand_mb = (distinct * RANK * sum(num_outs) * itemsize + t_bytes
                             + num_rows * sum(num_outs) * 4) / 1e6
                into_mb = expand_mb + num_rows * sum(num_outs) * (2 * 2 - 4) / 1e6
                for kernel, fn, mb in (("shrink", run_shrink, shrink_mb),
                                       ("expand", run_expand, expand_mb),
                                       ("into", run_expand_into, into_mb)):
                    seconds = time_graph(fn) / len(layers)
                    print(f"{num_rows:>5} {mixture:>9} {name:>7} {kernel:>6} "
                          f"{seconds * 1e6:>9.2f} {mb / 1e3 / seconds:>7.0f} "
                          f"{mb:>9.2f}", flush=True)


def print_table(rows, num_layers: int) -> None:
    print(f"{'batch':>5} {'mixture':>9} {'graph us':>9} {'us/layer':>9} {'GB/s':>7} "
          f"{'any-mix us':>10} {'eager us':>9} {'MB moved':>9}")
    for num_rows, mixture, exact, any_mix, eager_s, moved in rows:
        print(f"{num_rows:>5} {mixture:>9} {exact * 1e6:>9.1f} {exact * 1e6 / num_layers:>9.2f} "
              f"{moved / exact / 1e9:>7.0f} {any_mix * 1e6:>10.1f} {eager_s * 1e6:>9.0f} "
              f"{moved / 1e6:>9.1f}")


# (block_r, block_k, k_chunk, num_warps, num_stages) and (block_n, num_warps, num_stages): the
# defaults' neighbours, deeper pipelines and wider loads (the MMA kernels, 2026-12-02).
SWEEP_SHRINK = [shrink.ShrinkConfig(16, 128, 512, 2, 4), shrink.ShrinkConfig(16, 128, 512, 4, 4),
                shrink.ShrinkConfig(16, 64, 512, 2, 6), shrink.ShrinkConfig(16, 256, 512, 2, 3),
                shrink.ShrinkConfig(16, 128, 1024, 2, 4)]
SWEEP_EXPAND = [expand.ExpandConfig(128, 4, 4), expand.ExpandConfig(128, 4, 6),
                expand.ExpandConfig(256, 4, 3), expand.ExpandConfig(256, 4, 4),
                expand.ExpandConfig(64, 2, 6), expand.ExpandConfig(512, 8, 3),
                expand.ExpandConfig(256, 8, 3), expand.ExpandConfig(128, 8, 3)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--batches", default="1,8,32,64,128")
    parser.add_argument("--sweep", action="store_true",
                        help="also time other tile configs (graph, exact tiles)")
    parser.add_argument("--sweep-batches", default="1,32,128", help="the sweep's batches")
    parser.add_argument("--sweep-kernels", default="shrink,expand",
                        help="which kernel's configs the sweep varies")
    parser.add_argument("--programs-per-sm", default="",
                        help="also time the default configs with these persistent-grid sizes "
                             "(TileConfig.programs_per_sm), e.g. 4,8,32")
    parser.add_argument("--table-dtype", choices=sorted(TABLE_DTYPES), default="bf16",
                        help="the LoRA tables' dtype (the model's: the adapters' stored one)")
    parser.add_argument("--per-kernel", action="store_true",
                        help="also time each projection's shrink and expand on their own")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_lora_kernels: needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    batches = [int(b) for b in args.batches.split(",")]
    torch.manual_seed(0)
    layers = make_layers(args.layers, max(batches), device, TABLE_DTYPES[args.table_dtype])
    ranks = torch.full((NUM_ADAPTERS + 1,), RANK, dtype=torch.int32, device=device)
    ranks[0] = 0
    scales = torch.rand(NUM_ADAPTERS + 1, device=device) + 0.5
    print(f"# LoRA shrink+expand, one decode step: {args.layers} layers x (qkv, o, gate_up, down); "
          f"hidden {HIDDEN}, intermediate {INTERMEDIATE}, rank {RANK}, {NUM_ADAPTERS} adapters "
          f"loaded, x bf16, tables {args.table_dtype}")
    print(f"# {conditions(device)}")
    print(f"# shrink {ShrinkConfig()}, expand {ExpandSteps()}")
    print("# graph us: the step replayed as a CUDA graph (exact tiles); any-mix us: the graph "
          "sized for any mixture; GB/s: MB moved / graph us")
    # None: each kernel's config for the step's rows, as the model takes them.
    print_table(bench(layers, ranks, scales, batches, None, None), args.layers)
    for per_sm in [int(n) for n in args.programs_per_sm.split(",") if n]:
        print(f"\n# default configs, {per_sm} programs per SM "
              f"(default {TileConfig().programs_per_sm})")
        print_table(bench(layers, ranks, scales, batches, ShrinkConfig(), ExpandConfig(),
                          eager=False, tile_config=TileConfig(programs_per_sm=per_sm)),
                    args.layers)
    if args.per_kernel:
        print("\n# each kernel on its own")
        bench_per_kernel(layers, ranks, scales, batches)
    if args.sweep:
        sweep_batches = [int(b) for b in args.sweep_batches.split(",") if b]
        if max(sweep_batches) > max(batches):
            layers = make_layers(args.layers, max(sweep_batches), device,
                                 TABLE_DTYPES[args.table_dtype])
        kernels = args.sweep_kernels.split(",")
        for config in SWEEP_SHRINK if "shrink" in kernels else []:
            print(f"\n# shrink {config}, expand default")
            print_table(bench(layers, ranks, scales, sweep_batches, config,
                              ExpandConfig(), eager=False), args.layers)
        for config in SWEEP_EXPAND if "expand" in kernels else []:
            print(f"\n# shrink default, expand {config}")
            print_table(bench(layers, ranks, scales, sweep_batches, ShrinkConfig(),
                              config, eager=False), args.layers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
