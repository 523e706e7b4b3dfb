"""Each token's raw bytes, for the `bytes` of chat's log probabilities.

A token can hold part of a UTF-8 character, which decodes alone to U+FFFD; OpenAI's `bytes`
exist so that a client can join such tokens back into the character. Read from tokenizer.json
without `tokenizers`: the byte-level BPE vocabularies (GPT-2's alphabet, as SmolLM2's and Llama
3's) and byte-fallback tokens (`<0x0A>`) are mapped exactly; any other token gets None, and the
caller uses its decoded text's UTF-8.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable character standing for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):  # the others are shifted past 255, in byte order
        if b not in chars:
            chars[b] = chr(256 + shifted)
            shifted += 1
    return {c: b for b, c in chars.items()}


class TokenBytes:
    def __init__(self, bytes_by_id: dict[int, bytes]) -> None:
        self._bytes = bytes_by_id  # only the tokens whose bytes are known exactly

    def __call__(self, token_id: int) -> bytes | None:
        return self._bytes.get(token_id)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "TokenBytes":
        """An empty table (every token falls back to its text) for a file it cannot read."""
        try:
            raw = json.loads((Path(model_dir) / "tokenizer.json").read_text(encoding="utf-8"))
            vocab = raw["model"]["vocab"]
            byte_level = _uses_byte_level(raw.get("decoder"))
        except (OSError, ValueError, KeyError, TypeError):
            return cls({})
        if not isinstance(vocab, dict):
            return cls({})
        special = {t.get("id") for t in raw.get("added_tokens") or () if isinstance(t, dict)}
        alphabet = byte_level_alphabet() if byte_level else {}
        table = {}
        for token, token_id in vocab.items():
            if token_id in special or not isinstance(token, str):
                continue
            found = _token_bytes(token, alphabet)
            if found is not None:
                table[token_id] = found
        return cls(table)


def _uses_byte_level(decoder: object) -> bool:
    if not isinstance(decoder, dict):
        return False
    if decoder.get("type") == "Sequence":
        return any(_uses_byte_level(d) for d in decoder.get("decoders") or ())
    return decoder.get("type") == "ByteLevel"


def _token_bytes(token: str, alphabet: dict[str, int]) -> bytes | None:
    fallback = _BYTE_FALLBACK.fullmatch(token)
    if fallback:
        return bytes([int(fallback.group(1), 16)])
    if alphabet and all(c in alphabet for c in token):
        return bytes(alphabet[c] for c in token)
    return None
