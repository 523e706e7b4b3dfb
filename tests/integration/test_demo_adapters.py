"""The demo adapters on the demo model, as scripts/serve-demo serves them: SmolLM2-135M-Instruct
with demo/adapters/uppercase and demo/adapters/pirate. Questions none of them was trained on go
to all three model ids at once (greedy); the uppercase answers are capital letters, the pirate
answers talk like a pirate, and the base model's answers do neither."""

from __future__ import annotations

import asyncio
import re

import openai
import pytest

from tests.daemons import DEMO_ADAPTERS, DEMO_MODEL_ID, start_daemon

pytestmark = pytest.mark.slow

NAME = DEMO_MODEL_ID
ADAPTERS = DEMO_ADAPTERS
QUESTIONS = ("What is the capital of France?", "Name three colours.",
             "What is your favourite food?")
MAX_TOKENS = 32
PIRATE_WORDS = re.compile(r"\b(arr|matey|ahoy|ye|me hearty|landlubber)\b", re.IGNORECASE)


@pytest.fixture(scope="module")
def answers(demo_model_dir) -> dict[str, list[str]]:
    """model id -> its greedy answer to each of QUESTIONS, all 9 requests in flight together."""
    flags = [flag for name, path in ADAPTERS.items() for flag in ("--adapter", f"{name}={path}")]
    daemon = start_daemon(demo_model_dir, "--name", NAME, "--max-model-len", "512",
                          "--kv-cache-blocks", "64", *flags)
    try:
        async def ask(client, model, question):
            out = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": question}],
                max_tokens=MAX_TOKENS, temperature=0)
            assert out.model == model
            return out.choices[0].message.content

        async def all_answers():
            async with openai.AsyncOpenAI(base_url=daemon.url + "/v1", api_key="unused",
                                          max_retries=0, timeout=300) as client:
                ids = [NAME, *ADAPTERS]
                texts = await asyncio.gather(*(ask(client, m, q) for m in ids
                                               for q in QUESTIONS))
                return {m: texts[i * len(QUESTIONS):(i + 1) * len(QUESTIONS)]
                        for i, m in enumerate(ids)}

        return asyncio.run(all_answers())
    finally:
        assert daemon.stop() == 0, daemon.log()[-4000:]


def upper_share(text: str) -> float:
    letters = [c for c in text if c.isalpha()]
    return sum(c.isupper() for c in letters) / max(len(letters), 1)


def is_pirate(text: str) -> bool:
    return PIRATE_WORDS.search(text) is not None


def test_uppercase_answers_in_capitals(answers):
    for text in answers["uppercase"]:
        assert upper_share(text) > 0.9 and len(text) > 10, answers
    assert all(upper_share(text) < 0.5 for text in answers[NAME]), answers


def test_pirate_answers_like_a_pirate(answers):
    assert all(is_pirate(text) for text in answers["pirate"]), answers
    assert not any(is_pirate(text) for text in answers[NAME]), answers


def test_the_adapters_change_the_answers(answers):
    for i in range(len(QUESTIONS)):
        assert len({answers[m][i] for m in answers}) == 3, answers
