"""The warm-up steps (lorad/workers/warm_up.py): every kernel choice a step of any size can make
is made by one of them, and on a tiny model on the CPU they run and write nothing to the KV pool.

The choices below are read off the kernels' configs (PDL by the step's rows, the expand's tile,
the decode GEMV by projection); the GPU test tests/gpu/test_gpu_model.py checks the same thing
through triton's own caches."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lorad.workers.batch import MIN_ROWS, ForwardBatch
from lorad.workers.kernels.configs import PdlConfig
from lorad.workers.tuning import Tuning, replaced
from lorad.workers.warm_up import row_bands, seq_bands, warm_up_steps
from tests.model_steps import build_model
from tests.tiny_adapters import make_peft_adapter
from tests.tiny_models import make_tiny_llama


def choices(rows: int, with_lora: bool, tuning: Tuning) -> tuple:
    """What a step of `rows` rows selects by its size: the PDL flag, the expand's tile (LoRA
    steps), and for each base projection whether the decode GEMV runs it."""
    rows = max(rows, MIN_ROWS)
    pdl = rows <= tuning.pdl.step_rows(with_lora)
    expand = tuning.expand.config(rows) if with_lora else None
    gemv = tuple(config is not None and rows <= config.block_m
                 for config in (tuning.gemv.qkv, tuning.gemv.gate_up, tuning.gemv.o,
                                tuning.gemv.down))
    return pdl, expand, gemv


def step_choices(chunks, tuning: Tuning) -> tuple:
    rows = sum(len(tokens) for tokens, *_ in chunks)
    return choices(rows, any(slot for *_, slot in chunks), tuning)


TUNINGS = {
    "product": Tuning(),
    "no PDL": dataclasses.replace(Tuning(), pdl=PdlConfig(max_rows=0, max_rows_with_lora=0)),
    "wide PDL": dataclasses.replace(Tuning(), pdl=PdlConfig(max_rows=48, max_rows_with_lora=100)),
}


def test_the_product_bands():
    assert row_bands(Tuning(), 512) == [8, 17, 33, 65, 512]
    assert row_bands(Tuning(), 40) == [8, 17, 33, 40]
    assert row_bands(Tuning(), 4) == [4]
    # The MoE tile tables' small-step limit is a band of its own.
    assert 21 in row_bands(replaced(Tuning(), "moe.small_step_rows=20"), 512)
    assert seq_bands(Tuning()) == [1, 2, 3]


@pytest.mark.parametrize("name", sorted(TUNINGS))
@pytest.mark.parametrize("max_tokens,max_seqs", [(512, 256), (2048, 64), (24, 8), (3, 3)])
def test_every_reachable_choice_is_warmed(name, max_tokens, max_seqs):
    tuning = TUNINGS[name]
    steps = warm_up_steps(max_tokens, max_seqs, 4096, 16, 2, tuning)
    warmed_mixed = {step_choices(s, tuning) for s in steps if any(len(c[0]) > 1 for c in s)}
    warmed_decode = {step_choices(s, tuning) for s in steps if all(len(c[0]) == 1 for c in s)}
    for rows in range(2, max_tokens + 1):  # a prompt chunk (and decodes) of `rows` rows in all
        for with_lora in (False, True):
            assert choices(rows, with_lora, tuning) in warmed_mixed, (rows, with_lora)
    for num_seqs in range(1, min(max_seqs, max_tokens) + 1):
        for with_lora in (False, True):
            assert choices(num_seqs, with_lora, tuning) in warmed_decode, (num_seqs, with_lora)
    decode_sizes = {len(s) for s in steps if all(len(c[0]) == 1 for c in s)}
    assert {n for n in seq_bands(tuning) if n <= min(max_seqs, max_tokens)} <= decode_sizes
    # A mixed step's decodes run decode attention on their own: with the early block-id read
    # (one decode) and without (more), where the limits allow that many rows.
    mixed_decodes = {sum(len(c[0]) == 1 for c in s) for s in steps if any(len(c[0]) > 1 for c in s)}
    preload = tuning.attention.preload_max_seqs
    if max_tokens >= preload + 3 and max_seqs > preload + 1:
        assert preload in mixed_decodes and preload + 1 in mixed_decodes, mixed_decodes


def test_without_adapters_no_step_names_one():
    steps = warm_up_steps(512, 256, 4096, 16, 0, Tuning())
    assert steps and all(slot == 0 for step in steps for *_, slot in step)


@pytest.mark.parametrize("max_tokens,max_seqs,max_len", [(512, 256, 4096), (64, 80, 40)])
def test_steps_fit_the_limits(max_tokens, max_seqs, max_len):
    block_size = 16
    for step in warm_up_steps(max_tokens, max_seqs, max_len, block_size, 3, Tuning()):
        assert sum(len(tokens) for tokens, *_ in step) <= max_tokens
        assert len(step) <= max_seqs
        for tokens, start, table, _, slot in step:
            assert start + len(tokens) <= max_len
            assert len(table) * block_size >= start + len(tokens) and set(table) == {0}
            assert slot in (0, 1)


def test_the_steps_run_on_a_tiny_model_and_write_no_kv(tmp_path):
    checkpoint = make_tiny_llama(tmp_path / "llama", with_tokenizer=False, vocab_size=97)
    adapter = make_peft_adapter(checkpoint, tmp_path / "a1", r=4, lora_alpha=8, seed=3)
    block_size = 4
    model = build_model(checkpoint, [adapter], torch.float32, torch.device("cpu"), 8, block_size)
    caches = [t for layer in model.model.layers for t in (layer.self_attn.attn.kv_cache.k,
                                                          layer.self_attn.attn.kv_cache.v)]
    for t in caches:
        t.fill_(7.0)
    steps = warm_up_steps(40, 20, 64, block_size, 1, Tuning())
    assert len(steps) > 10
    for step in steps:
        batch = ForwardBatch.build(step, block_size, "cpu")
        batch = dataclasses.replace(batch, slot_mapping=torch.full_like(batch.slot_mapping, -1))
        logits = model.forward(batch)
        assert logits.shape[0] == len(step) and logits.isfinite().all()
    assert all(bool((t == 7.0).all()) for t in caches)
