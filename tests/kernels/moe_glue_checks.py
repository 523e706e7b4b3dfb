"""Checks of the MoE block's glue kernels (kernels/moe_glue.py's route, epilogue and epilogue
with the next add + norm, kernels/fused_moe.py's one-program tile tables) against the torch ops or
launches they replace (kernels/moe_math.py, fused_moe.expert_tiles, fused_moe's old composition,
the epilogue then fused_ops' add + norm), bit for bit, on any device.

test_triton_interpreted.py runs them on CPU tensors under TRITON_INTERPRET=1;
tests/gpu/test_moe_kernel_gpu.py calls them on CUDA at Qwen1.5-MoE-A2.7B's shapes. Fresh random
inputs, ties forced, padding rows, every buffer a kernel writes poisoned first.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from types import SimpleNamespace

import torch

from tests.kernels.triton_interpreter import run_checks

POISON = float("nan")
INT_POISON = -7777


def _logits(device, dtype, num_rows, num_experts, seed):
    """Random logits with ties: in each row expert 7's logit copied to experts 3 and 11 (and,
    in bf16, many more ties of rounding); a few rows all equal."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, num_experts, generator=gen) * 3
    logits[:, [3, 11]] = logits[:, 7:8].clone()
    logits[::5] = 0.5
    return logits.to(dtype=dtype, device=device)


def _real_rows(device, num_rows, seed):
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(num_rows, generator=gen) > 0.3).to(device)


def check_route(device: str, dtype: torch.dtype, num_rows: int, norm: bool,
                num_experts: int = 60, top_k: int = 4, seed: int = 0) -> None:
    """moe_glue.route against moe_math.route, padding rows or none, poisoned outputs; and a
    row's bits alone."""
    from lorad.workers.kernels import moe_glue, moe_math
    logits = _logits(device, dtype, num_rows, num_experts, seed)
    where = f"route {dtype} rows {num_rows} norm {norm}"
    for real_rows in (None, _real_rows(device, num_rows, seed)):
        out = (torch.full((num_rows, top_k), POISON, dtype=dtype, device=device),
               torch.full((num_rows, top_k), INT_POISON, dtype=torch.int64, device=device))
        got = moe_glue.route(logits, top_k, norm, real_rows, out=out)
        want = moe_math.route(logits, top_k, norm, real_rows)
        for name, a, b in zip(("weights", "experts"), got, want):
            if not torch.equal(a.cpu(), b.cpu()):
                bad = int((a != b).any(1).sum())
                raise AssertionError(f"{where} padding {real_rows is not None}: {name} differ "
                                     f"in {bad} rows")
    last = moe_glue.route(logits[-1:], top_k, norm)
    if not all(torch.equal(a[0], b[-1]) for a, b in zip(last, moe_glue.route(logits, top_k,
                                                                              norm))):
        raise AssertionError(f"{where}: the last row alone gave other bits")


def check_route_picks(device: str) -> None:
    """moe_math.route's choices on ties: the lowest experts first (a row of equal logits picks
    0..top_k-1, equal weights), as the kernel does (check_route)."""
    from lorad.workers.kernels import moe_glue, moe_math
    logits = torch.zeros(2, 8, device=device)
    logits[1, [6, 2, 5]] = 1.0
    for fn in (moe_math.route, moe_glue.route):
        weights, experts = fn(logits, 3, False)
        if experts.cpu().tolist() != [[0, 1, 2], [2, 5, 6]]:
            raise AssertionError(f"{fn.__module__}: picked {experts.tolist()}")
        if not torch.equal(weights[0], weights[0, :1].expand(3)):
            raise AssertionError(f"{fn.__module__}: unequal weights of equal logits")


def _sorted_experts(device, num_rows, num_experts, top_k, seed):
    """Each row's top_k distinct experts ascending, padding rows (30%) all num_experts."""
    gen = torch.Generator().manual_seed(seed)
    experts = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k]
                           for _ in range(num_rows)]).sort(dim=1).values
    real = _real_rows("cpu", num_rows, seed)
    return torch.where(real[:, None], experts, num_experts).to(device)


