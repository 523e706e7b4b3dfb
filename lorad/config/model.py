"""The base model's architecture, read from a Hugging Face `config.json`.

Only what the Llama and Qwen2-MoE families need is kept; anything lorad cannot compute exactly is
refused here, before any weight is read.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from lorad.config.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2_moe")


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 style frequency scaling (`rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    torch_dtype: str  # the checkpoint's dtype name, e.g. "float32", "bfloat16"
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    qkv_bias: bool = False  # q, k and v have biases (Qwen2)
    # Qwen2-MoE (0 experts: every layer dense): routed experts, top-k routing, a shared expert
    # with a sigmoid gate; layers listed in mlp_only_layers, or off decoder_sparse_step, are dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each routed expert's
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"config.json: {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"config.json: num_attention_heads ({self.num_attention_heads}) is not a multiple "
                f"of num_key_value_heads ({self.num_key_value_heads})")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise ConfigError(f"config.json: {name} must be a positive number, got {value!r}")

    @property
    def queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` has the MoE block (else the dense MLP), as
        transformers' Qwen2MoeDecoderLayer decides."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"--model {model_dir}: no config.json in that folder") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"--model {model_dir}: cannot read config.json: {exc}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a JSON object")
        extra = _read_generation_eos(Path(model_dir))
        return cls.from_dict(raw, source=str(path), extra_eos=extra)

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json",
                  extra_eos: tuple[int, ...] = ()) -> "ModelConfig":
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"{source}: model_type {model_type!r} is not supported "
                              f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{source}: hidden_act {act!r} is not supported (Llama uses silu)")
        for flag in ("attention_bias", "mlp_bias"):
            if raw.get(flag):
                raise ConfigError(f"{source}: {flag}=true is not supported yet")
        moe = _read_moe(raw, source) if model_type == "qwen2_moe" else {}
        if raw.get("quantization_config"):
            raise ConfigError(f"{source}: quantized checkpoints are not supported "
                              "(quantization_config is set)")
        heads = _get_int(raw, "num_attention_heads", source)
        hidden = _get_int(raw, "hidden_size", source)
        head_dim = raw.get("head_dim") or hidden // heads
        rope_theta, scaling = _read_rope(raw, source)
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        eos_ids = tuple(dict.fromkeys(eos_ids + tuple(extra_eos)))
        return cls(
            model_type=model_type,
            vocab_size=_get_int(raw, "vocab_size", source),
            hidden_size=hidden,
            intermediate_size=_get_int(raw, "intermediate_size", source),
            num_hidden_layers=_get_int(raw, "num_hidden_layers", source),
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=_get_int(raw, "max_position_embeddings", source),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id") if isinstance(raw.get("bos_token_id"), int) else None,
            **moe,
        )


def _get_int(raw: dict, key: str, source: str) -> int:
    value = raw.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{source}: {key} must be an integer, got {value!r}")
    return value


def _read_moe(raw: dict, source: str) -> dict:
    """Qwen2-MoE's fields (transformers' defaults where absent); sliding-window attention, which
    lorad does not compute, is refused by name."""
    if raw.get("use_sliding_window") or "sliding_attention" in (raw.get("layer_types") or ()):
        raise ConfigError(f"{source}: use_sliding_window=true (sliding-window attention) is not "
                          "supported")
    fields = {"qkv_bias": raw.get("qkv_bias", True),
              "norm_topk_prob": raw.get("norm_topk_prob", False)}
    for name in fields:
        if not isinstance(fields[name], bool):
            raise ConfigError(f"{source}: {name} must be true or false, got {fields[name]!r}")
    for name, default in (("num_experts", 60), ("num_experts_per_tok", 4),
                          ("moe_intermediate_size", 1408),
                          ("shared_expert_intermediate_size", 5632), ("decoder_sparse_step", 1)):
        fields[name] = _get_int({name: default, **raw}, name, source)
        if fields[name] < (0 if name == "num_experts" else 1):
            raise ConfigError(f"{source}: {name} must be positive, got {fields[name]}")
    if fields["num_experts"] and fields["num_experts_per_tok"] > fields["num_experts"]:
        raise ConfigError(f"{source}: num_experts_per_tok ({fields['num_experts_per_tok']}) is "
                          f"more than num_experts ({fields['num_experts']})")
    dense = raw.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in dense):
        raise ConfigError(f"{source}: mlp_only_layers must be a list of layer indices, "
                          f"got {dense!r}")
    fields["mlp_only_layers"] = tuple(sorted(set(dense)))
    return fields


def _read_rope(raw: dict, source: str) -> tuple[float, RopeScaling | None]:
    # transformers 5 writes `rope_parameters` (theta inside); 4.x writes `rope_theta` and
    # `rope_scaling`. Both spellings describe the same thing.
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"{source}: rope_parameters/rope_scaling must be an object")
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool):
        raise ConfigError(f"{source}: rope_theta must be a number, got {theta!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return float(theta), None
    if rope_type != "llama3":
        raise ConfigError(f"{source}: rope_type {rope_type!r} is not supported "
                          "(supported: default, llama3)")
    try:
        scaling = RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{source}: llama3 rope scaling is missing or has a bad {exc}") from None
    return float(theta), scaling


def _read_generation_eos(model_dir: Path) -> tuple[int, ...]:
    path = model_dir / "generation_config.json"
    if not path.exists():
        return ()
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from None
    eos = raw.get("eos_token_id") if isinstance(raw, dict) else None
    if isinstance(eos, int) and not isinstance(eos, bool):
        return (eos,)
    if isinstance(eos, list) and all(isinstance(e, int) for e in eos):
        return tuple(eos)
    return ()
