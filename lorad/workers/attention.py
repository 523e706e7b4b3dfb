"""Paged causal attention over this rank's heads: write the step's K/V, then attend per sequence.

Each sequence is computed on its own (its chunk's queries against its context read from its
block table), so a row's result never depends on the other sequences in the batch, and padding
rows are neither written nor attended. Nor does it depend on how the prompt was chunked or
whether the row is a decode: every product has one shape (at least MIN_ROWS query rows, as
batch.product_rows pads them, against KEY_BLOCK keys), and the sums over the context add the blocks' partials in block order,
so a position's bits are the same whatever context length the step has (a prefix-cache hit,
another --max-num-batched-tokens, a decode). On CUDA (with triton installed) the step goes to
the Triton kernels instead (attention_cuda.py); this loop is the reference they are compared with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from lorad.workers.batch import ForwardBatch, product_rows
from lorad.workers.kernel_path import kernel_path
from lorad.workers.kv_cache import PagedKVCache

# MKL (torch 2.13) gives a row other bits when a product has fewer than 8 rows (batch.py), and a
# sum over the context other bits as the context's length crosses its K blocking (at 193 keys,
# for one); products of one fixed shape, each block of keys its own, keep a row's bits.
KEY_BLOCK = 64

if TYPE_CHECKING:
    from lorad.workers.attention_cuda import CudaAttentionContext


@dataclass(frozen=True)
class SeqContext:
    """One sequence's view of the step, shared by every layer."""

    token_start: int
    num_tokens: int
    context_slots: torch.Tensor  # [context_len] int64: KV slot of positions 0..context_len-1
    # [num_tokens, context_len rounded up to KEY_BLOCK] bool, True = may attend (causal, and
    # never a key past the context)
    causal_mask: torch.Tensor


@dataclass(frozen=True)
class AttentionContext:
    write_rows: torch.Tensor  # [num_written] int64: rows whose K/V go into the cache
    write_slots: torch.Tensor  # [num_written] int64: their slots
    seqs: list[SeqContext]
    real_rows: torch.Tensor  # [num_rows] bool: the rows that are not padding

    @classmethod
    def build(cls, batch: ForwardBatch,
              block_size: int) -> "AttentionContext | CudaAttentionContext":
        """The step's context for every layer; on CUDA the kernels' (no host sync, no copies)."""
        device = batch.slot_mapping.device
        if kernel_path(device):
            from lorad.workers.attention_cuda import CudaAttentionContext
            return CudaAttentionContext.build(batch)
        real_rows = batch.slot_mapping >= 0  # padding rows write no KV
        write_rows = torch.nonzero(real_rows).squeeze(1)
        offsets = torch.arange(block_size, device=device)
        seqs = []
        for chunk in batch.seqs:
            num_blocks = (chunk.context_len + block_size - 1) // block_size
            blocks = torch.tensor(chunk.block_table[:num_blocks], dtype=torch.int64, device=device)
            slots = (blocks[:, None] * block_size + offsets[None, :]).flatten()[:chunk.context_len]
            # The chunk holds the last num_tokens positions of the context.
            first = chunk.context_len - chunk.num_tokens
            query_pos = torch.arange(first, chunk.context_len, device=device)
            key_pos = torch.arange(-(-chunk.context_len // KEY_BLOCK) * KEY_BLOCK, device=device)
            mask = key_pos[None, :] <= query_pos[:, None]
            seqs.append(SeqContext(chunk.token_start, chunk.num_tokens, slots, mask))
        return cls(write_rows, batch.slot_mapping[write_rows], seqs, real_rows)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: PagedKVCache,
                    ctx: "AttentionContext | CudaAttentionContext", scale: float) -> torch.Tensor:
    """q: [num_rows, q_heads, head_dim]; k, v: [num_rows, kv_heads, head_dim]
    -> [num_rows, q_heads * head_dim], zero on padding rows."""
    if not isinstance(ctx, AttentionContext):
        from lorad.workers.attention_cuda import paged_attention_cuda
        return paged_attention_cuda(q, k, v, cache, ctx, scale)
    num_rows, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_q_heads // num_kv_heads
    cache.write(k, v, ctx.write_rows, ctx.write_slots)
    out = torch.zeros(num_rows, num_q_heads * head_dim, dtype=q.dtype, device=q.device)
    for seq in ctx.seqs:
        if seq.causal_mask.shape[1] == 0:
            continue  # a graph bucket's padding sequence: no context, its rows stay zero
        n = seq.num_tokens
        rows = slice(seq.token_start, seq.token_start + n)
        keys, values = cache.read(seq.context_slots)  # [context_len, kv_heads, head_dim]
        # Query heads of one KV head are consecutive: [kv_heads, group * n, head_dim].
        q_seq = q[rows].view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        q_seq = q_seq.reshape(num_kv_heads, group * n, head_dim)
        attn = _attend(q_seq, keys, values, seq.causal_mask, scale)
        attn = attn.view(num_kv_heads, group, n, head_dim).permute(2, 0, 1, 3)
        out[rows] = attn.reshape(n, num_q_heads * head_dim)
    return out


def _key_blocks(t: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """[context_len, kv_heads, head_dim] -> [kv_heads, num_blocks, KEY_BLOCK, head_dim], padded
    with zeros."""
    t = F.pad(t, (0, 0, 0, 0, 0, num_blocks * KEY_BLOCK - t.shape[0]))
    return t.permute(1, 0, 2).reshape(t.shape[1], num_blocks, KEY_BLOCK, t.shape[2])


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
            scale: float) -> torch.Tensor:
    """softmax(q k^T * scale, masked) v for one sequence, with the shapes of the file's header.
    q: [kv_heads, num_q, head_dim]; keys, values: [context_len, kv_heads, head_dim]; mask:
    [num_q / group, num_blocks * KEY_BLOCK] -> [kv_heads, num_q, head_dim]."""
    num_kv_heads, num_q, head_dim = q.shape
    num_blocks = mask.shape[1] // KEY_BLOCK
    pad = product_rows(num_q) - num_q
    padded = F.pad(q, (0, 0, 0, pad))
    # [kv_heads, num_blocks, rows, KEY_BLOCK]: one product per block of keys; scaled after the
    # product, as transformers does
    scores = torch.matmul(padded.unsqueeze(1), _key_blocks(keys, num_blocks).transpose(2, 3))
    scores = scores[:, :, :num_q].permute(0, 2, 1, 3).reshape(num_kv_heads, num_q, -1) * scale
    scores = scores.view(num_kv_heads, -1, *mask.shape).masked_fill(~mask, float("-inf"))
    scores = scores.view(num_kv_heads, num_q, num_blocks, KEY_BLOCK).float()
    # softmax in fp32: the max is exact in any order; the sum is each block's, then the blocks'
    # in order (a cumulative sum's last element).
    exps = torch.exp(scores - scores.amax(dim=(2, 3), keepdim=True))
    total = exps.sum(dim=3).cumsum(dim=2)[:, :, -1:, None]
    probs = (exps / total).to(q.dtype).float()  # rounded to the model dtype, as transformers
    probs = F.pad(probs, (0, 0, 0, 0, 0, pad))
    # [kv_heads, num_blocks, rows, head_dim]: each block's partial sums, added in block order
    parts = torch.matmul(probs.permute(0, 2, 1, 3), _key_blocks(values, num_blocks).float())
    return parts.cumsum(dim=1)[:, -1, :num_q].to(q.dtype)
