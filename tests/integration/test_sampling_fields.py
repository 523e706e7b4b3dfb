"""The sampling fields through the HTTP API on the tiny random Llama with adapters a and b, at
--parallel 1 and 2: greedy with logit_bias, min_tokens, stop_token_ids and the penalties gives
the token ids of a transformers (peft) greedy loop that applies the fields' definitions to its
fp32 logits; log probabilities stay the model's own; streamed equals whole; a mixed burst gives
every stream its solo tokens; ids past the vocabulary are a 400 naming the field."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from lorad.daemon.tokenizer import ModelTokenizer
from tests.daemons import burst_texts, post
from tests.integration.test_logprobs import (  # noqa: F401 (fixtures)
    CHAT, PROMPT, references, served, stream)

EOS = 2  # the tiny tokenizer's <|im_end|>
TOL = 1e-5
NUM = 12  # long enough for every case to change the tiny models' greedy answers


def reference_greedy(model, prompt: list[int], max_tokens: int, *, logit_bias=None,
                     min_tokens=0, stop_token_ids=(), repetition_penalty=1.0,
                     presence_penalty=0.0, frequency_penalty=0.0, ignore_eos=False):
    """-> (ids, finish reason, the model's own log-softmax at each position): transformers'
    logits, then the fields as docs/api.md defines them, then the argmax."""
    ids, out, raw = list(prompt), [], []
    repetition = RepetitionPenaltyLogitsProcessor(repetition_penalty)
    ending = list(stop_token_ids) + ([] if ignore_eos else [EOS])
    with torch.no_grad():
        while len(out) < max_tokens:
            logits = model(torch.tensor([ids])).logits[0, -1].float()  # [vocab]
            raw.append(torch.log_softmax(logits, dim=-1))
            for token, bias in (logit_bias or {}).items():
                logits[int(token)] += bias
            if len(out) < min_tokens:
                logits[ending] = float("-inf")
            if repetition_penalty != 1.0:
                logits = repetition(torch.tensor([ids]), logits[None])[0]
            for token, count in Counter(out).items():
                logits[token] -= frequency_penalty * count + presence_penalty
            token = int(logits.argmax())
            ids.append(token)
            out.append(token)
            if token in ending and len(out) >= min_tokens:
                return out, "stop", raw
    return out, "length", raw


def completion(served, model: str, max_tokens: int, **fields) -> dict:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "logprobs": 0, **fields}
    code, reply = post(f"{served.url}/v1/completions", body)
    assert code == 200, reply
    return reply


CASES = {
    "bias": dict(logit_bias={"77": 100.0}),
    "bias_mixed": dict(logit_bias={"40": 3.5, "200": -100, "5": 2}),
    "repetition": dict(repetition_penalty=1.8),
    "repetition_below_1": dict(repetition_penalty=0.5),
    "presence": dict(presence_penalty=1.5),
    "frequency": dict(frequency_penalty=2.0, presence_penalty=-0.5),
    "all": dict(repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=0.4,
                logit_bias={"3": 1.0}),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("model", ["tiny", "a", "b"])
def test_greedy_ids_equal_the_reference(served, references, tiny_model, model, case):
    tokenizer = ModelTokenizer.from_dir(tiny_model)
    fields = {**CASES[case], "ignore_eos": True}
    ids, reason, raw = reference_greedy(references[model], PROMPT, NUM, **fields)
    reply = completion(served, model, NUM, **fields)
    choice = reply["choices"][0]
    assert choice["logprobs"]["tokens"] == [tokenizer.decode([i]) for i in ids]
    assert choice["finish_reason"] == reason == "length"
    # The log probabilities are the model's own, taken before the fields touch the logits.
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(
        [float(raw[n][i]) for n, i in enumerate(ids)], abs=TOL)
    plain, _, _ = reference_greedy(references[model], PROMPT, NUM, ignore_eos=True)
    assert ids != plain  # the field changed the answer
    if case == "bias":
        assert ids == [77] * NUM


def test_min_tokens_runs_past_an_eos_it_would_have_sampled(served, references, tiny_model):
    forced = {"logit_bias": {str(EOS): 100.0}}  # EOS is the argmax at every step
    reply = completion(served, "a", 8, **forced)
    assert reply["choices"][0]["finish_reason"] == "stop"
    assert reply["usage"]["completion_tokens"] == 1 and reply["choices"][0]["text"] == ""
    ids, reason, _ = reference_greedy(references["a"], PROMPT, 8, min_tokens=3, **forced)
    assert ids[-1] == EOS and len(ids) == 4 and reason == "stop"
    reply = completion(served, "a", 8, min_tokens=3, **forced)
    assert reply["choices"][0]["finish_reason"] == "stop"
    assert reply["usage"]["completion_tokens"] == 4  # three tokens, then the EOS
    tokenizer = ModelTokenizer.from_dir(tiny_model)
    assert reply["choices"][0]["logprobs"]["tokens"] == [tokenizer.decode([i]) for i in ids]


@pytest.mark.parametrize("route", ["completions", "chat"])
@pytest.mark.parametrize("ignore_eos", [False, True])
def test_stop_token_ids_end_with_stop_at_that_token(served, references, tiny_model, route,
                                                    ignore_eos):
    tokenizer = ModelTokenizer.from_dir(tiny_model)
    prompt = PROMPT if route == "completions" else tokenizer.encode_chat(CHAT)
    plain, _, _ = reference_greedy(references["b"], prompt, 8, ignore_eos=True)
    at = next(n for n in range(2, 8) if plain[n] not in plain[:n])
    stop = plain[at]
    body = {"model": "b", "max_tokens": 8, "temperature": 0, "stop_token_ids": [stop],
            "ignore_eos": ignore_eos}
    if route == "completions":
        url, body = f"{served.url}/v1/completions", {**body, "prompt": prompt}
    else:
        url, body = f"{served.url}/v1/chat/completions", {**body, "messages": CHAT}
    code, reply = post(url, body)
    assert code == 200, reply
    choice = reply["choices"][0]
    text = choice["text"] if route == "completions" else choice["message"]["content"]
    assert choice["finish_reason"] == "stop"
    assert reply["usage"]["completion_tokens"] == at + 1  # counted, never shown
    assert text == tokenizer.decode(plain[:at])
    streamed = "".join(c["choices"][0]["text"] if route == "completions"
                       else c["choices"][0]["delta"].get("content", "")
                       for c in stream(url, body) if c["choices"])
    assert streamed == text


def test_streamed_equals_whole_with_every_field(served):
    fields = {"repetition_penalty": 1.4, "frequency_penalty": 0.5, "presence_penalty": 0.5,
              "logit_bias": {"12": 5.0}, "min_p": 0.1, "min_tokens": 2, "temperature": 0.9,
              "seed": 4, "stop_token_ids": [9]}
    body = {"model": "a", "messages": CHAT, "max_tokens": 10, **fields}
    code, reply = post(f"{served.url}/v1/chat/completions", body)
    assert code == 200, reply
    chunks = stream(f"{served.url}/v1/chat/completions", body)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks
                   if c["choices"]) == reply["choices"][0]["message"]["content"]


def test_a_mixed_burst_gives_every_stream_its_solo_tokens(served):
    """Rows with penalties, biases, min_p and min_tokens beside rows with none, greedy and
    seeded, over the base model and both adapters: each text equals its solo run."""
    extras = [{}, {"repetition_penalty": 1.5}, {"logit_bias": {"30": 4.0, "31": -4.0}},
              {"frequency_penalty": 1.0, "presence_penalty": -1.0}, {"min_p": 0.2},
              {"min_tokens": 6, "logit_bias": {str(EOS): 8.0}}]
    bodies = [{"model": ("tiny", "a", "b")[i % 3], "prompt": PROMPT[: 3 + i % 4],
               "max_tokens": 8, "temperature": (0, 1.0)[i % 2], "seed": 100 + i,
               **extras[i % len(extras)]} for i in range(18)]
    solo = [post(f"{served.url}/v1/completions", b)[1]["choices"][0]["text"] for b in bodies]
    assert burst_texts(served.url, bodies) == solo


@pytest.mark.parametrize("fields,param", [
    ({"logit_bias": {"400": 1.0}}, "logit_bias"),
    ({"stop_token_ids": [3, 400]}, "stop_token_ids"),
    ({"min_tokens": 9}, "min_tokens"),  # over max_tokens
    ({"min_tokens": 2, "regex": "[0-9]+"}, "min_tokens"),
])
def test_refusals_name_the_field(served, fields, param):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, **fields}
    code, reply = post(f"{served.url}/v1/completions", body)
    assert code == 400, reply
    assert reply["error"]["param"] == param
    if param == "logit_bias":
        assert "'400'" in reply["error"]["message"]