def check_tiles_kernel(device: str, num_rows: int, num_experts: int = 60, top_k: int = 4,
                       block_m: int = 16, seed: int = 2, block_p: int | None = None) -> None:
    """expert_tiles_kernel's four tables equal expert_tiles', entry for entry (poisoned), over
    a pair block of block_p (None: the largest, TILE_KERNEL_MAX_PAIRS)."""
    from lorad.workers.kernels.fused_moe import (TILE_KERNEL_MAX_PAIRS, expert_tiles,
                                                 expert_tiles_kernel, tile_bound)
    experts = _sorted_experts(device, num_rows, num_experts, top_k, seed)
    num_tiles = tile_bound(num_rows * top_k, num_experts, block_m)
    out = (torch.full((num_rows * top_k,), INT_POISON, dtype=torch.int64, device=device),
           *(torch.full((num_tiles,), INT_POISON, dtype=torch.int32, device=device)
             for _ in range(3)))
    got = expert_tiles_kernel(experts, num_experts, block_m, out=out,
                              block_p=block_p or TILE_KERNEL_MAX_PAIRS)
    want = expert_tiles(experts, num_experts, block_m)
    for name, a, b in zip(("pair_order", "tile_expert", "tile_start", "tile_count"), got, want):
        if a.dtype != b.dtype or not torch.equal(a.cpu(), b.cpu()):
            raise AssertionError(f"tiles, {num_rows} rows of {num_experts} experts top "
                                 f"{top_k}, pair block {block_p}: {name} differs")
    _check_tile_cover(want, experts, num_experts, block_m, f"tiles, {num_rows} rows")


def check_tile_cover(device: str, num_experts: int = 60, top_k: int = 4,
                     block_m: int = 16) -> None:
    """expert_tiles' tables (tile_bound of them) give every pair of an expert a place in one
    tile of that expert, at the extremes of the bound: every pair a different expert (as many
    tiles as pairs), every row the same experts (full tiles), one row, padding rows."""
    from lorad.workers.kernels.fused_moe import expert_tiles
    distinct = torch.arange(num_experts - num_experts % top_k).view(-1, top_k)
    same = torch.arange(top_k).expand(3 * block_m + 1, top_k)
    padded = torch.cat([distinct[:3], torch.full((2, top_k), num_experts)])
    for name, experts in (("distinct", distinct), ("distinct, 2 rows", distinct[:2]),
                          ("one row", distinct[:1]), ("same", same), ("padding", padded)):
        experts = experts.contiguous().to(device)
        _check_tile_cover(expert_tiles(experts, num_experts, block_m), experts, num_experts,
                          block_m, name)


def _check_tile_cover(tables, experts, num_experts, block_m, where) -> None:
    """Each pair of an expert lies in exactly one tile, of its expert, of at most block_m
    pairs; no pair of no expert (padding) does."""
    pair_order, tile_expert, tile_start, tile_count = (t.cpu() for t in tables)
    flat = experts.reshape(-1).cpu()
    seen = torch.zeros(flat.numel(), dtype=torch.int64)
    for e, start, count in zip(tile_expert.tolist(), tile_start.tolist(), tile_count.tolist()):
        if e < 0:
            continue
        if not 0 < count <= block_m:
            raise AssertionError(f"{where}: a tile of expert {e} holds {count} pairs")
        pairs = pair_order[start:start + count]
        if not torch.all(flat[pairs] == e):
            raise AssertionError(f"{where}: a tile of expert {e} holds another's pairs")
        seen[pairs] += 1
    want = (flat < num_experts).to(torch.int64)
    if not torch.equal(seen, want):
        raise AssertionError(f"{where}: {int((seen < want).sum())} pairs in no tile, "
                             f"{int((seen > want).sum())} in a tile too many")


