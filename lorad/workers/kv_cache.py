"""One layer's paged KV cache: K and V blocks of this rank's KV heads, written and read by slot.

A slot is block_id * block_size + offset (lorad.workers.batch); which blocks a sequence owns is
the block manager's business, not this file's.
"""

from __future__ import annotations

import torch


def kv_bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                       dtype: torch.dtype) -> int:
    """Bytes of K and V, all layers, for one block of this rank's KV heads."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize


class PagedKVCache:
    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.block_size = block_size
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # [num_blocks, block_size, kv_heads, head_dim] each
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def write(self, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor,
              slots: torch.Tensor) -> None:
        # k, v: [num_rows, kv_heads, head_dim]; rows, slots: [num_written] (padding excluded)
        num_heads, head_dim = self.k.shape[2:]
        self.k.view(-1, num_heads, head_dim)[slots] = k[rows]
        self.v.view(-1, num_heads, head_dim)[slots] = v[rows]

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        # src, dst: [num_copies] block ids. Gathered before written: a block freed and reused
        # as a destination in the same step still gives its old content to the copies reading it.
        self.k[dst] = self.k[src]
        self.v[dst] = self.v[src]
