"""The leader's grammar rows on the tiny test tokenizer: the mask leaves unconstrained rows' bits
untouched and sends every disallowed token of a constrained row to -inf; greedy decoding through
the mask spells the regex and then allows only the stop tokens; a request whose matcher cannot be
built may only stop; the bitmask helpers."""

from __future__ import annotations

import json

import torch
from llguidance import LLMatcher
from tokenizers import Tokenizer

from lorad.workers.grammar import GrammarRows, _only, unpack
from tests.daemons import REPO
from tests.tiny_models import write_tokenizer

STOP_IDS = [2]  # <|im_end|> of the tiny tokenizer


def rows_for(tmp_path, extra_vocab: int = 16) -> tuple[GrammarRows, Tokenizer, int]:
    vocab = write_tokenizer(tmp_path) + extra_vocab  # the model's rows may exceed the tokenizer
    write_config(tmp_path, vocab)
    return GrammarRows(str(tmp_path)), Tokenizer.from_file(
        str(tmp_path / "tokenizer.json")), vocab


def write_config(folder, vocab_size: int) -> None:
    """Llama 3 8B's config.json (shapes only) with the vocabulary the logits will have."""
    config = json.loads((REPO / "scripts/configs/llama3-8b/config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": vocab_size}))


def test_unpack_and_only_agree():
    words = 3
    allowed = unpack(_only([0, 31, 32, 70], words)[None], 80)  # [1, 80]
    assert allowed.shape == (1, 80)
    assert allowed[0].nonzero().flatten().tolist() == [0, 31, 32, 70]


def test_mask_touches_only_constrained_rows(tmp_path):
    grammars, _, vocab = rows_for(tmp_path)
    grammars.add("c", LLMatcher.grammar_from_regex("[0-9]+"), STOP_IDS)
    logits = torch.randn(3, vocab)
    before = logits.clone()
    grammars.mask(logits, ["u1", "c", "u2"])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    kept = logits[1].isfinite()
    assert 0 < kept.sum() < vocab // 2
    assert torch.equal(logits[1][kept], before[1][kept])
    assert not kept[vocab - 16:].any()  # ids past the tokenizer are never allowed


def test_greedy_through_the_mask_spells_the_regex_then_stops(tmp_path):
    grammars, tokenizer, vocab = rows_for(tmp_path)
    grammars.add("c", LLMatcher.grammar_from_regex("ab(ab)?"), STOP_IDS)
    generated = []
    for _ in range(10):
        logits = torch.zeros(1, vocab)
        grammars.mask(logits, ["c"])
        token = int(logits.argmax())
        grammars.advance(["c"], [token])
        if token in STOP_IDS:
            break
        generated.append(token)
    assert tokenizer.decode(generated) in ("ab", "abab")
    logits = torch.zeros(1, vocab)
    grammars.mask(logits, ["c"])
    assert logits[0].isfinite().nonzero().flatten().tolist() == STOP_IDS
    grammars.remove("c")
    assert len(grammars) == 0


def test_a_request_without_a_matcher_may_only_stop(tmp_path):
    write_config(tmp_path, 400)  # no tokenizer.json: the matcher cannot be built
    grammars = GrammarRows(str(tmp_path))
    grammars.add("c", LLMatcher.grammar_from_regex("[0-9]+"), STOP_IDS)
    logits = torch.randn(2, 400)
    grammars.mask(logits, ["u", "c"])
    assert logits[0].isfinite().all()
    assert logits[1].isfinite().nonzero().flatten().tolist() == STOP_IDS
    grammars.advance(["u", "c"], [5, STOP_IDS[0]])  # nothing to advance, nothing raised


def test_a_prepared_fill_masks_as_a_fill_in_series(tmp_path):
    """prepare() fills on its thread, mask() joins it: the same logits as a mask alone, step
    after step, with the matchers advanced between; a prepare for other ids is not used."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    prepared, _, vocab = rows_for(tmp_path / "a")
    serial, _, _ = rows_for(tmp_path / "b")
    for grammars in (prepared, serial):
        grammars.add("c1", LLMatcher.grammar_from_regex("[0-9]{3}"), STOP_IDS)
        grammars.add("c2", LLMatcher.grammar_from_lark('start: "yes" | "no"'), STOP_IDS)
    ids = ["u", "c1", "c2"]
    gen = torch.Generator().manual_seed(5)
    for step in range(4):
        logits = torch.randn(3, vocab, generator=gen)
        a, b = logits.clone(), logits.clone()
        prepared.prepare(ids)
        assert prepared._pending is not None
        prepared.mask(a, ids)
        assert prepared._pending is None  # joined and used
        serial.mask(b, ids)
        assert torch.equal(a, b), step
        tokens = a.argmax(dim=-1).tolist()
        prepared.advance(ids, tokens)
        serial.advance(ids, tokens)
    prepared.prepare(["c1"])  # another step's rows: mask fills anew for its own
    logits = torch.randn(3, vocab, generator=gen)
    a, b = logits.clone(), logits.clone()
    prepared.mask(a, ids)
    serial.mask(b, ids)
    assert torch.equal(a, b)


def test_prepare_without_constrained_rows_starts_nothing(tmp_path):
    grammars, _, vocab = rows_for(tmp_path)
    grammars.prepare(["u1", "u2"])
    assert grammars._pending is None and grammars._filler is None
    grammars.add("c", LLMatcher.grammar_from_regex("[0-9]+"), STOP_IDS)
    grammars.prepare(["u1"])
    assert grammars._pending is None
