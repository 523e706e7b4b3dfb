"""Log probabilities through the HTTP API equal transformers' (and peft's) fp32 log-softmax.

Real daemons on the tiny random Llama with adapters a and b, at --parallel 1 and 2. Each greedy
generation is replayed on transformers (peft for an adapter): at every generated position the
sampled token's log probability and the top-k alternatives must match within 1e-5; streamed
chunks must carry the same values as the whole answer; in a mixed burst, rows that did not ask
get exactly the tokens they get alone.
"""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch

from lorad.daemon.token_bytes import TokenBytes
from lorad.daemon.tokenizer import ModelTokenizer
from tests.daemons import adapter_flags, burst_texts, post, start_daemon

TOL = 1e-5
PROMPT = [5, 17, 42, 99, 7, 250, 31]
NUM_TOKENS = 6
TOP = 5
CHAT = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module", params=[1, 2], ids=["parallel1", "parallel2"])
def served(request, tiny_model, tiny_adapters):
    daemon = start_daemon(tiny_model, "--parallel", str(request.param), "--kv-cache-blocks",
                          "128", *adapter_flags(tiny_adapters))
    yield daemon
    assert daemon.stop() == 0, daemon.log()[-4000:]


@pytest.fixture(scope="module")
def references(tiny_model, tiny_adapters):
    """model name -> fp32 transformers (peft for an adapter) model of the same weights."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    def base():
        return AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32).eval()
    models = {"tiny": base()}
    for name, folder in tiny_adapters.items():
        models[name] = PeftModel.from_pretrained(base(), folder).eval()
    return models


def reference_greedy(model, prompt: list[int], num_tokens: int) -> tuple[list[int], torch.Tensor]:
    """-> the greedy continuation and its positions' log-softmax [num_tokens, vocab] fp32."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(num_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1]  # [vocab]
            ids.append(int(logits.argmax()))
        logits = model(torch.tensor([ids])).logits[0]  # [len(ids), vocab]
    log_probs = torch.log_softmax(logits.float(), dim=-1)[len(prompt) - 1:-1]
    return ids[len(prompt):], log_probs


def stream(url: str, body: dict) -> list[dict]:
    request = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
    chunks = []
    with urllib.request.urlopen(request, timeout=60) as resp:
        for line in resp:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


@pytest.mark.parametrize("model", ["tiny", "a", "b"])
def test_completion_logprobs_equal_transformers(served, references, tiny_model, model):
    tokenizer = ModelTokenizer.from_dir(tiny_model)
    ids, ref = reference_greedy(references[model], PROMPT, NUM_TOKENS)
    body = {"model": model, "prompt": PROMPT, "max_tokens": NUM_TOKENS, "temperature": 0,
            "ignore_eos": True, "logprobs": TOP}
    code, reply = post(f"{served.url}/v1/completions", body)
    assert code == 200, reply
    got = reply["choices"][0]["logprobs"]
    assert got["tokens"] == [tokenizer.decode([i]) for i in ids]
    expected = [float(ref[n, i]) for n, i in enumerate(ids)]
    assert got["token_logprobs"] == pytest.approx(expected, abs=TOL)
    for n, top in enumerate(got["top_logprobs"]):
        values, top_ids = torch.topk(ref[n], TOP)
        wanted: dict[str, float] = {}
        for i, v in zip(top_ids.tolist() + [ids[n]], values.tolist() + [expected[n]]):
            wanted.setdefault(tokenizer.decode([i]), v)
        assert top.keys() == wanted.keys()
        assert list(top.values()) == pytest.approx(list(wanted.values()), abs=TOL)
    offsets = [sum(len(t) for t in got["tokens"][:n]) for n in range(NUM_TOKENS)]
    assert got["text_offset"] == offsets
    # The stream carries the same objects, split over its chunks.
    chunks = stream(f"{served.url}/v1/completions", body)
    logprobs = [c["choices"][0]["logprobs"] for c in chunks if c["choices"]]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for lp in logprobs for x in lp[key]] == got[key]


