"""Fixtures of the unit tests: a tiny base (config and weights, no tokenizer) and a good PEFT
folder for it, built once per test module (a module may override any of them), and one_thread
for the modules whose rows must keep their bits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lorad.config import ModelConfig
from tests.tiny_adapters import make_peft_adapter
from tests.tiny_models import make_tiny_llama


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for the module: the rule under which the CPU path keeps a row's bits
    whatever shares its step (shared/DESIGN.md, "Numerics")."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("base"), with_tokenizer=False)


@pytest.fixture(scope="module")
def model(base_dir) -> ModelConfig:
    return ModelConfig.from_dir(base_dir)


@pytest.fixture(scope="module")
def good_dir(base_dir, tmp_path_factory) -> Path:
    """Rank 4, alpha 8, every projection of every layer."""
    return make_peft_adapter(base_dir, tmp_path_factory.mktemp("good") / "sql", r=4)
