#!/usr/bin/env python3
"""Registers, spills and shared memory of lorad's decode-step Triton kernels on a GPU
architecture, compiled offline: no GPU needed, only triton (its wheel carries ptxas and
cuobjdump). A kernel that spills, or whose registers leave few programs per multiprocessor,
shows here before any device time is spent on it.

    python -m benchmarks.kernel_resources [--arch 90] [--expand BLOCK_N,WARPS ...]
        [--shrink BLOCK_R,BLOCK_K,K_CHUNK,WARPS,STAGES ...] [--block-m ROWS] [--only TEXT]

Each kernel is compiled with the constexprs, warps and stages the model launches it with at the
Llama-3-8B shape (hidden 4096, 32 q / 8 KV heads of 128, rank 16, bf16), pointers and the strides
triton would specialize marked 16-byte aligned as they are at run time. The figures are those of
the triton that is installed: the H200 image has triton 3.6, and another version compiles other
code (for that one: pip install --target DIR triton==3.6.0, then PYTHONPATH=DIR). `programs/SM`
is what registers alone allow (65,536 per multiprocessor, allocated per warp in units of 256);
shared memory or the hardware's cap of 32 may allow fewer.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from lorad.workers.kernels import (decode_gemv, fused_moe, fused_ops,  # noqa: E402
                                   lora_expand, lora_shrink, moe_glue, oneshot_reduce,
                                   paged_attention, row_matmul, token_draw)
from lorad.workers.kernels.configs import (DecodeAttentionConfig, ExpandConfig,  # noqa: E402
                                           ExpandSteps, GemvModelTiles, MoeConfig,
                                           ShrinkConfig, TileConfig)

FLOAT_SCALARS = {"scale", "eps"}
REGISTERS_PER_SM = 65536


@dataclass
class Spec:
    name: str
    fn: object  # a triton JITFunction
    constexprs: dict
    num_warps: int
    num_stages: int = 3
    # Element types of pointer arguments (default fp32) and of integer scalars (default i32).
    types: dict = field(default_factory=dict)
    # Integer arguments a multiple of 16 at the 8B shape, which triton specializes so at launch
    # (K 4096 or 14336, rank 16): without it a bf16 row's alignment is unknown and the compiler
    # pipelines no load of it.
    divisible: tuple[str, ...] = ()


def signature(spec: Spec) -> tuple[dict, dict]:
    """(signature, attrs) as ASTSource takes them: pointers and strides 16-aligned, as triton
    specializes them at launch, except the arguments the kernel keeps unspecialized."""
    fn = spec.fn
    unspecialized = {fn.arg_names[i] if isinstance(i, int) else i
                     for attr in ("do_not_specialize", "do_not_specialize_on_alignment")
                     for i in getattr(fn, attr, ())}
    sig, attrs = {}, {}
    for index, name in enumerate(fn.arg_names):
        if name in spec.constexprs:
            sig[name] = "constexpr"
            continue
        if name.endswith("_ptr"):
            sig[name] = "*" + spec.types.get(name, "fp32")
        elif name in FLOAT_SCALARS:
            sig[name] = "fp32"
        else:
            sig[name] = spec.types.get(name, "i32")
        aligned = name.endswith("_ptr") or name.startswith("stride") or name in spec.divisible
        if aligned and name not in unspecialized:
            attrs[(index,)] = [["tt.divisibility", 16]]
    return sig, attrs


def resources(spec: Spec, arch: int, tools: Path) -> dict:
    sig, attrs = signature(spec)
    kernel = triton.compile(ASTSource(fn=spec.fn, signature=sig, constexprs=spec.constexprs,
                                      attrs=attrs),
                            target=GPUTarget("cuda", arch, 32),
                            options={"num_warps": spec.num_warps,
                                     "num_stages": spec.num_stages})
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        dump = subprocess.run([str(tools / "cuobjdump"), "--dump-resource-usage", str(cubin)],
                              capture_output=True, text=True, check=True).stdout
    found = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", dump))
    registers = int(found.get("REG", 0))
    per_warp = -(-registers * 32 // 256) * 256
    return {"registers": registers, "spill_bytes": int(found.get("STACK", 0)),
            "shared": kernel.metadata.shared,
            "programs_per_sm": REGISTERS_PER_SM // max(per_warp * spec.num_warps, 1)}


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def lora_specs(shrink_configs, expand_configs, block_m: int) -> list[Spec]:
    specs = []
    lora_types = {"x_ptr": "bf16", "tile_rows_ptr": "i64", "tile_slot_ptr": "i64",
                  "num_tiles_ptr": "i64", **{f"ranks{i}_ptr": "i32" for i in range(3)},
                  **{f"out{i}_ptr": "bf16" for i in range(3)}}
    # (tables, their dtype): fp32, and bf16 (adapters stored in bf16, lora.table_dtype).
    variants = ((3, "fp32"), (1, "fp32"), (3, "bf16"))
    for config in shrink_configs:
        for tables, dtype in variants:
            specs.append(Spec(
                f"lora shrink, {tables} {dtype} table(s), {config}", lora_shrink._shrink_kernel,
                {"NUM_TABLES": tables, "BLOCK_M": block_m, "BLOCK_R": config.block_r,
                 "BLOCK_K": config.block_k, "K_CHUNK": config.k_chunk,
                 "NUM_STAGES": config.num_stages, "X_PARTS": 1,
                 "A_PARTS": lora_shrink.bf16_parts(DTYPES[dtype]), "PDL": True},
                config.num_warps, config.num_stages,
                {**lora_types, **{f"a{i}_ptr": dtype for i in range(3)}},
                ("K", "max_rank0", "max_rank1", "max_rank2")))
    for config in expand_configs:
        for tables, dtype in variants:
            specs.append(Spec(
                f"lora expand, {tables} {dtype} table(s), {config}", lora_expand._expand_kernel,
                {"NUM_TABLES": tables, "BLOCK_M": block_m, "BLOCK_N": config.block_n,
                 "RANK_PAD": 16, "MAX_CHUNKS": 8, "B_PARTS": lora_shrink.bf16_parts(DTYPES[dtype]),
                 "NUM_STAGES": config.num_stages, "DELTA": True, "PDL": True},
                config.num_warps, config.num_stages,
                # The model's way: fp32 delta buffers (lora.LoraDelta).
                {**lora_types, **{f"out{i}_ptr": "fp32" for i in range(3)},
                 **{f"b{i}_ptr": dtype for i in range(3)}},
                ("N0", "N1", "N2", "max_rank0", "max_rank1", "max_rank2")))
    return specs


def model_gemv_tiles() -> list:
    """The decode GEMV tiles the model uses (bf16 weights), each once."""
    tiles = GemvModelTiles()
    configs = [tiles.config(name, torch.bfloat16) for name in ("qkv", "gate_up", "o", "down")]
    return list(dict.fromkeys(c for c in configs if c is not None))


def model_specs() -> list[Spec]:
    """The decode step's other kernels at the 8B shape."""
    bf16 = "bf16"
    # With every LoRA delta added, as the model launches them with adapters loaded.
    lora = {"row_slots_ptr": "i64", **{f"{name}_ranks_ptr": "i32"
                                       for name in ("lora", "lq", "lk", "lv", "lg", "lu")}}
    attention = DecodeAttentionConfig()
    split = {"GROUP": 4, "HEAD_DIM": 128, "BLOCK_SIZE": 16, "SPLIT": attention.split_size,
             "TILE": attention.tile_tokens, "BLOCK_H": 16, "BLOCK_D": 128,
             "DOT_PRECISION": "tf32", "LINES": 2, "LINE_ELEMS": 64, "PDL": True}
    split_types = {"q_ptr": bf16, "k_cache_ptr": bf16, "v_cache_ptr": bf16, "tables_ptr": "i32",
                   "lens_ptr": "i32"}
    return [
        # Up to attention.prefetch_max_seqs sequences with the L2 prefetch (and, at one, the
        # early block ids), more without.
        *(Spec(f"decode attention, split{' + prefetch' if prefetch else ''}",
               paged_attention._decode_split_kernel,
               {**split, "PREFETCH": prefetch, "PRELOAD": prefetch},
               attention.num_warps, attention.num_stages, split_types)
          for prefetch in (True, False)),
        Spec("decode attention, reduce", paged_attention._decode_reduce_kernel,
             {"HEAD_DIM": 128, "SPLIT": attention.split_size, "BLOCK_D": 128,
              "GROUP_SPLITS": attention.reduce_group, "PDL": True}, 1, 3,
             {"lens_ptr": "i32", "out_ptr": bf16}),
        Spec("add + RMSNorm", fused_ops._add_rms_norm_kernel,
             {"HAS_RES": True, "HAS_LORA": True, "BLOCK": 4096, "PDL": True},
             fused_ops._norm_warps(4096), 3,
             {"delta_ptr": bf16, "res_ptr": bf16, "res_out_ptr": bf16, "normed_ptr": bf16,
              "weight_ptr": bf16, **lora}),
        # The one-shot all-reduce at world 2, with its flag barrier (--all-reduce oneshot).
        Spec("one-shot all-reduce, sum", oneshot_reduce._oneshot_sum_kernel,
             {"WORLD": 2, "BLOCK": oneshot_reduce.SUM_BLOCK, "SYNC": True}, 4, 3,
             {"data_ptr": "i64", "signal_table_ptr": "i64", "counters_ptr": "i32"}),
        Spec("one-shot all-reduce + add + RMSNorm", oneshot_reduce._oneshot_add_rms_norm_kernel,
             {"WORLD": 2, "BLOCK": 4096, "HAS_RES": True, "SYNC": True},
             fused_ops._norm_warps(4096), 3,
             {"data_ptr": "i64", "signal_table_ptr": "i64", "counters_ptr": "i32",
              "res_ptr": bf16, "res_out_ptr": bf16, "normed_ptr": bf16, "weight_ptr": bf16}),
        Spec("rotary + KV write", fused_ops._rotary_kv_kernel,
             {"HEAD_DIM": 128, "HAS_LQ": True, "HAS_LK": True, "HAS_LV": True, "PDL": True}, 1, 3,
             {"q_ptr": bf16, "k_ptr": bf16, "v_ptr": bf16, "q_out_ptr": bf16,
              "positions_ptr": "i64", "slots_ptr": "i64", "k_cache_ptr": bf16,
              "v_cache_ptr": bf16, **lora}),
        Spec("silu * up", fused_ops._silu_mul_kernel,
             {"BLOCK": fused_ops.SILU_BLOCK, "HAS_LG": True, "HAS_LU": True, "PDL": True}, 4, 3,
             {"gate_ptr": bf16, "up_ptr": bf16, "out_ptr": bf16, **lora}),
        *(gemv_spec(config, 4096) for config in model_gemv_tiles()),
        Spec("token draw, chunk stats", token_draw._chunk_stats_kernel,
             {"CHUNK": token_draw.CHUNK}, token_draw._warps(token_draw.CHUNK), 3, {}),
    ]


