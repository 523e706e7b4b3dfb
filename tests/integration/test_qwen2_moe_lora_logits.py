"""lorad's per-row LoRA on a Qwen2-MoE gives peft's logits, for every adapter and any mixture,
at world sizes 1, 2 and 3.

Random adapters made by peft itself on a tiny random Qwen2MoeForCausalLM (layers 0 and 2 sparse,
layer 1 dense): every servable projection (attention, the shared expert's, the dense layer's),
the shared expert's down projection with o_proj alone (the two writers into the residual),
rank_pattern + alpha_pattern on the shared expert, use_rslora, and the first at strength 0.5.
One launch of gloo ranks (tests/tp_runner.py) runs every world size; each sampled row is compared
with peft's fp32 logits of its adapter at the same position of the same full sequence.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.integration.test_llama_logits import check_row_bits, check_same_on_every_rank
from tests.integration.test_lora_logits import FP32_REL_TOL
from tests.model_steps import rel_error, runner_scenarios
from tests.tiny_adapters import make_peft_adapter, peft_logits
from tests.tiny_models import make_tiny_qwen2_moe
from tests.tp_runner import launch_ranks

BLOCK_SIZE = 4
NUM_BLOCKS = 48
WORLDS = (1, 2, 3)
FOLDERS = {
    "all": dict(r=4, lora_alpha=8, seed=21, magnitude=0.1),
    "writers": dict(r=3, lora_alpha=6, target_modules=("o_proj", "shared_expert.down_proj"),
                    seed=22, magnitude=0.15),
    "patterns": dict(r=6, lora_alpha=12, seed=23, magnitude=0.1,
                     rank_pattern={"shared_expert.gate_proj": 2,
                                   "model.layers.2.mlp.shared_expert.down_proj": 5},
                     alpha_pattern={"shared_expert.up_proj": 30, "v_proj": 3}),
    "rslora": dict(r=8, lora_alpha=8, use_rslora=True, layers_to_transform=[1, 2],
                   target_modules=("q_proj", "gate_proj", "up_proj", "down_proj"), seed=24,
                   magnitude=0.1),
}
# slot -> (adapter name, folder, strength); slot 0 is the base model.
SLOTS = {1: ("all", "all", 1.0), 2: ("writers", "writers", 1.0),
         3: ("patterns", "patterns", 1.0), 4: ("rslora", "rslora", 1.0),
         5: ("half", "all", 0.5)}

_rng = random.Random(77)
SEQS = {name: [_rng.randrange(3, 384) for _ in range(length)]
        for name, length in {"X": 12, "P": 13, "Q": 10, "R": 11, "S": 8}.items()}
SCENARIOS = {
    **{f"alone{slot}": [[("X", slot, 7)], [("X", slot, 3)], [("X", slot, 1)], [("X", slot, 1)]]
       for slot in range(len(SLOTS) + 1)},
    "mixed": [[("P", 0, 6), ("Q", 1, 5), ("R", 2, 4)],
              [("P", 0, 1), ("Q", 1, 1), ("R", 2, 5), ("S", 3, 6)],
              [("S", 3, 1), ("P", 0, 1), ("Q", 1, 1), ("R", 2, 1)],
              [("S", 3, 1), ("R", 2, 1), ("Q", 1, 1), ("P", 0, 1)]],
    "mixed2": [[("P", 5, 8), ("Q", 4, 4), ("R", 2, 9), ("S", 5, 2)],
               [("P", 5, 1), ("Q", 4, 1), ("R", 2, 1), ("S", 5, 1)]],
    "solo": [[("X", 2, 10)], [("X", 2, 1)], [("X", 2, 1)]],
    "batched": [[("P", 1, 6), ("X", 2, 10), ("Q", 0, 3), ("R", 2, 2)],
                [("P", 1, 7), ("Q", 0, 1), ("X", 2, 1), ("R", 2, 1)],
                [("X", 2, 1), ("Q", 0, 1), ("S", 4, 5)]],
}
STEPS, _EXPECTED = runner_scenarios(SCENARIOS, SEQS, BLOCK_SIZE, NUM_BLOCKS)
EXPECTED = {scenario: [[(slot, seq, pos) for slot, _, seq, pos in rows] for rows in rows_of]
            for scenario, rows_of in _EXPECTED.items()}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    root = tmp_path_factory.mktemp("moe_lora")
    base = make_tiny_qwen2_moe(root / "base", with_tokenizer=False, seed=6)
    return base, {name: make_peft_adapter(base, root / name, **kwargs)
                  for name, kwargs in FOLDERS.items()}


@pytest.fixture(scope="module")
def runs(checkpoint, tmp_path_factory) -> dict[int, Path]:
    base, folders = checkpoint
    adapters = [{"name": name, "path": str(folders[folder]), "strength": strength}
                for name, folder, strength in SLOTS.values()]
    entry = {"name": "fp32", "dtype": "float32", "dir": str(base), "num_blocks": NUM_BLOCKS,
             "block_size": BLOCK_SIZE, "scenarios": STEPS, "adapters": adapters}
    return launch_ranks({world: [entry] for world in WORLDS},
                        tmp_path_factory.mktemp("moe_lora_runs"))


@pytest.fixture(scope="module")
def reference(checkpoint) -> dict[tuple[int, str], torch.Tensor]:
    """(slot, sequence) -> peft's fp32 logits [seq_len, vocab] of the full sequence."""
    from transformers import Qwen2MoeForCausalLM

    base, folders = checkpoint
    model = Qwen2MoeForCausalLM.from_pretrained(base, dtype=torch.float32,
                                                attn_implementation="eager").eval()
    return peft_logits(model, folders, SLOTS, SEQS)


def read(runs: dict[int, Path], world: int, rank: int = 0) -> dict[str, torch.Tensor]:
    return load_file(str(runs[world] / f"fp32.rank{rank}.safetensors"))


def test_every_adapter_moves_the_logits(reference):
    """Guards the test itself: an adapter that changed nothing would pass vacuously."""
    for slot in SLOTS:
        for seq in SEQS:
            assert rel_error(reference[(slot, seq)], reference[(0, seq)]) > 1e-2, (slot, seq)


@pytest.mark.parametrize("world", WORLDS)
def test_logits_match_peft(runs, reference, world):
    logits = read(runs, world)
    for scenario, steps in EXPECTED.items():
        for i, rows in enumerate(steps):
            want = torch.stack([reference[(slot, seq)][pos] for slot, seq, pos in rows])
            rel = rel_error(logits[f"{scenario}.{i}"], want)
            assert rel < FP32_REL_TOL, f"{scenario} step {i}: relative error {rel:.2e}"


@pytest.mark.parametrize("world", WORLDS[1:])
def test_every_rank_returns_the_same_logits(runs, world):
    check_same_on_every_rank([read(runs, world, rank) for rank in range(world)])


@pytest.mark.parametrize("world", WORLDS)
def test_row_bits_do_not_depend_on_the_batch(runs, world):
    """X with slot 2: the same bits alone, sharing its slot with R, and among other slots."""
    check_row_bits(read(runs, world), EXPECTED)