def _epilogue_inputs(device, dtype, num_rows, hidden, top_k, seed):
    """-> (the generator, then pairs [num_rows, top_k, hidden] fp32, gate [num_rows, 1] of
    dtype with logits past +-80 in its first rows, shared [num_rows, hidden] fp32)."""
    gen = torch.Generator().manual_seed(seed)
    pairs = torch.randn(num_rows, top_k, hidden, generator=gen).to(device)
    gate = (torch.randn(num_rows, 1, generator=gen) * 30).to(dtype=dtype, device=device)
    gate[:2, 0] = torch.tensor([95.0, -95.0])[:num_rows]  # exp_fp32's clamps
    shared = torch.randn(num_rows, hidden, generator=gen).to(device)
    return gen, pairs, gate, shared


def check_epilogue(device: str, dtype: torch.dtype, num_rows: int = 9, hidden: int = 700,
                   top_k: int = 4, seed: int = 3) -> None:
    """moe_glue.epilogue against fused_moe's add_experts, torch's where, moe_math.sigmoid and
    the add, with and without padding rows (their pairs NaN), gate logits past +-80 too."""
    from lorad.workers.kernels.fused_moe import add_experts
    from lorad.workers.kernels.moe_glue import epilogue
    from lorad.workers.kernels.moe_math import sigmoid
    _, pairs, gate, shared = _epilogue_inputs(device, dtype, num_rows, hidden, top_k, seed)
    for real_rows in (None, _real_rows(device, num_rows, seed)):
        if real_rows is not None:
            pairs[~real_rows] = POISON
        out = torch.full_like(shared, POISON)
        got = epilogue(pairs, gate, shared, real_rows, out=out)
        routed = add_experts(pairs)
        if real_rows is not None:
            routed = torch.where(real_rows[:, None], routed, 0.0)
        want = routed + sigmoid(gate).float() * shared
        if not torch.equal(got.cpu(), want.cpu()):
            raise AssertionError(f"epilogue {dtype} padding {real_rows is not None}: "
                                 f"{int((got != want).any(1).sum())} rows differ")


def check_epilogue_add_norm(device: str, dtype: torch.dtype, num_rows: int = 9,
                            hidden: int = 700, top_k: int = 4, seed: int = 3) -> None:
    """moe_glue.epilogue_add_norm against its two launches, epilogue then fused_ops'
    add_rms_norm, with and without padding rows (their pairs NaN), gate logits past +-80 too:
    the residual bit for bit; the normed rows bit for bit under the interpreter, and on CUDA
    (where add_rms_norm's compiler may fuse the sum of squares' multiply-adds, this launch's
    may not) within two roundings of the model dtype; a row alone the same bits as in the
    batch."""
    from lorad.workers.kernels.fused_ops import add_rms_norm
    from lorad.workers.kernels.moe_glue import epilogue, epilogue_add_norm
    gen, pairs, gate, shared = _epilogue_inputs(device, dtype, num_rows, hidden, top_k, seed)
    residual = (torch.randn(num_rows, hidden, generator=gen) * 4).to(dtype=dtype, device=device)
    weight = (1 + torch.rand(hidden, generator=gen)).to(dtype=dtype, device=device)
    for real_rows in (None, _real_rows(device, num_rows, seed)):
        where = f"epilogue + add + norm {dtype} padding {real_rows is not None}"
        if real_rows is not None:
            pairs[~real_rows] = POISON
        got_res, got = epilogue_add_norm(pairs, gate, shared, real_rows, residual.clone(),
                                         weight, 1e-6)
        want_res, want = add_rms_norm(epilogue(pairs, gate, shared, real_rows),
                                      residual.clone(), weight, 1e-6)
        if not torch.equal(got_res.cpu(), want_res.cpu()):
            raise AssertionError(f"{where}: {int((got_res != want_res).any(1).sum())} rows' "
                                 "residual differ")
        exact = device == "cpu"
        if not (torch.equal(got.cpu(), want.cpu()) if exact else torch.allclose(
                got.float(), want.float(), rtol=2 * torch.finfo(dtype).eps, atol=0)):
            raise AssertionError(f"{where}: normed rows differ (max "
                                 f"{(got.float() - want.float()).abs().max().item():.2e})")
        last = num_rows - 1
        _, alone = epilogue_add_norm(pairs[last:], gate[last:], shared[last:],
                                     None if real_rows is None else real_rows[last:],
                                     residual[last:].clone(), weight, 1e-6)
        if not torch.equal(alone[0].cpu(), got[last].cpu()):
            raise AssertionError(f"{where}: the last row alone gave other bits")


