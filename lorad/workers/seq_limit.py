"""`--max-num-seqs auto`: the most sequences a step runs, from the KV pool the ranks agreed on.

Pure (no torch, no clocks): every rank computes it from the agreed block count and the same
flags, and engine.py takes the ranks' minimum besides, as it does for the block count. It does
not size the pool; it only reads it (the pool's default size asks `pool_sizing_seqs`).
"""

from __future__ import annotations

# Today's fixed default is the floor: lazy block allocation and newest-first preemption (the
# planner) already serve a pool that 64 sequences outgrow, and every CPU test runs at it.
AUTO_MIN_NUM_SEQS = 64
# The CPU's ceiling: a step there costs milliseconds per row, so more rows only queue longer.
AUTO_MAX_NUM_SEQS_CPU = 64
# The GPU's ceiling: the largest batch measured on the H200 (issue 29: 256 streams of an 8B
# served 15,733 tokens/s against ~9,300 at 64); its decode graph bucket is captured at start.
AUTO_MAX_NUM_SEQS_GPU = 256
# The context each sequence is granted when sizing by the pool: a longer --max-model-len would
# reserve for a length few sequences reach (blocks are allocated lazily, as tokens arrive).
AUTO_CONTEXT_TOKENS = 2048
ALIGN = 8  # a multiple of 8 rows: the decode kernels' row tiles and the graphs' largest bucket


def pool_sizing_seqs(max_num_seqs: int | None, on_gpu: bool) -> int:
    """The sequences the default KV pool is sized for: the explicit value, else auto's ceiling
    (the pool is then capped by memory as before, and auto reads what it got)."""
    if max_num_seqs is not None:
        return max_num_seqs
    return AUTO_MAX_NUM_SEQS_GPU if on_gpu else AUTO_MAX_NUM_SEQS_CPU


def auto_max_num_seqs(num_kv_blocks: int, block_size: int, max_model_len: int,
                      max_num_batched_tokens: int, on_gpu: bool) -> int:
    """The sequences the pool holds at min(max_model_len, AUTO_CONTEXT_TOKENS) tokens each,
    between AUTO_MIN_NUM_SEQS and the device's ceiling, at most one step's token budget (the
    decodes past it would wait while older ones run), rounded down to a multiple of ALIGN."""
    if min(num_kv_blocks, block_size, max_model_len, max_num_batched_tokens) <= 0:
        raise ValueError(f"auto --max-num-seqs needs a positive pool, block size, model length "
                         f"and token budget, got {num_kv_blocks}, {block_size}, "
                         f"{max_model_len}, {max_num_batched_tokens}")
    ceiling = AUTO_MAX_NUM_SEQS_GPU if on_gpu else AUTO_MAX_NUM_SEQS_CPU
    context = min(max_model_len, AUTO_CONTEXT_TOKENS)
    by_pool = num_kv_blocks * block_size // context
    num_seqs = min(max(AUTO_MIN_NUM_SEQS, min(ceiling, by_pool)), max_num_batched_tokens)
    return num_seqs // ALIGN * ALIGN if num_seqs >= ALIGN else num_seqs
