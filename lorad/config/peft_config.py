"""An adapter's `adapter_config.json` as PEFT writes it, read into what lorad serves: plain LoRA.

Every key lorad uses is type-checked; every key that would make PEFT compute something other than
`scale * B(A x)` on the base's own weights is refused by name unless it holds its neutral value;
other keys (and PEFT's many nulls) are ignored. Target and pattern matching follow peft 0.21's
rules, restated here; which modules really carry factors is decided by the caller.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from lorad.config.errors import ConfigError

CONFIG_FILE = "adapter_config.json"
PEFT_DEFAULT_LLAMA_TARGETS = ("q_proj", "v_proj")  # what PEFT targets when target_modules is null

# Keys whose only servable value is "off"; the reason names the feature.
_MUST_BE_OFF = {
    "use_dora": "DoRA (weight-decomposed LoRA)",
    "modules_to_save": "fully trained copies of base modules",
    "lora_bias": "a bias on lora_B",
    "alora_invocation_tokens": "aLoRA (activated LoRA)",
    "layer_replication": "replicated base layers",
    "fan_in_fan_out": "Conv1D-style transposed weights (Llama's linears are not Conv1D)",
    "use_qalora": "QALoRA (pooled inputs)",
    "use_bdlora": "block-diagonal LoRA",
    "velora_config": "VeLoRA",
    "monteclora_config": "MonteCLoRA",
    "arrow_config": "Arrow routing",
    "kasa_config": "KaSA",
    "trainable_token_indices": "trained embedding rows",
    "target_parameters": "LoRA on raw parameters",
    "megatron_config": "Megatron parallel layers",
}
_BOOL_FLAGS = ("use_dora", "lora_bias", "fan_in_fan_out", "use_qalora")
# init_lora_weights values that rewrite the base weights at creation: the factors only reproduce
# the fine-tune on that rewritten base (unless PEFT converted them, which resets this to true).
_BASE_REWRITING_INITS = ("pissa", "corda", "olora", "loftq", "lora_ga")
# What "all-linear" expands to in a Llama or a Qwen2-MoE: every nn.Linear but the output head
# (in a Qwen2-MoE's sparse layers the shared expert's and its gate's; transformers 5's router and
# routed experts are not nn.Linear).
_ALL_LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|"
                         r"mlp\.(shared_expert\.)?(gate|up|down)_proj|mlp\.shared_expert_gate)")


@dataclass(frozen=True)
class PeftLoraConfig:
    r: int
    lora_alpha: float
    use_rslora: bool
    rank_pattern: dict[str, int]  # regex key -> rank, in the file's order (first match wins)
    alpha_pattern: dict[str, float]
    target_modules: tuple[str, ...] | str  # names/suffixes, one regex matched whole, all-linear
    exclude_modules: tuple[str, ...] | str
    layers_to_transform: tuple[int, ...] | None
    layers_pattern: tuple[str, ...]
    base_model: str | None  # base_model_name_or_path, for display only

    def is_targeted(self, name: str) -> bool:
        """Whether PEFT would put LoRA on the module `name` (full name in the transformers
        model)."""
        if isinstance(self.exclude_modules, str):
            if re.fullmatch(self.exclude_modules, name):
                return False
        elif any(name == k or name.endswith("." + k) for k in self.exclude_modules):
            return False
        if self.target_modules == "all-linear":
            return _ALL_LINEAR.fullmatch(name) is not None
        if isinstance(self.target_modules, str):
            return re.fullmatch(self.target_modules, name) is not None
        if name in self.target_modules:
            return True  # an exact name is taken whatever layers_to_transform says
        if not any(name.endswith("." + k) for k in self.target_modules):
            return False
        if not self.layers_to_transform:
            return True
        index = self._layer_index(name)
        return index is not None and index in self.layers_to_transform

    def _layer_index(self, name: str) -> int | None:
        # PEFT reads the first numbered segment: the one after any single segment when no
        # layers_pattern is set, else the one after a segment matching a layers_pattern entry.
        if not self.layers_pattern:
            found = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", name)
        else:
            found = next((m for p in self.layers_pattern
                          if (m := re.match(_layer_regex(p), name))), None)
        return int(found.group("idx")) if found else None

    def rank_for(self, name: str) -> int:
        key = _first_key(self.rank_pattern, name)
        return self.r if key is None else self.rank_pattern[key]

    def rank_origin(self, name: str) -> str:
        """Where rank_for(name) came from, for messages: "r" or "rank_pattern['q_proj']"."""
        key = _first_key(self.rank_pattern, name)
        return "r" if key is None else f"rank_pattern[{key!r}]"

    def alpha_for(self, name: str) -> float:
        key = _first_key(self.alpha_pattern, name)
        return self.lora_alpha if key is None else self.alpha_pattern[key]

    def scale_for(self, name: str) -> float:
        """PEFT's `scaling`: lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora."""
        r, alpha = self.rank_for(name), self.alpha_for(name)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r


def _layer_regex(pattern: str) -> str:
    return rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\."


def _suffix_regex(key: str) -> str:
    # A pattern key must match the whole name or a suffix starting right after a dot.
    return rf"(?:.*\.)?(?:{key})"


def _first_key(patterns: dict, name: str) -> str | None:
    # The first key in the file's order that matches wins, as in PEFT.
    return next((key for key in patterns if re.fullmatch(_suffix_regex(key), name)), None)


