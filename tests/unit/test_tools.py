"""Chat's tools on the coordinator: definitions and tool_choice checked into the template's tools
and the constraint (the "required" schema checked with jsonschema, the reference validator, on
valid and invalid call lists), every refusal a 400 naming the field path; messages with tool
calls and tool turns; the call splitter and the tool_calls shapes, whose stream adds up to the
full answer."""

from __future__ import annotations

import json

import jsonschema
import pytest

from lorad.daemon.errors import ApiError
from lorad.daemon.responses import FullChoice
from lorad.daemon.schemas import parse_chat
from lorad.daemon.tool_calls import CallSplitter, ToolCallFormat
from lorad.daemon.tools import NO_PARAMETERS, ToolChoice

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
POINT = {"type": "object", "additionalProperties": False, "required": ["x", "y"],
         "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}}
TOOLS = [{"type": "function", "function": {"name": "move", "description": "Move to a point.",
                                           "parameters": POINT, "strict": True}},
         {"type": "function", "function": {"name": "stop-now"}}]


def refused(patch: dict, param: str, text: str = "") -> None:
    with pytest.raises(ApiError) as exc:
        parse_chat({**CHAT, **patch})
    assert exc.value.status == 400 and exc.value.param == param, exc.value.message
    assert text in exc.value.message, exc.value.message


def schema_of(grammar: str) -> dict:
    """The JSON schema an llguidance grammar (its JSON form) was built from."""
    return json.loads(grammar)["grammars"][0]["json_schema"]


def test_a_named_function_constrains_to_its_parameters():
    req = parse_chat({**CHAT, "tools": TOOLS, "tool_choice": {"type": "function",
                                                              "function": {"name": "move"}}})
    assert req.tool_choice == ToolChoice("move")
    assert req.constraint.where == "tools[0].function.parameters"
    schema = schema_of(req.constraint.grammar)
    assert {k: v for k, v in schema.items() if k != "x-guidance"} == POINT
    # The template sees the definitions in Hugging Face's shape; no parameters means none.
    assert req.tools == [
        {"type": "function", "function": {"name": "move", "description": "Move to a point.",
                                          "parameters": POINT}},
        {"type": "function", "function": {"name": "stop-now", "parameters": NO_PARAMETERS}}]


@pytest.mark.parametrize("parallel,limit", [(None, None), (True, None), (False, 1)])
def test_required_is_an_array_of_calls_to_the_tools(parallel, limit):
    req = parse_chat({**CHAT, "tools": TOOLS, "tool_choice": "required",
                      "parallel_tool_calls": parallel})
    assert req.tool_choice == ToolChoice(None, limit) and req.constraint.where == "tools"
    schema = schema_of(req.constraint.grammar)
    good = [{"name": "move", "arguments": {"x": 1, "y": 2}}, {"name": "stop-now", "arguments": {}}]
    jsonschema.validate(good[:1], schema)
    for calls in ([], [{"name": "move", "arguments": {"x": 1}}],
                  [{"name": "jump", "arguments": {}}],
                  [{"name": "stop-now", "arguments": {"a": 1}}],
                  [{"name": "move", "arguments": {"x": 1, "y": 2}, "extra": 0}],
                  {"name": "move", "arguments": {"x": 1, "y": 2}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(calls, schema)
    if limit is None:
        jsonschema.validate(good, schema)
    else:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(good, schema)


def test_none_shows_the_tools_and_constrains_nothing():
    req = parse_chat({**CHAT, "tools": TOOLS, "tool_choice": "none",
                      "response_format": {"type": "json_object"}})
    assert req.tool_choice is None and req.tools[0]["function"]["name"] == "move"
    assert req.constraint.where == "response_format"
    assert parse_chat({**CHAT, "tool_choice": "none"}).tools is None


NAMED = {"type": "function", "function": {"name": "move"}}


@pytest.mark.parametrize("patch,param,text", [
    ({"tools": {"move": {}}}, "tools", "must be a list"),
    ({"tools": ["move"]}, "tools[0]", "must be an object"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type", "code_interpreter"),
    ({"tools": [{"type": "function", "function": "move"}]}, "tools[0].function", "object"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name", "None"),
    ({"tools": [TOOLS[0], {"type": "function", "function": {"name": "a.b"}}]},
     "tools[1].function.name", "'a.b'"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]},
     "tools[0].function.name", "64"),
    ({"tools": [TOOLS[1], TOOLS[0], TOOLS[1]]}, "tools[2].function.name", "unique"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": 3}}]},
     "tools[0].function.description", "string"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": "\ud800"}}]},
     "tools[0].function.description", "surrogate"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]},
     "tools[0].function.strict", "boolean"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
     "tools[0].function.parameters", "JSON Schema object"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "array"}}}]}, "tools[0].function.parameters", "describe an object"),
    ({"tools": [TOOLS[1], {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}], "tool_choice": "none"},
     "tools[1].function.parameters", "nowhere"),
    ({"tools": TOOLS}, "tool_choice", '"auto"'),
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "not supported"),
    ({"tool_choice": "auto"}, "tool_choice", "not supported"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": "any"}, "tool_choice", "'any'"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": 3}}},
     "tool_choice.function.name", "string"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "jump"}}},
     "tool_choice.function.name", "none of the tools"),
    ({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": "no"},
     "parallel_tool_calls", "boolean"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "one"),
    ({"tools": TOOLS, "tool_choice": NAMED, "grammar": 'start: "a"'}, "grammar", "move"),
    ({"tools": TOOLS, "tool_choice": NAMED, "regex": "a"}, "regex", "one"),
    ({"tools": TOOLS, "tool_choice": "required", "ignore_eos": True}, "ignore_eos", ""),
    ({"tools": TOOLS, "tool_choice": NAMED, "stop": "}"}, "stop", "cut"),
])
def test_bad_tools_are_400s_naming_the_field(patch, param, text):
    refused(patch, param, text)


