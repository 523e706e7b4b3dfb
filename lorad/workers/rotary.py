"""Rotary position embedding (default and Llama 3 frequency scaling), as transformers computes it.

cos/sin are tabulated once for every position up to max_position_embeddings: a position's
values are then the same bits whatever the batch (a cos over a longer tensor could take another
code path). Other scaling types are refused in lorad.config.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from lorad.config import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """[head_dim // 2] float32: theta^(-2i/d), then Llama 3's per-band rescaling if configured."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    base = 1.0 / (theta ** exponents)
    if scaling is None:
        return base
    # Llama 3 splits the frequencies by wavelength against the original context: short
    # wavelengths (under context / high_freq_factor) stay, long ones (over context /
    # low_freq_factor) are divided by `factor`, and the band between blends the two linearly in
    # context / wavelength. The blend is evaluated in the reference's operation order so the
    # table has the same fp32 bits as transformers'.
    context = scaling.original_max_position_embeddings
    wavelength = 2 * math.pi / base
    slowed = base / scaling.factor
    blend = (context / wavelength - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - blend) * base / scaling.factor + blend * base
    is_long = wavelength > context / scaling.low_freq_factor
    is_short = wavelength < context / scaling.high_freq_factor
    return torch.where(is_long, slowed, torch.where(is_short, base, blended))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None,
                 max_positions: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, theta, scaling)  # [head_dim // 2]
        positions = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        # Computed in fp32 and rounded to the model dtype, as transformers does per step.
        cos_table = emb.cos().to(dtype=dtype, device=device)  # [max_positions, head_dim]
        sin_table = emb.sin().to(dtype=dtype, device=device)  # [max_positions, head_dim]
        self.register_buffer("cos_table", cos_table, persistent=False)
        self.register_buffer("sin_table", sin_table, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [num_rows] -> cos, sin: [num_rows, 1, head_dim], to broadcast over heads
        return self.cos_table[positions].unsqueeze(1), self.sin_table[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [num_rows, num_heads, head_dim]; cos, sin: [num_rows, 1, head_dim]
    return x * cos + rotate_half(x) * sin
