"""A decoder layer's attention between its q/k/v projection and o_proj: rotary on q and k, the
step's K/V written into this layer's paged cache, then paged causal attention over this rank's
heads.

On the kernel path rotary and the cache write are one kernel that also adds q/k/v's LoRA deltas
(kernels/fused_ops.py), then the Triton attention (attention_cuda.py); on the torch path
apply_rotary and the per-sequence loop (attention.py), the deltas having been added by the
projection. Not here: the projections, the heads' split over ranks (the model's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from lorad.workers.attention import AttentionContext, paged_attention
from lorad.workers.kernel_path import kernel_path
from lorad.workers.kv_cache import PagedKVCache
from lorad.workers.rotary import RotaryEmbedding, apply_rotary

if TYPE_CHECKING:  # kernel modules: the CPU path never imports triton
    from lorad.workers.kernels.configs import DecodeAttentionConfig
    from lorad.workers.kernels.lora_common import LoraDelta


@dataclass(frozen=True)
class RotaryInputs:
    """What every layer's rotary needs, built once per step: the torch path's per-row cos/sin
    ([num_rows, 1, head_dim] each), the fused kernel's tables and positions."""

    positions: torch.Tensor  # [num_rows] int64
    cos_table: torch.Tensor  # [max_positions, head_dim]
    sin_table: torch.Tensor
    cos: torch.Tensor | None  # torch path only
    sin: torch.Tensor | None

    @classmethod
    def build(cls, rotary_emb: RotaryEmbedding, positions: torch.Tensor) -> "RotaryInputs":
        cos = sin = None
        if not kernel_path(positions.device):
            cos, sin = rotary_emb(positions)
        return cls(positions, rotary_emb.cos_table, rotary_emb.sin_table, cos, sin)


class RotaryPagedAttention(nn.Module):
    """Rotary, the KV write and attention of num_q_heads query heads over num_kv_heads."""

    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.kv_cache: PagedKVCache | None = None  # allocate_kv_cache
        self.decode: DecodeAttentionConfig | None = None  # the decode kernels' (tune())
        # While a mixed step's graph is captured in pieces (mixed_graph.py): the object that
        # runs this layer's attention between them; None otherwise.
        self.breaker = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                deltas: tuple[LoraDelta | None, ...], rotary: RotaryInputs,
                ctx: AttentionContext, pdl_rows: int) -> torch.Tensor:
        """q: [num_rows, q_heads * d], k, v: [num_rows, kv_heads * d] (column slices of one
        projection output are fine), deltas: q's, k's and v's LoRA deltas left to this layer
        (kernel path) -> [num_rows, q_heads * d]. pdl_rows: the step's PDL row limit."""
        assert self.kv_cache is not None, "allocate_kv_cache() before forward()"
        cache = self.kv_cache
        if kernel_path(q.device):
            # Lazily: the CPU never imports triton.
            from lorad.workers.attention_cuda import attend_cuda
            from lorad.workers.kernels.fused_ops import rotary_write_kv
            q = rotary_write_kv(q, k, v, rotary.positions, rotary.cos_table, rotary.sin_table,
                                ctx.slot_mapping, cache.k, cache.v, self.num_q_heads,
                                self.head_dim, deltas, pdl_rows)
            if self.breaker is not None:
                return self.breaker.attention(self, q)
            return attend_cuda(q, cache, ctx, self.scale, self.decode, pdl_rows)
        assert all(delta is None for delta in deltas), "deltas are left to kernels only"
        num_rows = q.shape[0]
        q = q.view(num_rows, self.num_q_heads, self.head_dim)
        k = k.view(num_rows, self.num_kv_heads, self.head_dim)
        v = v.view(num_rows, self.num_kv_heads, self.head_dim)
        q = apply_rotary(q, rotary.cos, rotary.sin)
        k = apply_rotary(k, rotary.cos, rotary.sin)
        return paged_attention(q, k, v, cache, ctx, self.scale)
