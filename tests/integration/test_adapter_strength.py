"""adapter_strength (lorad's per-request strength) through real daemons at --parallel 2 and 1
(tiny Llama, adapters a and b): the same prompt at strengths 0, 0.5, 1 and 2 gives four answers, 1.0
equals a request without the field, 0 equals the base model's answer; a burst mixing strengths
equals each solo run; the prefix cache never serves one strength's blocks to another, and a
repeat at the same strength hits; bad values and a strength for the base model are 400s naming
adapter_strength."""

from __future__ import annotations

import random

import pytest

from tests.daemons import adapter_flags, burst_texts, post, start_daemon

_rng = random.Random(3207)  # prompts no other test of the session's adapter daemon sends
PROMPTS = [[_rng.randrange(3, 400) for _ in range(40)] for _ in range(3)]  # 2 full blocks + 8


@pytest.fixture(scope="module")
def single_rank_daemon(tiny_model, tiny_adapters):
    """adapter_daemon's setup at --parallel 1."""
    daemon = start_daemon(tiny_model, "--parallel", "1", "--kv-cache-blocks", "256",
                          "--max-num-seqs", "48", *adapter_flags(tiny_adapters))
    yield daemon
    assert daemon.stop() == 0, daemon.log()[-4000:]


@pytest.fixture(params=["parallel2", "parallel1"])
def any_daemon(request):
    name = "adapter_daemon" if request.param == "parallel2" else "single_rank_daemon"
    return request.getfixturevalue(name)


def complete(daemon, prompt, model="a", **fields) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "logprobs": 1, "return_token_ids": True, **fields}
    status, reply = post(f"{daemon.url}/v1/completions", body)
    assert status == 200, reply
    return reply


def answer(reply: dict) -> tuple[list[int], list[float]]:
    """(generated token ids, their log probabilities) of the first choice."""
    choice = reply["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_strengths_answer_apart_and_cache_apart(any_daemon):
    prompt = PROMPTS[0]
    plain = complete(any_daemon, prompt)  # no field: 1.0
    assert cached(plain) == 0
    replies = {x: complete(any_daemon, prompt, adapter_strength=x)
               for x in (1.0, 0.5, 2, 0)}
    assert answer(replies[1.0]) == answer(plain)  # the field at 1.0 changes nothing
    assert cached(replies[1.0]) == 32  # ... and shares plain's blocks (same root)
    for x in (0.5, 2, 0):
        assert cached(replies[x]) == 0, x  # no strength serves another's blocks
    logprobs = {x: answer(reply)[1] for x, reply in replies.items()}
    assert len({tuple(v) for v in logprobs.values()}) == 4, logprobs  # four answers
    base = complete(any_daemon, prompt, model="tiny")
    assert cached(base) == 0  # strength 0 computes the base model's values, but caches apart
    assert answer(replies[0])[0] == answer(base)[0]  # greedy tokens
    again = complete(any_daemon, prompt, adapter_strength=0.5)
    assert cached(again) == 32 and answer(again) == answer(replies[0.5])
    zero_again = complete(any_daemon, prompt, adapter_strength=0.0)
    assert cached(zero_again) == 32 and answer(zero_again)[0] == answer(base)[0]


def test_a_mixed_burst_of_strengths_equals_each_solo_run(any_daemon):
    bodies = [{"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0,
               "ignore_eos": True, **({} if x is None else {"adapter_strength": x})}
              for prompt in PROMPTS[1:] for model in ("a", "b")
              for x in (None, 0, 0.5, 1.0, 2.0, 4.0)]
    solo = [post(f"{any_daemon.url}/v1/completions", body)[1]["choices"][0]["text"]
            for body in bodies]
    assert burst_texts(any_daemon.url, bodies) == solo
    assert burst_texts(any_daemon.url, bodies[::-1]) == solo[::-1]


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
@pytest.mark.parametrize("model,value", [
    ("a", 4.5), ("a", -0.1), ("a", "2"), ("a", True), ("a", [1]), ("a", 10**40),
    ("tiny", 1.0), ("tiny", 0.5),  # the base model has no adapter to scale
])
def test_bad_strengths_are_400s_naming_the_field(adapter_daemon, route, model, value):
    body = {"model": model, "max_tokens": 2, "adapter_strength": value}
    if route == "completions":
        body["prompt"] = [5, 6, 7]
    else:
        body["messages"] = [{"role": "user", "content": "hi"}]
    status, reply = post(f"{adapter_daemon.url}/v1/{route}", body)
    assert status == 400, reply
    assert reply["error"]["param"] == "adapter_strength", reply


def test_the_largest_strength_and_an_adapter_field_are_accepted(adapter_daemon):
    reply = complete(adapter_daemon, [5, 6, 7], model="tiny", adapter="b", adapter_strength=4)
    assert reply["model"] == "b" and len(answer(reply)[0]) == 12
