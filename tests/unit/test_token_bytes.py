"""token_bytes.py: every token's raw bytes, checked against the tokenizer's own decoding on the
tiny model's byte-level BPE, byte-fallback tokens, and a file it cannot read."""

from __future__ import annotations

import json

from tokenizers import Tokenizer, pre_tokenizers

from lorad.daemon.token_bytes import TokenBytes, byte_level_alphabet
from tests.tiny_models import write_tokenizer


def test_the_alphabet_is_the_tokenizers_one():
    alphabet = byte_level_alphabet()
    assert len(alphabet) == 256 and sorted(alphabet.values()) == list(range(256))
    assert set(alphabet) == set(pre_tokenizers.ByteLevel.alphabet())


def test_byte_level_tokens_decode_to_their_bytes(tmp_path):
    write_tokenizer(tmp_path)
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    table = TokenBytes.from_dir(tmp_path)
    num_checked = num_partial = 0
    for token_id in range(tokenizer.get_vocab_size()):
        raw = table(token_id)
        if raw is None:  # special tokens only
            assert tokenizer.id_to_token(token_id).startswith("<")
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            num_partial += 1
            continue
        assert tokenizer.decode([token_id]) == text
        num_checked += 1
    assert num_checked > 100 and num_partial > 0  # the alphabet's bytes 0x80.. alone


def test_byte_fallback_and_unreadable_files(tmp_path):
    body = {"model": {"type": "BPE", "vocab": {"<0x0A>": 0, "▁hi": 1, "<0xE2>": 2}},
            "decoder": {"type": "Sequence", "decoders": [{"type": "ByteFallback"}]}}
    (tmp_path / "tokenizer.json").write_text(json.dumps(body))
    table = TokenBytes.from_dir(tmp_path)
    assert (table(0), table(1), table(2)) == (b"\n", None, b"\xe2")
    assert TokenBytes.from_dir(tmp_path / "missing")(0) is None
