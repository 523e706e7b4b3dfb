"""The sampling fields of both routes as the schemas read them: accepted values reach
SamplingOptions as given, absent ones are "off", and every value out of its range (or of the
wrong type) is a 400 naming the field."""

from __future__ import annotations

import pytest

from lorad.daemon.errors import ApiError
from lorad.daemon.schemas import parse_chat, parse_completion
from lorad.daemon.token_fields import check_vocabulary
from lorad.protocol.messages import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}
PARSERS = [(parse_completion, COMPLETION), (parse_chat, CHAT)]


@pytest.mark.parametrize("parse,base", PARSERS, ids=["completions", "chat"])
def test_absent_fields_are_off(parse, base):
    opts = parse(base).options
    assert (opts.presence_penalty, opts.frequency_penalty, opts.repetition_penalty,
            opts.min_p, opts.logit_bias, opts.stop_token_ids, opts.min_tokens) == \
        (0.0, 0.0, 1.0, 0.0, (), (), 0)
    nulls = {name: None for name in ("presence_penalty", "frequency_penalty", "min_p",
                                     "repetition_penalty", "logit_bias", "stop_token_ids",
                                     "min_tokens")}
    assert parse({**base, **nulls}).options == opts


@pytest.mark.parametrize("parse,base", PARSERS, ids=["completions", "chat"])
def test_accepted_values_arrive_as_given(parse, base):
    opts = parse({**base, "presence_penalty": -2, "frequency_penalty": 2.0,
                  "repetition_penalty": 0.01, "min_p": 1, "max_tokens": 9, "min_tokens": 9,
                  "logit_bias": {"50": -100, "7": 100, "12": 0.5},
                  "stop_token_ids": [5, 3, 5]}).options
    assert (opts.presence_penalty, opts.frequency_penalty, opts.repetition_penalty,
            opts.min_p, opts.min_tokens) == (-2.0, 2.0, 0.01, 1.0, 9)
    assert opts.logit_bias == ((7, 100.0), (12, 0.5), (50, -100.0))  # sorted by id
    assert opts.stop_token_ids == (5, 3)


@pytest.mark.parametrize("patch,param", [
    ({"presence_penalty": 2.01}, "presence_penalty"),
    ({"presence_penalty": "1"}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": 2.5}, "repetition_penalty"),
    ({"repetition_penalty": -1}, "repetition_penalty"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": True}, "min_p"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 1.5}, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"1.5": 1}}, "logit_bias"),
    ({"logit_bias": {"7": 101}}, "logit_bias"),
    ({"logit_bias": {"7": -100.5}}, "logit_bias"),
    ({"logit_bias": {"7": "1"}}, "logit_bias"),
    ({"logit_bias": {"7": None}}, "logit_bias"),
    ({"logit_bias": {"7": float("inf")}}, "logit_bias"),
    ({"logit_bias": {"7": 1, "07": 2}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias"),
    ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"stop_token_ids": [1, "2"]}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"stop_token_ids": [-3]}, "stop_token_ids"),
    ({"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))}, "stop_token_ids"),
    ({"min_tokens": 1, "regex": "[a-z]+"}, "min_tokens"),
])
@pytest.mark.parametrize("parse,base", PARSERS, ids=["completions", "chat"])
def test_out_of_range_values_name_the_field(parse, base, patch, param):
    with pytest.raises(ApiError) as exc:
        parse({**base, **patch})
    assert exc.value.status == 400, exc.value.message
    assert exc.value.param == param, exc.value.message
    assert len(exc.value.message) < 200


def test_ids_past_the_vocabulary_name_the_field_and_the_key():
    check_vocabulary(((0, 1.0), (399, -1.0)), (0, 399), 400)
    with pytest.raises(ApiError) as exc:
        check_vocabulary(((3, 1.0), (400, 1.0)), (), 400)
    assert exc.value.param == "logit_bias" and "'400'" in exc.value.message
    with pytest.raises(ApiError) as exc:
        check_vocabulary((), (3, 1000), 400)
    assert exc.value.param == "stop_token_ids" and "1000" in exc.value.message
