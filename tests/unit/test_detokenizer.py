"""Incremental detokenization against the reference: decoding all ids at once, with a real
byte-level BPE whose tokens split multi-byte characters. Stop strings are checked against a plain
search in that reference text."""

from __future__ import annotations

import random

import pytest

from lorad.daemon.detokenizer import IncrementalDetokenizer
from tests.tiny_models import train_tokenizer

TEXTS = [
    "Hello, world! How are you today?",
    "Café, naïve, résumé: 東京 and 日本語 😀👍🏽 ∑ ≠ ∞",
    "emoji 🧪🧬 in the middle 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 and ελληνικά и кириллица",
    "def add(a, b):\n    return a + b\n",
]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


def _decode(tokenizer):
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def _stream(tokenizer, ids, stop=(), chunk=1):
    detok = IncrementalDetokenizer(_decode(tokenizer), stop)
    deltas = []
    for i in range(0, len(ids), chunk):
        deltas.append(detok.add(ids[i:i + chunk]))
        if detok.stopped:
            break
    deltas.append(detok.finish())
    return deltas, detok


def test_tokens_do_split_characters(tokenizer):
    # Guard: the tests below only mean something if single tokens are partial characters.
    ids = tokenizer.encode(TEXTS[1]).ids
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_deltas_equal_full_decode_and_never_split_a_character(tokenizer, text, chunk):
    ids = tokenizer.encode(text).ids
    deltas, detok = _stream(tokenizer, ids, chunk=chunk)
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert detok.text == text
    assert not any("\ufffd" in d for d in deltas)


def test_random_ids_match_full_decode(tokenizer):
    rng = random.Random(0)
    vocab = tokenizer.get_vocab_size()
    for _ in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        deltas, _ = _stream(tokenizer, ids, chunk=rng.choice([1, 1, 2]))
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)


def test_special_tokens_are_skipped(tokenizer):
    im_start, im_end = tokenizer.token_to_id("<|im_start|>"), tokenizer.token_to_id("<|im_end|>")
    ids = [im_start] + tokenizer.encode("日本語 ok").ids + [im_end]
    deltas, _ = _stream(tokenizer, ids)
    assert "".join(deltas) == "日本語 ok"


def test_stop_string_spanning_tokens_is_held_back_and_not_returned(tokenizer):
    text = "The river runs through the old town, past the market"
    ids = tokenizer.encode(text).ids
    deltas, detok = _stream(tokenizer, ids, stop=["old town"])
    assert detok.stopped
    assert "".join(deltas) == "The river runs through the "
    assert all("old" not in d for d in deltas)


def test_earliest_stop_string_wins(tokenizer):
    ids = tokenizer.encode("alpha beta gamma delta").ids
    deltas, detok = _stream(tokenizer, ids, stop=["delta", "beta", "gamma"])
    assert detok.stopped and "".join(deltas) == "alpha "


def test_partial_stop_match_is_released_at_finish(tokenizer):
    ids = tokenizer.encode("the sea shore").ids
    deltas, detok = _stream(tokenizer, ids, stop=["shore line"])
    assert not detok.stopped
    assert "".join(deltas) == "the sea shore"
    assert not deltas[-2].endswith("shore")  # "shore" was held until finish()


def test_nothing_after_a_stop_is_released(tokenizer):
    detok = IncrementalDetokenizer(_decode(tokenizer), ["."])
    out = detok.add(tokenizer.encode("Hi. More").ids)
    assert detok.stopped and out == "Hi"
    assert detok.add(tokenizer.encode(" text").ids) == "" and detok.finish() == ""


@pytest.mark.parametrize("stop", ["本語", "😀", "é", "\n    return", "!"])
def test_stop_strings_against_reference(tokenizer, stop):
    for text in TEXTS:
        ids = tokenizer.encode(text).ids
        deltas, detok = _stream(tokenizer, ids, stop=[stop])
        cut = text.find(stop)
        assert "".join(deltas) == (text if cut < 0 else text[:cut])
        assert detok.stopped == (cut >= 0)
        assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_no_stop_strings_releases_as_the_search_for_one_that_never_matches(tokenizer, chunk):
    # Without stop strings _release skips the search; its deltas must be the searching path's.
    rng = random.Random(chunk)
    for text in TEXTS:
        ids = tokenizer.encode(text).ids
        noise = [rng.randrange(3, 384) for _ in range(40)]
        for sequence in (ids, noise, ids + noise):
            plain, _ = _stream(tokenizer, sequence, chunk=chunk)
            searched, detok = _stream(tokenizer, sequence, stop=["\x00never\x00"], chunk=chunk)
            assert plain == searched and not detok.stopped
            assert "".join(plain) == tokenizer.decode(sequence, skip_special_tokens=True)
