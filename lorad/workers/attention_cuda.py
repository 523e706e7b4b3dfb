"""Paged attention on CUDA: the Triton kernels, driven by the ForwardBatch's tensors alone.

A decode step (one token per sequence) writes K/V with the sync-free write kernel (or the model's
fused rotary kernel has, and calls attend_cuda) and runs the split-KV decode kernel. It reads only
batch tensors and shapes, so it can be captured in a CUDA graph and replayed with new contents.
Mixed and prefill steps run eagerly: the varlen prefill kernel for the sequences with prompt
tokens, then the decode kernel for every generated token's row, each as a sequence of its own.
So a token keeps one arithmetic whatever shares its step: a prompt token the prefill kernel's
(chunk-invariant: key tiles at fixed positions, one row's sums its own), a generated token the
decode kernel's, beside prompt chunks, in a graph, or computed again after a preemption. The
per-sequence path in attention.py is what both are tested against.
"""

from __future__ import annotations

import functools
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
    # A mixed or prefill step: the sequences with prompt tokens (None: none), and the rows of
    # generated tokens (None: none). A decode step: both None.
    prompt_seqs: "PromptSeqs | None" = None
    generated: "GeneratedRows | None" = None

    @functools.cached_property
    def real_rows(self) -> torch.Tensor:
        """[num_rows] bool: the rows that are not padding, from the step's slot_mapping: once
        a step, at its first use (every MoE layer reads it; a graph computes it at each
        replay)."""
        return self.slot_mapping >= 0

    @classmethod
    def build(cls, batch: ForwardBatch) -> "CudaAttentionContext":
        max_query_len = max((chunk.num_tokens for chunk in batch.seqs), default=0)
        is_decode = batch.is_decode
        prompt_seqs = generated = None
        if not is_decode:
            prompt_seqs = PromptSeqs.build(batch)
            generated = GeneratedRows.build(batch)
        return cls(batch.slot_mapping, batch.block_tables, batch.context_lens,
                   batch.query_starts, is_decode, max_query_len, prompt_seqs, generated)


@dataclass(frozen=True)
class PromptSeqs:
    """The sequences of a step with prompt tokens, as the prefill kernel takes them: each chunk
    whole (rows of generated tokens in it are computed again by the decode kernel)."""

    block_tables: torch.Tensor  # [n, max_blocks] int32
    context_lens: torch.Tensor  # [n] int32
    query_starts: torch.Tensor  # [n] int32: sequence i's rows are query_starts[i]:query_ends[i]
    query_ends: torch.Tensor  # [n] int32
    max_query_len: int

    @classmethod
    def build(cls, batch: ForwardBatch) -> "PromptSeqs | None":
        picked = [i for i, chunk in enumerate(batch.seqs) if chunk.num_prompt]
        if not picked:
            return None
        device = batch.block_tables.device
        chunks = [batch.seqs[i] for i in picked]
        tables, lens = batch.block_tables, batch.context_lens
        if len(picked) < len(batch.seqs):  # else the batch's own (a prefill step's)
            index = torch.tensor(picked, dtype=torch.int64, device=device)
            tables, lens = tables.index_select(0, index), lens.index_select(0, index)

        def int32(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=device)
        return cls(tables, lens, int32([c.token_start for c in chunks]),
                   int32([c.token_start + c.num_tokens for c in chunks]),
                   max(c.num_tokens for c in chunks))


@dataclass(frozen=True)
class GeneratedRows:
    """The rows of generated tokens in a mixed or prefill step, each a sequence of its own for
    the decode kernel: its chunk's block table, its position + 1 as the context."""

    rows: torch.Tensor  # [n] int64
    block_tables: torch.Tensor  # [n, max_blocks] int32
    context_lens: torch.Tensor  # [n] int32

    @classmethod
    def build(cls, batch: ForwardBatch) -> "GeneratedRows | None":
        rows, seqs, lens = [], [], []
        for i, chunk in enumerate(batch.seqs):
            first_pos = chunk.context_len - chunk.num_tokens
            for j in range(chunk.num_prompt, chunk.num_tokens):
                rows.append(chunk.token_start + j)
                seqs.append(i)
                lens.append(first_pos + j + 1)
        if not rows:
            return None
        device = batch.block_tables.device
        index = torch.tensor(seqs, dtype=torch.int64, device=device)
        return cls(torch.tensor(rows, dtype=torch.int64, device=device),
                   batch.block_tables.index_select(0, index),
                   torch.tensor(lens, dtype=torch.int32, device=device))


def paged_attention_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: PagedKVCache,
                         ctx: CudaAttentionContext, scale: float,
                         config: DecodeAttentionConfig = DecodeAttentionConfig(),
                         pdl_rows: int = 0) -> torch.Tensor:
    """q: [num_rows, q_heads, head_dim]; k, v: [num_rows, kv_heads, head_dim]
    -> [num_rows, q_heads * head_dim], zero on padding rows."""
    write_kv(k, v, ctx.slot_mapping, cache.k, cache.v)
    return attend_cuda(q, cache, ctx, scale, config, pdl_rows)


def _attend_mixed(q: torch.Tensor, cache: PagedKVCache, ctx: CudaAttentionContext, scale: float,
                  config: DecodeAttentionConfig, out: torch.Tensor | None = None) -> torch.Tensor:
    """A mixed or prefill step: the prefill kernel over the sequences with prompt tokens, then
    the decode kernel over the generated tokens' rows, written into theirs; padding rows zero.
    out: [num_rows, q_heads * head_dim] to write (a graph's static tensor); None: a new one."""
    num_rows, num_q_heads, head_dim = q.shape
    if out is None:
        out = torch.zeros(num_rows, num_q_heads * head_dim, dtype=q.dtype, device=q.device)
    else:
        out.zero_()
    prompt = ctx.prompt_seqs
    if prompt is not None:
        paged_prefill_attention(q, cache.k, cache.v, prompt.block_tables, prompt.context_lens,
                                prompt.query_starts, prompt.max_query_len, scale, out=out,
                                query_ends=prompt.query_ends)
    generated = ctx.generated
    if generated is not None:
        rows = paged_decode_attention(q.index_select(0, generated.rows), cache.k, cache.v,
                                      generated.block_tables, generated.context_lens, scale,
                                      config=config)
        out.index_copy_(0, generated.rows, rows)
    return out


def attend_cuda(q: torch.Tensor, cache: PagedKVCache, ctx: CudaAttentionContext, scale: float,
                config: DecodeAttentionConfig = DecodeAttentionConfig(),
                pdl_rows: int = 0, out: torch.Tensor | None = None) -> torch.Tensor:
    """The attention alone, the step's K/V being in the cache already (the model's fused rotary
    kernel writes them). q: [num_rows, q_heads, head_dim] -> [num_rows, q_heads * head_dim],
    zero on padding rows. config: the decode kernels' settings; pdl_rows: the step's PDL row
    limit (kernels/pdl.py); out: the output tensor to write (None: a new one)."""
    num_rows, num_q_heads, head_dim = q.shape
    num_seqs = ctx.context_lens.shape[0]
    if not ctx.is_decode:
        return _attend_mixed(q, cache, ctx, scale, config, out)
    # Rows past the last sequence pad the batch to MIN_ROWS: the kernel writes them with zeros,
    # as on the CPU path.
    if out is None:
        out = torch.empty(num_rows, num_q_heads * head_dim, dtype=q.dtype, device=q.device)
    return paged_decode_attention(q[:num_seqs], cache.k, cache.v, ctx.block_tables,
                                  ctx.context_lens, scale, out=out, config=config,
                                  pdl_rows=pdl_rows)
