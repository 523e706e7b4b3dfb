"""`--adapter` / `--adapter-strength` parsing and their one-line errors (exit 2), the registry
reaching WorkerConfig, and `lorad check-adapter`'s report, exit status and per-rank memory.

Errors of the real entry point, run in a subprocess: tests/integration/test_entry_point.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lorad.config import check_adapter
from lorad.config.adapter_memory import bytes_per_rank, total_bytes
from lorad.config.partition import projection_range
from lorad.config.adapters import AdapterArg, AdapterSpec, LoraModule, load_adapter
from lorad.config.cli import parse_args
from lorad.config.errors import ConfigError
from lorad.config.model import ModelConfig
from tests.adapter_folders import edit_config
from tests.tiny_adapters import make_peft_adapter
from tests.tiny_models import make_tiny_llama


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("base"), with_tokenizer=True)


@pytest.fixture(scope="module")
def adapters(base_dir, tmp_path_factory) -> tuple[Path, Path]:
    """A good adapter (r=4, alpha=8, every projection) and a DoRA one lorad refuses."""
    root = tmp_path_factory.mktemp("adapters")
    good = make_peft_adapter(base_dir, root / "good", r=4, lora_alpha=8)
    dora = make_peft_adapter(base_dir, root / "dora", seed=1)
    edit_config(dora, use_dora=True)
    return good, dora


def test_adapter_flags_in_order_with_strengths(tmp_path):
    config = parse_args(["--model", "m", "--adapter", "sql=/srv/a/sql", "--adapter",
                         "chat=/srv/a/x=y", "--adapter-strength", "chat=0.25"])
    assert config.adapters == (AdapterArg("sql", "/srv/a/sql", 1.0),
                               AdapterArg("chat", "/srv/a/x=y", 0.25))
    assert parse_args(["--model", "m"]).adapters == ()


@pytest.mark.parametrize("argv,needles", [
    (["--adapter", "sql"], ("argument --adapter", "NAME=DIR")),
    (["--adapter", "=/srv/a"], ("argument --adapter", "NAME=DIR")),
    (["--adapter", "sql="], ("argument --adapter", "NAME=DIR")),
    (["--adapter", "a=x", "--adapter-strength", "a"], ("--adapter-strength", "NAME=NUMBER")),
    (["--adapter", "a=x", "--adapter-strength", "a=strong"], ("--adapter-strength",)),
    (["--adapter", "a=x", "--adapter-strength", "a=nan"], ("--adapter-strength", "finite")),
    (["--adapter", "a=x", "--adapter-strength", "a=-inf"], ("--adapter-strength", "finite")),
    (["--adapter", "a=x", "--adapter-strength", "b=2"],
     ("--adapter-strength b", "no --adapter is named 'b'")),
    (["--adapter", "a=x", "--adapter-strength", "a=2", "--adapter-strength", "a=3"],
     ("--adapter-strength a", "twice")),
    (["--adapter", "a=x", "--adapter", "a=y"], ("--adapter a", "given twice")),
    (["--adapter", "m=x"], ("--adapter m", "--name")),
    (["--name", "base", "--adapter", "base=x"], ("--adapter base", "--name")),
    (["--adapter", "two words=x"], ("--adapter 'two words'", "model id")),
    (["--adapter", "a/b=x"], ("--adapter 'a/b'", "model id")),
    (["--adapter=-x=x"], ("model id",)),
    ([f"--adapter={'n' * 65}=x"], ("model id",)),
])
def test_bad_adapter_flags_are_one_line(argv, needles, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--model", "m", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("lorad: error: ")
    for needle in needles:
        assert needle in err, (needle, err)


def test_registry_reaches_the_worker_config(base_dir, adapters, tmp_path):
    from lorad.daemon.main import load_served_model
    from lorad.daemon.service import _worker_config

    good, _ = adapters
    config = parse_args(["--model", str(base_dir), "--adapter", f"a={good}", "--adapter",
                         f"b={good}", "--adapter-strength", "b=0.5"])
    served = load_served_model(config)
    assert [(s.name, s.adapter_id) for s in served.adapters] == [("a", 1), ("b", 2)]
    entries = _worker_config(config, served, tmp_path, "id").adapters
    assert entries == [{"name": "a", "path": str(good.resolve()), "strength": 1.0,
                        "key": served.adapters[0].key, "id": 1},
                       {"name": "b", "path": str(good.resolve()), "strength": 0.5,
                        "key": served.adapters[1].key, "id": 2}]
    assert entries[0]["key"] != entries[1]["key"]


# --- check-adapter -------------------------------------------------------------------------------

def test_check_adapter_report(base_dir, adapters, capsys):
    good, _ = adapters
    assert check_adapter.main([str(good), "--model", str(base_dir), "--parallel", "2"]) == 0
    out = capsys.readouterr().out
    key = load_adapter(AdapterArg("x", str(good)), 1, ModelConfig.from_dir(base_dir)).key
    assert out.startswith(f"{good}: ok\n") and f"key       {key}\n" in out
    assert "checked against" in out and "(2 layers)" in out
    assert "14 projections: layers 0-1 (2) x q_proj, k_proj, v_proj, o_proj, gate_proj, " \
           "up_proj, down_proj; factors F32" in out
    assert "    k_proj     0-1             4          2  [4, 64]        [32, 4]\n" in out
    assert "    down_proj  0-1             4          2  [4, 128]       [64, 4]\n" in out
    # Per layer and rank: q 384, k 320, v 320, o 384, gate 512, up 512, down 512 floats.
    assert "whole adapter 32.0 KiB; per rank at --parallel 2: rank 0 23.0 KiB, " \
           "rank 1 23.0 KiB" in out


def test_check_adapter_without_a_model(adapters, capsys):
    good, _ = adapters
    assert check_adapter.main([str(good), "--parallel", "2"]) == 0
    out = capsys.readouterr().out
    assert "NOT CHECKED (no --model)" in out and "whole adapter 32.0 KiB (" in out


def test_check_adapter_refusal_exits_1(base_dir, adapters, capsys):
    good, dora = adapters
    assert check_adapter.main([str(dora), str(good), "--model", str(base_dir)]) == 1
    out = capsys.readouterr().out
    assert f"{dora}: refused: adapter_config.json: use_dora=true" in out
    assert f"{good}: ok" in out


@pytest.mark.parametrize("argv,needle", [
    (["--parallel", "4"], "--parallel 4 is more than the model's 2 key-value heads"),
    (["--parallel", "0"], "argument --parallel"),
])
def test_check_adapter_bad_flags_exit_2(base_dir, adapters, argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        check_adapter.main([str(adapters[0]), "--model", str(base_dir), *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("lorad check-adapter: error: ") and needle in err


# --- per-rank memory -----------------------------------------------------------------------------

def test_memory_follows_the_placement_on_uneven_splits():
    model = ModelConfig.from_dict({
        "model_type": "llama", "vocab_size": 10, "hidden_size": 48, "intermediate_size": 100,
        "num_hidden_layers": 1, "num_attention_heads": 6, "num_key_value_heads": 3,
        "head_dim": 8, "max_position_embeddings": 16})
    features = {"q_proj": (48, 48), "k_proj": (48, 24), "v_proj": (48, 24), "o_proj": (48, 48),
                "gate_proj": (48, 100), "up_proj": (48, 100), "down_proj": (100, 48)}
    modules = tuple(LoraModule(0, name, 2, 1.0, "a", "b", i, o, "F32")
                    for name, (i, o) in features.items())
    spec = AdapterSpec("x", "/x", 1, 1.0, "0" * 64, "/x/w", modules)
    # KV heads split (2, 1): q rows / o columns 32 + 16, k and v rows 16 + 8; MLP 50 + 50.
    assert projection_range(model, "q_proj", 1, 2) == (32, 48)
    assert projection_range(model, "v_proj", 0, 2) == (0, 16)
    assert projection_range(model, "down_proj", 1, 2) == (50, 100)
    assert bytes_per_rank(spec, model, 2) == [1164 * 4, 1068 * 4]
    assert total_bytes(spec) == 1560 * 4
    assert bytes_per_rank(spec, model, 1) == [total_bytes(spec)]
    with pytest.raises(ConfigError, match="--parallel 4"):
        bytes_per_rank(spec, model, 4)


def test_slot_flags_resolve_the_capacity_the_workers_get(base_dir, adapters, tmp_path):
    from lorad.daemon.main import load_served_model
    from lorad.daemon.service import _worker_config

    good, _ = adapters
    key_file = tmp_path / "admin"
    key_file.write_text("k" * 20 + "\n")
    config = parse_args(["--model", str(base_dir), "--adapter", f"a={good}", "--adapter",
                         f"b={good}", "--pin-adapter", "b", "--admin-key-file", str(key_file),
                         "--max-cpu-adapters", "3"])
    served = load_served_model(config)
    assert (served.capacity.num_slots, served.capacity.runtime, served.capacity.max_rank) == \
        (8, True, 16)
    worker = _worker_config(config, served, tmp_path, "id")
    assert (worker.lora_slots, worker.lora_runtime, worker.lora_max_rank) == (8, True, 16)
    assert (worker.max_cpu_adapters, worker.pinned_adapters) == (3, [2])
    auto = parse_args(["--model", str(base_dir), "--admin-key-file", str(key_file)])
    assert auto.max_cpu_adapters is None  # auto, the default: sized by each worker
    assert parse_args(["--model", str(base_dir), "--admin-key-file", str(key_file),
                       "--max-cpu-adapters", "auto"]).max_cpu_adapters is None
    assert _worker_config(auto, load_served_model(auto), tmp_path, "id").max_cpu_adapters is None
    # --lora-dtype: the tables' dtype, agreed through the worker config; start adapters it
    # cannot hold exactly are refused at start, naming the flag and the module.
    half = parse_args(["--model", str(base_dir), "--admin-key-file", str(key_file),
                       "--lora-dtype", "bfloat16"])
    assert load_served_model(half).capacity.dtype == "BF16"
    assert _worker_config(half, load_served_model(half), tmp_path, "id").lora_capacity.dtype == \
        "BF16"
    assert load_served_model(auto).capacity.dtype is None
    with pytest.raises(ConfigError, match=r"--lora-dtype float16: an adapter given at start "
                       r"\('a'\): module model\.layers\.\d+\.\S+ stores F32 factors"):
        load_served_model(parse_args(["--model", str(base_dir), "--adapter", f"a={good}",
                                      "--lora-dtype", "float16"]))
    wide = load_served_model(parse_args(["--model", str(base_dir), "--adapter", f"a={good}",
                                         "--lora-dtype", "float32"]))
    assert (wide.capacity.dtype, wide.capacity.runtime) == ("F32", False)
    plain = load_served_model(parse_args(["--model", str(base_dir), "--adapter", f"a={good}"]))
    assert (plain.capacity.num_slots, plain.capacity.runtime) == (1, False)


@pytest.mark.parametrize("flags, message", [
    (["--max-gpu-adapters", "0"], "adapters need at least one device slot"),
    (["--pin-adapter", "a", "--max-gpu-adapters", "1", "--adapter", "b=GOOD"],
     "could never run"),
    (["--pin-adapter", "zz"], "--pin-adapter zz: no --adapter is named 'zz'"),
    (["--max-lora-rank", "2"], "--max-lora-rank 2: an adapter given at start has rank 4"),
    (["--adapter-dir", "/nonexistent"], "--adapter-dir /nonexistent: not a folder"),
    (["--admin-key-file", "SHORT"], "--admin-key-file must hold a key of at least 16"),
])
def test_slot_flag_errors_name_the_flag(base_dir, adapters, tmp_path, capsys, flags, message):
    from lorad.daemon.main import load_served_model

    good, _ = adapters
    (tmp_path / "short").write_text("abc\n")
    flags = [f.replace("GOOD", str(good)).replace("SHORT", str(tmp_path / "short"))
             for f in flags]
    argv = ["--model", str(base_dir), "--adapter", f"a={good}", *flags]
    with pytest.raises((SystemExit, ConfigError)) as raised:
        load_served_model(parse_args(argv))
    text = str(raised.value) if raised.type is ConfigError else capsys.readouterr().err
    assert message in text
