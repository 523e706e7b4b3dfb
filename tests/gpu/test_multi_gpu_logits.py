"""lorad's logits over NCCL on CUDA at world 1, 2 (and 4 where four GPUs are), fp32 and bf16,
against transformers + peft fp32, against world 1, and identical on every rank.

The adapters, scenarios and tolerances are tests/integration/test_lora_logits.py's (its CPU
counterpart: gloo, world 1 to 3); tests/tp_runner.py runs the ranks. Skipped unless two CUDA
devices are visible.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.integration import test_lora_logits as cpu
from tests.model_steps import rel_error
from tests.tiny_adapters import make_peft_adapter
from tests.tiny_models import make_tiny_llama
from tests.tp_runner import launch_ranks

NUM_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(NUM_GPUS < 2, reason="needs two CUDA devices")]

WORLDS = (1, 2, 4)
DTYPES = ("fp32", "bf16")
TOLERANCES = {"fp32": cpu.FP32_REL_TOL, "bf16": cpu.BF16_REL_TOL}


def worlds_here() -> list[int]:
    return [world for world in WORLDS if world <= NUM_GPUS]


def skip_unless_here(world: int) -> None:
    if world > NUM_GPUS:
        pytest.skip(f"world {world} needs {world} CUDA devices ({NUM_GPUS} here)")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    shape = dict(cpu.MODEL)
    largest = max(worlds_here())
    if largest > shape["num_key_value_heads"]:  # whole KV heads per rank
        heads = 2 * largest  # head_dim 16, as the GPU attention kernels need
        shape.update(num_key_value_heads=largest, num_attention_heads=heads,
                     hidden_size=16 * heads)
    root = tmp_path_factory.mktemp("nccl_logits")
    base = make_tiny_llama(root / "base", with_tokenizer=False, **shape)
    return base, {name: make_peft_adapter(base, root / name, **kwargs)
                  for name, kwargs in cpu.FOLDERS.items()}


@pytest.fixture(scope="module")
def runs(checkpoint, tmp_path_factory) -> dict[int, Path]:
    base, folders = checkpoint
    entry = {"dir": str(base), "num_blocks": cpu.NUM_BLOCKS, "block_size": cpu.BLOCK_SIZE,
             "scenarios": cpu.STEPS, "adapters": cpu.adapter_args(folders)}
    models = {world: [{**entry, "name": "fp32", "dtype": "float32"},
                      {**entry, "name": "bf16", "dtype": "bfloat16"}] for world in worlds_here()}
    return launch_ranks(models, tmp_path_factory.mktemp("nccl_runs"), backend="nccl",
                        device="cuda", timeout_s=150)


@pytest.fixture(scope="module")
def reference(checkpoint) -> dict[tuple[int, str], torch.Tensor]:
    return cpu.peft_reference(*checkpoint)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("world", WORLDS)
def test_logits_match_peft(runs, reference, world, dtype):
    skip_unless_here(world)
    cpu.test_logits_match_peft(runs, reference, world, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("world", WORLDS[1:])
def test_logits_match_world_one(runs, world, dtype):
    skip_unless_here(world)
    one, many = cpu.read(runs, 1, dtype), cpu.read(runs, world, dtype)
    for key in one:
        rel = rel_error(many[key], one[key])
        assert rel < TOLERANCES[dtype], f"{key}: relative error {rel:.2e} against world 1"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("world", WORLDS[1:])
def test_every_rank_returns_the_same_logits(runs, world, dtype):
    skip_unless_here(world)
    leader = cpu.read(runs, world, dtype)
    for rank in range(1, world):
        follower = cpu.read(runs, world, dtype, rank)
        for key in leader:
            assert torch.equal(leader[key], follower[key]), f"rank {rank} differs at {key}"
