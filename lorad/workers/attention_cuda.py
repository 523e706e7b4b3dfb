"""Paged attention on CUDA: the Triton kernels, driven by the ForwardBatch's tensors alone.

A decode step (one token per sequence) writes K/V with the sync-free write kernel (or the model's
fused rotary kernel has, and calls attend_cuda) and runs the split-KV decode kernel. It reads only
batch tensors and shapes, so it can be captured in a CUDA graph and replayed with new contents.
Mixed and prefill steps run the varlen prefill kernel, eagerly. The per-sequence path in
attention.py is what both are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lorad.workers.batch import ForwardBatch
from lorad.workers.kernels.configs import DecodeAttentionConfig
from lorad.workers.kernels.kv_cache_write import write_kv
from lorad.workers.kernels.paged_attention import paged_decode_attention
from lorad.workers.kernels.paged_prefill_attention import paged_prefill_attention
from lorad.workers.kv_cache import PagedKVCache


@dataclass(frozen=True)
class CudaAttentionContext:
    """The step's attention metadata, shared by every layer: references to the batch's tensors,
    never copies, so a graph replay after the batch's tensors are refilled sees the new step."""

    slot_mapping: torch.Tensor  # [num_rows] int64: KV slot per row, -1 = padding
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor  # [num_seqs] int32; 0 = a padding sequence, which reads nothing
    query_starts: torch.Tensor  # [num_seqs + 1] int32: sequence i's rows
    is_decode: bool  # one token per sequence, sequence i on row i
    max_query_len: int  # the longest chunk: the prefill grid

    @property
    def real_rows(self) -> torch.Tensor:
        """[num_rows] bool: the rows that are not padding, from the step's slot_mapping (so a
        graph computes it again at each replay)."""
        return self.slot_mapping >= 0

    @classmethod
    def build(cls, batch: ForwardBatch) -> "CudaAttentionContext":
        max_query_len = max((chunk.num_tokens for chunk in batch.seqs), default=0)
        return cls(batch.slot_mapping, batch.block_tables, batch.context_lens,
                   batch.query_starts, batch.is_decode, max_query_len)


def paged_attention_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: PagedKVCache,
                         ctx: CudaAttentionContext, scale: float,
                         config: DecodeAttentionConfig = DecodeAttentionConfig(),
                         pdl_rows: int = 0) -> torch.Tensor:
    """q: [num_rows, q_heads, head_dim]; k, v: [num_rows, kv_heads, head_dim]
    -> [num_rows, q_heads * head_dim], zero on padding rows."""
    write_kv(k, v, ctx.slot_mapping, cache.k, cache.v)
    return attend_cuda(q, cache, ctx, scale, config, pdl_rows)


def attend_cuda(q: torch.Tensor, cache: PagedKVCache, ctx: CudaAttentionContext, scale: float,
                config: DecodeAttentionConfig = DecodeAttentionConfig(),
                pdl_rows: int = 0) -> torch.Tensor:
    """The attention alone, the step's K/V being in the cache already (the model's fused rotary
    kernel writes them). q: [num_rows, q_heads, head_dim] -> [num_rows, q_heads * head_dim],
    zero on padding rows. config: the decode kernels' settings; pdl_rows: the step's PDL row
    limit (kernels/pdl.py)."""
    num_rows, num_q_heads, head_dim = q.shape
    num_seqs = ctx.context_lens.shape[0]
    if not ctx.is_decode:
        return paged_prefill_attention(q, cache.k, cache.v, ctx.block_tables, ctx.context_lens,
                                       ctx.query_starts, ctx.max_query_len, scale)
    # Rows past the last sequence pad the batch to MIN_ROWS: the kernel writes them with zeros,
    # as on the CPU path.
    out = torch.empty(num_rows, num_q_heads * head_dim, dtype=q.dtype, device=q.device)
    return paged_decode_attention(q[:num_seqs], cache.k, cache.v, ctx.block_tables,
                                  ctx.context_lens, scale, out=out, config=config,
                                  pdl_rows=pdl_rows)
