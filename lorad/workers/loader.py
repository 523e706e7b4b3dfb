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

from lorad.config import ConfigError, ModelConfig
from lorad.config.adapter_capacity import LoraCapacity
from lorad.config.adapters import AdapterSpec, layer_modules
from lorad.workers.lora import STORED_DTYPES, fill_tables, table_dtype

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
                       specs: tuple[AdapterSpec, ...],
                       capacity: LoraCapacity | None = None,
                       model_config: ModelConfig | None = None) -> dict:
    """Allocate slot tables -> {(layer, module): its LoraSlots}. Without a capacity: slots
    0..K for the K specs, on every projection some adapter edits, ranks padded to the largest
    rank any adapter gives that projection, all in lora.table_dtype of the stored dtypes. With
    one: slots 0..capacity.num_slots; with run-time adapters on every projection an adapter
    may edit in each layer of model_config (adapters.layer_modules) at capacity.max_rank in
    fp32, else as above; in capacity.dtype where --lora-dtype names one.

    target_of(layer, module) is the projection; it has `add_lora_slots(num_slots, max_rank,
    dtype)`."""
    max_rank: dict[tuple[int, str], int] = {}
    for spec in specs:
        for m in spec.modules:
            max_rank[(m.layer, m.module)] = max(max_rank.get((m.layer, m.module), 0), m.rank)
    dtype = table_dtype({m.dtype for spec in specs for m in spec.modules})
    num_slots = len(specs) + 1 if capacity is None else capacity.num_slots + 1
    if capacity is not None and capacity.runtime:
        max_rank = {(layer, module): capacity.max_rank
                    for layer in range(model_config.num_hidden_layers)
                    for module in layer_modules(model_config, layer)}
        dtype = torch.float32  # holds any adapter's factors exactly, whatever it stores
    if capacity is not None and capacity.dtype is not None:
        dtype = STORED_DTYPES[capacity.dtype]  # --lora-dtype: holds what it admits exactly
    if num_slots == 1:
        return {}
    return {where: target_of(*where).add_lora_slots(num_slots, rank, dtype)
            for where, rank in sorted(max_rank.items())}


def load_adapter_weights(target_of: Callable[[int, str], nn.Module],
                         specs: tuple[AdapterSpec, ...]) -> dict:
    """add_adapter_tables for specs of ids 1..K, then fill slot i with adapter i's shards."""
    for i, spec in enumerate(specs):
        if spec.adapter_id != i + 1:
            raise ConfigError(f"adapter {spec.name!r} has id {spec.adapter_id}, expected {i + 1}")
    tables = add_adapter_tables(target_of, specs)
    for spec in specs:
        fill_slot(tables, spec.adapter_id, spec, read_shards(tables, spec))
    return tables


def read_shards(tables: dict, spec: AdapterSpec) -> dict:
    """This rank's shards of the adapter's factors, read from its weights file:
    {(layer, module): (A shard, B shard)} (LoraSlots.shard). ConfigError names the file."""
    shards = {}
    try:
        with safe_open(spec.weights_file, framework="pt", device="cpu") as f:
            for m in spec.modules:
                table = tables.get((m.layer, m.module))
                if table is None:
                    raise ValueError(f"{m.full_name} has no slot table here")
                shards[(m.layer, m.module)] = table.shard(m, f.get_slice(m.a_tensor),
                                                          f.get_slice(m.b_tensor))
    except (ValueError, SafetensorError, OSError) as exc:
        raise ConfigError(f"adapter {spec.name!r} ({spec.weights_file}): {exc}") from None
    return shards


def fill_slot(tables: dict, slot: int, spec: AdapterSpec, shards: dict) -> None:
    """Put an adapter's shards into `slot` of every table; tables it does not edit are cleared
    (the slot may have held an adapter that edits them)."""
    by_where = {(m.layer, m.module): m for m in spec.modules}
    entries = []
    for where, table in tables.items():
        module = by_where.get(where)
        entries.append((table, None, None, None) if module is None
                       else (table, module, *shards[where]))
    fill_tables(slot, entries)


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
