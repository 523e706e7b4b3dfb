"""A multiple-choice score from prompt log probabilities, as evaluation harnesses compute it, picks
the same choice through lorad's HTTP API as on transformers.

lorad serves the SmolLM2 demo model (fp32, CPU) at --parallel 1 and 2. Each choice is scored as lm-evaluation-harness's
openai-completions loglikelihood does: the prompt is the context's tokens then the
continuation's, sent with echo, logprobs and max_tokens 0 (or 1, the harness's own request, whose
one generated token is dropped), and the score is the sum of the continuation tokens' log
probabilities. The same sum on transformers' AutoModelForCausalLM over the same folder (fp32):
the same argmax for every item, each sum within 1e-4.
"""

from __future__ import annotations

import pytest
import torch

from tests.daemons import post, start_daemon

pytestmark = pytest.mark.slow

TOL = 1e-4
ITEMS = [
    ("Question: What is the capital of France?\nAnswer:", [" Paris", " Berlin", " Madrid"]),
    ("Question: How many legs does a spider have?\nAnswer:", [" eight", " six", " four",
                                                              " ten"]),
    ("Question: Which planet is known as the Red Planet?\nAnswer:", [" Mars", " Venus",
                                                                     " Jupiter", " Saturn"]),
    ("Question: What do bees make?\nAnswer:", [" honey", " milk", " silk"]),
    ("Question: What is frozen water called?\nAnswer:", [" ice", " steam", " sand", " glass"]),
]


@pytest.fixture(scope="module", params=[1, 2], ids=["parallel1", "parallel2"])
def served_demo(request, demo_model_dir):
    daemon = start_daemon(demo_model_dir, "--parallel", str(request.param), "--max-model-len",
                          "512")
    yield daemon
    assert daemon.stop() == 0, daemon.log()[-4000:]


@pytest.fixture(scope="module")
def demo_reference(demo_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(demo_model_dir, torch_dtype=torch.float32)
    return AutoTokenizer.from_pretrained(demo_model_dir), model.eval()


def reference_score(model, context: list[int], continuation: list[int]) -> float:
    ids = context + continuation
    with torch.no_grad():
        log_probs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return sum(float(log_probs[p - 1, ids[p]]) for p in range(len(context), len(ids)))


def lorad_score(url: str, context: list[int], continuation: list[int], max_tokens: int) -> float:
    body = {"model": "SmolLM2-135M-Instruct", "prompt": context + continuation, "echo": True,
            "logprobs": 1, "max_tokens": max_tokens, "temperature": 0}
    code, reply = post(f"{url}/v1/completions", body)
    assert code == 200, reply
    values = reply["choices"][0]["logprobs"]["token_logprobs"]
    assert len(values) == len(context) + len(continuation) + max_tokens
    return sum(values[len(context):len(context) + len(continuation)])


def test_multiple_choice_scores_pick_what_transformers_picks(served_demo, demo_reference):
    tokenizer, model = demo_reference
    for n, (question, choices) in enumerate(ITEMS):
        context = tokenizer(question, add_special_tokens=False).input_ids
        scores, expected = [], []
        for choice in choices:
            continuation = tokenizer(choice, add_special_tokens=False).input_ids
            scores.append(lorad_score(served_demo.url, context, continuation, n % 2))
            expected.append(reference_score(model, context, continuation))
        picked, wanted = max(range(len(choices)), key=scores.__getitem__), \
            max(range(len(choices)), key=expected.__getitem__)
        diff = max(abs(a - b) for a, b in zip(scores, expected))
        print(f"item {n}: lorad picks {choices[picked]!r}, transformers {choices[wanted]!r}, "
              f"max abs diff {diff:.2e}")
        assert picked == wanted, (question, scores, expected)
        assert scores == pytest.approx(expected, abs=TOL), question
