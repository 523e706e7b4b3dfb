"""Per-request adapter strength gives peft's logits with the adapter's scaling multiplied by it,
for rows of several strengths of one adapter in one step, at world 1 and 2.

Two peft adapters on a tiny random Llama: "plain" registered at strength 1.0 and "patterns"
(rank_pattern + alpha_pattern) registered at 0.5, so a request's strength multiplies the
registered one. One launch of real gloo processes (tests/tp_runner.py) runs both world sizes;
each sampled row is compared with peft's fp32 logits with every module's scaling multiplied by
registered strength x request strength. Rows at strength 1.0 keep the bits of rows that carry no
strength, and rows at 0 the base model's.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.model_steps import rel_error, runner_scenarios
from tests.integration.test_lora_logits import FOLDERS as LORA_FOLDERS
from tests.integration.test_lora_logits import MODEL
from tests.tiny_adapters import make_checkpoint, reference_llama, scaled_peft_model
from tests.tp_runner import launch_ranks

FP32_REL_TOL = 1e-5  # as test_lora_logits.py: lorad vs peft in fp32
BLOCK_SIZE = 4
NUM_BLOCKS = 48
WORLDS = (1, 2)
# test_lora_logits' model and two of its folders
FOLDERS = {name: LORA_FOLDERS[name] for name in ("plain", "patterns")}
SLOTS = {1: ("plain", 1.0), 2: ("patterns", 0.5)}  # slot -> (folder, registered strength)

_rng = random.Random(7)
SEQS = {name: [_rng.randrange(3, 384) for _ in range(length)]
        for name, length in {"P": 12, "Q": 10, "R": 10, "S": 12, "T": 10}.items()}

# A step: (sequence, slot, request strength or None for a chunk without one, new tokens) per
# chunk; every chunk samples its last row. Each scenario starts from an empty pool.
SCENARIOS = {
    # Four strengths of slot 1 in the same steps, and slot 2 (registered at 0.5) at 4.0.
    "mixed": [[("P", 1, 0.0, 6), ("Q", 1, 0.5, 5), ("R", 1, 1.0, 4), ("S", 1, 2.0, 7),
               ("T", 2, 4.0, 3)],
              [("P", 1, 0.0, 5), ("Q", 1, 0.5, 1), ("R", 1, 1.0, 5), ("S", 1, 2.0, 1),
               ("T", 2, 4.0, 7)],
              [("S", 1, 2.0, 1), ("R", 1, 1.0, 1), ("Q", 1, 0.5, 1), ("P", 1, 0.0, 1)]],
    # R without a strength and P on the base model, chunked as in "mixed": the same bits as
    # mixed's R at 1.0 and P at 0 (a row's bits do not depend on its neighbours).
    "plain": [[("R", 1, None, 4), ("P", 0, None, 6)], [("R", 1, None, 5), ("P", 0, None, 5)],
              [("R", 1, None, 1), ("P", 0, None, 1)]],
}


def build_scenarios() -> tuple[dict, dict]:
    """-> runner steps per scenario, and per step the (slot, strength, sequence, position) of
    each sampled row (tests/model_steps.runner_scenarios)."""
    return runner_scenarios(SCENARIOS, SEQS, BLOCK_SIZE, NUM_BLOCKS)


STEPS, EXPECTED = build_scenarios()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    return make_checkpoint(tmp_path_factory.mktemp("strength_logits"), MODEL, FOLDERS)


@pytest.fixture(scope="module")
def runs(checkpoint, tmp_path_factory) -> dict[int, Path]:
    base, folders = checkpoint
    adapters = [{"name": f"{folder}-{slot}", "path": str(folders[folder]), "strength": strength}
                for slot, (folder, strength) in SLOTS.items()]
    entry = {"dir": str(base), "num_blocks": NUM_BLOCKS, "block_size": BLOCK_SIZE,
             "scenarios": STEPS, "adapters": adapters, "name": "fp32", "dtype": "float32"}
    return launch_ranks({world: [entry] for world in WORLDS},
                        tmp_path_factory.mktemp("strength_runs"))


@pytest.fixture(scope="module")
def reference(checkpoint) -> dict[tuple[int, float, str], torch.Tensor]:
    """(slot, request strength, sequence) -> peft's fp32 logits [seq_len, vocab]: peft's own
    per-adapter `scaling` of every LoRA layer multiplied by registered x request strength."""
    base, folders = checkpoint
    model = reference_llama(base)
    wanted = {(slot, strength, seq) for steps in EXPECTED.values() for rows in steps
              for slot, strength, seq, _ in rows}
    refs = {}
    with torch.no_grad():
        for seq, ids in SEQS.items():
            refs[(0, 1.0, seq)] = model(torch.tensor([ids])).logits[0]
        for slot, (folder, registered) in SLOTS.items():
            for strength in sorted({x for s, x, _ in wanted if s == slot}):
                peft_model = scaled_peft_model(model, folders[folder], f"slot{slot}",
                                               registered * strength)
                for seq, ids in SEQS.items():
                    refs[(slot, strength, seq)] = peft_model(torch.tensor([ids])).logits[0]
                model = peft_model.unload()
    return refs


def read(runs: dict[int, Path], world: int, rank: int = 0) -> dict[str, torch.Tensor]:
    return load_file(str(runs[world] / f"fp32.rank{rank}.safetensors"))


def test_strengths_move_the_reference(reference):
    """Guards the test: each strength of an adapter gives other logits, 0 the base model's."""
    for seq in SEQS:
        strengths = [reference[(1, x, seq)] for x in (0.5, 1.0, 2.0)] + [reference[(0, 1.0, seq)]]
        for i in range(len(strengths)):
            for j in range(i):
                assert rel_error(strengths[i], strengths[j]) > 1e-3, (seq, i, j)
        assert torch.allclose(reference[(1, 0.0, seq)], reference[(0, 1.0, seq)])


@pytest.mark.parametrize("world", WORLDS)
def test_logits_match_peft_scaled_by_strength(runs, reference, world):
    logits = read(runs, world)
    for scenario, steps in EXPECTED.items():
        for i, rows in enumerate(steps):
            got = logits[f"{scenario}.{i}"]  # [num_sampled, vocab]
            for k, (slot, strength, seq, pos) in enumerate(rows):
                want = reference[(slot, strength, seq)][pos]
                rel = rel_error(got[k], want)
                assert rel < FP32_REL_TOL, (f"{scenario} step {i} row {k} (slot {slot} at "
                                            f"{strength}): relative error {rel:.2e}")


@pytest.mark.parametrize("world", WORLDS)
def test_strength_one_and_zero_keep_their_bits(runs, world):
    """R at 1.0 = R without a strength, P at 0 = P on the base model, bit for bit."""
    logits = read(runs, world)
    for i in range(len(SCENARIOS["plain"])):
        mixed, plain = logits[f"mixed.{i}"], logits[f"plain.{i}"]
        r_mixed = [row[2] for row in EXPECTED["mixed"][i]].index("R")
        p_mixed = [row[2] for row in EXPECTED["mixed"][i]].index("P")
        assert torch.equal(mixed[r_mixed], plain[0]), f"step {i}: R at 1.0"
        assert torch.equal(mixed[p_mixed], plain[1]), f"step {i}: P at 0"


def test_ranks_agree(runs):
    leader, follower = read(runs, 2), read(runs, 2, rank=1)
    for key in leader:
        assert torch.equal(leader[key], follower[key]), key
