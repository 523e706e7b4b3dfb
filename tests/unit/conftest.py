"""Fixtures of the adapter tests: a tiny base (config and weights, no tokenizer) and a good PEFT
folder for it, built once per test module; a module may override any of them."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorad.config import ModelConfig
from tests.tiny_adapters import make_peft_adapter
from tests.tiny_models import make_tiny_llama


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
