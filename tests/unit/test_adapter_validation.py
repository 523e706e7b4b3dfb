"""Adapter folder validation: whatever lorad cannot serve exactly is refused, in one line that
names the flag, the file and the field; nothing is dropped silently.

One real PEFT folder is made per module; each case copies it and breaks one thing. Validation
reads the base's config.json only (no base weights). Malformed safetensors headers have their own
file (test_safetensors_header.py).
"""

from __future__ import annotations

import builtins
import io
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from lorad.config.adapter_manifest import MANIFEST_FILE, write_manifest
from lorad.config.adapters import AdapterArg, load_adapter
from lorad.config.errors import ConfigError
from tests.adapter_folders import (CONFIG, DELETE, WEIGHTS, edit_config, edit_tensors,
                                  raw_parts, write_raw)

Q0 = "base_model.model.model.layers.0.self_attn.q_proj"
UP1 = "base_model.model.model.layers.1.mlp.up_proj"


@pytest.fixture
def folder(good_dir, tmp_path) -> Path:
    """A fresh copy of the good folder for one test to break."""
    return Path(shutil.copytree(good_dir, tmp_path / "adapter"))


def refused(folder: Path, model, *needles: str) -> str:
    with pytest.raises(ConfigError) as exc:
        load_adapter(AdapterArg("sql", str(folder)), 1, model)
    message = str(exc.value)
    assert "\n" not in message and message.startswith(f"--adapter sql={folder}: "), message
    for needle in needles:
        assert needle in message, (needle, message)
    return message


@pytest.mark.parametrize("changes,needles", [
    ({"use_dora": True}, ("adapter_config.json", "use_dora", "DoRA")),
    ({"modules_to_save": ["lm_head"]}, ("modules_to_save",)),
    ({"bias": "all"}, ("bias",)),
    ({"bias": "lora_only"}, ("bias",)),
    ({"lora_bias": True}, ("lora_bias",)),
    ({"alora_invocation_tokens": [1, 2]}, ("alora_invocation_tokens",)),
    ({"layer_replication": [[0, 1], [0, 2]]}, ("layer_replication",)),
    ({"fan_in_fan_out": True}, ("fan_in_fan_out", "Conv1D")),
    ({"fan_in_fan_out": "no"}, ("fan_in_fan_out", "true or false")),
    ({"use_qalora": True}, ("use_qalora",)),
    ({"trainable_token_indices": [3]}, ("trainable_token_indices",)),
    ({"target_parameters": ["mlp.experts"]}, ("target_parameters",)),
    ({"init_lora_weights": "pissa_niter_4"}, ("init_lora_weights",)),
    ({"init_lora_weights": 3}, ("init_lora_weights",)),
    ({"peft_type": "IA3"}, ("peft_type",)),
    ({"peft_type": DELETE}, ("peft_type",)),
    ({"r": "4"}, ("r must be a positive integer",)),
    ({"r": 4.0}, ("r must be a positive integer",)),
    ({"r": 0}, ("r must be a positive integer",)),
    ({"lora_alpha": "8"}, ("lora_alpha must be a number",)),
    ({"lora_alpha": True}, ("lora_alpha must be a number",)),
    ({"lora_alpha": float("nan")}, ("lora_alpha must be finite",)),
    ({"lora_alpha": float("inf")}, ("lora_alpha must be finite",)),
    ({"alpha_pattern": {"q_proj": float("nan")}}, ("alpha_pattern['q_proj'] must be finite",)),
    ({"alpha_pattern": {"q_proj": "2"}}, ("alpha_pattern['q_proj'] must be a number",)),
    ({"alpha_pattern": [1]}, ("alpha_pattern must be an object",)),
    ({"rank_pattern": {"q_proj": 2.5}}, ("rank_pattern['q_proj'] must be a positive integer",)),
    ({"rank_pattern": {"(q_proj": 2}}, ("rank_pattern key '(q_proj'", "regular expression")),
    ({"use_rslora": "yes"}, ("use_rslora must be true or false",)),
    ({"target_modules": 5}, ("target_modules must be a list of strings",)),
    ({"target_modules": ["q_proj", 3]}, ("target_modules must be a list of strings",)),
    ({"exclude_modules": "["}, ("exclude_modules", "regular expression")),
    ({"layers_to_transform": "0"}, ("layers_to_transform",)),
    ({"layers_to_transform": [0, -1]}, ("layers_to_transform",)),
    ({"layers_pattern": [7]}, ("layers_pattern",)),
    ({"base_model_name_or_path": 12}, ("base_model_name_or_path must be a string",)),
])
def test_config_refusals(folder, model, changes, needles):
    edit_config(folder, **changes)
    refused(folder, model, *needles)


