"""The request fields that name token ids: `logit_bias` (OpenAI's) and `stop_token_ids` (vLLM's),
checked into sorted tuples, each refusal a 400 naming the field.

The ids' bound (the vocabulary) is the model's, checked in routes.py with check_vocabulary.
"""

from __future__ import annotations

import math

from lorad.daemon.errors import bad_request
from lorad.protocol.messages import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS

MAX_BIAS = 100.0
MAX_ID_DIGITS = 10  # beyond any vocabulary; keeps int() of a hostile key cheap


def parse_logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} -> ((id, bias), ...) sorted by id; null or {} is none."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise bad_request("logit_bias must be an object mapping token ids to biases",
                          "logit_bias", "invalid_type")
    if len(value) > MAX_LOGIT_BIAS:
        raise bad_request(f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got "
                          f"{len(value)}", "logit_bias")
    entries = {}
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit() and len(key) <= MAX_ID_DIGITS):
            raise bad_request(f"logit_bias keys must be token ids (non-negative integers as "
                              f"strings), got {key[:40]!r}", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise bad_request(f"logit_bias[{key!r}] must be a number", "logit_bias",
                              "invalid_type")
        if not (math.isfinite(bias) and -MAX_BIAS <= bias <= MAX_BIAS):
            raise bad_request(f"logit_bias[{key!r}] must be between -100 and 100, got "
                              f"{bias if abs(bias) < 1e30 else 'a number beyond that'}",
                              "logit_bias")
        token_id = int(key)
        if token_id in entries:  # "7" and "07"
            raise bad_request(f"logit_bias names token {token_id} twice", "logit_bias")
        entries[token_id] = float(bias)
    return tuple(sorted(entries.items()))


def parse_stop_token_ids(value: object) -> tuple[int, ...]:
    """vLLM's list of token ids that end the sequence -> the ids, each once, in order."""
    if value is None:
        return ()
    if not isinstance(value, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise bad_request("stop_token_ids must be a list of token ids", "stop_token_ids",
                          "invalid_type")
    if len(value) > MAX_STOP_TOKEN_IDS:
        raise bad_request(f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids",
                          "stop_token_ids")
    if any(t < 0 for t in value):
        raise bad_request("stop_token_ids must be non-negative", "stop_token_ids")
    return tuple(dict.fromkeys(value))


def check_vocabulary(logit_bias: tuple[tuple[int, float], ...], stop_token_ids: tuple[int, ...],
                     vocab_size: int) -> None:
    """A 400 naming the field (and logit_bias' key) for an id at or past the vocabulary."""
    for token_id, _ in logit_bias:
        if token_id >= vocab_size:
            raise bad_request(f"logit_bias key {str(token_id)!r} is outside the vocabulary "
                              f"(0..{vocab_size - 1})", "logit_bias")
    bad = next((t for t in stop_token_ids if t >= vocab_size), None)
    if bad is not None:
        raise bad_request(f"stop_token_ids holds {bad}, outside the vocabulary "
                          f"(0..{vocab_size - 1})", "stop_token_ids")