def read_peft_config(folder: Path) -> PeftLoraConfig:
    """Read and check `folder/adapter_config.json`; ConfigError names the file and field."""
    try:
        raw = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"no {CONFIG_FILE} in the folder (not a PEFT adapter?)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{CONFIG_FILE}: cannot read: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{CONFIG_FILE}: expected a JSON object")
    return _from_dict(raw)


def _from_dict(raw: dict) -> PeftLoraConfig:
    if raw.get("peft_type") != "LORA":
        raise ConfigError(f"{CONFIG_FILE}: peft_type is {raw.get('peft_type')!r}; lorad serves "
                          "only LORA adapters")
    _refuse_features(raw)
    targets = raw.get("target_modules")
    if targets is None:
        targets = list(PEFT_DEFAULT_LLAMA_TARGETS)
    targets = _names(targets, "target_modules")
    if isinstance(targets, str) and targets.lower() == "all-linear":
        targets = "all-linear"  # PEFT expands it to every linear layer but the output head
    elif isinstance(targets, str):
        _regex(targets, "target_modules", targets)
    excluded = _names(raw.get("exclude_modules"), "exclude_modules")
    if isinstance(excluded, str):
        _regex(excluded, "exclude_modules", excluded)
    layers_pattern = _names(raw.get("layers_pattern"), "layers_pattern")
    layers_pattern = (layers_pattern,) if isinstance(layers_pattern, str) else layers_pattern
    for item in layers_pattern:
        _regex(item, f"layers_pattern entry {item!r}", _layer_regex(item))
    return PeftLoraConfig(
        r=_positive_int(raw.get("r"), "r"), lora_alpha=_finite(raw.get("lora_alpha"), "lora_alpha"),
        use_rslora=_bool(raw, "use_rslora"),
        rank_pattern=_pattern(raw, "rank_pattern", _positive_int),
        alpha_pattern=_pattern(raw, "alpha_pattern", _finite),
        target_modules=targets, exclude_modules=excluded,
        layers_to_transform=_layers(raw.get("layers_to_transform")),
        layers_pattern=layers_pattern, base_model=_optional_str(raw, "base_model_name_or_path"))


def _refuse_features(raw: dict) -> None:
    for key, feature in _MUST_BE_OFF.items():
        value = raw.get(key)
        if key in _BOOL_FLAGS and value is not None and not isinstance(value, bool):
            raise ConfigError(f"{CONFIG_FILE}: {key} must be true or false, got {value!r}")
        if not (value is None or value is False or value == [] or value == {}):
            raise ConfigError(f"{CONFIG_FILE}: {key}={json.dumps(value)[:60]} asks for "
                              f"{feature}, which lorad cannot serve exactly")
    bias = raw.get("bias", "none")
    if bias != "none":
        raise ConfigError(f"{CONFIG_FILE}: bias={json.dumps(bias)[:60]} trains base biases; "
                          'lorad serves only bias="none"')
    init = raw.get("init_lora_weights", True)
    if not isinstance(init, (bool, str)):
        raise ConfigError(f"{CONFIG_FILE}: init_lora_weights must be true, false or a string, "
                          f"got {init!r}")
    if isinstance(init, str) and init.lower().startswith(_BASE_REWRITING_INITS):
        raise ConfigError(f"{CONFIG_FILE}: init_lora_weights={init!r} rewrote the base weights "
                          "when the adapter was made; convert it to a plain LoRA first "
                          "(PEFT's path_initial_model_for_weight_conversion)")


def _positive_int(value, field: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{CONFIG_FILE}: {field} must be a positive integer, got {value!r}")
    return value


def _finite(value, field: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ConfigError(f"{CONFIG_FILE}: {field} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(f"{CONFIG_FILE}: {field} must be finite, got {value!r}")
    return value


def _bool(raw: dict, field: str) -> bool:
    value = raw.get(field)
    if value is not None and not isinstance(value, bool):
        raise ConfigError(f"{CONFIG_FILE}: {field} must be true or false, got {value!r}")
    return bool(value)


def _optional_str(raw: dict, field: str) -> str | None:
    value = raw.get(field)
    if value is not None and not isinstance(value, str):
        raise ConfigError(f"{CONFIG_FILE}: {field} must be a string, got {value!r}")
    return value


def _pattern(raw: dict, field: str, check) -> dict:
    patterns = raw.get(field)
    if patterns is None:
        return {}
    if not isinstance(patterns, dict):
        raise ConfigError(f"{CONFIG_FILE}: {field} must be an object, got {patterns!r}")
    for key, value in patterns.items():
        _regex(key, f"{field} key {key!r}", _suffix_regex(key))
        check(value, f"{field}[{key!r}]")
    return dict(patterns)


def _names(value, field: str) -> tuple[str, ...] | str:
    if value is None:
        return ()
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{CONFIG_FILE}: {field} must be a list of strings or a string, "
                          f"got {value!r}")
    return tuple(value)


def _regex(text: str, what: str, full_regex: str) -> None:
    try:
        re.compile(full_regex)
    except re.error as exc:
        raise ConfigError(f"{CONFIG_FILE}: {what} is not a usable regular expression ({exc})") \
            from None


def _layers(value) -> tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise ConfigError(f"{CONFIG_FILE}: layers_to_transform must be a non-negative integer "
                          f"or a list of them, got {value!r}")
    return tuple(value)
