"""Paged causal attention over this rank's heads: write the step's K/V, then attend per sequence.

Each sequence is computed on its own (its chunk's queries against its context read from its
block table), so a row's result never depends on the other sequences in the batch, and padding
rows are neither written nor attended. On CUDA (with triton installed) the step goes to the
Triton kernels instead (attention_cuda.py); this loop is the reference they are compared with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lorad.workers.batch import ForwardBatch
from lorad.workers.kernel_path import kernel_path
from lorad.workers.kv_cache import PagedKVCache

if TYPE_CHECKING:
    from lorad.workers.attention_cuda import CudaAttentionContext


@dataclass(frozen=True)
class SeqContext:
    """One sequence's view of the step, shared by every layer."""

    token_start: int
    num_tokens: int
    context_slots: torch.Tensor  # [context_len] int64: KV slot of positions 0..context_len-1
    # [num_tokens, context_len] bool, True = may attend; None for one token (it sees everything)
    causal_mask: torch.Tensor | None


@dataclass(frozen=True)
class AttentionContext:
    write_rows: torch.Tensor  # [num_written] int64: rows whose K/V go into the cache
    write_slots: torch.Tensor  # [num_written] int64: their slots
    seqs: list[SeqContext]

    @classmethod
    def build(cls, batch: ForwardBatch,
              block_size: int) -> "AttentionContext | CudaAttentionContext":
        """The step's context for every layer; on CUDA the kernels' (no host sync, no copies)."""
        device = batch.slot_mapping.device
        if kernel_path(device):
            from lorad.workers.attention_cuda import CudaAttentionContext
            return CudaAttentionContext.build(batch)
        write_rows = torch.nonzero(batch.slot_mapping >= 0).squeeze(1)
        offsets = torch.arange(block_size, device=device)
        seqs = []
        for chunk in batch.seqs:
            num_blocks = (chunk.context_len + block_size - 1) // block_size
            blocks = torch.tensor(chunk.block_table[:num_blocks], dtype=torch.int64, device=device)
            slots = (blocks[:, None] * block_size + offsets[None, :]).flatten()[:chunk.context_len]
            mask = None
            if chunk.num_tokens > 1:
                # The chunk holds the last num_tokens positions of the context.
                first = chunk.context_len - chunk.num_tokens
                query_pos = torch.arange(first, chunk.context_len, device=device)
                key_pos = torch.arange(chunk.context_len, device=device)
                mask = key_pos[None, :] <= query_pos[:, None]
            seqs.append(SeqContext(chunk.token_start, chunk.num_tokens, slots, mask))
        return cls(write_rows, batch.slot_mapping[write_rows], seqs)


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
        n = seq.num_tokens
        rows = slice(seq.token_start, seq.token_start + n)
        keys, values = cache.read(seq.context_slots)  # [context_len, kv_heads, head_dim]
        # Query heads of one KV head are consecutive: [kv_heads, group * n, head_dim].
        q_seq = q[rows].view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        q_seq = q_seq.reshape(num_kv_heads, group * n, head_dim)
        # [kv_heads, group * n, context_len]; scaled after the product, as transformers does
        scores = torch.matmul(q_seq, keys.permute(1, 2, 0)) * scale
        if seq.causal_mask is not None:
            scores = scores.view(num_kv_heads, group, n, -1)
            scores = scores.masked_fill(~seq.causal_mask, float("-inf"))
            scores = scores.view(num_kv_heads, group * n, -1)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        attn = torch.matmul(probs, values.transpose(0, 1))  # [kv_heads, group * n, head_dim]
        attn = attn.view(num_kv_heads, group, n, head_dim).permute(2, 0, 1, 3)
        out[rows] = attn.reshape(n, num_q_heads * head_dim)
    return out
