"""Checks of the fused elementwise kernels (lorad/workers/kernels/fused_ops.py) against the torch
path they replace (RMSNorm and silu_and_mul in lorad.workers.layers, apply_rotary and the cache
write in lorad.workers.rotary / kv_cache), on any device.

tests/unit/test_triton_interpreted.py runs them on CPU tensors under TRITON_INTERPRET=1 in a
subprocess; tests/gpu/test_fused_ops_gpu.py calls them on CUDA at Llama-3-8B's sizes. Each check
takes fresh random inputs, poisons every output the kernel must write, and raises AssertionError
naming what differed: the result against the torch path (equal up to the kernel's own sum order
and exp), untouched elements (padding rows' cache slots), and a row's bits across batch sizes.
"""

from __future__ import annotations

import sys

import torch

from tests.triton_interpreter import run_checks

POISON = float("nan")


def assert_close(name: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """Within a few roundings of the dtype: the kernels round where the torch path does, but may
    sum (RMSNorm) or exponentiate (silu) in another way, which can move a rounding by one ulp."""
    got, want = got.float().cpu(), want.float().cpu()
    if torch.isnan(got).any():
        raise AssertionError(f"{name}: {int(torch.isnan(got).sum())} elements never written")
    eps = torch.finfo(dtype).eps
    err = ((got - want).abs() / (want.abs() + 1.0)).max().item()
    if err > 4 * eps:
        raise AssertionError(f"{name}: relative error {err:.3g} over 4 eps of {dtype}")


def _rand(gen: torch.Generator, *shape: int, dtype: torch.dtype, device: str,
          scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=device)


def check_add_rms_norm(device: str, dtype: torch.dtype = torch.bfloat16, hidden: int = 48,
                       num_rows: int = 11) -> None:
    """add_rms_norm against `residual + delta.to(dtype)` then RMSNorm, with an fp32 delta (a
    row-parallel sum), a model-dtype delta (the embedding, no residual), and in place."""
    from lorad.workers.kernels.fused_ops import add_rms_norm
    from lorad.workers.layers import RMSNorm
    gen = torch.Generator().manual_seed(7)
    norm = RMSNorm(hidden, 1e-5, dtype, torch.device(device))
    norm.weight.data.copy_(_rand(gen, hidden, dtype=dtype, device=device))
    for delta_dtype, with_residual in ((torch.float32, True), (dtype, False)):
        delta = _rand(gen, num_rows, hidden, dtype=delta_dtype, device=device, scale=3.0)
        residual = _rand(gen, num_rows, hidden, dtype=dtype, device=device) if with_residual \
            else None
        want_hidden = delta.to(dtype) if residual is None else residual + delta.to(dtype)
        want_normed = norm(want_hidden)
        res_in = None if residual is None else residual.clone()
        got_hidden, got_normed = add_rms_norm(delta, res_in, norm.weight, norm.eps)
        where = f"add_rms_norm delta {delta_dtype} residual {with_residual}"
        if not torch.equal(got_hidden.cpu(), want_hidden.cpu()):
            raise AssertionError(f"{where}: the residual sum differs (it must be bit-equal)")
        if res_in is not None and got_hidden.data_ptr() != res_in.data_ptr():
            raise AssertionError(f"{where}: the residual was not updated in place")
        assert_close(where, got_normed, want_normed, dtype)
        # A row's bits alone and among others.
        one_hidden, one_normed = add_rms_norm(
            delta[3:4], None if residual is None else residual[3:4].clone(), norm.weight,
            norm.eps)
        if not torch.equal(one_normed.cpu(), got_normed[3:4].cpu()):
            raise AssertionError(f"{where}: row 3 alone differs from row 3 in the batch")


def check_silu_and_mul(device: str, dtype: torch.dtype = torch.bfloat16, n: int = 2500,
                       num_rows: int = 5) -> None:
    """silu_and_mul on the two halves of one projection output (strided rows) against the torch
    path; a row alone gives the same bits. n spans several column blocks with a ragged end."""
    from lorad.workers.kernels.fused_ops import silu_and_mul
    from lorad.workers import layers
    gen = torch.Generator().manual_seed(11)
    gate_up = _rand(gen, num_rows, 2 * n, dtype=dtype, device=device, scale=4.0)
    gate, up = gate_up.chunk(2, dim=1)
    g = gate.cpu().float()
    want = (g / (1 + torch.exp(-g))).to(dtype) * up.cpu()  # layers.silu_and_mul's torch path
    got = silu_and_mul(gate, up)
    assert_close(f"silu_and_mul {dtype}", got, want, dtype)
    if not torch.equal(silu_and_mul(gate[2:3], up[2:3]).cpu(), got[2:3].cpu()):
        raise AssertionError("silu_and_mul: row 2 alone differs from row 2 in the batch")
    if device != "cpu":  # the dispatcher picks the kernel on CUDA
        if not torch.equal(layers.silu_and_mul(gate, up).cpu(), got.cpu()):
            raise AssertionError("layers.silu_and_mul does not run the kernel on CUDA")


def check_rotary_write_kv(device: str, dtype: torch.dtype = torch.bfloat16,
                          num_q_heads: int = 6, num_kv_heads: int = 2, head_dim: int = 16,
                          block_size: int = 4) -> None:
    """rotary_write_kv on column slices of one q/k/v output against apply_rotary and
    PagedKVCache.write: q bit-equal to the torch path (the same roundings), the cache equal
    where written and untouched elsewhere (padding rows write nothing)."""
    from lorad.workers.kernels.fused_ops import rotary_write_kv
    from lorad.workers.kv_cache import PagedKVCache
    from lorad.workers.rotary import RotaryEmbedding, apply_rotary
    gen = torch.Generator().manual_seed(5)
    rotary = RotaryEmbedding(head_dim, 10000.0, None, 256, dtype, torch.device(device))
    positions = torch.tensor([0, 5, 17, 255, 100, 3, 0, 0], device=device)
    slots = torch.tensor([9, 2, 40, 63, 0, 17, -1, -1], device=device)  # two padding rows
    num_rows = positions.shape[0]
    nq, nkv = num_q_heads * head_dim, num_kv_heads * head_dim
    qkv = _rand(gen, num_rows, nq + 2 * nkv, dtype=dtype, device=device)
    q, k, v = qkv.split((nq, nkv, nkv), dim=1)
    caches = {}
    for name in ("want", "got"):
        caches[name] = PagedKVCache(16, block_size, num_kv_heads, head_dim, dtype,
                                    torch.device(device))
        caches[name].k.fill_(POISON)
        caches[name].v.fill_(POISON)
    cos, sin = rotary(positions)
    want_q = apply_rotary(q.reshape(num_rows, num_q_heads, head_dim), cos, sin)
    want_k = apply_rotary(k.reshape(num_rows, num_kv_heads, head_dim), cos, sin)
    written = torch.nonzero(slots >= 0).squeeze(1)
    caches["want"].write(want_k, v.reshape(num_rows, num_kv_heads, head_dim), written,
                         slots[written])
    got_q = rotary_write_kv(q, k, v, positions, rotary.cos_table, rotary.sin_table, slots,
                            caches["got"].k, caches["got"].v, num_q_heads, head_dim)
    if not torch.equal(got_q.cpu(), want_q.cpu()):
        diff = (got_q.float() - want_q.float()).abs().max().item()
        raise AssertionError(f"rotary_write_kv {dtype}: q differs from apply_rotary "
                             f"(max abs {diff:.3g}); it must be bit-equal")
    for part in ("k", "v"):
        got_c, want_c = getattr(caches["got"], part).cpu(), getattr(caches["want"], part).cpu()
        # NaN marks untouched slots in both: equal_nan compares them too.
        if not torch.allclose(got_c, want_c, rtol=0, atol=0, equal_nan=True):
            raise AssertionError(f"rotary_write_kv {dtype}: the {part} cache differs")


def _lora_group(gen: torch.Generator, num_rows: int, num_slots: int, in_features: int,
                out_features: tuple[int, ...], max_ranks: tuple[int | None, ...], device: str):
    """LoraSlots for projections that share an input (max rank None: a projection no adapter
    edits), mixed row slots (slot-0 rows among them) and the LoraRows a CUDA graph would use."""
    from lorad.workers.kernels.lora_tiles import LoraTiles
    from lorad.workers.lora import LoraRows, LoraSlots
    from tests.lora_kernel_checks import Shape, fill_lora_slots, make_tables, mixed_slots
    edited = [(n, r) for n, r in zip(out_features, max_ranks) if r is not None]
    tables = make_tables(Shape(num_slots, in_features, tuple(n for n, _ in edited),
                               tuple(r for _, r in edited)), gen, device)
    loras, i = [], 0
    for n, max_rank in zip(out_features, max_ranks):
        if max_rank is None:
            loras.append(None)
            continue
        lora = LoraSlots(num_slots, max_rank, in_features, n, (0, in_features), (0, n),
                         torch.device(device))
        fill_lora_slots(lora, tables, i)
        loras.append(lora)
        i += 1
    row_slots = mixed_slots(num_rows, num_slots, gen)
    row_slots[0] = 0
    row_slots = row_slots.to(device)
    tiles = LoraTiles.build(row_slots, num_rows, num_rows)
    rows = LoraRows(tuple(range(1, num_slots)), [], tiles, launch_always=True)
    return loras, rows, row_slots


def _lora_subset(rows, row_slots: torch.Tensor, keep: torch.Tensor):
    """The LoraRows of a subset of the rows (a smaller batch holding them)."""
    from lorad.workers.kernels.lora_tiles import LoraTiles
    from lorad.workers.lora import LoraRows
    sub = row_slots[keep]
    n = sub.shape[0]
    return LoraRows(rows.slots, [], LoraTiles.build(sub, n, n), launch_always=True)


def check_rotary_write_kv_lora(device: str, dtype: torch.dtype = torch.bfloat16,
                               num_q_heads: int = 6, num_kv_heads: int = 2, head_dim: int = 16,
                               block_size: int = 4, hidden: int = 40, num_rows: int = 13) -> None:
    """rotary_write_kv with the pending q/k/v shrink (deltas added as it reads) against the
    expand followed by the plain kernel: q and the cache within a rounding (bit-equal under the
    interpreter), slot-0 rows and unedited v bit-equal to the plain kernel, padding rows' cache
    slots untouched, a row alone equal to the row in the batch."""
    from lorad.workers.kernels.fused_ops import rotary_write_kv
    from lorad.workers.kv_cache import PagedKVCache
    from lorad.workers.lora import add_lora_deltas, start_shrink
    from lorad.workers.rotary import RotaryEmbedding
    gen = torch.Generator().manual_seed(17)
    rotary = RotaryEmbedding(head_dim, 10000.0, None, 512, dtype, torch.device(device))
    nq, nkv = num_q_heads * head_dim, num_kv_heads * head_dim
    for ranks in ((8, 20, 3), (5, 5, None)):
        loras, rows, row_slots = _lora_group(gen, num_rows, 5, hidden, (nq, nkv, nkv), ranks,
                                             device)
        x = _rand(gen, num_rows, hidden, dtype=dtype, device=device)
        qkv = _rand(gen, num_rows, nq + 2 * nkv, dtype=dtype, device=device)
        positions = torch.randint(0, 512, (num_rows,), generator=gen).to(device)
        slots = torch.randperm(16 * block_size, generator=gen)[:num_rows].to(device)
        slots[-2:] = -1  # padding rows
        where = f"rotary_write_kv with LoRA {dtype}, ranks {ranks}"

        def run(with_lora: bool, keep: torch.Tensor | None = None):
            cache = PagedKVCache(16, block_size, num_kv_heads, head_dim, dtype,
                                 torch.device(device))
            cache.k.fill_(POISON)
            cache.v.fill_(POISON)
            sel = slice(None) if keep is None else keep
            sub_rows = rows if keep is None else _lora_subset(rows, row_slots, keep)
            q, k, v = qkv[sel].clone().split((nq, nkv, nkv), dim=1)
            pending = None
            if with_lora:
                pending = start_shrink(loras, x[sel], sub_rows)
            elif keep is None:  # the reference: the expand, then the plain kernel
                q, k, v = add_lora_deltas(loras, [q, k, v], x, rows)
            got_q = rotary_write_kv(q, k, v, positions[sel], rotary.cos_table, rotary.sin_table,
                                    slots[sel], cache.k, cache.v, num_q_heads, head_dim,
                                    lora=pending)
            return got_q, cache

        got_q, got_cache = run(True)
        want_q, want_cache = run(False)
        assert_close(f"{where}: q", got_q, want_q, dtype)
        for part in ("k", "v"):
            got_c, want_c = getattr(got_cache, part).cpu(), getattr(want_cache, part).cpu()
            if not torch.equal(got_c.isnan(), want_c.isnan()):
                raise AssertionError(f"{where}: the {part} cache is written elsewhere")
            assert_close(f"{where}: {part} cache", got_c.nan_to_num(0.0), want_c.nan_to_num(0.0),
                         dtype)
        base = row_slots == 0
        plain_q, plain_cache = run(False, keep=torch.ones(num_rows, dtype=torch.bool,
                                                          device=device))
        if not torch.equal(got_q[base].cpu(), plain_q[base].cpu()):
            raise AssertionError(f"{where}: a slot-0 row differs from the plain kernel's")
        if ranks[2] is None and not torch.equal(got_cache.v.cpu().nan_to_num(0.0),
                                                plain_cache.v.cpu().nan_to_num(0.0)):
            raise AssertionError(f"{where}: v, which no adapter edits, differs")
        keep = torch.zeros(num_rows, dtype=torch.bool, device=device)
        keep[3] = True
        one_q, _ = run(True, keep=keep)
        if not torch.equal(one_q.cpu(), got_q[3:4].cpu()):
            raise AssertionError(f"{where}: row 3 alone differs from row 3 in the batch")


def check_silu_and_mul_lora(device: str, dtype: torch.dtype = torch.bfloat16, n: int = 300,
                            hidden: int = 40, num_rows: int = 13) -> None:
    """silu_and_mul with the pending gate/up shrink against the expand followed by the plain
    kernel; slot-0 rows bit-equal to the plain kernel; a row alone equal to the row in the
    batch. n spans several column blocks with a ragged end."""
    from lorad.workers.kernels.fused_ops import silu_and_mul
    from lorad.workers.lora import add_lora_deltas, start_shrink
    gen = torch.Generator().manual_seed(19)
    for ranks in ((16, 7), (None, 4)):
        loras, rows, row_slots = _lora_group(gen, num_rows, 6, hidden, (n, n), ranks, device)
        x = _rand(gen, num_rows, hidden, dtype=dtype, device=device)
        gate_up = _rand(gen, num_rows, 2 * n, dtype=dtype, device=device, scale=4.0)
        gate, up = gate_up.chunk(2, dim=1)
        where = f"silu_and_mul with LoRA {dtype}, ranks {ranks}"
        got = silu_and_mul(gate, up, lora=start_shrink(loras, x, rows))
        want = silu_and_mul(*add_lora_deltas(loras, [gate.clone(), up.clone()], x, rows))
        assert_close(where, got, want, dtype)
        base = row_slots == 0
        if not torch.equal(got[base].cpu(), silu_and_mul(gate, up)[base].cpu()):
            raise AssertionError(f"{where}: a slot-0 row differs from the plain kernel's")
        keep = torch.zeros(num_rows, dtype=torch.bool, device=device)
        keep[4] = True
        one = silu_and_mul(gate[keep], up[keep],
                           lora=start_shrink(loras, x[keep], _lora_subset(rows, row_slots, keep)))
        if not torch.equal(one.cpu(), got[4:5].cpu()):
            raise AssertionError(f"{where}: row 4 alone differs from row 4 in the batch")


def check_add_rms_norm_lora(device: str, dtype: torch.dtype = torch.bfloat16, hidden: int = 300,
                            in_features: int = 40, num_rows: int = 13) -> None:
    """add_rms_norm with the pending shrink of the projection whose output it adds (o/down at
    world size 1) against the expand followed by the plain kernel: the residual and the norm
    within a rounding; slot-0 rows bit-equal to the plain kernel's; a
    row alone equal to the row in the batch. hidden spans several column blocks."""
    from lorad.workers.kernels.fused_ops import add_rms_norm
    from lorad.workers.layers import RMSNorm
    from lorad.workers.lora import add_lora_deltas, start_shrink
    gen = torch.Generator().manual_seed(23)
    norm = RMSNorm(hidden, 1e-5, dtype, torch.device(device))
    norm.weight.data.copy_(_rand(gen, hidden, dtype=dtype, device=device))
    loras, rows, row_slots = _lora_group(gen, num_rows, 6, in_features, (hidden,), (16,), device)
    x = _rand(gen, num_rows, in_features, dtype=dtype, device=device)
    out = _rand(gen, num_rows, hidden, dtype=dtype, device=device, scale=3.0)
    residual = _rand(gen, num_rows, hidden, dtype=dtype, device=device)
    where = f"add_rms_norm with LoRA {dtype}"
    got_hidden, got_normed = add_rms_norm(out, residual.clone(), norm.weight, norm.eps,
                                          lora=start_shrink(loras, x, rows))
    with_delta = add_lora_deltas(loras, [out.clone()], x, rows)[0]
    want_hidden, want_normed = add_rms_norm(with_delta, residual.clone(), norm.weight, norm.eps)
    # Within a rounding: the delta's sums have another shape here (a row, not a tile).
    assert_close(f"{where}: residual", got_hidden, want_hidden, dtype)
    assert_close(where, got_normed, want_normed, dtype)
    base = row_slots == 0
    _, plain_normed = add_rms_norm(out, residual.clone(), norm.weight, norm.eps)
    if not torch.equal(got_normed[base].cpu(), plain_normed[base].cpu()):
        raise AssertionError(f"{where}: a slot-0 row differs from the plain kernel's")
    keep = torch.zeros(num_rows, dtype=torch.bool, device=device)
    keep[5] = True
    _, one = add_rms_norm(out[keep], residual[keep].clone(), norm.weight, norm.eps,
                          lora=start_shrink(loras, x[keep], _lora_subset(rows, row_slots, keep)))
    if not torch.equal(one.cpu(), got_normed[5:6].cpu()):
        raise AssertionError(f"{where}: row 5 alone differs from row 5 in the batch")


CHECKS = {
    "add_rms_norm_bf16": (check_add_rms_norm, dict(dtype=torch.bfloat16)),
    "add_rms_norm_fp32": (check_add_rms_norm, dict(dtype=torch.float32)),
    "silu_and_mul_bf16": (check_silu_and_mul, dict(dtype=torch.bfloat16)),
    "silu_and_mul_fp32": (check_silu_and_mul, dict(dtype=torch.float32)),
    "rotary_write_kv_bf16": (check_rotary_write_kv, dict(dtype=torch.bfloat16)),
    "rotary_write_kv_fp32": (check_rotary_write_kv, dict(dtype=torch.float32)),
    "rotary_write_kv_lora_bf16": (check_rotary_write_kv_lora, dict(dtype=torch.bfloat16)),
    "rotary_write_kv_lora_fp32": (check_rotary_write_kv_lora, dict(dtype=torch.float32)),
    "silu_and_mul_lora_bf16": (check_silu_and_mul_lora, dict(dtype=torch.bfloat16)),
    "silu_and_mul_lora_fp32": (check_silu_and_mul_lora, dict(dtype=torch.float32)),
    "add_rms_norm_lora_bf16": (check_add_rms_norm_lora, dict(dtype=torch.bfloat16)),
}


def main(names: list[str]) -> int:
    return run_checks(CHECKS, names)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
