"""Plain-torch reference of the LoRA shrink and expand kernels: the same math, one row at a time.

For tests only: a Python loop over rows, each row's products in fp32 with torch's own order, so
it agrees with the kernels within fp32 rounding, not bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def lora_shrink_reference(x: torch.Tensor, a_tables: Sequence[torch.Tensor],
                          rank_tables: Sequence[torch.Tensor],
                          row_slots: torch.Tensor) -> list[dict[int, torch.Tensor]]:
    """-> per table, {row: t_row [rank] float32} for each row whose slot the table edits.

    x: [num_rows, in]; a_tables[i]: [num_slots, max_rank_i, in]; row_slots: [num_rows]."""
    result = []
    for a, ranks in zip(a_tables, rank_tables):
        t = {}
        for row, slot in enumerate(row_slots.tolist()):
            rank = int(ranks[slot])
            if slot != 0 and rank > 0:
                t[row] = x[row].float() @ a[slot, :rank].float().t()
        result.append(t)
    return result


def lora_expand_reference(t: Sequence[dict[int, torch.Tensor]], outs: Sequence[torch.Tensor],
                          b_tables: Sequence[torch.Tensor], scale_tables: Sequence[torch.Tensor],
                          row_slots: torch.Tensor,
                          row_strengths: torch.Tensor | None = None) -> list[torch.Tensor]:
    """-> copies of outs (fp32) with (scale * (t_row B[slot, :, :rank]^T)) * strength[row] added
    to each row of t; rows absent from t keep their bits. t: from lora_shrink_reference with the
    same row_slots; row_strengths: [num_rows] float32 (None: all 1.0)."""
    results = []
    for t_rows, out, b, scales in zip(t, outs, b_tables, scale_tables):
        result = out.clone()
        for row, t_row in t_rows.items():
            slot = int(row_slots[row])
            rank = t_row.shape[0]
            delta = (t_row @ b[slot, :, :rank].float().t()) * scales[slot]
            if row_strengths is not None:
                delta = delta * row_strengths[row]
            result[row] = out[row] + delta
        results.append(result)
    return results


def lora_delta_reference(x: torch.Tensor, outs: Sequence[torch.Tensor],
                         a_tables: Sequence[torch.Tensor], b_tables: Sequence[torch.Tensor],
                         rank_tables: Sequence[torch.Tensor], scale_tables: Sequence[torch.Tensor],
                         row_slots: torch.Tensor,
                         row_strengths: torch.Tensor | None = None) -> list[torch.Tensor]:
    """-> copies of outs (fp32) with each row's delta added:
    out[row] + (scale * ((x A^T) B^T)) * strength[row]."""
    shrunk = lora_shrink_reference(x, a_tables, rank_tables, row_slots)
    return lora_expand_reference(shrunk, outs, b_tables, scale_tables, row_slots, row_strengths)