def moe_specs() -> list[Spec]:
    """The fused MoE kernels and the block's glue at Qwen1.5-MoE-A2.7B's shape
    (scripts/configs/qwen1.5-moe-a2.7b: hidden 2048, 60 experts of intermediate 1408, top 4,
    bf16), launched with PDL as MoeConfig.pdl does."""
    config = MoeConfig()
    tiles = {"BLOCK_M": config.block_m, "BLOCK_N": config.block_n, "BLOCK_K": config.block_k,
             "PDL": True}
    tables = {"pair_order_ptr": "i64", "tile_expert_ptr": "i32", "tile_start_ptr": "i32",
              "tile_count_ptr": "i32"}
    return [
        Spec(f"fused MoE, gate/up + silu * up, {config}", fused_moe._gate_up_kernel,
             {**tiles, "TOP_K": 4}, config.num_warps, config.num_stages,
             {"x_ptr": "bf16", "w_ptr": "bf16", "h_ptr": "bf16", **tables}, ("N", "K")),
        Spec(f"fused MoE, down x routing weight, {config}", fused_moe._down_kernel, tiles,
             config.num_warps, config.num_stages,
             {"h_ptr": "bf16", "w_ptr": "bf16", "weight_ptr": "bf16", **tables}, ("H", "N")),
        Spec("MoE tile tables, one program", fused_moe._expert_tiles_kernel,
             {"NUM_EXPERTS": 60, "BLOCK_M": config.block_m,
              "BLOCK_P": fused_moe.TILE_KERNEL_MAX_PAIRS, "BLOCK_E": 64, "BLOCK_T": 128,
              "PDL": True}, 4, 3,
             {"experts_ptr": "i64", **tables}),
        Spec("MoE route, 60 experts top 4", moe_glue._route_kernel,
             {"TOP_K": 4, "NORM": False, "HAS_PADDING": True, "BLOCK_E": 64, "LOG_E": 6,
              "PDL": True}, 1, 3,
             {"logits_ptr": "bf16", "real_rows_ptr": "i1", "weights_ptr": "bf16",
              "experts_ptr": "i64"}),
        Spec("MoE epilogue, routed + sigmoid(gate) * shared", moe_glue._epilogue_kernel,
             {"TOP_K": 4, "HAS_PADDING": True, "BLOCK": moe_glue.EPILOGUE_BLOCK, "PDL": True},
             4, 3,
             {"real_rows_ptr": "i1", "gate_ptr": "bf16"}, ("H",)),
        Spec("MoE epilogue + add + RMSNorm (MoeConfig.fold_epilogue)",
             moe_glue._epilogue_add_norm_kernel,
             {"TOP_K": 4, "HAS_PADDING": True, "BLOCK": 2048, "PDL": True},
             fused_ops._norm_warps(2048), 3,
             {"real_rows_ptr": "i1", "gate_ptr": "bf16", "res_ptr": "bf16", "normed_ptr": "bf16",
              "weight_ptr": "bf16"}, ("H",)),
    ]


