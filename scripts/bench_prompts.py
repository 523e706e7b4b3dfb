"""The text of bench.py's prefix workloads: a shared system prompt, each conversation's user
messages and growing history (chat-turns), and the shared examples before each question
(few-shot). Deterministic: the same seed gives the same text on every Python and platform.
Pure; sizes are in words, about one token each in the BPE vocabularies of real models.
"""

from __future__ import annotations

import random

# Common words that most BPE vocabularies hold whole, with their leading space.
WORDS = (
    "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "river", "runs", "through",
    "old", "town", "past", "market", "library", "station", "where", "trains", "leave", "every",
    "ten", "minutes", "sun", "rise", "evening", "morning", "new", "blue", "gold", "little",
    "robot", "wanted", "learn", "paint", "sky", "weather", "warm", "light", "west", "world",
    "small", "model", "answers", "requests", "many", "each", "worker", "holds", "part", "same",
    "step", "other", "time", "there", "was", "who", "how", "what", "day", "water", "house",
    "green", "long",
)
WORDS_PER_SENTENCE = 12


def sentences(rng: random.Random, num_words: int) -> str:
    """num_words words from WORDS, a capital and a full stop every WORDS_PER_SENTENCE."""
    words = [rng.choice(WORDS) for _ in range(num_words)]
    parts = []
    for start in range(0, num_words, WORDS_PER_SENTENCE):
        sentence = " ".join(words[start:start + WORDS_PER_SENTENCE])
        parts.append(sentence[:1].upper() + sentence[1:] + ".")
    return " ".join(parts)


def system_prompt(num_tokens: int, seed: int) -> str:
    """About num_tokens tokens of instructions, the same for every conversation of a run."""
    head = "You are a helpful assistant. Follow these notes:"  # about 10 tokens
    num_words = max(1, (num_tokens - 10) * WORDS_PER_SENTENCE // (WORDS_PER_SENTENCE + 1))
    return f"{head} {sentences(random.Random(f'bench-system:{seed}'), num_words)}"


def user_message(conversation: int, turn: int, seed: int) -> str:
    """A short question, distinct for each (conversation, turn)."""
    rng = random.Random(f"bench-user:{seed}:{conversation}:{turn}")
    return f"Conversation {conversation}, turn {turn}: " + sentences(rng, 6)[:-1] + "?"


class Conversation:
    """One chat's messages: the system prompt, then a user message and the answer per turn, so
    each turn's prompt is the last one's with the answer and a new question appended."""

    def __init__(self, system: str, index: int, seed: int) -> None:
        self.index = index
        self.seed = seed
        self.num_turns = 0
        self.messages: list[dict] = [{"role": "system", "content": system}]

    def next_turn(self) -> list[dict]:
        """The next turn's messages (a copy): the history and a new user message."""
        assert self.messages[-1]["role"] != "user", "answer() the last turn first"
        self.num_turns += 1
        content = user_message(self.index, self.num_turns, self.seed)
        self.messages.append({"role": "user", "content": content})
        return [dict(m) for m in self.messages]

    def answer(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})


def few_shot_examples(num_shots: int, num_tokens: int, seed: int) -> str:
    """num_shots question-and-answer examples of about num_tokens tokens each, the shared head
    of every few-shot prompt of a run; ends with a blank line, before the question."""
    rng = random.Random(f"bench-shots:{seed}")
    num_question_words = max(2, num_tokens // 4)
    num_answer_words = max(2, num_tokens - num_question_words - 12)  # "Q1: ", "?\nA1: ", ...
    examples = []
    for i in range(1, num_shots + 1):
        question = sentences(rng, num_question_words)[:-1]
        examples.append(f"Q{i}: {question}?\nA{i}: {sentences(rng, num_answer_words)}\n\n")
    return "".join(examples)


def few_shot_prompt(examples: str, index: int, seed: int) -> str:
    """The shared examples, then question `index`'s own text, open for the answer."""
    rng = random.Random(f"bench-question:{seed}:{index}")
    return f"{examples}Question {index}: {sentences(rng, 8)[:-1]}?\nAnswer:"


def warm_up_message(index: int) -> str:
    """Unmeasured requests' text: shares no prefix with the measured ones (run with any seed)."""
    return f"Warm-up {index}: " + sentences(random.Random(f"bench-warm-up:{index}"), 12)
