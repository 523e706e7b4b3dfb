"""The penalties and min_tokens on the real demo model: greedy chat answers of SmolLM2-135M-Instruct
through lorad (--parallel 1, fp32, CPU) give the token ids of transformers' greedy on the same
chat-templated prompt: `generate(repetition_penalty=...)` (transformers' own
RepetitionPenaltyLogitsProcessor), and a step-by-step loop over transformers' logits for the
presence and frequency penalties (transformers has none) and for min_tokens."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from tests.daemons import post, start_daemon

pytestmark = pytest.mark.slow

NAME = "SmolLM2-135M-Instruct"
MAX_TOKENS = 24
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
STORY = [{"role": "user", "content": "Write a haiku about the sea."}]


@pytest.fixture(scope="module")
def served(demo_model_dir):
    daemon = start_daemon(demo_model_dir, "--name", NAME, "--parallel", "1", "--dtype",
                          "float32", "--device", "cpu", "--max-model-len", "2048",
                          "--kv-cache-blocks", "256")
    yield daemon
    assert daemon.stop() == 0, daemon.log()[-4000:]


@pytest.fixture(scope="module")
def hf(demo_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    model = AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos]) | {tokenizer.eos_token_id}
    return model, tokenizer, sorted(eos_ids)


def prompt_ids(tokenizer, messages) -> list[int]:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                         return_dict=True)["input_ids"]


def step_by_step(hf, messages, presence=0.0, frequency=0.0, min_tokens=0) -> list[int]:
    """Greedy over transformers' fp32 logits with OpenAI's penalties and vLLM's min_tokens."""
    model, tokenizer, eos_ids = hf
    ids, out, cache = prompt_ids(tokenizer, messages), [], None
    step_input = torch.tensor([ids])
    with torch.no_grad():
        while len(out) < MAX_TOKENS:
            result = model(step_input, past_key_values=cache, use_cache=True)
            cache = result.past_key_values
            logits = result.logits[0, -1].float().clone()  # [vocab]
            if len(out) < min_tokens:
                logits[eos_ids] = float("-inf")
            for token, count in Counter(out).items():
                logits[token] -= frequency * count + presence
            token = int(logits.argmax())
            out.append(token)
            if token in eos_ids and len(out) >= min_tokens:
                break
            step_input = torch.tensor([[token]])
    return out


def generated(hf, messages, **kwargs) -> list[int]:
    model, tokenizer, _ = hf
    ids = prompt_ids(tokenizer, messages)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id, **kwargs)
    return out[0, len(ids):].tolist()


def lorad_tokens(served, hf, messages, **fields) -> tuple[list[str], str, int]:
    """-> (each generated token's text, the answer, completion_tokens) of a greedy chat."""
    code, reply = post(f"{served.url}/v1/chat/completions", {
        "model": NAME, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0,
        "logprobs": True, **fields})
    assert code == 200, reply
    choice = reply["choices"][0]
    return ([t["token"] for t in choice["logprobs"]["content"]], choice["message"]["content"],
            reply["usage"]["completion_tokens"])


def assert_same_ids(served, hf, messages, expected: list[int], **fields) -> None:
    tokenizer = hf[1]
    tokens, text, num = lorad_tokens(served, hf, messages, **fields)
    assert num == len(expected)
    assert tokens == [tokenizer.decode([i], skip_special_tokens=True) for i in expected]
    shown = [i for i in expected if i not in hf[2]]
    assert text == tokenizer.decode(shown, skip_special_tokens=True,
                                    clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("penalty", [1.3, 1.8])
def test_repetition_penalty_equals_transformers_generate(served, hf, penalty):
    expected = generated(hf, STORY, repetition_penalty=penalty)
    assert expected != generated(hf, STORY)  # the penalty changes the answer
    assert_same_ids(served, hf, STORY, expected, repetition_penalty=penalty)


@pytest.mark.parametrize("presence,frequency", [(1.5, 0.0), (0.0, 1.2), (0.6, 0.6), (-1.0, 0.0)])
def test_presence_and_frequency_penalties_equal_the_reference(served, hf, presence, frequency):
    expected = step_by_step(hf, STORY, presence=presence, frequency=frequency)
    assert expected != step_by_step(hf, STORY)
    assert_same_ids(served, hf, STORY, expected, presence_penalty=presence,
                    frequency_penalty=frequency)


def test_min_tokens_keeps_the_answer_going_past_its_eos(served, hf):
    plain = step_by_step(hf, QUESTION)
    assert plain[-1] in hf[2] and len(plain) < MAX_TOKENS - 6  # it ends by itself
    expected = step_by_step(hf, QUESTION, min_tokens=len(plain) + 3)
    assert len(expected) > len(plain)
    assert_same_ids(served, hf, QUESTION, expected, min_tokens=len(plain) + 3)
    # transformers' own min_new_tokens masks the same end-of-sequence tokens
    assert generated(hf, QUESTION, min_new_tokens=len(plain) + 3)[:len(expected)] == expected
