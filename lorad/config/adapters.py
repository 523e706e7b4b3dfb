"""The adapter registry fixed at start: PEFT LoRA folders validated, scaled and keyed.

Reads adapter_config.json, the optional lorad-adapter.json and the safetensors header (never the
base weights, never a pickle), decides which projections the adapter edits from the tensors
present, cross-checks them with PEFT's targeting, and refuses by name whatever lorad could not
serve exactly. Workers call `load_adapter` too, and must arrive at the coordinator's key.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from lorad.config.adapter_key import identity_key
from lorad.config.adapter_manifest import read_manifest
from lorad.config.errors import ConfigError
from lorad.config.lora_module import (MODULE_ORDER, PARENTS, SHARED_EXPERT_MODULES,  # noqa: F401
                                      TARGET_MODULES, LoraModule, module_name)
from lorad.config.model import ModelConfig
from lorad.config.peft_config import PeftLoraConfig, read_peft_config
from lorad.config.safetensors_header import TensorEntry, read_safetensors_header

WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"
FACTOR_DTYPES = ("F32", "BF16", "F16")
MAX_LAYERS = 10_000
# A model id in requests: no spaces or slashes, short enough for logs and metric labels.
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_FACTOR_NAME = re.compile(r"base_model\.model\.model\.layers\.(0|[1-9][0-9]*)\."
                          r"(self_attn|mlp)\.((?:shared_expert\.)?\w+)\.lora_(A|B)\.weight")
# Modules of a Qwen2-MoE sparse layer that are not served projections, and what they are.
_MOE_OTHERS = {"mlp.gate": "the MoE router", "mlp.experts": "the routed experts",
               "mlp.shared_expert_gate": "the shared expert's gate",
               "mlp.shared_expert": "the shared expert as a whole",
               "mlp.shared_expert.act_fn": "an activation"}
_MOE_EDITS = ("Qwen2-MoE adapters may edit q/k/v/o_proj, the shared expert's gate/up/down_proj "
              "and a dense layer's gate/up/down_proj")


@dataclass(frozen=True)
class AdapterArg:
    """One `--adapter NAME=DIR` (with its `--adapter-strength NAME=NUMBER`, default 1.0)."""

    name: str
    path: str
    strength: float = 1.0


@dataclass(frozen=True)
class AdapterSpec:
    """A validated adapter: everything a worker needs to load its shard of the factors."""

    name: str
    path: str  # the resolved folder
    adapter_id: int  # the registry id: 1..K in command-line order, then one per run-time load
    strength: float
    key: str  # identity key: hex sha256 over factor bytes, module set and final scales
    weights_file: str  # the resolved adapter_model.safetensors
    modules: tuple[LoraModule, ...]  # sorted by (layer, MODULE_ORDER)
    base_model: str | None = None  # the manifest's base_model, else PEFT's base_model_name_or_path
    has_manifest: bool = False  # a lorad-adapter.json was present and agreed with the files
    shapes_checked: bool = True  # False when read without a base model (check-adapter alone)

    def to_worker_dict(self) -> dict:
        """The WorkerConfig.adapters entry; the worker reloads the folder and checks the key."""
        return {"name": self.name, "path": self.path, "strength": self.strength, "key": self.key,
                "id": self.adapter_id}


def check_adapter_args(args: tuple[AdapterArg, ...], reserved_names: tuple[str, ...]) -> None:
    """Names usable as model ids, unique, not reserved; strengths finite. Errors name the flag."""
    seen: set[str] = set()
    for arg in args:
        if not isinstance(arg.name, str) or not ADAPTER_NAME.fullmatch(arg.name):
            raise ConfigError(f"--adapter {arg.name!r}: an adapter name is its model id: 1 to 64 "
                              "letters, digits, '.', '_' or '-', starting with a letter or digit")
        if arg.name in seen:
            raise ConfigError(f"--adapter {arg.name}: the name is given twice")
        if arg.name in reserved_names:
            raise ConfigError(f"--adapter {arg.name}: the name is taken by the base model "
                              "(--name); adapters need their own model ids")
        seen.add(arg.name)
        strength = arg.strength
        if (not isinstance(strength, (int, float)) or isinstance(strength, bool)
                or not math.isfinite(strength)):
            raise ConfigError(f"--adapter-strength {arg.name}={strength!r}: the strength must be "
                              "a finite number")


def load_registry(args: tuple[AdapterArg, ...], model: ModelConfig,
                  reserved_names: tuple[str, ...]) -> tuple[AdapterSpec, ...]:
    """Validate every adapter (ids 1..K in order); names unique and not in reserved_names."""
    check_adapter_args(args, reserved_names)
    return tuple(load_adapter(arg, i, model) for i, arg in enumerate(args, start=1))


def load_adapter(arg: AdapterArg, adapter_id: int, model: ModelConfig | None) -> AdapterSpec:
    """Validate one PEFT folder against the base model; ConfigError names the flag, file and
    field. model=None checks what needs no base (check-adapter without --model)."""
    try:
        return read_adapter(Path(arg.path), arg.name, arg.strength, adapter_id, model)
    except ConfigError as exc:
        raise ConfigError(f"--adapter {arg.name}={arg.path}: {exc}") from None


def read_adapter(folder: Path, name: str, strength: float, adapter_id: int,
                 model: ModelConfig | None) -> AdapterSpec:
    """`load_adapter` with errors that name only the file and field."""
    folder = _check_folder(folder)
    weights = folder / WEIGHTS_FILE
    if not weights.exists():
        if (folder / PICKLE_FILE).exists():
            raise ConfigError(f"{PICKLE_FILE} is a pickle, which lorad never opens: safetensors "
                              f"required (save with safe_serialization=True for {WEIGHTS_FILE})")
        raise ConfigError(f"no {WEIGHTS_FILE} in the folder")
    manifest = read_manifest(folder)  # first: files that changed since may fail anywhere below
    config = read_peft_config(folder)
    header = read_safetensors_header(weights, WEIGHTS_FILE)
    pairs = _factor_pairs(header.tensors, model)
    _check_targets(config, pairs, model)
    modules = tuple(_module(config, layer, module, a, b, strength, model)
                    for (layer, module), (a, b) in sorted(
                        pairs.items(), key=lambda kv: (kv[0][0], MODULE_ORDER.index(kv[0][1]))))
    key = identity_key(modules, header.tensors, weights, WEIGHTS_FILE)
    base_model = manifest.base_model if manifest and manifest.base_model else config.base_model
    return AdapterSpec(name=name, path=str(folder), adapter_id=adapter_id, strength=strength,
                       key=key,
                       weights_file=str(weights), modules=modules, base_model=base_model,
                       has_manifest=manifest is not None, shapes_checked=model is not None)


def _check_folder(folder: Path) -> Path:
    if not folder.exists():
        raise ConfigError("no such folder")
    if not folder.is_dir():
        raise ConfigError("not a folder (give the adapter's folder, not a file in it)")
    if not os.access(folder, os.R_OK | os.X_OK):
        raise ConfigError("the folder is not readable")
    return folder.resolve()


def _factor_pairs(tensors: dict[str, TensorEntry], model: ModelConfig | None
                  ) -> dict[tuple[int, str], tuple[TensorEntry, TensorEntry]]:
    """(layer, module) -> (A, B) from the tensor names; anything else is refused by name."""
    halves: dict[tuple[int, str, str], TensorEntry] = {}
    for name, entry in tensors.items():
        found = _FACTOR_NAME.fullmatch(name)
        if not found or PARENTS.get(found.group(3)) != found.group(2):
            raise ConfigError(f"{WEIGHTS_FILE}: tensor {name!r}: {_unknown_reason(name)}")
        layer = int(found.group(1))
        if model is not None and layer >= model.num_hidden_layers:
            raise ConfigError(f"{WEIGHTS_FILE}: tensor {name!r}: layer {layer} is out of range "
                              f"(the base model has {model.num_hidden_layers} layers)")
        if model is not None and found.group(3) not in layer_modules(model, layer):
            raise ConfigError(f"{WEIGHTS_FILE}: tensor {name!r}: {_absent_reason(model, layer)}")
        if layer >= MAX_LAYERS:  # without a base, the layer count comes from the names
            raise ConfigError(f"{WEIGHTS_FILE}: tensor {name!r}: layer {layer} is out of any "
                              f"plausible range (at most {MAX_LAYERS} layers)")
        halves[(layer, found.group(3), found.group(4))] = entry
    pairs = {}
    for (layer, module, half), entry in halves.items():
        other = "B" if half == "A" else "A"
        if (layer, module, other) not in halves:
            raise ConfigError(f"{WEIGHTS_FILE}: tensor {entry.name!r} has no lora_{other} "
                              "partner: a LoRA factor needs both A and B")
        if half == "A":
            pairs[(layer, module)] = (entry, halves[(layer, module, "B")])
    if not pairs:
        raise ConfigError(f"{WEIGHTS_FILE}: holds no LoRA factors; the adapter edits nothing")
    return pairs


def layer_modules(model: ModelConfig, layer: int) -> tuple[str, ...]:
    """The projections an adapter may edit in decoder layer `layer` of `model`: a Qwen2-MoE
    sparse layer has the shared expert's in place of the dense MLP's."""
    if model.is_moe_layer(layer):
        return TARGET_MODULES[:4] + SHARED_EXPERT_MODULES
    return TARGET_MODULES


def _absent_reason(model: ModelConfig, layer: int) -> str:
    if model.is_moe_layer(layer):
        return (f"layer {layer} of the base model is a sparse (MoE) layer, which has no dense "
                f"MLP; {_MOE_EDITS}")
    if model.model_type == "qwen2_moe":
        return f"layer {layer} of the base model is a dense layer, which has no shared expert"
    return f"the base model ({model.model_type}) has no shared expert"


def _unknown_reason(name: str) -> str:
    moe = re.search(r"\.mlp\.(experts\.\d+|gate|shared_expert_gate)\.", name)
    if moe:
        what = "a routed expert" if moe.group(1).startswith("experts") else \
            _MOE_OTHERS["mlp." + moe.group(1)]
        return f"a LoRA on {what} (mlp.{moe.group(1)}), which lorad does not serve; {_MOE_EDITS}"
    if "lora_magnitude_vector" in name:
        return "a DoRA magnitude (use_dora), which lorad does not serve"
    if re.search(r"\.lora_[AB]\.bias$", name):
        return "a LoRA bias (lora_bias), which lorad does not serve"
    for outside in ("embed_tokens", "lm_head", "lora_embedding_", "norm"):
        if outside in name:
            return (f"edits {outside.rstrip('_')}, outside the linear projections lorad serves "
                    f"({', '.join(TARGET_MODULES)})")
    return ("unknown tensor name; expected base_model.model.model.layers.<i>."
            "<self_attn|mlp>.<projection>.lora_<A|B>.weight")


def projection_features(model: ModelConfig, module: str) -> tuple[int, int]:
    """(in_features, out_features) of one projection (a shared expert's: over its own
    intermediate size)."""
    hidden, inter = model.hidden_size, model.intermediate_size
    if module.startswith("shared_expert."):
        module, inter = module.removeprefix("shared_expert."), model.shared_expert_intermediate_size
    q_width = model.num_attention_heads * model.head_dim
    kv_width = model.num_key_value_heads * model.head_dim
    return {"q_proj": (hidden, q_width), "k_proj": (hidden, kv_width),
            "v_proj": (hidden, kv_width), "o_proj": (q_width, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}[module]


def _check_targets(config: PeftLoraConfig, pairs: dict, model: ModelConfig | None) -> None:
    """The modules with factors must be exactly those PEFT would have made from the config."""
    num_layers = model.num_hidden_layers if model else max(layer for layer, _ in pairs) + 1
    sparse = _sparse_layers(model, pairs, num_layers)
    for name in _other_module_names(num_layers, sparse):
        if config.is_targeted(name):
            what = _MOE_OTHERS.get(name.split(".", 3)[-1])
            raise ConfigError(f"adapter_config.json: target_modules matches {name}"
                              + (f" ({what}), which lorad does not serve; {_MOE_EDITS}" if what
                                 else ", which is not one of the projections lorad serves "
                                 f"({', '.join(TARGET_MODULES)})"))
    for layer in range(num_layers):
        modules = TARGET_MODULES[:4] + SHARED_EXPERT_MODULES if layer in sparse else TARGET_MODULES
        for module in modules:
            full = module_name(layer, module)
            targeted, present = config.is_targeted(full), (layer, module) in pairs
            if targeted and not present:
                raise ConfigError(f"adapter_config.json: target_modules matches {full}, but "
                                  f"{WEIGHTS_FILE} has no factors for it")
            if present and not targeted:
                raise ConfigError(f"{WEIGHTS_FILE}: has factors for {full}, which adapter_config"
                                  ".json does not target (target_modules, exclude_modules, "
                                  "layers_to_transform)")


def _sparse_layers(model: ModelConfig | None, pairs: dict, num_layers: int) -> set[int]:
    """The Qwen2-MoE sparse layers; without a base, the layers with shared-expert factors."""
    if model is None:
        return {layer for layer, module in pairs if module in SHARED_EXPERT_MODULES}
    return {layer for layer in range(num_layers) if model.is_moe_layer(layer)}


def _other_module_names(num_layers: int, sparse: set[int]) -> list[str]:
    """Every module of the transformers model that is not a projection (a sparse layer's
    router, routed experts and shared expert gate among them)."""
    names = ["model", "model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb",
             "lm_head"]
    for i in range(num_layers):
        names += [f"model.layers.{i}{suffix}" for suffix in (
            "", ".self_attn", ".mlp", ".input_layernorm", ".post_attention_layernorm")]
        names += [f"model.layers.{i}.{other}" for other in _MOE_OTHERS] if i in sparse else \
            [f"model.layers.{i}.mlp.act_fn"]
    return names


def _module(config: PeftLoraConfig, layer: int, module: str, a: TensorEntry, b: TensorEntry,
            strength: float, model: ModelConfig | None) -> LoraModule:
    full = module_name(layer, module)
    for entry in (a, b):
        if entry.dtype not in FACTOR_DTYPES:
            raise ConfigError(f"{WEIGHTS_FILE}: tensor {entry.name!r} is {entry.dtype}; LoRA "
                              f"factors must be one of {', '.join(FACTOR_DTYPES)}")
        if len(entry.shape) != 2:
            raise ConfigError(f"{WEIGHTS_FILE}: tensor {entry.name!r} has shape "
                              f"{list(entry.shape)}; a LoRA factor is a matrix")
    if a.dtype != b.dtype:
        raise ConfigError(f"{WEIGHTS_FILE}: {a.name!r} is {a.dtype} but {b.name!r} is {b.dtype}; "
                          "one module's factors must share a dtype")
    rank = config.rank_for(full)
    in_features, out_features = (projection_features(model, module) if model
                                 else (a.shape[1], b.shape[0]))
    origin = "the base config" if model else "the other factor"
    for entry, want, layout in ((a, (rank, in_features), "[rank, in_features]"),
                                (b, (out_features, rank), "[out_features, rank]")):
        if entry.shape != want:
            raise ConfigError(
                f"{WEIGHTS_FILE}: tensor {entry.name!r} has shape {list(entry.shape)}, expected "
                f"{layout} = {list(want)} (rank {rank} from adapter_config.json "
                f"{config.rank_origin(full)}, features from {origin})")
    return LoraModule(layer=layer, module=module, rank=rank,
                      scale=config.scale_for(full) * strength, a_tensor=a.name, b_tensor=b.name,
                      in_features=in_features, out_features=out_features, dtype=a.dtype)
