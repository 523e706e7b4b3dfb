"""OpenAI request validation: accepted shapes become the right dataclasses, and every refusal is a
400 ApiError naming the offending field (never a crash on odd JSON)."""

from __future__ import annotations

import pytest

from lorad.daemon.errors import ApiError
from lorad.daemon.schemas import parse_chat, parse_completion

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}


def test_completion_defaults():
    req = parse_completion(COMPLETION)
    assert req.model == "m" and req.prompt == "hi"
    opts = req.options
    assert opts.max_tokens is None and opts.seed is None and opts.stop == ()
    assert (opts.temperature, opts.top_p, opts.top_k) == (1.0, 1.0, 0)
    assert not opts.stream and not opts.include_usage and not opts.ignore_eos
    assert not opts.continuous_usage and not opts.return_token_ids


def test_completion_fields():
    req = parse_completion({**COMPLETION, "prompt": [1, 2, 3], "max_tokens": 7, "temperature": 0,
                            "top_p": 0.5, "top_k": -1, "seed": -5, "stop": "\n", "n": 1,
                            "stream": True, "stream_options": {"include_usage": True},
                            "ignore_eos": True, "user": "x", "some_future_field": {"a": 1}})
    opts = req.options
    assert req.prompt == [1, 2, 3]
    assert (opts.max_tokens, opts.temperature, opts.top_p, opts.top_k) == (7, 0.0, 0.5, 0)
    assert opts.seed == -5 and opts.stop == ("\n",) and opts.stream and opts.include_usage
    assert opts.ignore_eos and not opts.continuous_usage


def test_continuous_usage_stats_is_read_from_stream_options():
    req = parse_completion({**COMPLETION, "stream": True, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}})
    assert req.options.include_usage and req.options.continuous_usage


def test_one_element_prompt_batches_are_unwrapped():
    assert parse_completion({**COMPLETION, "prompt": ["abc"]}).prompt == "abc"
    assert parse_completion({**COMPLETION, "prompt": [[5, 6]]}).prompt == [5, 6]


def test_prompt_lists_keep_their_order():
    req = parse_completion({**COMPLETION, "prompt": ["a", [5, 6], "c"]})
    assert req.prompts == ("a", [5, 6], "c")
    assert len(parse_completion({**COMPLETION, "prompt": ["x"] * 64}).prompts) == 64
    with pytest.raises(ValueError):
        req.prompt  # noqa: B018 - a request of several prompts has no single one


def test_n_choices_and_best_of_equal_to_n():
    assert parse_completion({**COMPLETION, "n": 16, "best_of": 16}).options.n == 16
    assert parse_completion({**COMPLETION, "n": 3}).options.n == 3
    assert parse_chat({**CHAT, "n": 4}).options.n == 4


def test_echo_allows_max_tokens_0_with_a_prompt_list_and_n_1():
    req = parse_completion({**COMPLETION, "prompt": ["a", [5, 6]], "echo": True, "max_tokens": 0,
                            "logprobs": 2, "n": 1})
    assert req.echo and req.prompts == ("a", [5, 6])
    assert req.options.max_tokens == 0 and req.options.min_tokens == 0


def test_chat_messages_and_text_parts():
    req = parse_chat({"model": "m", "max_completion_tokens": 3, "messages": [
        {"role": "system", "content": "be brief", "name": "ignored"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "ok"}]})
    assert req.messages == [{"role": "system", "content": "be brief"},
                            {"role": "user", "content": "a\nb"},
                            {"role": "assistant", "content": "ok"}]
    assert req.options.max_tokens == 3


def test_chat_max_tokens_spellings_must_agree():
    assert parse_chat({**CHAT, "max_tokens": 4, "max_completion_tokens": 4}).options.max_tokens == 4
    assert parse_chat({**CHAT, "max_tokens": 4}).options.max_tokens == 4
    _refused(parse_chat, {**CHAT, "max_tokens": 4, "max_completion_tokens": 5},
             "max_completion_tokens")


def _refused(parse, body, param):
    with pytest.raises(ApiError) as exc:
        parse(body)
    assert exc.value.status == 400, exc.value.message
    assert exc.value.param == param, exc.value.message
    assert exc.value.body()["error"]["type"] == "invalid_request_error"
    return exc.value


@pytest.mark.parametrize("patch,param", [
    ({"model": 3}, "model"),
    ({"model": None}, "model"),
    ({"prompt": None}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [1, True]}, "prompt"),
    ({"prompt": ["a"] * 65}, "prompt"),
    ({"prompt": ["a", []]}, "prompt"),
    ({"prompt": ["a", [1, True]]}, "prompt"),
    ({"prompt": ["a", "b\ud800"]}, "prompt"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": 2.0}, "max_tokens"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": False}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"seed": 2**64}, "seed"),
    ({"seed": "1"}, "seed"),
    ({"stop": 5}, "stop"),
    ({"stop": ["a", 1]}, "stop"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"n": 17}, "n"),
    ({"n": 0}, "n"),
    ({"n": 2, "best_of": 3}, "best_of"),
    ({"n": True}, "n"),
    ({"best_of": 3}, "best_of"),
    ({"echo": "yes"}, "echo"),
    ({"echo": 1}, "echo"),
    ({"echo": True, "max_tokens": -1}, "max_tokens"),
    ({"echo": False, "max_tokens": 0}, "max_tokens"),
    ({"echo": True, "n": 2}, "n"),
    ({"echo": True, "max_tokens": 0, "min_tokens": 1}, "min_tokens"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"logprobs": 1.5}, "logprobs"),
    ({"suffix": "x"}, "suffix"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({"stream": True, "stream_options": []}, "stream_options"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": "yes"}},
     "stream_options.continuous_usage_stats"),
    ({"ignore_eos": "true"}, "ignore_eos"),
    ({"return_token_ids": "true"}, "return_token_ids"),
    ({"return_token_ids": 1}, "return_token_ids"),
    ({"return_token_ids": [True]}, "return_token_ids"),
])
def test_completion_refusals(patch, param):
    _refused(parse_completion, {**COMPLETION, **patch}, param)


