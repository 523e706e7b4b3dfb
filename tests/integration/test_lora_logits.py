"""lorad's per-row LoRA gives peft's logits, for every adapter and any mixture, at world 1, 2, 3.

Random adapters made by peft itself (tests/tiny_adapters.py) on a tiny random Llama: plain,
rank_pattern + alpha_pattern, use_rslora, a subset of modules and layers, an MLP-only one with the
largest rank, and the plain one again at strength 0.5. One launch of real gloo processes
(tests/tp_runner.py) runs every world size; each sampled row is compared with peft's fp32 logits
of the same adapter at the same position of the same full sequence.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.integration.test_llama_logits import check_row_bits, check_same_on_every_rank
from tests.model_steps import rel_error, runner_scenarios
from tests.tiny_adapters import make_checkpoint, peft_logits, reference_llama
from tests.tp_runner import launch_ranks

# max|lorad - peft| / max|peft| over a step's logits (as for the base model in
# test_llama_logits.py). The row-parallel delta is summed over ranks before B is applied once in
# peft, so world 2 and 3 round differently from peft; measured: below 1e-6 at every world size.
FP32_REL_TOL = 1e-5
BF16_REL_TOL = 5e-2  # bf16 base against the fp32 reference, as for the base model
BLOCK_SIZE = 4
NUM_BLOCKS = 48
WORLDS = (1, 2, 3)
MODEL = dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3, intermediate_size=100,
             num_hidden_layers=3, seed=5)

# slot -> (adapter name, folder, strength); slot 0 is the base model. "half" is "plain"'s folder.
FOLDERS = {
    "plain": dict(r=4, lora_alpha=8, seed=11, magnitude=0.1),
    "patterns": dict(r=8, lora_alpha=16, seed=12, magnitude=0.1,
                     rank_pattern={"q_proj": 2, "model.layers.1.mlp.down_proj": 5},
                     alpha_pattern={"v_proj": 3, "gate_proj": 40}),
    "rslora": dict(r=6, lora_alpha=12, use_rslora=True, seed=13, magnitude=0.1),
    "subset": dict(r=3, lora_alpha=6, target_modules=("q_proj", "v_proj", "down_proj"),
                   layers_to_transform=[0, 2], seed=14, magnitude=0.1),
    "mlp_only": dict(r=16, lora_alpha=8, target_modules=("o_proj", "gate_proj", "up_proj"),
                     layers_to_transform=[1], seed=15, magnitude=0.1),
}
SLOTS = {1: ("plain", "plain", 1.0), 2: ("patterns", "patterns", 1.0),
         3: ("rslora", "rslora", 1.0), 4: ("subset", "subset", 1.0),
         5: ("half", "plain", 0.5), 6: ("mlp_only", "mlp_only", 1.0)}

_rng = random.Random(99)
SEQS = {name: [_rng.randrange(3, 384) for _ in range(length)]
        for name, length in {"X": 12, "P": 13, "Q": 10, "R": 11, "S": 8, "T": 10}.items()}

# A step: (sequence, slot, new tokens) per chunk, in batch order; every chunk samples its last row.
SCENARIOS = {
    # Each slot alone: a prompt in two chunks, then two decodes.
    **{f"alone{slot}": [[("X", slot, 7)], [("X", slot, 3)], [("X", slot, 1)], [("X", slot, 1)]]
       for slot in range(len(SLOTS) + 1)},
    # The base and three adapters in one step, slot 1 used by two sequences (Q and T).
    "mixed": [[("P", 0, 6), ("Q", 1, 5), ("R", 2, 4)],
              [("P", 0, 1), ("Q", 1, 1), ("R", 2, 5), ("S", 4, 6), ("T", 1, 4)],
              [("T", 1, 6), ("P", 0, 1), ("Q", 1, 1), ("R", 2, 1), ("S", 4, 1)],
              [("S", 4, 1), ("R", 2, 1), ("Q", 1, 1), ("P", 0, 1)]],
    "mixed2": [[("P", 5, 8), ("Q", 3, 4), ("R", 6, 9), ("S", 0, 2)],
               [("P", 5, 1), ("Q", 3, 1), ("R", 6, 1), ("S", 0, 1), ("T", 5, 10)]],
    # X with slot 2 alone, then batched: sharing its slot with R, then next to other slots only.
    "solo": [[("X", 2, 10)], [("X", 2, 1)], [("X", 2, 1)]],
    "batched": [[("P", 1, 6), ("X", 2, 10), ("Q", 0, 3), ("R", 2, 2)],
                [("P", 1, 7), ("Q", 0, 1), ("X", 2, 1), ("R", 2, 1)],
                [("X", 2, 1), ("Q", 0, 1), ("T", 6, 5)]],
}


def build_scenarios() -> tuple[dict, dict]:
    """-> runner steps per scenario, and per step the (slot, sequence, position) of each sampled
    row (tests/model_steps.runner_scenarios)."""
    steps, expected = runner_scenarios(SCENARIOS, SEQS, BLOCK_SIZE, NUM_BLOCKS)
    return steps, {scenario: [[(slot, seq, pos) for slot, _, seq, pos in rows] for rows in rows_of]
                   for scenario, rows_of in expected.items()}


STEPS, EXPECTED = build_scenarios()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    return make_checkpoint(tmp_path_factory.mktemp("lora_logits"), MODEL, FOLDERS)


def adapter_args(folders: dict[str, Path]) -> list[dict]:
    return [{"name": name, "path": str(folders[folder]), "strength": strength}
            for name, folder, strength in SLOTS.values()]


@pytest.fixture(scope="module")
def runs(checkpoint, tmp_path_factory) -> dict[int, Path]:
    base, folders = checkpoint
    entry = {"dir": str(base), "num_blocks": NUM_BLOCKS, "block_size": BLOCK_SIZE,
             "scenarios": STEPS, "adapters": adapter_args(folders)}
    models = {world: [{**entry, "name": "fp32", "dtype": "float32"}] for world in WORLDS}
    models[2].append({**entry, "name": "bf16", "dtype": "bfloat16"})
    return launch_ranks(models, tmp_path_factory.mktemp("lora_runs"))


@pytest.fixture(scope="module")
def reference(checkpoint) -> dict[tuple[int, str], torch.Tensor]:
    return peft_reference(*checkpoint)


def peft_reference(base: Path, folders: dict[str, Path]) -> dict[tuple[int, str], torch.Tensor]:
    """(slot, sequence) -> peft's fp32 logits [seq_len, vocab] of the full sequence."""
    return peft_logits(reference_llama(base), folders, SLOTS, SEQS)


