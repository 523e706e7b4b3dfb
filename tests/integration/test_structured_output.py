"""Structured output end to end on the demo model (SmolLM2-135M-Instruct with the uppercase and
pirate adapters): every constrained answer parses and validates (jsonschema) or matches its regex,
for each model id, greedy and seeded, streamed and not; a grammar that cannot finish within
max_tokens ends with `length`; bad constraints are 400s before any stream; and unconstrained
requests in a burst with the constrained ones give exactly their solo runs' text (one burst
serves the three checks)."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest

from tests.daemons import DEMO_ADAPTERS, DEMO_MODEL_ID, post, start_daemon

pytestmark = pytest.mark.slow

NAME = DEMO_MODEL_ID
ADAPTERS = DEMO_ADAPTERS
MODELS = (NAME, *ADAPTERS)
MAX_TOKENS = 160
# Bounded lengths and integer ranges: every document these allow fits in MAX_TOKENS.
SCHEMAS = {
    "person": {"type": "object", "additionalProperties": False, "required": ["name", "age"],
               "properties": {"name": {"type": "string", "maxLength": 24},
                              "age": {"type": "integer", "minimum": 0, "maximum": 120}}},
    "order": {"type": "object", "additionalProperties": False, "required": ["items", "paid"],
              "properties": {
                  "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
                      "type": "object", "additionalProperties": False,
                      "required": ["fruit", "count"],
                      "properties": {"fruit": {"enum": ["apple", "pear", "plum"]},
                                     "count": {"type": "integer", "minimum": 1, "maximum": 9}}}},
                  "paid": {"type": "boolean"}}},
    "answer": {"type": "object", "additionalProperties": False,
               "required": ["verdict", "score", "tags"],
               "properties": {"verdict": {"enum": ["yes", "no", "maybe"]},
                              "score": {"type": "integer", "minimum": -5, "maximum": 5},
                              "tags": {"type": "array", "maxItems": 2,
                                       "items": {"type": "string", "maxLength": 12}}}},
}
PROMPTS = {"person": "Describe a famous scientist.", "order": "I would like some fruit.",
           "answer": "Is the sea blue?"}
DATE = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
SAMPLINGS = ({"temperature": 0}, {"temperature": 0.9, "seed": 11})


@pytest.fixture(scope="module")
def demo_daemon(demo_model_dir):
    flags = [flag for name, path in ADAPTERS.items() for flag in ("--adapter", f"{name}={path}")]
    # Sequences and KV blocks for all 66 requests of the burst at once.
    daemon = start_daemon(demo_model_dir, "--name", NAME, "--max-model-len", "512",
                          "--kv-cache-blocks", "384", "--max-num-seqs", "80", *flags)
    yield daemon
    assert daemon.stop() == 0, daemon.log()[-4000:]


async def chat(client, stream: bool, **body) -> tuple[str, str]:
    """-> (text, finish_reason) of one chat request, streamed or not."""
    if not stream:
        out = await client.chat.completions.create(stream=False, **body)
        return out.choices[0].message.content, out.choices[0].finish_reason
    texts, finish = [], None
    async for chunk in await client.chat.completions.create(stream=True, **body):
        for choice in chunk.choices:
            texts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return "".join(texts), finish


def run_all(daemon, requests: list[dict]) -> list[tuple[str, str]]:
    async def go():
        async with openai.AsyncOpenAI(base_url=daemon.url + "/v1", api_key="unused",
                                      max_retries=0, timeout=600) as client:
            return await asyncio.gather(*(chat(client, **r) for r in requests))
    return asyncio.run(go())


def schema_request(model: str, name: str, sampling: dict, stream: bool) -> dict:
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name],
                                                   "strict": True}}
    return {"model": model, "stream": stream, "max_tokens": MAX_TOKENS, **sampling,
            "messages": [{"role": "user", "content": PROMPTS[name] + " Answer in JSON."}],
            "response_format": fmt}


# The module's one burst: its constrained requests, and plain ones (each to equal its solo run)
# spread among them.
SCHEMA_CASES = [(m, n, s, st) for m in MODELS for n in SCHEMAS for s in SAMPLINGS
                for st in (False, True)]
WHEN = {"max_tokens": MAX_TOKENS, "messages": [{"role": "user", "content": "When?"}]}
REGEX_AND_JSON = [{**WHEN, "model": m, "stream": st, **s, "extra_body": {"regex": DATE}}
                  for m in MODELS for s in SAMPLINGS for st in (False, True)]
REGEX_AND_JSON += [{**WHEN, "model": m, "stream": False, **s,
                    "response_format": {"type": "json_object"}}
                   for m in MODELS for s in SAMPLINGS]
PLAIN = [{"model": m, "stream": st, "max_tokens": 40, **s,
          "messages": [{"role": "user", "content": "Name three colours."}]}
         for m in MODELS for s in SAMPLINGS for st in (False, True)]


@pytest.fixture(scope="module")
def burst(demo_daemon) -> dict[str, list[tuple[str, str]]]:
    """Each plain request's solo run, then one burst of every request above -> {"schema",
    "regex_and_json", "plain", "solo"}: answers in the order of SCHEMA_CASES, REGEX_AND_JSON and
    PLAIN ("solo": each plain request's solo answer). The constrained requests are at once the
    answers checked and the load the plain requests must not notice: one burst for three tests."""
    # One solo run per model and sampling, not streamed: each plain request of the burst,
    # streamed or not, must give exactly its text.
    solo = [run_all(demo_daemon, [r])[0] for r in PLAIN[::2]]
    constrained = ([("schema", schema_request(*case)) for case in SCHEMA_CASES]
                   + [("regex_and_json", request) for request in REGEX_AND_JSON])
    every = len(constrained) // len(PLAIN)  # a plain request after every this many
    order = [x for i, plain in enumerate(PLAIN)
             for x in (*constrained[every * i:every * (i + 1)], ("plain", plain))]
    order += constrained[every * len(PLAIN):]
    answers = run_all(demo_daemon, [request for _, request in order])
    out = {"schema": [], "regex_and_json": [], "plain": [],
           "solo": [answer for answer in solo for _ in range(2)]}
    for (kind, _), answer in zip(order, answers):
        out[kind].append(answer)
    return out


def test_every_answer_validates_against_its_schema(burst):
    assert len(burst["schema"]) == len(SCHEMA_CASES)
    for (model, name, sampling, stream), (text, finish) in zip(SCHEMA_CASES, burst["schema"]):
        where = f"{model} {name} {sampling} stream={stream}: {text!r}"
        assert finish == "stop", where
        jsonschema.validate(json.loads(text), SCHEMAS[name])


def test_json_object_and_regex(burst):
    assert len(burst["regex_and_json"]) == len(REGEX_AND_JSON)
    for request, (text, finish) in zip(REGEX_AND_JSON, burst["regex_and_json"]):
        if "extra_body" in request:
            assert re.fullmatch(DATE, text) and finish == "stop", (request, text)
        elif finish == "stop":  # an open-ended object may run out of tokens; it must be a prefix
            assert isinstance(json.loads(text), dict), text
        else:
            assert finish == "length" and text.startswith("{"), text


def test_a_grammar_that_cannot_finish_ends_with_length(demo_daemon):
    request = {"model": "pirate", "max_tokens": 12, "stream": True, "temperature": 0,
               "messages": [{"role": "user", "content": "Spell a long word."}],
               "extra_body": {"grammar": "start: /[a-z]{300}/"}}
    [(text, finish)] = run_all(demo_daemon, [request])
    assert finish == "length" and re.fullmatch("[a-z]+", text), text


@pytest.mark.parametrize("patch,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objec"}}}}, "response_format.json_schema.schema"),
    ({"regex": "([0-9]"}, "regex"),
    ({"grammar": "start: missing_rule"}, "grammar"),
    ({"regex": "a", "grammar": 'start: "a"'}, "grammar"),
])
def test_bad_constraints_are_400s_before_a_stream(demo_daemon, patch, param):
    body = {"model": NAME, "stream": True, "messages": [{"role": "user", "content": "hi"}],
            **patch}
    status, answer = post(demo_daemon.url + "/v1/chat/completions", body)
    assert status == 400 and answer["error"]["param"] == param, answer


def test_unconstrained_requests_in_a_constrained_burst_equal_their_solo_runs(burst):
    assert burst["plain"] == burst["solo"]
