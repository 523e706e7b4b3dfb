"""The adapter registry fixed at start: PEFT LoRA folders validated, scaled and keyed.

INTERFACE STUB: the validation is being written; the names below are the contract that the
worker (factor tables) and the coordinator (model ids) code against.
"""

from __future__ import annotations

from dataclasses import dataclass

from lorad.config.model import ModelConfig

# The Llama family's linear projections, in the order the identity key and tables use.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class AdapterArg:
    """One `--adapter NAME=DIR` (with its `--adapter-strength NAME=NUMBER`, default 1.0)."""

    name: str
    path: str
    strength: float = 1.0


@dataclass(frozen=True)
class LoraModule:
    """One edited projection of one layer."""

    layer: int
    module: str  # one of TARGET_MODULES
    rank: int
    scale: float  # lora_alpha / r (or / sqrt(r) with use_rslora), per pattern, times strength
    a_tensor: str  # name in the weights file; shape [rank, in_features]
    b_tensor: str  # name in the weights file; shape [out_features, rank]


@dataclass(frozen=True)
class AdapterSpec:
    """A validated adapter: everything a worker needs to load its shard of the factors."""

    name: str
    path: str  # the resolved folder
    slot: int  # 1..K in command-line order; 0 is the base model
    strength: float
    key: str  # identity key: hex sha256 over factor bytes, module set and final scales
    weights_file: str  # the resolved adapter_model.safetensors
    modules: tuple[LoraModule, ...]  # sorted by (layer, TARGET_MODULES order)


def load_adapter(arg: AdapterArg, slot: int, model: ModelConfig) -> AdapterSpec:
    """Validate one PEFT folder against the base model; ConfigError names the file and field."""
    raise NotImplementedError


def load_registry(args: tuple[AdapterArg, ...], model: ModelConfig,
                  reserved_names: tuple[str, ...]) -> tuple[AdapterSpec, ...]:
    """Validate every adapter (slots 1..K in order); names unique and not in reserved_names."""
    raise NotImplementedError
