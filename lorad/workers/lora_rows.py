"""Which rows of a step use which adapter (LoraRows), built once per step and read by every
projection with LoRA slots: row indices per slot on the torch path; on the kernel path the LoRA
kernels' row tiles, their settings and the step's PDL row limit.

No factor tables here (lora.py) and no launches: building the rows makes no device sync, so a
CUDA graph can capture the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from lorad.workers.batch import ForwardBatch
from lorad.workers.kernel_path import kernel_path
from lorad.workers.kernels.configs import ExpandSteps, ShrinkConfig
from lorad.workers.kernels.lora_tiles import LoraTiles, count_tiles, max_tiles_any_mixture
from lorad.workers.tuning import Tuning


@dataclass(frozen=True)
class LoraRows:
    """Which rows of a step use which adapter: built once per step, read by every LoRA layer.

    On the CPU (the torch path) as row indices per slot; on CUDA as row tiles for the kernels,
    with no per-slot tensors and no host sync, so a CUDA graph can capture the whole step."""

    slots: tuple[int, ...]  # adapter slots (>= 1) with rows this step, ascending
    # torch path: (slot, row indices [n] int64, the rows' strengths [n, 1] float32 or None when
    # every one is 1.0: then no multiply, so those deltas keep their bits)
    groups: list[tuple[int, torch.Tensor, torch.Tensor | None]]
    tiles: LoraTiles | None = None  # kernel path; None on the torch path
    # Kernel path in a CUDA graph: launch for every edited projection whatever `slots` says
    # (replays serve other mixtures); rows of slot 0 then exit inside the kernels.
    launch_always: bool = False
    row_slots: torch.Tensor | None = None  # kernel path: [num_rows] int64, each row's slot
    # kernel path: [num_rows] float32, each row's adapter strength (the expand multiplies by it)
    row_strengths: torch.Tensor | None = None
    # Kernel path: the LoRA kernels' settings, and the step's PDL row limit, which every kernel
    # of the step takes (kernels/pdl.py; 0 on the torch path).
    shrink: ShrinkConfig = ShrinkConfig()
    expand: ExpandSteps = ExpandSteps()
    pdl_rows: int = 0
    # Kernel path: the step adds its deltas into the base outputs in place after each matmul
    # rather than leaving fp32 deltas to the next kernel (ExpandSteps.in_place: prompt steps of
    # many rows); the bits are the same either way.
    in_place: bool = False

    @classmethod
    def from_batch(cls, batch: ForwardBatch, launch_always: bool = False,
                   use_kernels: bool | None = None, tuning: Tuning = Tuning()) -> "LoraRows":
        """use_kernels: None picks the kernels on CUDA when triton imports (tests force it)."""
        # From the chunk list, not from batch.row_adapter_slots: no device-to-host copy per step.
        rows: dict[int, list[int]] = {}
        strengths: dict[int, list[float]] = {}
        for chunk in batch.seqs:
            if chunk.adapter_slot != 0:
                rows.setdefault(chunk.adapter_slot, []).extend(
                    range(chunk.token_start, chunk.token_start + chunk.num_tokens))
                strengths.setdefault(chunk.adapter_slot, []).extend(
                    [chunk.adapter_strength] * chunk.num_tokens)
        slots = tuple(sorted(rows))
        device = batch.input_ids.device
        if use_kernels is None:
            use_kernels = kernel_path(device)
        if use_kernels:
            if launch_always:
                max_tiles = max_tiles_any_mixture(batch.row_adapter_slots.shape[0])
            else:
                max_tiles = count_tiles((len(rows[slot]) for slot in slots), tuning.tiles.block_m)
            pdl_rows = tuning.pdl.step_rows(with_lora=bool(slots) or launch_always)
            tiles = step_tiles(batch, max_tiles, tuning, _capturing(device))
            row_strengths = batch.row_strengths
            if row_strengths is None:
                row_strengths = torch.ones(batch.row_adapter_slots.shape[0], dtype=torch.float32,
                                           device=device)
            in_place = tuning.expand.in_place(batch.row_adapter_slots.shape[0],
                                              prompt=not batch.is_decode)
            return cls(slots, [], tiles, launch_always, batch.row_adapter_slots, row_strengths,
                       tuning.shrink, tuning.expand, pdl_rows, tiles is not None and in_place)
        if launch_always:
            raise ValueError("launch_always is for the kernel path (CUDA graphs)")
        return cls(slots, [(slot, torch.tensor(rows[slot], dtype=torch.int64, device=device),
                            _group_strengths(strengths[slot], device)) for slot in slots])

    @property
    def any_delta(self) -> bool:
        """Whether any LoRA work may run this step (its PDL row limit follows)."""
        return bool(self.slots) or self.launch_always

    def launches(self, ranks: list[int]) -> bool:
        """Kernel path: whether a table with these ranks per slot (LoraSlots.ranks) takes part
        (a fact known to Python, no sync)."""
        return self.launch_always or any(ranks[slot] for slot in self.slots)


def _group_strengths(strengths: list[float], device: torch.device) -> torch.Tensor | None:
    """[n, 1] float32: a slot group's row strengths, or None when all are 1.0 (no multiply)."""
    if all(x == 1.0 for x in strengths):
        return None
    return torch.tensor(strengths, dtype=torch.float32, device=device).unsqueeze(1)


def step_tiles(batch: ForwardBatch, max_tiles: int, tuning: Tuning,
               capturing: bool) -> LoraTiles | None:
    """The step's row tiles for the LoRA kernels (None: no adapter row, none launch); capturing:
    whether a CUDA graph is being captured on the batch's device."""
    if not max_tiles:
        return None
    if batch.lora_tiles is not None:  # a decode graph's inputs, filled from the chunks
        return LoraTiles(*batch.lora_tiles, max_tiles, tuning.tiles.programs_per_sm)
    device = batch.input_ids.device
    if not capturing:
        # Built here, from the chunks: no kernels for it in the step (docs/performance-log.md:
        # host-built LoRA tiles).
        return LoraTiles.from_host(_row_slots(batch), max_tiles, device, tuning.tiles)
    # On the device, from the row slots, where a CUDA graph is being captured without tiles among
    # its inputs: tiles copied from the host would be this mixture's, fixed into every replay.
    return LoraTiles.build(batch.row_adapter_slots, max_tiles, tuning.tiles)


def _capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on `device`'s current stream."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _row_slots(batch: ForwardBatch) -> np.ndarray:
    """[num_rows] int64: each row's adapter slot, from the chunk list (padding rows 0)."""
    slots = np.zeros(batch.row_adapter_slots.shape[0], dtype=np.int64)
    for chunk in batch.seqs:
        slots[chunk.token_start:chunk.token_start + chunk.num_tokens] = chunk.adapter_slot
    return slots