@pytest.mark.parametrize("messages,param", [
    (None, "messages"),
    ([], "messages"),
    ("hi", "messages"),
    (["hi"], "messages[0]"),
    ([{"role": "tool", "content": "x"}], "messages[0].tool_call_id"),
    ([{"role": "developer", "content": "x"}], "messages[0].role"),
    ([{"content": "x"}], "messages[0].role"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "assistant", "content": None}], "messages[0].content"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
     "messages[0].content[0]"),
    ([{"role": "user", "content": [{"type": "text", "text": 3}]}], "messages[0].content[0].text"),
    ([{"role": "user", "content": "ok"}, {"role": "bot", "content": "x"}], "messages[1].role"),
])
def test_chat_message_refusals(messages, param):
    _refused(parse_chat, {"model": "m", "messages": messages}, param)


@pytest.mark.parametrize("patch,param", [
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"n": 17}, "n"),
])
def test_chat_unsupported_features_are_refused_not_ignored(patch, param):
    _refused(parse_chat, {**CHAT, **patch}, param)


def test_draft_on_both_routes():
    assert parse_completion(COMPLETION).options.draft
    assert not parse_completion({**COMPLETION, "draft": False}).options.draft
    assert parse_chat({**CHAT, "draft": True}).options.draft
    _refused(parse_chat, {**CHAT, "draft": "no"}, "draft")
    _refused(parse_completion, {**COMPLETION, "draft": 0}, "draft")


def test_return_token_ids_on_both_routes():
    assert parse_completion({**COMPLETION, "return_token_ids": True}).options.return_token_ids
    assert parse_chat({**CHAT, "return_token_ids": True}).options.return_token_ids
    assert not parse_chat({**CHAT, "return_token_ids": None}).options.return_token_ids
    assert not parse_chat({**CHAT, "return_token_ids": False}).options.return_token_ids
    _refused(parse_chat, {**CHAT, "return_token_ids": 0}, "return_token_ids")


@pytest.mark.parametrize("patch,param", [
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": False, "top_logprobs": 0}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"logprobs": 1}, "logprobs"),
    ({"logprobs": "true"}, "logprobs"),
])
def test_chat_logprobs_refusals(patch, param):
    _refused(parse_chat, {**CHAT, **patch}, param)


@pytest.mark.parametrize("patch,expected", [
    ({}, None), ({"logprobs": None}, None), ({"logprobs": False}, None),
    ({"logprobs": True}, 0), ({"logprobs": True, "top_logprobs": 0}, 0),
    ({"logprobs": True, "top_logprobs": 20}, 20), ({"logprobs": True, "top_logprobs": None}, 0),
])
def test_chat_logprobs_give_the_number_of_alternatives(patch, expected):
    assert parse_chat({**CHAT, **patch}).options.num_logprobs == expected


@pytest.mark.parametrize("value", [None, 0, 5, 20])
def test_completion_logprobs_give_the_number_of_alternatives(value):
    assert parse_completion({**COMPLETION, "logprobs": value}).options.num_logprobs == value


def test_off_values_of_unsupported_features_are_accepted():
    parse_chat({**CHAT, "logprobs": False, "tools": [], "tool_choice": "none",
                "response_format": {"type": "text"}, "presence_penalty": 0,
                "frequency_penalty": 0.0, "logit_bias": {}})
    parse_completion({**COMPLETION, "echo": False, "logprobs": None, "best_of": 1, "suffix": ""})


@pytest.mark.parametrize("body", [None, [], "text", 3])
def test_body_must_be_an_object(body):
    with pytest.raises(ApiError) as exc:
        parse_chat(body)
    assert exc.value.status == 400 and exc.value.code == "invalid_json"


@pytest.mark.parametrize("patch,param", [
    ({"max_tokens": 10**400}, "max_tokens"),
    ({"top_k": 2**63}, "top_k"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"n": 10**400}, "n"),
    ({"best_of": 10**400}, "best_of"),
    ({"temperature": float("inf")}, "temperature"),  # what json reads 1e400 as
    ({"top_p": float("-inf")}, "top_p"),
    ({"temperature": 10**400}, "temperature"),
    ({"max_tokens": 1e308}, "max_tokens"),
    ({"prompt": "a\ud800b"}, "prompt"),
])
def test_out_of_range_numbers_and_lone_surrogates_name_the_field(patch, param):
    _refused(parse_completion, {**COMPLETION, **patch}, param)


def test_lone_surrogates_in_chat_name_the_part():
    _refused(parse_chat, {"model": "m", "messages": [{"role": "user", "content": "\udc00"}]},
             "messages[0].content")
    _refused(parse_chat, {"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "x\ud800"}]}]},
        "messages[0].content[0].text")


def test_huge_numbers_are_not_echoed_in_full():
    with pytest.raises(ApiError) as exc:
        parse_completion({**COMPLETION, "seed": 10**400})
    assert "an integer of 401 digits" in exc.value.message and len(exc.value.message) < 200