@pytest.mark.parametrize("targets,needle", [
    (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"],
     "target_modules matches lm_head"),
    (["embed_tokens", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
      "down_proj"], "target_modules matches model.embed_tokens"),
    (["q_proj", "k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
     "model.layers.0.self_attn.v_proj, which adapter_config.json does not target"),
    (r".*\.(q|k|v|o|gate|up)_proj", "model.layers.0.mlp.down_proj, which adapter_config"),
])
def test_targets_must_match_the_tensors(folder, model, targets, needle):
    edit_config(folder, target_modules=targets)
    refused(folder, model, needle)


def test_layers_to_transform_must_match_the_tensors(folder, model):
    edit_config(folder, layers_to_transform=[0])
    refused(folder, model, WEIGHTS, "model.layers.1.self_attn.q_proj", "does not target")
    edit_config(folder, layers_to_transform=[0, 1], layers_pattern="h")  # PEFT finds no layer
    refused(folder, model, "model.layers.0.self_attn.q_proj", "does not target")


def test_a_target_without_factors(folder, model):
    edit_tensors(folder, lambda t: [t.pop(f"{UP1}.lora_{h}.weight") for h in "AB"])
    refused(folder, model, CONFIG, "matches model.layers.1.mlp.up_proj",
            f"{WEIGHTS} has no factors")


def test_all_linear_and_exclusions_are_understood(folder, model):
    edit_config(folder, target_modules="all-linear")
    load_adapter(AdapterArg("sql", str(folder)), 1, model)
    edit_config(folder, exclude_modules=["up_proj"])
    refused(folder, model, "model.layers.0.mlp.up_proj", "does not target")


@pytest.mark.parametrize("change,needles", [
    (lambda t: t.update({f"{Q0}.lora_C.weight": t[f"{Q0}.lora_A.weight"]}),
     ("lora_C", "unknown tensor name")),
    (lambda t: t.update({f"{Q0}.lora_magnitude_vector": np.ones(64, np.float32)}),
     ("lora_magnitude_vector", "DoRA")),
    (lambda t: t.update({f"{Q0}.lora_B.bias": np.ones(64, np.float32)}),
     ("lora_B.bias", "lora_bias")),
    (lambda t: t.update({"base_model.model.lm_head.lora_A.weight": np.ones((4, 64), np.float32),
                         "base_model.model.lm_head.lora_B.weight": np.ones((400, 4), np.float32)}),
     ("lm_head", "outside the linear projections")),
    (lambda t: t.update({"base_model.model.model.embed_tokens.lora_embedding_A":
                         np.ones((4, 400), np.float32)}), ("embed_tokens",)),
    (lambda t: t.update({"base_model.model.model.layers.0.mlp.q_proj.lora_A.weight":
                         np.ones((4, 64), np.float32)}), ("mlp.q_proj", "unknown tensor name")),
    (lambda t: t.pop(f"{Q0}.lora_B.weight"), (f"{Q0}.lora_A.weight", "no lora_B partner")),
    (lambda t: t.pop(f"{Q0}.lora_A.weight"), (f"{Q0}.lora_B.weight", "no lora_A partner")),
    (lambda t: t.update({k.replace("layers.1.", "layers.7."): t.pop(k) for k in list(t)
                         if "layers.1." in k}),
     ("layers.7.", "layer 7 is out of range", "2 layers")),
    (lambda t: t.update({f"{Q0}.lora_B.weight": np.ones((60, 4), np.float32)}),
     (f"{Q0}.lora_B.weight", "[60, 4]", "[out_features, rank] = [64, 4]")),
    (lambda t: t.update({f"{Q0}.lora_A.weight": np.ones((4, 60), np.float32)}),
     (f"{Q0}.lora_A.weight", "[rank, in_features] = [4, 64]")),
    (lambda t: t.update({f"{Q0}.lora_A.weight": np.ones((2, 64), np.float32),
                         f"{Q0}.lora_B.weight": np.ones((64, 2), np.float32)}),
     ("[2, 64]", "rank 4 from adapter_config.json r")),
    (lambda t: t.update({f"{Q0}.lora_A.weight": np.ones((4, 64), np.int32)}), ("is I32",)),
    (lambda t: t.update({f"{Q0}.lora_A.weight": np.ones((4, 64), np.float64)}), ("is F64",)),
    (lambda t: t.update({f"{Q0}.lora_A.weight": np.ones((4, 64), np.float16)}),
     ("share a dtype",)),
    (lambda t: t.update({f"{Q0}.lora_A.weight": np.ones((4, 8, 8), np.float32)}), ("matrix",)),
    (lambda t: t[f"{Q0}.lora_B.weight"].__setitem__((3, 1), np.nan),
     (f"{Q0}.lora_B.weight", "NaN or infinite")),
    (lambda t: t[f"{Q0}.lora_A.weight"].__setitem__((0, 0), -np.inf), ("NaN or infinite",)),
    (lambda t: t.clear(), ("no LoRA factors",)),
])
def test_tensor_refusals(folder, model, change, needles):
    edit_tensors(folder, change)
    refused(folder, model, WEIGHTS, *needles)


def test_absurd_layer_index_without_a_base(folder):
    edit_tensors(folder, lambda t: t.update({k.replace("layers.1.", "layers.1000000."): t.pop(k)
                                             for k in list(t) if "layers.1." in k}))
    refused(folder, None, "layer 1000000 is out of any plausible range")


def test_rank_must_follow_rank_pattern(folder, model):
    edit_config(folder, rank_pattern={"q_proj": 2})
    refused(folder, model, f"{Q0}.lora_A.weight", "rank 2", "rank_pattern['q_proj']")


def test_bfloat16_factors_load_and_are_checked_for_nan(folder, model):
    def to_bf16_bits(t):  # numpy has no bfloat16: keep the top half of each float32, as U16
        t.update({k: (v.view(np.uint32) >> 16).astype(np.uint16) for k, v in t.items()})

    edit_tensors(folder, to_bf16_bits)
    header, body = raw_parts(folder)
    for name, info in header.items():
        if name != "__metadata__":
            info["dtype"] = "BF16"
    write_raw(folder, header, body)
    spec = load_adapter(AdapterArg("sql", str(folder)), 1, model)
    assert {m.dtype for m in spec.modules} == {"BF16"}
    start = header[f"{Q0}.lora_B.weight"]["data_offsets"][0]
    write_raw(folder, header, body[:start] + b"\x80\x7f" + body[start + 2:])  # bf16 +inf
    refused(folder, model, f"{Q0}.lora_B.weight", "NaN or infinite")


@pytest.mark.parametrize("content,needle", [
    (None, "no adapter_config.json"),
    ("{not json", "adapter_config.json: cannot read"),
    ("[1, 2]", "adapter_config.json: expected a JSON object"),
])
def test_unreadable_config(folder, model, content, needle):
    if content is None:
        (folder / CONFIG).unlink()
    else:
        (folder / CONFIG).write_text(content)
    refused(folder, model, needle)


# --- lorad-adapter.json --------------------------------------------------------------------------

def test_manifest_that_agrees(folder, model):
    write_manifest(folder, base_model="tiny-llama", provenance={"seed": 0},
                   extra_files=("README.md",))
    spec = load_adapter(AdapterArg("sql", str(folder)), 1, model)
    assert spec.has_manifest and spec.base_model == "tiny-llama"


@pytest.mark.parametrize("edit,needles", [
    (lambda f: (f / CONFIG).write_text((f / CONFIG).read_text() + " "),
     (MANIFEST_FILE, "files['adapter_config.json']", "changed since")),
    (lambda f: edit_tensors(f, lambda t: t[f"{Q0}.lora_B.weight"].__setitem__((0, 0), 1.0)),
     (MANIFEST_FILE, "files['adapter_model.safetensors']")),
    (lambda f: (f / "README.md").unlink(), ("'README.md', which is not in the folder",)),
    (lambda f: _manifest(f, lambda m: m["files"].pop(WEIGHTS)), (f"must list {WEIGHTS}",)),
    (lambda f: _manifest(f, lambda m: m["files"].update({CONFIG: "ABC"})), ("64 lowercase hex",)),
    (lambda f: _manifest(f, lambda m: m["files"].update({"../x": "0" * 64})),
     ("files key '../x'",)),
    (lambda f: _manifest(f, lambda m: m.update(format=2)), ("format must be 1",)),
    (lambda f: _manifest(f, lambda m: m.update(signature="x")), ("unknown field 'signature'",)),
    (lambda f: _manifest(f, lambda m: m.update(base_model=3)), ("base_model must be a string",)),
    (lambda f: (f / MANIFEST_FILE).write_text("[]"), ("expected a JSON object",)),
])
def test_manifest_refusals(folder, model, edit, needles):
    write_manifest(folder, base_model="tiny-llama", extra_files=("README.md",))
    edit(folder)
    refused(folder, model, *needles)


def _manifest(folder: Path, change) -> None:
    raw = json.loads((folder / MANIFEST_FILE).read_text())
    change(raw)
    (folder / MANIFEST_FILE).write_text(json.dumps(raw))


# --- pickles -------------------------------------------------------------------------------------

def test_pickled_bin_is_refused_without_being_opened(folder, model, monkeypatch):
    (folder / WEIGHTS).unlink()
    (folder / "adapter_model.bin").write_bytes(b"\x80\x04 not even a valid pickle")
    opened = []

    def guard(real):
        def wrapper(file, *args, **kwargs):
            if str(file).endswith(".bin"):
                opened.append(file)
            return real(file, *args, **kwargs)
        return wrapper

    monkeypatch.setattr(builtins, "open", guard(builtins.open))
    monkeypatch.setattr(io, "open", guard(io.open))
    monkeypatch.setattr(os, "open", guard(os.open))
    refused(folder, model, "adapter_model.bin", "safetensors required")
    assert opened == []