def row_matmul_specs() -> list[Spec]:
    """The row-invariant matmul with the tiles benchmarks/probe_row_matmul.py compares."""
    from benchmarks.probe_row_matmul import TILES
    return [Spec(f"row matmul, {name}, {config}", row_matmul._row_matmul_kernel,
                 {"BLOCK_M": config.block_m, "BLOCK_N": config.block_n,
                  "BLOCK_K": config.block_k, "GROUP_M": config.group_m, "EVEN_K": True,
                  "NUM_STAGES": config.num_stages},
                 config.num_warps, config.num_stages,
                 {"x_ptr": "bf16", "w_ptr": "bf16", "out_ptr": "fp32"}, ("N", "K"))
            for name, config in TILES.items()]


def gemv_spec(config, k: int) -> Spec:
    """The decode GEMV of the model's base projections, K = k."""
    return Spec(f"decode GEMV, K {k}, {config}", decode_gemv._decode_gemv_kernel,
                {"BLOCK_M": config.block_m, "BLOCK_N": config.block_n, "BLOCK_K": config.block_k,
                 "EVEN_K": k % config.block_k == 0, "NUM_STAGES": config.num_stages,
                 "HAS_BIAS": False, "PDL": True},
                config.num_warps, config.num_stages,
                {"x_ptr": "bf16", "w_ptr": "bf16", "out_ptr": "bf16", "bias_ptr": "bf16"},
                ("N", "K"))


