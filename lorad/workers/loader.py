"""Read a Hugging Face safetensors checkpoint, and validated adapters, each rank only its shard;
or fill the weights with seeded random values instead (`--load-format random`).

Every parameter carries a `weight_loader(param, name, tensor_slice)` that knows which rows or
columns its rank holds, and every edited projection's LoraSlots a `load` that does the same for
the factors; this file only maps names to them and checks that each is loaded exactly once.
Pickled checkpoints (`*.bin`, `*.pt`) are refused: they can run code. Adapters arrive validated
(lorad.config.adapters); the shapes are checked again because a file may change after validation.
"""

from __future__ import annotations

import json
import logging
import time
import zlib
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from lorad.config import ConfigError
from lorad.config.adapters import AdapterSpec
from lorad.workers.lora import table_dtype

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Buffers some older exports write next to the weights; lorad recomputes them.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
RANDOM_STD = 0.02  # --load-format random: the usual Llama initializer range
NORM_SUFFIX = "norm.weight"  # --load-format random: RMSNorm scales are ones
PROGRESS_EVERY_S = 10.0  # inside one large file, log how far this rank got this often

log = logging.getLogger("lorad.worker")


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint, from its index when it is sharded."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ConfigError(f"{index}: cannot read the weight map: {exc}") from None
        names = sorted(set(weight_map.values()))
        missing = [name for name in names if not (model_dir / name).is_file()]
        if missing:
            raise ConfigError(f"{index}: names files that are not there: {', '.join(missing)}")
        return [model_dir / name for name in names]
    if (model_dir / SINGLE_FILE).is_file():
        return [model_dir / SINGLE_FILE]
    if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pt")):
        raise ConfigError(f"--model {model_dir}: only safetensors checkpoints are loaded; "
                          "pickled .bin/.pt weights are refused")
    raise ConfigError(f"--model {model_dir}: no {SINGLE_FILE} or {INDEX_FILE}")


def load_weights(model: nn.Module, model_dir: str | Path, skip: tuple[str, ...] = ()) -> None:
    """Fill every parameter of `model` from the checkpoint, through its weight_loader:
    model.weight_targets() maps each checkpoint name to its parameter (and the part of a fused
    one, passed to the weight_loader as its shard id)."""
    targets = model.weight_targets()
    loaded: set[str] = set()
    files = checkpoint_files(model_dir)
    started = last_log = time.monotonic()
    for num, path in enumerate(files, start=1):
        log.info("reading shard %d/%d: %s (%.2f GB)", num, len(files), path.name,
                 path.stat().st_size / 1e9)
        with safe_open(str(path), framework="pt", device="cpu") as f:
            names = list(f.keys())
            for i, name in enumerate(names):
                if time.monotonic() - last_log > PROGRESS_EVERY_S:
                    last_log = time.monotonic()
                    log.info("shard %d/%d: %d/%d tensors read", num, len(files), i, len(names))
                if name in skip or name.endswith(IGNORED_SUFFIXES):
                    continue
                param, shard_id = targets.get(name, (None, None))
                if param is None:
                    raise ConfigError(f"{path}: tensor {name} is not part of the model lorad "
                                      "builds from config.json")
                if name in loaded:
                    raise ConfigError(f"{path}: tensor {name} appears in more than one file")
                # get_slice reads only the rows/columns the weight_loader indexes.
                try:
                    param.weight_loader(param, name, f.get_slice(name),
                                        *(() if shard_id is None else (shard_id,)))
                except ValueError as exc:
                    raise ConfigError(f"{path}: {exc}") from None
                loaded.add(name)
    log.info("read %d tensors from %d shard(s) in %.1fs", len(loaded), len(files),
             time.monotonic() - started)
    missing = sorted(set(targets) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ConfigError(f"--model {model_dir}: the checkpoint lacks {len(missing)} tensors "
                          f"the model needs: {shown}")


def add_adapter_tables(target_of: Callable[[int, str], nn.Module],
                       specs: tuple[AdapterSpec, ...]) -> dict:
    """Allocate slot tables on every projection some adapter edits (slots 0..K, ranks padded to
    the largest rank any adapter gives that projection; all in lora.table_dtype of the adapters'
    stored dtypes) -> {(layer, module): its LoraSlots}.

    target_of(layer, module) is the projection; it has `add_lora_slots(num_slots, max_rank,
    dtype)`."""
    for i, spec in enumerate(specs):
        if spec.slot != i + 1:
            raise ConfigError(f"adapter {spec.name!r} has slot {spec.slot}, expected {i + 1}")
    max_rank: dict[tuple[int, str], int] = {}
    for spec in specs:
        for m in spec.modules:
            max_rank[(m.layer, m.module)] = max(max_rank.get((m.layer, m.module), 0), m.rank)
    dtype = table_dtype({m.dtype for spec in specs for m in spec.modules})
    return {where: target_of(*where).add_lora_slots(len(specs) + 1, rank, dtype)
            for where, rank in sorted(max_rank.items())}


def load_adapter_weights(target_of: Callable[[int, str], nn.Module],
                         specs: tuple[AdapterSpec, ...]) -> None:
    """add_adapter_tables, then fill each adapter's slot with this rank's factor shards."""
    tables = add_adapter_tables(target_of, specs)
    for spec in specs:
        with safe_open(spec.weights_file, framework="pt", device="cpu") as f:
            for m in spec.modules:
                try:
                    tables[(m.layer, m.module)].load(spec.slot, m, f.get_slice(m.a_tensor),
                                                     f.get_slice(m.b_tensor))
                except (ValueError, SafetensorError) as exc:
                    raise ConfigError(f"adapter {spec.name!r} ({spec.weights_file}): "
                                      f"{exc}") from None


class WholeTensor:
    """A full tensor in the shape of a safetensors slice, so weight_loaders can cut their shard."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index) -> torch.Tensor:
        return self.tensor[index]


def load_random_weights(model: nn.Module, full_shapes: dict[str, tuple[int, ...]],
                        seed: int, std: float = RANDOM_STD) -> None:
    """Fill every parameter with N(0, std) values (norm scales with ones), without a checkpoint.

    full_shapes: name -> the unsharded checkpoint shape. Each tensor is drawn whole, in fp32, on
    the parameter's device from a generator seeded by (seed, name), and handed to its
    weight_loader: every world size then holds shards of the same model, and the bf16 model is
    the fp32 one rounded. The same seed gives the same weights on the same kind of device (the
    CPU and CUDA generators give different streams)."""
    targets = model.weight_targets()
    if set(targets) != set(full_shapes):
        raise ValueError(f"shapes given for {sorted(set(full_shapes) ^ set(targets))[:5]} do not "
                         "match the model's checkpoint names")
    for name in sorted(targets):
        param, shard_id = targets[name]
        shape = tuple(full_shapes[name])
        if name.endswith(NORM_SUFFIX):
            whole = torch.ones(shape, dtype=torch.float32, device=param.device)
        else:
            generator = torch.Generator(device=param.device)
            generator.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) & (2**63 - 1))
            whole = torch.randn(shape, generator=generator, dtype=torch.float32,
                                device=param.device).mul_(std)
        param.weight_loader(param, name, WholeTensor(whole.to(param.dtype)),
                            *(() if shard_id is None else (shard_id,)))
