"""How many bytes of an adapter's factors each tensor-parallel rank holds, by the placement rule.

Column-parallel projections (q, k, v, gate, up) keep A whole and split B by output rows;
row-parallel ones (o, down) split A by input columns and keep B whole. Heads split in balanced
contiguous groups of whole KV heads, the MLP's intermediate size in balanced ranges: the same
rule as lorad.workers, restated here because lorad.config never imports the workers. Counts the
factors as stored, unpadded; the workers' slot tables may round ranks up.
"""

from __future__ import annotations

from lorad.config.adapters import AdapterSpec, LoraModule
from lorad.config.errors import ConfigError
from lorad.config.model import ModelConfig
from lorad.config.safetensors_header import DTYPE_SIZES

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


def balanced_split(n: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges covering 0..n; sizes differ by at most one, earlier parts
    get the extra."""
    base, extra = divmod(n, parts)
    ranges, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


def check_parallel(model: ModelConfig, parallel: int) -> None:
    if parallel > model.num_key_value_heads:
        raise ConfigError(f"--parallel {parallel} is more than the model's "
                          f"{model.num_key_value_heads} key-value heads; use --parallel "
                          f"{model.num_key_value_heads} or fewer")


def split_range(model: ModelConfig, module: str, parallel: int, rank: int) -> tuple[int, int]:
    """The rows (column-parallel) or columns (row-parallel) of `module` that `rank` holds."""
    if module in ("gate_proj", "up_proj", "down_proj"):
        return balanced_split(model.intermediate_size, parallel)[rank]
    kv_start, kv_end = balanced_split(model.num_key_value_heads, parallel)[rank]
    width = model.head_dim if module in ("k_proj", "v_proj") else \
        model.head_dim * model.queries_per_kv  # q_proj's outputs and o_proj's inputs
    return kv_start * width, kv_end * width


def module_bytes(model: ModelConfig, m: LoraModule, parallel: int, rank: int) -> int:
    start, end = split_range(model, m.module, parallel, rank)
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
