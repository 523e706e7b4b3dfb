"""Completions' echo through the HTTP API: the prompt's log probabilities equal transformers' (and
peft's) fp32 log-softmax at every prompt position.

Real daemons on the tiny random Llama with adapters a and b, at --parallel 1 and 2, with
--max-num-batched-tokens 8 so that the prompts here take several prefill chunks. Each answer is
checked against transformers (peft for an adapter) within 1e-5: every prompt token's log
probability (the first one null) and top-k, then the generated tokens' as test_logprobs.py does;
streamed chunks carry the same values; max_tokens 0 scores the prompt alone; with a list of
prompts each choice echoes its own prompt, with the values that prompt gets alone; in a mixed
burst the requests without echo get exactly the tokens they get alone; echo with n > 1 is refused.
"""

from __future__ import annotations

import threading

import pytest
import torch

from lorad.daemon.tokenizer import ModelTokenizer
from tests.daemons import adapter_flags, post, start_daemon
from tests.integration.test_logprobs import reference_greedy, references, stream  # noqa: F401

TOL = 1e-5  # lorad's values against the fp32 references (the tol fixture; the GPU's is wider)
# 21 tokens: three chunks of at most 8 tokens at --max-num-batched-tokens 8
PROMPT = [5, 17, 42, 99, 7, 250, 31, 64, 3, 128, 77, 200, 11, 19, 300, 8, 45, 91, 150, 23, 60]
TOP = 4
NUM_TOKENS = 3


@pytest.fixture(scope="module", params=[1, 2], ids=["parallel1", "parallel2"])
def served(request, tiny_model, tiny_adapters):
    daemon = start_daemon(tiny_model, "--parallel", str(request.param), "--kv-cache-blocks",
                          "128", "--max-num-batched-tokens", "8",
                          *adapter_flags(tiny_adapters))
    yield daemon
    assert daemon.stop() == 0, daemon.log()[-4000:]


