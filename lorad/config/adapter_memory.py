"""How many bytes of an adapter's factors each tensor-parallel rank holds, by the placement rule.

Column-parallel projections (q, k, v, gate, up) keep A whole and split B by output rows;
row-parallel ones (o, down) split A by input columns and keep B whole. Heads split in balanced
contiguous groups of whole KV heads, the MLP's intermediate size in balanced ranges: the same
rule as lorad.workers (lorad.config.partition). Counts the
factors as stored, unpadded; the workers' slot tables may round ranks up.
"""

from __future__ import annotations

from lorad.config.adapters import AdapterSpec, LoraModule
from lorad.config.model import ModelConfig
from lorad.config.partition import check_parallel, projection_range
from lorad.config.safetensors_header import DTYPE_SIZES

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj",
                   "shared_expert.gate_proj", "shared_expert.up_proj")
ROW_PARALLEL = ("o_proj", "down_proj", "shared_expert.down_proj")


def module_bytes(model: ModelConfig, m: LoraModule, parallel: int, rank: int) -> int:
    start, end = projection_range(model, m.module, rank, parallel)
    if m.module in COLUMN_PARALLEL:
        elements = m.rank * m.in_features + (end - start) * m.rank  # A whole, B's rows
    else:
        elements = m.rank * (end - start) + m.out_features * m.rank  # A's columns, B whole
    return elements * DTYPE_SIZES[m.dtype]


def bytes_per_rank(spec: AdapterSpec, model: ModelConfig, parallel: int) -> list[int]:
    """Factor bytes each of the `parallel` ranks holds for `spec`."""
    check_parallel(model, parallel)
    return [sum(module_bytes(model, m, parallel, rank) for m in spec.modules)
            for rank in range(parallel)]


def total_bytes(spec: AdapterSpec) -> int:
    """Factor bytes of the whole adapter, unsplit."""
    return sum((m.rank * m.in_features + m.out_features * m.rank) * DTYPE_SIZES[m.dtype]
               for m in spec.modules)
