"""Checks of the fused elementwise kernels (lorad/workers/kernels/fused_ops.py) against the torch
path they replace (RMSNorm and silu_and_mul in lorad.workers.layers, apply_rotary and the cache
write in lorad.workers.rotary / kv_cache), on any device.

test_triton_interpreted.py runs them on CPU tensors under TRITON_INTERPRET=1 in a
subprocess; tests/gpu/test_fused_ops_gpu.py calls them on CUDA at Llama-3-8B's sizes. Each check
takes fresh random inputs, poisons every output the kernel must write, and raises AssertionError
naming what differed: the result against the torch path (equal up to the kernel's own sum order
and exp), untouched elements (padding rows' cache slots), and a row's bits
across batch sizes.
"""

from __future__ import annotations

import sys

import torch

from tests.kernels.triton_interpreter import run_checks

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


def _lora_delta(gen: torch.Generator, out: torch.Tensor, row_slots: torch.Tensor,
                ranks: list[int]):
    """A LoraDelta for `out`: random fp32 deltas on the rows whose slot has a rank, NaN (never
    to be read into a result) on every other row."""
    from lorad.workers.kernels.lora_common import LoraDelta
    ranks_t = torch.tensor(ranks, dtype=torch.int32, device=out.device)
    delta = _rand(gen, *out.shape, dtype=torch.float32, device=str(out.device), scale=0.5)
    delta[ranks_t[row_slots] == 0] = POISON
    return LoraDelta(delta, ranks_t, row_slots)


def check_lora_deltas_added(device: str, dtype: torch.dtype = torch.bfloat16, hidden: int = 48,
                            n: int = 2500, num_q_heads: int = 6, num_kv_heads: int = 2,
                            head_dim: int = 16) -> None:
    """add_rms_norm, silu_and_mul and rotary_write_kv given LoRA deltas (LoraDelta) equal the
    same kernels run on inputs with the deltas added by LoraDelta.apply_reference (`(out.float()
    + delta).to(dtype)` on edited rows), bit for bit; rows of slot 0, of a slot the table does
    not edit (rank 0) and padding never read their (NaN) deltas; a table without a delta (None)
    beside one with leaves its input as it is."""
    from lorad.workers.kernels.fused_ops import add_rms_norm, rotary_write_kv, silu_and_mul
    from lorad.workers.kv_cache import PagedKVCache
    from lorad.workers.rotary import RotaryEmbedding
    gen = torch.Generator().manual_seed(13)
    # Rows on slots 0..3 and a padding row (slot 0); slot 2 leaves the second table unedited.
    row_slots = torch.tensor([1, 0, 2, 3, 1, 2, 0], dtype=torch.int64, device=device)
    num_rows = row_slots.shape[0]
    first, second = [0, 4, 16, 2], [0, 8, 0, 5]

    def same(where: str, got: torch.Tensor, want: torch.Tensor) -> None:
        got, want = got.cpu(), want.cpu()
        if not torch.equal(got, want):
            bad = int((got != want).flatten(1).any(1).sum()) if got.dim() > 1 else -1
            raise AssertionError(f"{where} {dtype}: differs from the deltas added first "
                                 f"({bad} rows; it must be bit-equal)")

    weight = _rand(gen, hidden, dtype=dtype, device=device)
    out = _rand(gen, num_rows, hidden, dtype=dtype, device=device, scale=3.0)
    residual = _rand(gen, num_rows, hidden, dtype=dtype, device=device)
    lora = _lora_delta(gen, out, row_slots, first)
    if torch.equal(lora.apply_reference(out).cpu(), out.cpu()):
        raise AssertionError("the deltas change nothing: this check could not fail")
    got_hidden, got_normed = add_rms_norm(out, residual.clone(), weight, 1e-5, lora)
    want_hidden, want_normed = add_rms_norm(lora.apply_reference(out), residual.clone(), weight,
                                            1e-5)
    same("add_rms_norm hidden", got_hidden, want_hidden)
    same("add_rms_norm normed", got_normed, want_normed)

    gate_up = _rand(gen, num_rows, 2 * n, dtype=dtype, device=device, scale=4.0)
    gate, up = gate_up.chunk(2, dim=1)
    for pair in ((first, second), (first, None), (None, second)):
        loras = [None if r is None else _lora_delta(gen, g, row_slots, r)
                 for r, g in zip(pair, (gate, up))]
        want = silu_and_mul(*(x if d is None else d.apply_reference(x)
                              for x, d in zip((gate, up), loras)))
        same(f"silu_and_mul ({'gate' if pair[0] else ''} {'up' if pair[1] else ''})",
             silu_and_mul(gate, up, loras), want)

    rotary = RotaryEmbedding(head_dim, 10000.0, None, 256, dtype, torch.device(device))
    positions = torch.tensor([0, 5, 17, 255, 100, 3, 0], device=device)
    slots = torch.tensor([9, 2, 40, 63, 0, 17, -1], device=device)  # the last row pads
    nq, nkv = num_q_heads * head_dim, num_kv_heads * head_dim
    qkv = _rand(gen, num_rows, nq + 2 * nkv, dtype=dtype, device=device)
    q, k, v = qkv.split((nq, nkv, nkv), dim=1)
    for ranks in ((first, second, first), (None, second, None), (first, None, second)):
        loras = [None if r is None else _lora_delta(gen, x, row_slots, r)
                 for r, x in zip(ranks, (q, k, v))]
        added = [x if d is None else d.apply_reference(x) for x, d in zip((q, k, v), loras)]
        results = []
        for inputs, given in ((added, (None, None, None)), ((q, k, v), loras)):
            cache = PagedKVCache(16, 4, num_kv_heads, head_dim, dtype, torch.device(device))
            cache.k.fill_(POISON)
            cache.v.fill_(POISON)
            got_q = rotary_write_kv(*inputs, positions, rotary.cos_table, rotary.sin_table,
                                    slots, cache.k, cache.v, num_q_heads, head_dim, given)
            results.append((got_q, cache.k.cpu(), cache.v.cpu()))
        where = f"rotary_write_kv (deltas for {[r is not None for r in ranks]})"
        same(f"{where} q", results[1][0], results[0][0])
        for part, a, b in (("k", results[1][1], results[0][1]), ("v", results[1][2], results[0][2])):
            if not torch.allclose(a, b, rtol=0, atol=0, equal_nan=True):
                raise AssertionError(f"{where} {dtype}: the {part} cache differs")


CHECKS = {
    "add_rms_norm_bf16": (check_add_rms_norm, dict(dtype=torch.bfloat16)),
    "add_rms_norm_fp32": (check_add_rms_norm, dict(dtype=torch.float32)),
    "silu_and_mul_bf16": (check_silu_and_mul, dict(dtype=torch.bfloat16)),
    "silu_and_mul_fp32": (check_silu_and_mul, dict(dtype=torch.float32)),
    "rotary_write_kv_bf16": (check_rotary_write_kv, dict(dtype=torch.bfloat16)),
    "rotary_write_kv_fp32": (check_rotary_write_kv, dict(dtype=torch.float32)),
    "lora_deltas_added_bf16": (check_lora_deltas_added, dict(dtype=torch.bfloat16)),
    "lora_deltas_added_fp32": (check_lora_deltas_added, dict(dtype=torch.float32)),
}


def main(names: list[str]) -> int:
    return run_checks(CHECKS, names)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