def prompt_log_softmax(model, prompt: list[int]) -> torch.Tensor:
    """-> [len(prompt), vocab] fp32 log-softmax at each prompt position."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def expected_top(tokenizer, ref_row: torch.Tensor, token_id: int, k: int) -> dict[str, float]:
    """OpenAI's top_logprobs entry: the k most likely texts, and the token's own."""
    values, ids = torch.topk(ref_row, k)
    wanted: dict[str, float] = {}
    for i, v in zip(ids.tolist() + [token_id], values.tolist() + [float(ref_row[token_id])]):
        wanted.setdefault(tokenizer.decode([i]), v)
    return wanted


@pytest.fixture
def tol() -> float:
    return TOL


def check_prompt_part(got: dict, tokenizer, ref: torch.Tensor, prompt: list[int], k: int,
                      tol: float = TOL) -> None:
    """The first len(prompt) entries of a completions logprobs object against the reference."""
    n = len(prompt)
    assert got["tokens"][:n] == [tokenizer.decode([i]) for i in prompt]
    assert got["token_logprobs"][0] is None and got["top_logprobs"][0] is None
    expected = [float(ref[p - 1, prompt[p]]) for p in range(1, n)]
    assert got["token_logprobs"][1:n] == pytest.approx(expected, abs=tol)
    for p in range(1, n):
        top, wanted = got["top_logprobs"][p], expected_top(tokenizer, ref[p - 1], prompt[p], k)
        assert top.keys() == wanted.keys(), p
        assert list(top.values()) == pytest.approx(list(wanted.values()), abs=tol)


def check_offsets(text: str, got: dict) -> None:
    """Every whole token's text is where its offset says, in the answer's text (echo included);
    a token holding part of a character (U+FFFD alone) begins where that character does."""
    assert got["text_offset"] == sorted(got["text_offset"])
    for token, offset in zip(got["tokens"], got["text_offset"]):
        if "\ufffd" not in token:
            assert text[offset:offset + len(token)] == token


@pytest.mark.parametrize("model", ["tiny", "a", "b"])
def test_echo_logprobs_equal_transformers(served, references, tiny_model, model, tol):
    tokenizer = ModelTokenizer.from_dir(tiny_model)
    ref = prompt_log_softmax(references[model], PROMPT)
    ids, ref_generated = reference_greedy(references[model], PROMPT, NUM_TOKENS)
    body = {"model": model, "prompt": PROMPT, "max_tokens": NUM_TOKENS, "temperature": 0,
            "ignore_eos": True, "logprobs": TOP, "echo": True}
    code, reply = post(f"{served.url}/v1/completions", body)
    assert code == 200, reply
    choice = reply["choices"][0]
    assert choice["text"] == tokenizer.decode(PROMPT) + tokenizer.decode(ids)
    got = choice["logprobs"]
    assert len(got["tokens"]) == len(PROMPT) + NUM_TOKENS
    check_prompt_part(got, tokenizer, ref, PROMPT, TOP, tol)
    # The generated part is what it is without echo.
    assert got["tokens"][len(PROMPT):] == [tokenizer.decode([i]) for i in ids]
    expected = [float(ref_generated[n, i]) for n, i in enumerate(ids)]
    assert got["token_logprobs"][len(PROMPT):] == pytest.approx(expected, abs=tol)
    check_offsets(choice["text"], got)
    assert reply["usage"]["prompt_tokens"] == len(PROMPT)
    assert reply["usage"]["completion_tokens"] == NUM_TOKENS
    # Streamed: the opening chunk, the prompt's chunk, then the tokens; the same objects.
    chunks = [c for c in stream(f"{served.url}/v1/completions", body) if c["choices"]]
    assert chunks[1]["choices"][0]["text"] == tokenizer.decode(PROMPT)
    assert len(chunks[1]["choices"][0]["logprobs"]["tokens"]) == len(PROMPT)
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    logprobs = [c["choices"][0]["logprobs"] for c in chunks]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for lp in logprobs for x in lp[key]] == got[key]


@pytest.mark.parametrize("stream_it", [False, True], ids=["whole", "streamed"])
def test_max_tokens_0_scores_the_prompt_alone(served, references, tiny_model, stream_it, tol):
    """What evaluation harnesses send: echo, logprobs, max_tokens 0, temperature 0."""
    tokenizer = ModelTokenizer.from_dir(tiny_model)
    ref = prompt_log_softmax(references["a"], PROMPT)
    body = {"model": "a", "prompt": PROMPT, "max_tokens": 0, "temperature": 0, "logprobs": 1,
            "echo": True}
    if stream_it:
        chunks = [c for c in stream(f"{served.url}/v1/completions", body) if c["choices"]]
        text = "".join(c["choices"][0]["text"] for c in chunks)
        got = {key: [x for c in chunks for x in c["choices"][0]["logprobs"][key]]
               for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
        finish = chunks[-1]["choices"][0]["finish_reason"]
    else:
        code, reply = post(f"{served.url}/v1/completions", body)
        assert code == 200, reply
        text, got = reply["choices"][0]["text"], reply["choices"][0]["logprobs"]
        finish = reply["choices"][0]["finish_reason"]
        assert reply["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": 0,
                                  "total_tokens": len(PROMPT),
                                  "prompt_tokens_details": {"cached_tokens": 0}}
    assert finish == "length"
    assert text == tokenizer.decode(PROMPT)
    assert len(got["tokens"]) == len(PROMPT)
    check_prompt_part(got, tokenizer, ref, PROMPT, 1, tol)
    check_offsets(text, got)


def test_echo_of_a_text_prompt_and_echo_without_logprobs(served, tiny_model):
    tokenizer = ModelTokenizer.from_dir(tiny_model)
    prompt = "The quick brown fox jumps over the lazy dog. Café!"
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0, "echo": True}
    code, reply = post(f"{served.url}/v1/completions", body)
    assert code == 200, reply
    plain = post(f"{served.url}/v1/completions", {**body, "echo": False})[1]
    assert reply["choices"][0]["text"] == prompt + plain["choices"][0]["text"]
    assert reply["choices"][0]["logprobs"] is None
    code, reply = post(f"{served.url}/v1/completions", {**body, "logprobs": 0})
    assert code == 200, reply
    got = reply["choices"][0]["logprobs"]
    assert len(got["tokens"]) == len(tokenizer.encode(prompt)) + 2
    assert all(top is None or len(top) == 1 for top in got["top_logprobs"])
    check_offsets(reply["choices"][0]["text"], got)
    code, reply = post(f"{served.url}/v1/completions", {**body, "max_tokens": 0})
    assert code == 200 and reply["choices"][0]["text"] == prompt, reply


@pytest.mark.parametrize("patch,param", [
    ({"echo": "yes"}, "echo"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"echo": True, "max_tokens": -1}, "max_tokens"),
    ({"echo": True, "logprobs": 21}, "logprobs"),
    ({"echo": True, "n": 2}, "n"),
])
def test_refusals_name_the_field(served, patch, param):
    code, reply = post(f"{served.url}/v1/completions", {"model": "tiny", "prompt": PROMPT,
                                                        "max_tokens": 2, **patch})
    assert code == 400 and reply["error"]["param"] == param, reply


def test_echo_with_n_2_is_refused_naming_n(served):
    """The workers score a prompt once, for its first choice: echo takes n = 1."""
    code, reply = post(f"{served.url}/v1/completions", {
        "model": "tiny", "prompt": [PROMPT, PROMPT[:5]], "max_tokens": 2, "echo": True,
        "logprobs": 1, "n": 2})
    assert code == 400 and reply["error"]["param"] == "n", reply
    assert "echo takes n = 1" in reply["error"]["message"], reply


LOGPROBS_KEYS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


def same_values(got: dict, alone: dict, i: int) -> None:
    assert got["tokens"] == alone["tokens"] and got["text_offset"] == alone["text_offset"], i
    assert [v is None for v in got["token_logprobs"]] == [v is None for v in
                                                          alone["token_logprobs"]], i
    assert got["token_logprobs"][1:] == pytest.approx(alone["token_logprobs"][1:], abs=TOL), i
    for top, wanted in zip(got["top_logprobs"], alone["top_logprobs"]):
        assert (top is None) == (wanted is None), i
        if top is not None:
            assert top.keys() == wanted.keys(), i
            assert list(top.values()) == pytest.approx(list(wanted.values()), abs=TOL), i


@pytest.mark.parametrize("max_tokens", [2, 0])
@pytest.mark.parametrize("stream_it", [False, True], ids=["whole", "streamed"])
def test_a_prompt_list_echoes_each_prompt_in_its_own_choice(served, references, tiny_model,
                                                            stream_it, max_tokens):
    """What harnesses send for a batch: each choice's text begins with its own prompt's, and its
    logprobs object (prompt entries, then the generated ones) equals that prompt's answer alone:
    the same tokens, offsets and alternatives, values within TOL (a batch of other prompts
    changes the float sums' order, by ~1e-6 at most here)."""
    tokenizer = ModelTokenizer.from_dir(tiny_model)
    prompts = [PROMPT, "The quick brown fox. Café!", PROMPT[4:15]]
    body = {"model": "a", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": 2, "echo": True}
    alone = []
    for prompt in prompts:
        code, reply = post(f"{served.url}/v1/completions", {**body, "prompt": prompt})
        assert code == 200, reply
        alone.append(reply["choices"][0])
    # A text prompt echoes as sent; token ids as they decode together.
    echoed = [tokenizer.decode(PROMPT), prompts[1], tokenizer.decode(PROMPT[4:15])]
    if stream_it:
        chunks = [c for c in stream(f"{served.url}/v1/completions", {**body, "prompt": prompts})
                  if c["choices"]]
        by_index: dict[int, list] = {}
        for c in chunks:
            by_index.setdefault(c["choices"][0]["index"], []).append(c["choices"][0])
        assert sorted(by_index) == [0, 1, 2]
        got = []
        for i in range(3):
            opening, echo, *rest = by_index[i]
            assert opening["text"] == "" and opening["logprobs"]["tokens"] == []
            assert echo["text"] == echoed[i] and echo["finish_reason"] is None
            parts = [opening, echo, *rest]
            got.append({"index": i, "text": "".join(p["text"] for p in parts),
                        "logprobs": {key: [x for p in parts for x in p["logprobs"][key]]
                                     for key in LOGPROBS_KEYS},
                        "finish_reason": parts[-1]["finish_reason"]})
    else:
        code, reply = post(f"{served.url}/v1/completions", {**body, "prompt": prompts})
        assert code == 200, reply
        got = reply["choices"]
        num_prompt = len(PROMPT) + len(tokenizer.encode(prompts[1])) + len(PROMPT[4:15])
        assert reply["usage"]["prompt_tokens"] == num_prompt
        assert reply["usage"]["completion_tokens"] == 3 * max_tokens
    assert [c["index"] for c in got] == [0, 1, 2]
    for i, (choice, solo) in enumerate(zip(got, alone)):
        assert choice["text"].startswith(echoed[i]), i
        assert choice["text"] == solo["text"], i
        assert choice["finish_reason"] == solo["finish_reason"] == "length", i
        same_values(choice["logprobs"], solo["logprobs"], i)
    # The token-id prompts' entries are the model's too, not only each other's.
    ref = prompt_log_softmax(references["a"], PROMPT[4:15])
    check_prompt_part(got[2]["logprobs"], tokenizer, ref, PROMPT[4:15], 2)
    check_offsets(got[1]["text"], got[1]["logprobs"])


def test_a_mixed_burst_gives_other_requests_their_solo_tokens(served):
    """Echo requests (some scoring only) in a burst with plain ones: the plain ones' texts equal
    their solo runs, and each echo request's values equal its own solo values."""
    bodies = []
    for i in range(10):
        body = {"model": ("tiny", "a", "b")[i % 3], "prompt": PROMPT[i % 5:], "max_tokens": 6,
                "temperature": 1.0, "seed": 200 + i, "ignore_eos": True}
        if i % 3 == 0:
            body.update(echo=True, logprobs=i % 4, max_tokens=6 if i % 2 else 0)
        bodies.append(body)
    solo = [post(f"{served.url}/v1/completions", b)[1]["choices"][0] for b in bodies]
    burst: list = [None] * len(bodies)

    def run(i: int) -> None:
        burst[i] = post(f"{served.url}/v1/completions", bodies[i])[1]["choices"][0]
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i, (alone, together) in enumerate(zip(solo, burst)):
        assert together["text"] == alone["text"], i
        if bodies[i].get("echo"):
            values = [v for v in together["logprobs"]["token_logprobs"] if v is not None]
            expected = [v for v in alone["logprobs"]["token_logprobs"] if v is not None]
            assert values == pytest.approx(expected, abs=TOL), i


def test_scoring_a_prompt_that_fills_the_context(served, references):
    """max_tokens 0 leaves no room to need: a prompt of the whole context is scored; asking for
    one token more is refused."""
    prompt = [(7 * i + 3) % 380 + 3 for i in range(256)]  # the tiny model's whole context
    ref = prompt_log_softmax(references["tiny"], prompt)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 0, "logprobs": 0, "echo": True}
    code, reply = post(f"{served.url}/v1/completions", body)
    assert code == 200, reply
    got = reply["choices"][0]["logprobs"]["token_logprobs"]
    expected = [float(ref[p - 1, prompt[p]]) for p in range(1, len(prompt))]
    assert got[0] is None and got[1:] == pytest.approx(expected, abs=TOL)
    code, reply = post(f"{served.url}/v1/completions", {**body, "max_tokens": 1})
    assert code == 400 and reply["error"]["code"] == "context_length_exceeded", reply