def read(runs: dict[int, Path], world: int, model: str = "fp32",
         rank: int = 0) -> dict[str, torch.Tensor]:
    return load_file(str(runs[world] / f"{model}.rank{rank}.safetensors"))


def test_every_adapter_moves_the_logits(reference):
    """Guards the test itself: an adapter that changed nothing would pass vacuously."""
    for slot in SLOTS:
        for seq in SEQS:
            assert rel_error(reference[(slot, seq)], reference[(0, seq)]) > 1e-2, (slot, seq)
    assert rel_error(reference[(5, "X")], reference[(1, "X")]) > 1e-2  # strength counts


CASES = [(world, "fp32") for world in WORLDS] + [(2, "bf16")]


@pytest.mark.parametrize("world, model", CASES, ids=[f"world{w}-{m}" for w, m in CASES])
def test_logits_match_peft(runs, reference, world, model):
    tol = BF16_REL_TOL if model == "bf16" else FP32_REL_TOL
    logits = read(runs, world, model)
    for scenario, steps in EXPECTED.items():
        for i, rows in enumerate(steps):
            got = logits[f"{scenario}.{i}"]  # [num_sampled, vocab]
            want = torch.stack([reference[(slot, seq)][pos] for slot, seq, pos in rows])
            rel = rel_error(got, want)
            assert rel < tol, f"{scenario} step {i}: relative error {rel:.2e} >= {tol:.0e}"


@pytest.mark.parametrize("world", WORLDS[1:])
def test_every_rank_returns_the_same_logits(runs, world):
    check_same_on_every_rank([read(runs, world, rank=rank) for rank in range(world)])


@pytest.mark.parametrize("world", WORLDS)
def test_row_bits_do_not_depend_on_the_batch(runs, world):
    """X with slot 2: the same bits alone, sharing its slot with R, and among other slots."""
    check_row_bits(read(runs, world), EXPECTED)