def test_messages_with_tool_calls_and_tool_turns():
    call = {"id": "call_7", "type": "function",
            "function": {"name": "move", "arguments": '{"x": 1, "y": 2}'}}
    req = parse_chat({**CHAT, "messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_7", "content": [{"type": "text", "text": "ok"}]},
        {"role": "assistant", "content": "done", "tool_calls": []}]})
    assert req.messages[1:] == [
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "call_7", "type": "function",
                         "function": {"name": "move", "arguments": {"x": 1, "y": 2}}}]},
        {"role": "tool", "tool_call_id": "call_7", "content": "ok"},
        {"role": "assistant", "content": "done"}]


CALL = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize("messages,param", [
    ([{"role": "assistant", "content": None, "tool_calls": {}}], "messages[0].tool_calls"),
    ([{"role": "assistant", "tool_calls": [{"type": "web"}]}], "messages[0].tool_calls[0]"),
    ([{"role": "assistant", "tool_calls": [{**CALL, "id": 5}]}], "messages[0].tool_calls[0]"),
    ([{"role": "assistant", "tool_calls": [{**CALL, "function": {"arguments": "{}"}}]}],
     "messages[0].tool_calls[0].function.name"),
    ([{"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f",
                                                                 "arguments": "{x"}}]}],
     "messages[0].tool_calls[0].function.arguments"),
    ([{"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f",
                                                                 "arguments": {}}}]}],
     "messages[0].tool_calls[0].function.arguments"),
    ([{"role": "assistant", "tool_calls": [{**CALL, "id": "\udfff"}]}],
     "messages[0].tool_calls[0].id"),
    ([{"role": "tool", "tool_call_id": 3, "content": "x"}], "messages[0].tool_call_id"),
    ([{"role": "assistant", "tool_calls": [CALL]},
      {"role": "tool", "tool_call_id": "other", "content": "x"}], "messages[1].tool_call_id"),
    ([{"role": "tool", "tool_call_id": "c", "content": "x"},
      {"role": "assistant", "tool_calls": [CALL]}], "messages[0].tool_call_id"),
    ([{"role": "assistant", "tool_calls": [CALL]},
      {"role": "tool", "tool_call_id": "c", "content": None}], "messages[1].content"),
])
def test_bad_tool_messages_are_400s(messages, param):
    refused({"messages": messages}, param)


REQUIRED_TEXT = ('[ {"name": "move", "arguments": {"x": 1, "y": -2}},\n{"name": "say", '
                 '"arguments": {"text": "a } ] , [ { \\" \\u00e9 é"}} ,{"name": "stop-now", '
                 '"arguments": {}}]')


