"""How the tensor-parallel ranks divide the model: one rule for the workers and the coordinator.

Heads split in balanced contiguous groups of whole KV heads (each rank takes the query heads of
its KV heads); the MLP's intermediate size and the vocabulary split in balanced contiguous
ranges. The workers shard weights and adapter factors by it; the coordinator checks --parallel
and sizes adapters by it, without importing the workers.
"""

from __future__ import annotations

from lorad.config.errors import ConfigError
from lorad.config.model import ModelConfig


def balanced_split(n: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges covering 0..n; sizes differ by at most one, earlier parts
    get the extra."""
    assert n >= 0 and parts > 0, (n, parts)
    base, extra = divmod(n, parts)
    ranges, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


def check_parallel(model: ModelConfig, parallel: int) -> None:
    """Every rank needs at least one whole KV head."""
    if parallel > model.num_key_value_heads:
        raise ConfigError(f"--parallel {parallel} is more than the model's "
                          f"{model.num_key_value_heads} key-value heads; use --parallel "
                          f"{model.num_key_value_heads} or fewer")


def kv_head_range(model: ModelConfig, rank: int, parallel: int) -> tuple[int, int]:
    """The contiguous range of KV heads `rank` holds."""
    check_parallel(model, parallel)
    return balanced_split(model.num_key_value_heads, parallel)[rank]


def projection_range(model: ModelConfig, module: str, rank: int, parallel: int) -> tuple[int, int]:
    """The output rows (q, k, v, gate, up) or input columns (o, down) of `module` at `rank`
    (a shared expert's gate, up and down as the dense MLP's, over its own intermediate size)."""
    if module in ("gate_proj", "up_proj", "down_proj"):
        return balanced_split(model.intermediate_size, parallel)[rank]
    if module.startswith("shared_expert."):
        return balanced_split(model.shared_expert_intermediate_size, parallel)[rank]
    kv_start, kv_end = kv_head_range(model, rank, parallel)
    width = model.head_dim if module in ("k_proj", "v_proj") else \
        model.head_dim * model.queries_per_kv  # q_proj's outputs and o_proj's inputs
    return kv_start * width, kv_end * width