@pytest.mark.parametrize("model", ["tiny", "b"])
def test_chat_top_logprobs_equal_transformers(served, references, tiny_model, model):
    tokenizer = ModelTokenizer.from_dir(tiny_model)
    ids, ref = reference_greedy(references[model], tokenizer.encode_chat(CHAT), NUM_TOKENS)
    body = {"model": model, "messages": CHAT, "max_tokens": NUM_TOKENS, "temperature": 0,
            "ignore_eos": True, "logprobs": True, "top_logprobs": TOP}
    code, reply = post(f"{served.url}/v1/chat/completions", body)
    assert code == 200, reply
    content = reply["choices"][0]["logprobs"]["content"]
    assert len(content) == NUM_TOKENS
    token_bytes = TokenBytes.from_dir(tiny_model)
    for n, item in enumerate(content):
        text, raw = tokenizer.decode([ids[n]]), token_bytes(ids[n])
        assert item["token"] == text
        assert item["bytes"] == list(raw if raw is not None else text.encode())
        assert item["logprob"] == pytest.approx(float(ref[n, ids[n]]), abs=TOL)
        values, top_ids = torch.topk(ref[n], TOP)
        assert [t["logprob"] for t in item["top_logprobs"]] == pytest.approx(values.tolist(),
                                                                             abs=TOL)
        # Near-ties may come in either order; every listed token must carry its own value.
        for t in item["top_logprobs"]:
            assert any(tokenizer.decode([i]) == t["token"] and abs(v - t["logprob"]) <= TOL
                       for i, v in zip(top_ids.tolist(), values.tolist()))
    # The tokens' own bytes join into the answer, where a token alone is half a character.
    joined = bytes(b for item in content for b in item["bytes"])
    assert joined.decode("utf-8", "replace") == reply["choices"][0]["message"]["content"]
    chunks = stream(f"{served.url}/v1/chat/completions", body)
    streamed = [x for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                for x in c["choices"][0]["logprobs"]["content"]]
    assert streamed == content


def test_logprobs_without_alternatives_and_absent_when_not_asked(served):
    chat = {"model": "a", "messages": CHAT, "max_tokens": 3, "temperature": 0}
    code, reply = post(f"{served.url}/v1/chat/completions", {**chat, "logprobs": True})
    assert code == 200 and all(t["top_logprobs"] == []
                               for t in reply["choices"][0]["logprobs"]["content"])
    code, reply = post(f"{served.url}/v1/chat/completions", chat)
    assert code == 200 and reply["choices"][0]["logprobs"] is None


def test_a_mixed_burst_gives_rows_without_logprobs_their_solo_tokens(served):
    """Sampled rows (seeded) with and without logprobs in one burst: each text equals its solo
    run without logprobs, so asking changes no row's tokens, its own or its neighbours'."""
    bodies = [{"model": ("tiny", "a", "b")[i % 3], "prompt": PROMPT[: 3 + i % 4],
               "max_tokens": 8, "temperature": 1.0, "seed": 100 + i, "ignore_eos": True,
               **({"logprobs": i % 21} if i % 2 else {})} for i in range(12)]
    plain = [{k: v for k, v in b.items() if k != "logprobs"} for b in bodies]
    solo = [post(f"{served.url}/v1/completions", b)[1]["choices"][0]["text"] for b in plain]
    assert burst_texts(served.url, bodies) == solo


def test_values_are_taken_before_the_grammar_mask_and_the_warpers(served):
    """The first position's distribution is the model's, whatever the request samples with: a
    regex that forbids most tokens, or temperature and top-k, leave its values as greedy's."""
    chat = {"model": "b", "messages": CHAT, "max_tokens": 2, "logprobs": True,
            "top_logprobs": TOP}

    def first_position(**extra) -> dict:
        code, reply = post(f"{served.url}/v1/chat/completions", {**chat, **extra})
        assert code == 200, reply
        return reply["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    plain = first_position(temperature=0)
    assert first_position(temperature=0, regex="[0-9]+") == plain
    assert first_position(temperature=1.5, top_k=2, seed=3) == plain
