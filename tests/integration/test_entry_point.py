"""The real `lorad` entry point in a fresh interpreter: model-folder, limit and adapter errors
exit 2 with one line naming the flag before any worker starts (the exact stderr a user sees),
`lorad check-adapter` through the command, and the config package importing no torch.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiny_models import write_tokenizer
from tests.unit.test_adapter_cli import adapters, base_dir  # noqa: F401  (fixtures)

REPO = Path(__file__).resolve().parents[2]


def _run_lorad(*args: str) -> subprocess.CompletedProcess:
    code = "import sys; from lorad.daemon.main import main; sys.exit(main())"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=120, cwd=REPO)


@pytest.fixture
def model_dir(tmp_path) -> Path:
    """A config.json without a tokenizer."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(
        '{"model_type": "llama", "vocab_size": 400, "hidden_size": 64, "intermediate_size": 128,'
        ' "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,'
        ' "max_position_embeddings": 256, "eos_token_id": 2}')
    return folder


def test_model_folder_errors_before_any_worker(tmp_path, model_dir):
    result = _run_lorad("--model", str(tmp_path / "missing"))
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "--model" in result.stderr
    result = _run_lorad("--model", str(model_dir))
    assert result.returncode == 2 and "tokenizer.json" in result.stderr
    assert result.stderr.count("\n") == 1


def test_max_model_len_may_not_exceed_the_model(model_dir):
    write_tokenizer(model_dir)
    result = _run_lorad("--model", str(model_dir), "--max-model-len", "257")
    assert result.returncode == 2
    assert "--max-model-len" in result.stderr and "256" in result.stderr
    assert result.stderr.count("\n") == 1


def test_parallel_above_the_kv_heads_is_refused_before_any_worker(model_dir):
    write_tokenizer(model_dir)
    result = _run_lorad("--model", str(model_dir), "--parallel", "3")
    assert result.returncode == 2
    assert "--parallel 3" in result.stderr and "2 key-value heads" in result.stderr
    assert result.stderr.count("\n") == 1 and "worker" not in result.stderr


# --- adapters -----------------------------------------------------------------------------------

def test_registry_errors_exit_2_before_anything_loads(base_dir, adapters, tmp_path):
    good, dora = adapters
    result = _run_lorad("--model", str(base_dir), "--adapter", f"sql={tmp_path / 'missing'}")
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert f"--adapter sql={tmp_path / 'missing'}: no such folder" in result.stderr
    result = _run_lorad("--model", str(base_dir), "--adapter", f"ok={good}",
                        "--adapter", f"dora={dora}")
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert f"--adapter dora={dora}: adapter_config.json: use_dora=true" in result.stderr


def test_check_adapter_through_the_lorad_command(adapters, tmp_path):
    good, _ = adapters
    result = _run_lorad("check-adapter", str(good))
    assert result.returncode == 0 and f"{good}: ok" in result.stdout
    result = _run_lorad("check-adapter", str(good), "--model", str(tmp_path / "none"))
    assert result.returncode == 2 and "--model" in result.stderr


def test_config_does_not_import_torch():
    code = ("import sys, lorad.config.adapters, lorad.config.check_adapter, "
            "lorad.config.adapter_memory; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