def _block(device, dtype, hidden, num_experts, top_k, inter, shared_inter, norm, seed):
    from lorad.workers.moe import SparseMoeBlock
    from lorad.workers.parallel import TensorParallel
    from lorad.workers.tuning import Tuning
    config = SimpleNamespace(hidden_size=hidden, num_experts=num_experts,
                             num_experts_per_tok=top_k, norm_topk_prob=norm,
                             moe_intermediate_size=inter,
                             shared_expert_intermediate_size=shared_inter)
    block = SparseMoeBlock(config, TensorParallel(0, 1, torch.device(device)), dtype,
                           torch.device(device), Tuning())
    gen = torch.Generator().manual_seed(seed)
    for param in block.parameters():
        fan_in = param.shape[-1]
        param.data.copy_(torch.randn(param.shape, generator=gen) * fan_in ** -0.5)
    return block


def check_block(device: str, dtype: torch.dtype, num_rows: int, norm: bool = False,
                hidden: int = 64, num_experts: int = 12, top_k: int = 4, inter: int = 32,
                shared_inter: int = 48, seed: int = 5, pdl: bool = False) -> None:
    """SparseMoeBlock.forward on the kernel path (route, tiles, two expert kernels, epilogue)
    against the composition it replaced there (moe_math.route, fused_moe with its sort and
    add_experts, torch's sigmoid scale and add), bit for bit, with padding rows; and row 0
    alone (among padding rows) against the row in a step of up to 16 rows. pdl: the block's
    kernels launched with PDL (MoeConfig.pdl, a step limit of 512 rows; on CUDA 9.0+ only)."""
    from lorad.workers.kernels import moe_math
    from lorad.workers.kernels.fused_moe import fused_moe
    from lorad.workers.lora_rows import LoraRows
    from lorad.workers.models.llama import plan_module_matmuls
    from lorad.workers.tuning import Tuning
    block = _block(device, dtype, hidden, num_experts, top_k, inter, shared_inter, norm, seed)
    block.experts.config = dataclasses.replace(block.experts.config, pdl=pdl)
    if device != "cpu":  # the shared expert's matmul plans, as the engine measures them at start
        plan_module_matmuls(block, 16, Tuning().matmul)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, hidden, generator=gen).to(dtype=dtype, device=device)
    real_rows = _real_rows(device, num_rows, seed)
    real_rows[0] = True
    lora = LoraRows(slots=(), groups=[], pdl_rows=512 if pdl else 0)
    where = f"block {dtype} rows {num_rows} norm {norm} pdl {pdl}"
    with _kernel_path(device):
        got = _sum(block(x, lora, SimpleNamespace(real_rows=real_rows))[0])
        weights, experts = moe_math.route(block.gate(x), top_k, norm)
        routed = fused_moe(x, block.experts.gate_up, block.experts.down, weights, experts,
                           block.experts.config, real_rows=real_rows)
        scale = moe_math.sigmoid(block.shared_expert_gate(x)).float()
        want = routed + scale * block.shared_expert.partial_sum(x, lora)
        if not torch.equal(got.cpu(), want.cpu()):
            raise AssertionError(f"{where}: {int((got != want).any(1).sum())} rows differ from "
                                 "the old composition")
        padding = torch.zeros(7, dtype=torch.bool, device=device)
        alone = _sum(block(torch.cat([x[:1], x[:7]]), lora,
                           SimpleNamespace(real_rows=torch.cat([real_rows[:1], padding])))[0])
    # Up to 16 rows only: past the decode GEMV's rows the shared expert's base matmul is
    # another kernel (MKL's on the CPU), whose bits are not this block's.
    if num_rows <= 16 and not torch.equal(alone[0].cpu(), got[0].cpu()):
        raise AssertionError(f"{where}: row 0 alone gave other bits")


