"""Plain-torch references for the paged attention kernels: the same inputs, the same math, in fp32.

One loop per sequence over its context gathered through its block table; slow and obviously right.
The kernels are compared with these on fresh random inputs
(tests/kernels/paged_attention_checks.py). Not used by the serving path.
"""

from __future__ import annotations

import torch


def context_slots(block_table: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """block_table: [max_blocks] -> [context_len] int64 KV slots of positions 0..context_len-1."""
    positions = torch.arange(context_len, device=block_table.device)
    return block_table.long()[positions // block_size] * block_size + positions % block_size


def paged_prefill_attention_reference(q: torch.Tensor, k_cache: torch.Tensor,
                                      v_cache: torch.Tensor, block_tables: torch.Tensor,
                                      context_lens: torch.Tensor, query_starts: torch.Tensor,
                                      scale: float) -> torch.Tensor:
    """q: [num_tokens, q_heads, head_dim], seq i's tokens at rows query_starts[i]:[i+1], the last
    positions of its context; k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim];
    block_tables: [num_seqs, max_blocks]; context_lens: [num_seqs]
    -> [num_tokens, q_heads * head_dim] in q's dtype, causal within each sequence."""
    num_tokens, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    keys_all = k_cache.reshape(-1, num_kv_heads, head_dim)
    values_all = v_cache.reshape(-1, num_kv_heads, head_dim)
    out = torch.zeros(num_tokens, num_q_heads, head_dim, dtype=torch.float32, device=q.device)
    starts = query_starts.tolist()
    for seq, context_len in enumerate(context_lens.tolist()):
        first, last = starts[seq], starts[seq + 1]
        n = last - first
        if n == 0 or context_len == 0:
            continue
        slots = context_slots(block_tables[seq], context_len, block_size)
        # [kv_heads, context_len, head_dim], each query head reading its KV head's
        keys = keys_all[slots].float().transpose(0, 1).repeat_interleave(group, dim=0)
        values = values_all[slots].float().transpose(0, 1).repeat_interleave(group, dim=0)
        queries = q[first:last].float().transpose(0, 1)  # [q_heads, n, head_dim]
        scores = torch.matmul(queries, keys.transpose(1, 2)) * scale  # [q_heads, n, context]
        query_pos = torch.arange(context_len - n, context_len, device=q.device)
        key_pos = torch.arange(context_len, device=q.device)
        scores = scores.masked_fill(key_pos[None, None, :] > query_pos[None, :, None],
                                    float("-inf"))
        out[first:last] = torch.matmul(torch.softmax(scores, dim=-1), values).transpose(0, 1)
    return out.reshape(num_tokens, num_q_heads * head_dim).to(q.dtype)


def paged_decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor,
                                     v_cache: torch.Tensor, block_tables: torch.Tensor,
                                     context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token per sequence, q: [num_seqs, q_heads, head_dim] -> [num_seqs, q_heads *
    head_dim]; zero rows where context_len is 0."""
    query_starts = torch.arange(q.shape[0] + 1, device=q.device)
    return paged_prefill_attention_reference(q, k_cache, v_cache, block_tables, context_lens,
                                             query_starts, scale)


def write_kv_reference(k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """k, v: [num_rows, kv_heads, head_dim] into the caches at slot_mapping [num_rows]; rows with
    slot -1 (padding) are skipped."""
    rows = torch.nonzero(slot_mapping >= 0).squeeze(1)
    num_kv_heads, head_dim = k_cache.shape[2:]
    k_cache.view(-1, num_kv_heads, head_dim)[slot_mapping[rows]] = k[rows]
    v_cache.view(-1, num_kv_heads, head_dim)[slot_mapping[rows]] = v[rows]
