"""Paged causal attention over this rank's heads: write the step's K/V, then attend.

Each sequence is computed as if alone (its chunk's queries against its context read from its
block table), so a row's result never depends on the other sequences in the batch, and padding
rows are neither written nor attended. Sequences whose chunks have the same number of tokens
(every decode of a step) go through batched products together, each with the shapes it would
have alone: a shorter context's extra key blocks are masked, their values zeros, which adds +-0
to its sums (tests/unit/test_attention_batched.py holds it to the one-sequence arithmetic). Nor
does a row's result depend on how the prompt was chunked or whether the row is a decode: every
product has one shape (at least MIN_ROWS query rows, as batch.product_rows pads them, against
KEY_BLOCK keys), and the sums over the context add the blocks' partials in block order, so a
position's bits are the same whatever context length the step has (a prefix-cache hit, another
--max-num-batched-tokens, a decode). On CUDA (with triton installed) the step goes to the Triton
kernels instead (attention_cuda.py); this is the reference they are compared with.
"""

from __future__ import annotations

import math
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
class SeqGroup:
    """Sequences of the step with the same number of new tokens (every decode: one), attended
    together in batched products of the shapes each would have alone; shared by every layer."""

    rows: torch.Tensor  # [num_seqs, num_tokens] int64: each sequence's rows of the batch
    # [num_seqs, num_keys / block_size] int64: the KV blocks holding each sequence's key
    # positions, num_keys the longest context rounded up to KEY_BLOCK; the blocks past a
    # sequence's context are block 0's (their scores masked, their values zeroed)
    key_blocks: torch.Tensor
    # [num_past] int64: positions past each context, as rows of the [num_seqs * num_keys] keys
    past_context: torch.Tensor
    # [num_seqs, num_tokens, num_keys] bool, True = may attend (causal, within the context)
    causal_mask: torch.Tensor


@dataclass(frozen=True)
class AttentionContext:
    write_rows: torch.Tensor  # [num_written] int64: rows whose K/V go into the cache
    write_slots: torch.Tensor  # [num_written] int64: their slots
    groups: list[SeqGroup]
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
        by_size: dict[int, list] = {}
        for chunk in batch.seqs:
            if chunk.context_len > 0:  # a graph bucket's padding sequence: its rows stay zero
                by_size.setdefault(chunk.num_tokens, []).append(chunk)
        groups = [_group(chunks, block_size, device) for _, chunks in sorted(by_size.items())]
        return cls(write_rows, batch.slot_mapping[write_rows], groups, real_rows)


