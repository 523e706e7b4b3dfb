"""Forced tool calls end to end on the demo model (SmolLM2-135M-Instruct with the uppercase and
pirate adapters), through the openai client: a named function's arguments and every call of a
"required" answer parse and validate (jsonschema) against the called tool's parameters, for each
model id, greedy and seeded, streamed and not, in one mixed burst with plain requests (which give
their solo runs' text); the stream's tool_calls deltas add up to the full answer's; max_tokens
cuts a call with "length"; calls validate at --parallel 2 too; bad tools, "auto" and a second
constraint are 400s before a stream; tools reach SmolLM2's template (which ignores them) and tool
turns render as transformers renders them."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from tests.daemons import DEMO_ADAPTERS, DEMO_MODEL_ID, post, start_daemon

pytestmark = pytest.mark.slow

NAME = DEMO_MODEL_ID
ADAPTERS = DEMO_ADAPTERS
MODELS = (NAME, *ADAPTERS)
MAX_TOKENS = 200
SAMPLINGS = ({"temperature": 0}, {"temperature": 0.9, "seed": 7})
# Bounded strings and integers, so every call these allow fits in MAX_TOKENS.
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 20},
                          "unit": {"enum": ["celsius", "fahrenheit"]}}}
BOOKING = {"type": "object", "additionalProperties": False, "required": ["party", "when"],
           "properties": {
               "party": {"type": "object", "additionalProperties": False,
                         "required": ["adults", "children"],
                         "properties": {"adults": {"type": "integer", "minimum": 1, "maximum": 12},
                                        "children": {"type": "integer", "minimum": 0,
                                                     "maximum": 6}}},
               "when": {"type": "object", "additionalProperties": False,
                        "required": ["day", "hour"],
                        "properties": {"day": {"enum": ["mon", "tue", "wed"]},
                                       "hour": {"type": "integer", "minimum": 11, "maximum": 22}}},
               "note": {"type": "string", "maxLength": 16}}}
PARAMETERS = {"get_weather": WEATHER, "book_table": BOOKING}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} tool",
                                           "parameters": schema, "strict": True}}
         for name, schema in PARAMETERS.items()]
PROMPT = [{"role": "user", "content": "Book a table for two on Tuesday at 7pm, and tell me the "
                                      "weather in Paris."}]


@pytest.fixture(scope="module")
def demo_daemon(demo_model_dir):
    flags = [flag for name, path in ADAPTERS.items() for flag in ("--adapter", f"{name}={path}")]
    daemon = start_daemon(demo_model_dir, "--name", NAME, "--max-model-len", "768",
                          "--kv-cache-blocks", "320", "--max-num-seqs", "64", *flags)
    yield daemon
    assert daemon.stop() == 0, daemon.log()[-4000:]


async def chat(client, stream: bool, **body) -> dict:
    """-> {"content", "tool_calls": [(id, name, arguments)], "finish"} of one request."""
    if not stream:
        out = (await client.chat.completions.create(stream=False, **body)).choices[0]
        calls = [(c.id, c.function.name, c.function.arguments)
                 for c in out.message.tool_calls or ()]
        return {"content": out.message.content, "tool_calls": calls, "finish": out.finish_reason}
    texts, calls, finish = [], {}, None
    async for chunk in await client.chat.completions.create(stream=True, **body):
        for choice in chunk.choices:
            texts.append(choice.delta.content or "")
            for call in choice.delta.tool_calls or ():
                if call.index not in calls:  # the first delta of a call names it
                    assert call.id.startswith("call_") and call.type == "function", call
                    calls[call.index] = [call.id, call.function.name, ""]
                else:
                    assert call.id is None and call.function.name is None, call
                calls[call.index][2] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    assert sorted(calls) == list(range(len(calls)))
    return {"content": "".join(texts) or None, "finish": finish,
            "tool_calls": [tuple(calls[i]) for i in sorted(calls)]}


def run_all(daemon, requests: list[dict]) -> list[dict]:
    async def go():
        async with openai.AsyncOpenAI(base_url=daemon.url + "/v1", api_key="unused",
                                      max_retries=0, timeout=900) as client:
            return await asyncio.gather(*(chat(client, **r) for r in requests))
    return asyncio.run(go())


def tool_request(model: str, choice, sampling: dict, stream: bool, **extra) -> dict:
    return {"model": model, "stream": stream, "max_tokens": MAX_TOKENS, **sampling,
            "messages": PROMPT, "tools": TOOLS, "tool_choice": choice, **extra}


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def without_ids(answer: dict) -> dict:
    return {**answer, "tool_calls": [call[1:] for call in answer["tool_calls"]]}


def check_calls(answer: dict, names: tuple[str, ...], where: str,
                finishes: tuple[str, ...] = ("tool_calls",)) -> None:
    assert answer["finish"] in finishes and answer["content"] is None, where
    assert answer["tool_calls"], where
    for call_id, name, arguments in answer["tool_calls"]:
        assert call_id.startswith("call_") and name in names, where
        jsonschema.validate(json.loads(arguments), PARAMETERS[name])


def test_forced_calls_validate_in_a_mixed_burst(demo_daemon):
    cases = [(m, choice, s, st) for m in MODELS for s in SAMPLINGS for st in (False, True)
             for choice in ("get_weather", "book_table", "required", "required_one")]
    requests = [tool_request(m, "required", s, st, parallel_tool_calls=False)
                if c == "required_one" else
                tool_request(m, "required" if c == "required" else named(c), s, st)
                for m, c, s, st in cases]
    plain = [{"model": m, "stream": st, "max_tokens": 24, **s, "messages": PROMPT}
             for m in MODELS for s in SAMPLINGS for st in (False, True)]
    # One solo run per model and sampling, not streamed: each plain request of the burst,
    # streamed or not, must give exactly its answer.
    solo = [run_all(demo_daemon, [r])[0] for r in plain[::2]]
    burst = run_all(demo_daemon, plain + requests)
    assert burst[:len(plain)] == [answer for answer in solo for _ in range(2)]
    answers = burst[len(plain):]
    num_length = 0
    for (model, choice, sampling, stream), answer in zip(cases, answers):
        where = f"{model} {choice} {sampling} stream={stream}: {answer}"
        if choice == "required":
            # Any number of calls: the demo model may repeat calls until max_tokens, and then
            # the calls completed before it are whole.
            check_calls(answer, tuple(PARAMETERS), where, ("tool_calls", "length"))
            num_length += answer["finish"] == "length"
        else:
            check_calls(answer, tuple(PARAMETERS) if choice == "required_one" else (choice,),
                        where)
            assert len(answer["tool_calls"]) == 1, where
    assert num_length < len(MODELS) * len(SAMPLINGS) * 2, "every unbounded answer ran out"
    # The same request streamed and not gives the same calls (greedy, and seeded).
    for i in range(0, len(cases), 8):
        for j in range(4):
            assert without_ids(answers[i + j]) == without_ids(answers[i + 4 + j]), cases[i + j]


def test_max_tokens_cuts_a_named_call_with_length(demo_daemon):
    requests = [tool_request(NAME, named("book_table"), {"temperature": 0}, st, max_tokens=6)
                for st in (False, True)]
    answers = run_all(demo_daemon, requests)
    assert without_ids(answers[0]) == without_ids(answers[1])
    [(_, name, arguments)] = answers[0]["tool_calls"]
    assert answers[0]["finish"] == "length" and name == "book_table"
    assert arguments.lstrip().startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(arguments)


BAD = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("patch,param", [
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [TOOLS[0], {"type": "function", "function": {"name": "a b"}}]},
     "tools[1].function.name"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
    ({"tools": [TOOLS[0], {"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "nope"}}}}}]},
     "tools[1].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "string"}}}]}, "tools[0].function.parameters"),
    ({"tools": [BAD], "tool_choice": named("g")}, "tool_choice.function.name"),
    ({"tools": [BAD], "tool_choice": "auto"}, "tool_choice"),
    ({"tools": [BAD]}, "tool_choice"),
    ({"tools": [BAD], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
    ({"tools": [BAD], "tool_choice": named("f"), "regex": "a"}, "regex"),
    ({"tools": [BAD], "tool_choice": "required", "stop": ["}"]}, "stop"),
])
def test_bad_tool_requests_are_400s_before_a_stream(demo_daemon, patch, param):
    body = {"model": "pirate", "stream": True, "messages": PROMPT, **patch}
    status, answer = post(demo_daemon.url + "/v1/chat/completions", body)
    assert status == 400 and answer["error"]["param"] == param, answer


def test_tools_reach_the_template_and_tool_turns_render(demo_daemon, demo_model_dir):
    """SmolLM2's template ignores tools and tool_calls: tool_choice "none" answers text from the
    same prompt as without tools; a conversation with a call and its result renders as
    transformers renders it (the assistant's null content as "")."""
    reference = AutoTokenizer.from_pretrained(demo_model_dir)
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather",
                         "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    turns = [*PROMPT, {"role": "assistant", "content": None, "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}]
    base = {"model": NAME, "max_tokens": 8, "temperature": 0}
    status, plain = post(demo_daemon.url + "/v1/chat/completions", {**base, "messages": PROMPT})
    assert status == 200, plain
    status, none = post(demo_daemon.url + "/v1/chat/completions",
                        {**base, "messages": PROMPT, "tools": TOOLS, "tool_choice": "none"})
    assert status == 200 and none["choices"][0]["message"] == plain["choices"][0]["message"]
    assert none["usage"] == plain["usage"]
    status, answer = post(demo_daemon.url + "/v1/chat/completions",
                          {**base, "messages": turns, "tools": TOOLS, "tool_choice": "none"})
    assert status == 200, answer
    expected = reference.apply_chat_template(
        [{**t, "content": t["content"] or ""} for t in turns], tools=TOOLS,
        add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert answer["usage"]["prompt_tokens"] == len(expected)


def test_forced_calls_validate_at_parallel_2(demo_model_dir):
    flags = [flag for name, path in ADAPTERS.items() for flag in ("--adapter", f"{name}={path}")]
    daemon = start_daemon(demo_model_dir, "--name", NAME, "--parallel", "2", "--max-model-len",
                          "768", "--kv-cache-blocks", "160", "--max-num-seqs", "16", *flags)
    try:
        cases = [(m, c, s, st) for m in MODELS for c, s, st in (
            ("book_table", SAMPLINGS[0], True), ("required_one", SAMPLINGS[1], False))]
        answers = run_all(daemon, [
            tool_request(m, "required", s, st, parallel_tool_calls=False)
            if c == "required_one" else tool_request(m, named(c), s, st)
            for m, c, s, st in cases])
    finally:
        assert daemon.stop() == 0, daemon.log()[-4000:]
    for (model, choice, sampling, stream), answer in zip(cases, answers):
        where = f"{model} {choice} {sampling} stream={stream}: {answer}"
        check_calls(answer, tuple(PARAMETERS) if choice == "required_one" else (choice,), where)
        assert len(answer["tool_calls"]) == 1, where
