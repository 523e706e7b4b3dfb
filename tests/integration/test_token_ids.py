"""`return_token_ids` through the HTTP API on the tiny random Llama with adapters a and b, at
--parallel 1 and 2: each choice's ids equal a transformers (peft) greedy loop's, on both routes,
streamed (each chunk its new ids, held-back text's ids with the finishing chunk) and not; with n
and prompt lists each choice carries its own (equal to its solo run's); echo returns the
generated ids only; the stop token is counted and returned; a non-boolean is a 400."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from lorad.daemon.tokenizer import ModelTokenizer
from tests.daemons import post
from tests.integration.test_logprobs import (  # noqa: F401 (fixtures)
    CHAT, PROMPT, reference_greedy, references, served, stream)

NUM_TOKENS = 8
EOS = 2  # the tiny tokenizer's <|im_end|>
ROUTES = {"completions": ("/v1/completions", {"prompt": PROMPT}),
          "chat": ("/v1/chat/completions", {"messages": CHAT})}


def request(served, route: str, **fields) -> tuple[str, dict]:
    path, prompt = ROUTES[route]
    return f"{served.url}{path}", {"return_token_ids": True, **prompt, **fields}


def text_of(route: str, choice: dict) -> str:
    return choice["text"] if route == "completions" else choice["message"]["content"]


def streamed_ids(chunks: list[dict]) -> dict[int, list[int]]:
    """choice index -> its ids, the stream's chunks' concatenated; every choice chunk has them."""
    ids: dict[int, list[int]] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            ids.setdefault(choice["index"], []).extend(choice["token_ids"])
    return ids


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("model", ["tiny", "a", "b"])
def test_ids_equal_transformers_greedy_streamed_and_not(served, references, tiny_model, route,
                                                        model):
    tokenizer = ModelTokenizer.from_dir(tiny_model)
    prompt = PROMPT if route == "completions" else tokenizer.encode_chat(CHAT)
    expected, _ = reference_greedy(references[model], prompt, NUM_TOKENS)
    url, body = request(served, route, model=model, max_tokens=NUM_TOKENS, temperature=0,
                        ignore_eos=True)
    code, reply = post(url, body)
    assert code == 200, reply
    [choice] = reply["choices"]
    assert list(choice)[-1] == "token_ids" and choice["token_ids"] == expected
    assert reply["usage"]["completion_tokens"] == len(expected)
    assert text_of(route, choice) == tokenizer.decode(expected)
    assert streamed_ids(stream(url, body)) == {0: expected}
    # Per-chunk usage sends a chunk every step: each carries that step's one id.
    chunks = stream(url, {**body, "stream_options": {"include_usage": True,
                                                     "continuous_usage_stats": True}})
    per_step = [c["choices"][0]["token_ids"] for c in chunks if c["choices"]]
    assert per_step == [[]] + [[i] for i in expected]  # the opening chunk first
    assert chunks[-1]["choices"] == [] and "token_ids" not in chunks[-1]


def test_held_back_ids_arrive_with_the_finishing_chunk(served, tiny_model):
    """A lone UTF-8 lead byte at every step: no text is released before the end, so the
    opening chunk and the finishing one are the whole stream, and the latter has every id."""
    lead = Tokenizer.from_file(str(tiny_model / "tokenizer.json")).token_to_id("æ")  # 0xE6
    url, body = request(served, "completions", model="a", max_tokens=5, temperature=0,
                        ignore_eos=True, logit_bias={str(lead): 100})
    code, reply = post(url, body)
    assert code == 200 and reply["choices"][0]["token_ids"] == [lead] * 5, reply
    chunks = [c["choices"][0] for c in stream(url, body)]
    assert [(c["text"], c["token_ids"], c["finish_reason"]) for c in chunks] == [
        ("", [], None), (reply["choices"][0]["text"], [lead] * 5, "length")]


@pytest.mark.parametrize("stream_it", [False, True], ids=["whole", "streamed"])
def test_n_and_prompt_lists_give_each_choice_its_own_ids(served, tiny_model, stream_it):
    tokenizer = ModelTokenizer.from_dir(tiny_model)
    prompts = [PROMPT, PROMPT[:3]]
    url, body = request(served, "completions", model="b", prompt=prompts, n=2, max_tokens=6,
                        temperature=1.0, seed=40, ignore_eos=True, logprobs=0)
    solo = {}
    for i, prompt in enumerate(prompts):
        for j in range(2):
            code, reply = post(url, {**body, "prompt": prompt, "n": 1, "seed": 40 + j})
            assert code == 200, reply
            solo[i * 2 + j] = reply["choices"][0]["token_ids"]
    assert len({tuple(ids) for ids in solo.values()}) == 4  # four different answers
    if stream_it:
        got = streamed_ids(stream(url, body))
    else:
        code, reply = post(url, body)
        assert code == 200, reply
        got = {c["index"]: c["token_ids"] for c in reply["choices"]}
        for choice in reply["choices"]:  # the ids are what logprobs and the text are made of
            ids = choice["token_ids"]
            assert choice["logprobs"]["tokens"] == [tokenizer.decode([i]) for i in ids]
            assert choice["text"] == tokenizer.decode(ids)
        assert reply["usage"]["completion_tokens"] == 4 * 6
    assert got == solo


def test_echo_returns_the_generated_ids_only(served, tiny_model):
    tokenizer = ModelTokenizer.from_dir(tiny_model)
    url, body = request(served, "completions", model="tiny", max_tokens=4, temperature=0,
                        ignore_eos=True, echo=True, logprobs=1)
    code, reply = post(url, body)
    assert code == 200, reply
    [choice] = reply["choices"]
    ids = choice["token_ids"]
    assert len(ids) == 4 and choice["logprobs"]["tokens"][len(PROMPT):] == [
        tokenizer.decode([i]) for i in ids]
    assert choice["text"] == tokenizer.decode(PROMPT) + tokenizer.decode(ids)
    assert streamed_ids(stream(url, body)) == {0: ids}
    code, reply = post(url, {**body, "max_tokens": 0})
    assert code == 200 and reply["choices"][0]["token_ids"] == [], reply


@pytest.mark.parametrize("route", ROUTES)
def test_the_stop_token_is_returned_and_counted(served, tiny_model, route):
    url, body = request(served, route, model="a", max_tokens=8, temperature=0, min_tokens=3,
                        logit_bias={str(EOS): 100})  # the EOS once min_tokens allow it
    code, reply = post(url, body)
    assert code == 200, reply
    [choice] = reply["choices"]
    ids = choice["token_ids"]
    assert choice["finish_reason"] == "stop" and len(ids) == 4 and ids[-1] == EOS
    assert reply["usage"]["completion_tokens"] == 4
    assert text_of(route, choice) == ModelTokenizer.from_dir(tiny_model).decode(ids[:-1])
    assert streamed_ids(stream(url, body)) == {0: ids}


def test_a_forced_tool_call_carries_its_ids(served):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}]
    url, body = request(served, "chat", model="b", max_tokens=10, temperature=0, tools=tools,
                        tool_choice="required")
    code, reply = post(url, body)
    assert code == 200, reply
    ids = reply["choices"][0]["token_ids"]
    assert len(ids) == reply["usage"]["completion_tokens"] > 0
    assert streamed_ids(stream(url, body)) == {0: ids}


@pytest.mark.parametrize("route", ROUTES)
def test_not_asked_no_ids_and_a_non_boolean_is_a_400(served, route):
    url, body = request(served, route, model="tiny", max_tokens=2)
    del body["return_token_ids"]
    code, reply = post(url, body)
    assert code == 200 and "token_ids" not in reply["choices"][0], reply
    assert all("token_ids" not in c for chunk in stream(url, body) for c in chunk["choices"])
    for value in ("true", 1, [True]):
        code, reply = post(url, {**body, "return_token_ids": value})
        assert code == 400 and reply["error"]["param"] == "return_token_ids", reply
        assert reply["error"]["code"] == "invalid_type"