def _group(chunks: list, block_size: int, device: torch.device) -> SeqGroup:
    n = chunks[0].num_tokens
    # Whole blocks are gathered: num_keys is a multiple of the block size too.
    step = KEY_BLOCK * block_size // math.gcd(KEY_BLOCK, block_size)
    num_keys = max(-(-c.context_len // step) for c in chunks) * step
    blocks = torch.zeros(len(chunks), num_keys // block_size, dtype=torch.int64)
    for i, c in enumerate(chunks):
        num_blocks = -(-c.context_len // block_size)
        blocks[i, :num_blocks] = torch.tensor(c.block_table[:num_blocks], dtype=torch.int64)
    context = torch.tensor([c.context_len for c in chunks])
    starts = torch.tensor([c.token_start for c in chunks])
    # The chunk holds the last n positions of its context.
    query_pos = context[:, None] - n + torch.arange(n)[None, :]  # [num_seqs, n]
    key_pos = torch.arange(num_keys)
    past = torch.nonzero((key_pos[None, :] >= context[:, None]).flatten()).squeeze(1)
    return SeqGroup((starts[:, None] + torch.arange(n)[None, :]).to(device), blocks.to(device),
                    past.to(device), (key_pos[None, None, :] <= query_pos[:, :, None]).to(device))


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
    for seqs in ctx.groups:
        num_seqs, n = seqs.rows.shape
        shape = (num_seqs, -1, num_kv_heads, head_dim)
        # [num_seqs, num_keys, kv_heads, head_dim]. Past a context, the keys are whatever their
        # blocks hold (their scores are masked) and the values zeros, as alone: a probability of
        # 0 times a value adds +-0 to a sum, which changes no bit.
        # Blocks as rows of a 2-D view: torch's gather of a 4-D tensor's rows is slower.
        block_ids = seqs.key_blocks.flatten()
        keys = cache.k.view(cache.k.shape[0], -1).index_select(0, block_ids).view(shape)
        values = cache.v.view(cache.v.shape[0], -1).index_select(0, block_ids)
        values.view(-1, num_kv_heads, head_dim).index_fill_(0, seqs.past_context, 0)
        values = values.view(shape)
        # Query heads of one KV head are consecutive: [num_seqs, kv_heads, group * n, head_dim].
        q_seqs = q[seqs.rows.flatten()].view(num_seqs, n, num_kv_heads, group, head_dim)
        q_seqs = q_seqs.permute(0, 2, 3, 1, 4).reshape(num_seqs, num_kv_heads, group * n,
                                                        head_dim)
        attn = _attend(q_seqs, keys, values, seqs.causal_mask, scale)
        attn = attn.view(num_seqs, num_kv_heads, group, n, head_dim).permute(0, 3, 1, 2, 4)
        out[seqs.rows.flatten()] = attn.reshape(num_seqs * n, num_q_heads * head_dim)
    return out


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
            scale: float) -> torch.Tensor:
    """softmax(q k^T * scale, masked) v for sequences of equal chunks, each with the shapes of
    the file's header. q: [num_seqs, kv_heads, num_q, head_dim]; keys, values: [num_seqs,
    num_keys, kv_heads, head_dim], zero past each context; mask: [num_seqs, num_q / group,
    num_keys] -> [num_seqs, kv_heads, num_q, head_dim].

    One torch.bmm a KV head over every (sequence, block of keys), reading the gathered keys and
    values in place (a block of one head is a strided matrix): a batched product over heads too
    would copy them into a head-major layout first (~7 ms of SmolLM2's 8-decode step at one
    thread)."""
    num_seqs, num_kv_heads, num_q, head_dim = q.shape
    num_blocks = mask.shape[2] // KEY_BLOCK
    rows = product_rows(num_q)
    padded = F.pad(q, (0, 0, 0, rows - num_q))  # [num_seqs, kv_heads, rows, head_dim]
    # [num_seqs * num_blocks, KEY_BLOCK, kv_heads, head_dim]: one block of keys a matrix
    key_blocks = keys.view(num_seqs * num_blocks, KEY_BLOCK, num_kv_heads, head_dim)
    value_blocks = values.view(num_seqs * num_blocks, KEY_BLOCK, num_kv_heads, head_dim).float()
    # one product per block of keys; scaled after the product, as transformers does
    scores = torch.stack([
        torch.bmm(padded[:, h, None].expand(num_seqs, num_blocks, rows, head_dim)
                  .reshape(num_seqs * num_blocks, rows, head_dim),
                  key_blocks[:, :, h].transpose(1, 2))
        for h in range(num_kv_heads)], dim=1)  # [num_seqs * num_blocks, kv_heads, rows, KEY]
    scores = scores.view(num_seqs, num_blocks, num_kv_heads, rows, KEY_BLOCK)[:, :, :, :num_q]
    scores = scores.permute(0, 2, 3, 1, 4).reshape(num_seqs, num_kv_heads, num_q, -1) * scale
    scores = scores.view(num_seqs, num_kv_heads, -1, *mask.shape[1:])
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    scores = scores.view(num_seqs, num_kv_heads, num_q, num_blocks, KEY_BLOCK).float()
    # softmax in fp32: the max is exact in any order; the sum is each block's, then the blocks'
    # in order (a cumulative sum's last element).
    exps = torch.exp(scores - scores.amax(dim=(3, 4), keepdim=True))
    total = exps.sum(dim=4).cumsum(dim=3)[..., -1:, None]
    probs = (exps / total).to(q.dtype).float()  # rounded to the model dtype, as transformers
    # [num_seqs * num_blocks, kv_heads, rows, KEY_BLOCK]
    probs = F.pad(probs.permute(0, 3, 1, 2, 4), (0, 0, 0, rows - num_q))
    probs = probs.reshape(num_seqs * num_blocks, num_kv_heads, rows, KEY_BLOCK)
    # each block's partial sums, added in block order
    parts = torch.stack([torch.bmm(probs[:, h], value_blocks[:, :, h])
                         for h in range(num_kv_heads)], dim=1)
    parts = parts.view(num_seqs, num_blocks, num_kv_heads, rows, head_dim)
    return parts.cumsum(dim=1)[:, -1, :, :num_q].to(q.dtype)
