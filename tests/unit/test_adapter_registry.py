"""A good adapter folder loads with the right modules, ranks and scales; its identity key follows
what the adapter computes (factor bytes, dtypes, scales), not names, folders or file layout; the
registry gives slots in order and refuses bad names and strengths by flag.

One real PEFT folder is made per module; validation reads the base's config.json only.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from lorad.config.adapters import TARGET_MODULES, AdapterArg, load_adapter, load_registry
from lorad.config.errors import ConfigError
from tests.adapter_folders import CONFIG, WEIGHTS, edit_config, edit_tensors, raw_parts, write_raw

Q0 = "base_model.model.model.layers.0.self_attn.q_proj"


@pytest.fixture
def folder(good_dir, tmp_path) -> Path:
    """A fresh copy of the good folder for a test to break."""
    return Path(shutil.copytree(good_dir, tmp_path / "adapter"))


def load(folder: Path, model, strength: float = 1.0, name: str = "sql"):
    return load_adapter(AdapterArg(name, str(folder), strength), 1, model)


# --- a good folder -------------------------------------------------------------------------------

def test_good_folder_loads(folder, model):
    spec = load(folder, model)
    assert spec.name == "sql" and spec.adapter_id == 1 and spec.strength == 1.0
    assert spec.path == str(folder.resolve()) and spec.weights_file == str(folder / WEIGHTS)
    assert [(m.layer, m.module) for m in spec.modules] == [
        (layer, module) for layer in range(2) for module in TARGET_MODULES]
    assert all(m.rank == 4 and m.scale == 2.0 and m.dtype == "F32" for m in spec.modules)
    features = {m.module: (m.in_features, m.out_features) for m in spec.modules}
    assert features == {"q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32),
                        "o_proj": (64, 64), "gate_proj": (64, 128), "up_proj": (64, 128),
                        "down_proj": (128, 64)}
    assert spec.modules[0].a_tensor == f"{Q0}.lora_A.weight"
    assert spec.modules[0].b_tensor == f"{Q0}.lora_B.weight"
    assert len(spec.key) == 64 and spec.shapes_checked and not spec.has_manifest
    assert spec.to_worker_dict() == {"name": "sql", "path": spec.path, "strength": 1.0,
                                     "key": spec.key, "id": 1}


def test_without_base_the_same_key_and_shapes_unchecked(folder, model):
    with_base, alone = load(folder, model), load(folder, None)
    assert alone.key == with_base.key and alone.modules == with_base.modules
    assert not alone.shapes_checked


def test_unknown_and_null_config_keys_are_ignored(folder, model):
    key = load(folder, model).key
    edit_config(folder, some_future_option=None, another={"x": 1}, lora_dropout=0.1,
                megatron_core="megatron.core", task_type="CAUSAL_LM", inference_mode=False)
    assert load(folder, model).key == key


def test_strength_multiplies_every_scale_and_changes_the_key(folder, model):
    spec, half = load(folder, model), load(folder, model, strength=0.5)
    assert all(m.scale == 1.0 for m in half.modules) and half.key != spec.key
    assert load(folder, model, strength=-1.0).modules[0].scale == -2.0


def test_key_follows_the_scale_not_how_it_was_written(folder, model):
    spec = load(folder, model)
    edit_config(folder, lora_alpha=16)
    doubled = load(folder, model)
    assert doubled.key != spec.key and doubled.modules[0].scale == 4.0
    # alpha 16 at strength 0.5 computes exactly what alpha 8 at strength 1 does: one key.
    assert load(folder, model, strength=0.5).key == spec.key


def test_key_changes_with_one_factor_byte(folder, model):
    key = load(folder, model).key
    header, body = raw_parts(folder)
    start = header[f"{Q0}.lora_B.weight"]["data_offsets"][0]
    body = body[:start] + bytes([body[start] ^ 1]) + body[start + 1:]  # lowest mantissa bit
    write_raw(folder, header, body)
    assert load(folder, model).key != key


def test_key_stays_when_resaved_identically(folder, model, tmp_path):
    key = load(folder, model).key
    tensors = load_file(folder / WEIGHTS)
    reordered = dict(reversed(list(tensors.items())))  # another layout in the file
    save_file(reordered, folder / WEIGHTS, metadata={"saved_by": "another tool"})
    config = json.loads((folder / CONFIG).read_text())
    (folder / CONFIG).write_text(json.dumps(config, indent=4, sort_keys=False))
    moved = shutil.copytree(folder, tmp_path / "elsewhere")
    assert load(folder, model).key == key
    assert load(moved, model, name="other-name").key == key


def test_key_changes_with_dtype(folder, model):
    key = load(folder, model).key
    edit_tensors(folder, lambda t: t.update({k: v.astype(np.float16) for k, v in t.items()}))
    spec = load(folder, model)
    assert spec.key != key and spec.modules[0].dtype == "F16"


# --- the registry --------------------------------------------------------------------------------

def test_registry_slots_in_order(good_dir, model):
    args = (AdapterArg("a", str(good_dir)), AdapterArg("b", str(good_dir), 0.5))
    specs = load_registry(args, model, reserved_names=("base",))
    assert [(s.name, s.adapter_id) for s in specs] == [("a", 1), ("b", 2)]


@pytest.mark.parametrize("names,strength,needle", [
    (("a", "a"), 1.0, "given twice"),
    (("base",), 1.0, "base model"),
    (("has space",), 1.0, "model id"),
    (("a/b",), 1.0, "model id"),
    (("x" * 65,), 1.0, "model id"),
    (("",), 1.0, "model id"),
    (("a",), math.nan, "finite"),
    (("a",), math.inf, "finite"),
])
def test_registry_names_and_strengths(good_dir, model, names, strength, needle):
    args = tuple(AdapterArg(n, str(good_dir), strength) for n in names)
    with pytest.raises(ConfigError, match=needle) as exc:
        load_registry(args, model, reserved_names=("base",))
    assert str(exc.value).startswith("--adapter")


def test_folder_errors(tmp_path, model, good_dir):
    with pytest.raises(ConfigError, match="no such folder"):
        load(tmp_path / "missing", model)
    with pytest.raises(ConfigError, match="not a folder"):
        load(good_dir / CONFIG, model)
    with pytest.raises(ConfigError, match=f"no {WEIGHTS}"):
        load(tmp_path, model)