def _sum(out) -> torch.Tensor:
    """The block's output as a tensor: a MoeSum (one rank, MoeConfig.fold_epilogue) through
    its epilogue launch."""
    return out if isinstance(out, torch.Tensor) else out.tensor()


class _kernel_path:
    """The block's kernel path: on CPU tensors through LORAD_TEST_KERNELS_ON_CPU (CUDA has it)."""

    def __init__(self, device: str) -> None:
        self.on_cpu = device == "cpu"

    def __enter__(self):
        from lorad.workers.kernel_path import KERNELS_ON_CPU_ENV
        if self.on_cpu:
            os.environ[KERNELS_ON_CPU_ENV] = "1"

    def __exit__(self, *exc):
        from lorad.workers.kernel_path import KERNELS_ON_CPU_ENV
        if self.on_cpu:
            os.environ.pop(KERNELS_ON_CPU_ENV, None)


CHECKS = {
    **{f"route_{name}_{rows}_norm{int(norm)}": (check_route, dict(
        dtype=dtype, num_rows=rows, norm=norm))
       for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))
       for rows in (1, 7, 33, 64) for norm in (False, True)},
    "route_ties_lowest_first": (check_route_picks, {}),
    **{f"tiles_kernel_{rows}": (check_tiles_kernel, dict(num_rows=rows))
       for rows in (1, 7, 33, 64, 128)},
    # The small steps' pair block (MoeConfig.small_step_rows), full and part full.
    **{f"tiles_kernel_{rows}_block_{block}": (check_tiles_kernel, dict(num_rows=rows,
                                                                      block_p=block))
       for rows, block in ((1, 16), (8, 32), (16, 64), (9, 64))},
    "tiles_kernel_few_experts": (check_tiles_kernel, dict(num_rows=40, num_experts=4, top_k=2)),
    "tiles_kernel_16_experts": (check_tiles_kernel, dict(num_rows=50, num_experts=16, top_k=3)),
    "tile_cover": (check_tile_cover, {}),
    "tile_cover_few_experts": (check_tile_cover, dict(num_experts=8, top_k=2, block_m=4)),
    "epilogue_fp32": (check_epilogue, dict(dtype=torch.float32)),
    "epilogue_bf16": (check_epilogue, dict(dtype=torch.bfloat16)),
    "epilogue_add_norm_fp32": (check_epilogue_add_norm, dict(dtype=torch.float32)),
    "epilogue_add_norm_bf16": (check_epilogue_add_norm, dict(dtype=torch.bfloat16)),
    "block_fp32_8": (check_block, dict(dtype=torch.float32, num_rows=8)),
    "block_bf16_8_norm": (check_block, dict(dtype=torch.bfloat16, num_rows=8, norm=True)),
    "block_fp32_16": (check_block, dict(dtype=torch.float32, num_rows=16)),
    "block_fp32_8_pdl": (check_block, dict(dtype=torch.float32, num_rows=8, pdl=True)),
    "block_fp32_33_norm": (check_block, dict(dtype=torch.float32, num_rows=33, norm=True)),
    # 150 rows x 4: past TILE_KERNEL_MAX_PAIRS, expert_tiles' torch tables
    "block_bf16_150": (check_block, dict(dtype=torch.bfloat16, num_rows=150)),
}


def main(names: list[str]) -> int:
    return run_checks(CHECKS, names)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