def parse_configs(texts, make, fields: int) -> list:
    configs = []
    for text in texts:
        values = [int(v) for v in text.split(",")]
        if len(values) != fields:
            raise SystemExit(f"{text!r}: expected {fields} comma-separated integers")
        configs.append(make(*values))
    return configs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10 (H200: 90)")
    p.add_argument("--shrink", action="append", default=[],
                   help="BLOCK_R,BLOCK_K,K_CHUNK,WARPS,STAGES: also this shrink config")
    p.add_argument("--expand", action="append", default=[],
                   help="BLOCK_N,WARPS: also this expand config (default stages)")
    p.add_argument("--block-m", type=int, default=TileConfig().block_m,
                   help=f"rows per LoRA tile (lorad: {TileConfig().block_m})")
    p.add_argument("--only", default="", help="only the kernels whose name holds this text")
    args = p.parse_args()
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not (tools / "cuobjdump").exists():
        print(f"kernel_resources: no cuobjdump in {tools}", file=sys.stderr)
        return 2
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # quiets triton 3.9's notice
    steps = ExpandSteps()
    shrinks = [ShrinkConfig()] + parse_configs(args.shrink, ShrinkConfig, 5)
    expands = [steps.large, steps.small] + parse_configs(
        args.expand, lambda n, w: ExpandConfig(n, w), 2)
    specs = (lora_specs(shrinks, expands, args.block_m) + model_specs() + moe_specs()
             + row_matmul_specs())
    print(f"# triton {triton.__version__}, sm_{args.arch}, LoRA tiles of {args.block_m} rows; "
          f"registers per thread, spill bytes per thread (stack), shared bytes per program, "
          f"programs/SM that registers allow")
    print(f"{'registers':>9} {'spills':>6} {'shared':>7} {'programs/SM':>11}  kernel")
    failed = 0
    for spec in specs:
        if args.only and args.only not in spec.name:
            continue
        try:
            r = resources(spec, args.arch, tools)
        except Exception as exc:  # one kernel's failure must not hide the others
            failed += 1
            print(f"{'-':>9} {'-':>6} {'-':>7} {'-':>11}  {spec.name}: failed: "
                  f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
            continue
        print(f"{r['registers']:>9} {r['spill_bytes']:>6} {r['shared']:>7} "
              f"{r['programs_per_sm']:>11}  {spec.name} ({spec.num_warps} warps)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
