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
    """[head_dim // 2] float32, the formula of transformers' default and llama3 rope init."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    factor = scaling.factor
    low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = ((scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor)
                     / (scaling.high_freq_factor - scaling.low_freq_factor))
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed, inv_freq_llama)


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