@pytest.mark.parametrize("piece", [1, 3, 7, len(REQUIRED_TEXT)])
def test_the_splitter_finds_each_call_as_it_closes(piece):
    splitter, calls, seen_at = CallSplitter(), [], []
    for start in range(0, len(REQUIRED_TEXT), piece):
        found = splitter.add(REQUIRED_TEXT[start:start + piece])
        calls += found
        seen_at += [start + piece] * len(found)
    expected = [(c["name"], json.dumps(c["arguments"], ensure_ascii=False))
                for c in json.loads(REQUIRED_TEXT)]
    assert calls == expected
    # Each call is reported in the piece that closes its object, not later.
    closes = [REQUIRED_TEXT.index(end) + len(end) for end in ('-2}}', 'é"}}', '{}}')]
    assert [min(at, len(REQUIRED_TEXT)) for at in seen_at] == [
        min(-(-c // piece) * piece, len(REQUIRED_TEXT)) for c in closes]


def _stream(fmt: ToolCallFormat, pieces: list[str], finish: str) -> dict:
    """The stream's chunks folded into a message, as a client folds them."""
    chunks = [fmt.opening_chunk(5)] + [fmt.chunk(p, None, 5, i + 1) for i, p in enumerate(pieces)]
    chunks.append(fmt.chunk("", finish, 5, len(pieces) + 1))
    calls, reason = {}, None
    for chunk in (c for c in chunks if c is not None):
        [choice] = chunk["choices"]
        assert choice["delta"].get("content") is None
        for call in choice["delta"].get("tool_calls", ()):
            if call["index"] not in calls:
                calls[call["index"]] = {k: v for k, v in call.items() if k != "index"}
            else:
                assert set(call) == {"index", "function"}
                calls[call["index"]]["function"]["arguments"] += call["function"]["arguments"]
        reason = choice["finish_reason"] or reason
    return {"tool_calls": [calls[i] for i in sorted(calls)], "finish_reason": reason}


@pytest.mark.parametrize("choice,text,finish,expected", [
    (ToolChoice("move"), ' {"x": 1, "y": 2}', "stop", "tool_calls"),
    (ToolChoice("move"), '{"x": 1, "y"', "length", "length"),
    (ToolChoice(None), REQUIRED_TEXT, "stop", "tool_calls"),
    (ToolChoice(None), REQUIRED_TEXT[:-8], "length", "length"),
])
def test_streamed_tool_calls_add_up_to_the_full_answer(choice, text, finish, expected):
    full = ToolCallFormat("chatcmpl-1", "m", choice).full([FullChoice(0, text, finish)], 5, 9)
    [answer] = full["choices"]
    assert answer["finish_reason"] == expected and answer["message"]["content"] is None
    calls = answer["message"].get("tool_calls", [])
    if choice.function is not None:
        assert [c["function"] for c in calls] == [{"name": "move", "arguments": text}]
    else:
        num_whole = 3 if finish == "stop" else 2  # the cut one is left out
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] \
            == [(c["name"], c["arguments"]) for c in json.loads(REQUIRED_TEXT)][:num_whole]
    assert all(c["id"].startswith("call_") and len(c["id"]) == 29 and c["type"] == "function"
               for c in calls)
    assert len({c["id"] for c in calls}) == len(calls)
    pieces = [text[i:i + 4] for i in range(0, len(text), 4)]
    streamed = _stream(ToolCallFormat("chatcmpl-1", "m", choice), pieces, finish)
    assert streamed["finish_reason"] == expected
    assert [c["function"] for c in streamed["tool_calls"]] == [c["function"] for c in calls]


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_without_a_call_does_not_say_tool_calls(stream):
    # A leader that cannot build the matcher ends the answer at once with "stop" and no text.
    fmt = ToolCallFormat("chatcmpl-1", "m", ToolChoice(None))
    if stream:
        fmt.opening_chunk(3)
        [choice] = fmt.chunk("", "stop", 3, 1)["choices"]
    else:
        [choice] = fmt.full([FullChoice(0, "", "stop")], 3, 1)["choices"]
        assert choice["message"] == {"role": "assistant", "content": None}
    assert choice["finish_reason"] == "stop"


def test_a_required_stream_sends_nothing_until_a_call_closes():
    fmt = ToolCallFormat("chatcmpl-1", "m", ToolChoice(None))
    assert fmt.opening_chunk(3)["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert fmt.chunk('[{"name": "move", "argu', None, 3, 4) is None
    usage_fmt = ToolCallFormat("chatcmpl-1", "m", ToolChoice(None), include_usage=True,
                               continuous_usage=True)
    chunk = usage_fmt.chunk('[{"name"', None, 3, 4)
    assert chunk["choices"][0]["delta"] == {} and chunk["usage"]["completion_tokens"] == 4
