"""scripts/bench.py's pure parts, bench_models.py and bench_clock.py: the model picker (round-robin;
Zipf deterministic given the seed, hottest first, S=0 uniform), the model file's checks, and how a
stream's chunks become a first token and per-token latencies, with and without per-chunk usage,
the cached prompt tokens a server's usage reports, and the answer's text. Then the prefix
workloads' parts: their text (bench_prompts.py: deterministic, each turn extending the last), the
hit rate, and what --no-cache adds to a body."""

from __future__ import annotations

import argparse
from collections import Counter

import pytest

from tests.script_modules import load_script




bench_models = load_script("bench_models")
bench_clock = load_script("bench_clock")
bench_prompts = load_script("bench_prompts")
bench_table = load_script("bench_table")
bench_stream = load_script("bench_stream")
MODELS = [f"m{i}" for i in range(8)]


def picks(zipf, seed, n=4000, models=MODELS) -> list[str]:
    picker = bench_models.ModelPicker(models, zipf, seed)
    return [picker.pick(i) for i in range(n)]


def test_round_robin_without_zipf():
    assert picks(None, 0, n=10, models=["a", "b", "c"]) == list("abcabcabca")


def test_zipf_is_deterministic_given_the_seed_and_independent_of_order():
    assert picks(1.1, 7) == picks(1.1, 7)
    assert picks(1.1, 7) != picks(1.1, 8)
    picker = bench_models.ModelPicker(MODELS, 1.1, 7)
    assert [picker.pick(i) for i in reversed(range(50))] == picks(1.1, 7, n=50)[::-1]


def test_zipf_puts_the_hottest_id_first_in_list_order():
    counts = Counter(picks(1.2, 0))
    ranked = [model for model, _ in counts.most_common()]
    assert ranked[0] == "m0" and counts["m0"] > 2 * counts["m1"] > 0
    assert counts["m0"] > counts["m1"] > counts["m3"] > counts["m7"] > 0
    # P(m0) = 1 / sum(1/k^1.2, k=1..8) = 0.4286: 1714 of 4000, sigma 31
    assert 1560 < counts["m0"] < 1870


def test_zipf_zero_is_uniform():
    counts = Counter(picks(0.0, 3, n=8000))
    assert set(counts) == set(MODELS)
    assert all(850 < c < 1150 for c in counts.values()), counts  # 1000 each, +-4.8 sigma


@pytest.mark.parametrize("text,message", [
    ("", "no model ids"),
    ("# only a comment\n\n", "no model ids"),
    ("a\nb\n a \n", "line 3 repeats 'a' (first on line 1)"),
])
def test_bad_model_files_are_refused_in_one_line(tmp_path, text, message):
    path = tmp_path / "ids.txt"
    path.write_text(text)
    with pytest.raises(bench_models.ModelListError) as err:
        bench_models.read_model_file(str(path))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_model_file_order_and_unserved_ids(tmp_path):
    path = tmp_path / "ids.txt"
    path.write_text("b\n\n# cold ones\na\nzz\n")
    assert bench_models.read_model_file(str(path)) == ["b", "a", "zz"]
    with pytest.raises(bench_models.ModelListError, match=r"1 of 3 .* 'zz'"):
        bench_models.check_served(["b", "a", "zz"], ["base", "a", "b"], "http://x")
    with pytest.raises(bench_models.ModelListError, match="cannot read"):
        bench_models.read_model_file(str(tmp_path / "missing.txt"))
    with pytest.raises(bench_models.ModelListError, match="--zipf"):
        bench_models.ModelPicker(["a"], -1.0)


def chunk(text: str | None, completion_tokens: int | None) -> dict:
    usage = None if completion_tokens is None else {"prompt_tokens": 3,
                                                     "completion_tokens": completion_tokens}
    return {"choices": [{"index": 0, "text": text}], "usage": usage}


def test_usage_on_every_chunk_times_each_token_even_without_text():
    outcome = bench_clock.Outcome("m")
    clock = bench_clock.TokenClock(outcome, started=10.0)
    for now, c in [(10.5, chunk("", 0)),   # the opening chunk: no token yet
                   (10.5, chunk("", 1)),   # first token, text held back
                   (10.6, chunk("", 2)),
                   (10.9, chunk("ab", 5)),  # three tokens in 0.3 s
                   (11.0, {"choices": [], "usage": {"completion_tokens": 5}})]:
        clock.chunk(c, now)
    assert outcome.ttft_s == pytest.approx(0.5) and outcome.usage_per_chunk
    assert outcome.gaps_s == pytest.approx([0.1, 0.1, 0.1, 0.1])
    assert clock.num_tokens == 5 and outcome.num_text_chunks == 1


def test_without_usage_the_first_chunk_is_the_first_token_then_one_per_text_chunk():
    outcome = bench_clock.Outcome("m")
    clock = bench_clock.TokenClock(outcome, started=0.0)
    for now, c in [(0.2, chunk("", None)), (0.3, chunk("", None)), (0.5, chunk("x", None)),
                   (0.6, chunk("y", None))]:
        clock.chunk(c, now)
    assert outcome.ttft_s == pytest.approx(0.2) and not outcome.usage_per_chunk
    assert outcome.gaps_s == pytest.approx([0.3, 0.1])


@pytest.mark.parametrize("usage,cached,reported", [
    ({"prompt_tokens": 40, "completion_tokens": 2}, 0, False),
    ({"prompt_tokens": 40, "completion_tokens": 2, "prompt_tokens_details": None}, 0, False),
    ({"prompt_tokens": 40, "completion_tokens": 2,
      "prompt_tokens_details": {"cached_tokens": 32}}, 32, True),
    ({"prompt_tokens": 40, "completion_tokens": 2,
      "prompt_tokens_details": {"cached_tokens": 0}}, 0, True),
])
def test_usage_gives_the_cached_prompt_tokens_when_the_server_reports_them(usage, cached,
                                                                           reported):
    outcome = bench_clock.Outcome("m")
    bench_clock.read_usage(outcome, usage)
    assert (outcome.num_prompt_tokens, outcome.num_output_tokens) == (40, 2)
    assert (outcome.num_cached_tokens, outcome.cached_reported) == (cached, reported)


def test_the_clock_keeps_the_answer_text():
    outcome = bench_clock.Outcome("m")
    clock = bench_clock.TokenClock(outcome, started=0.0)
    for c in [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
              {"choices": [{"index": 0, "delta": {"content": "Hel"}}]},
              {"choices": [{"index": 0, "delta": {"content": "lo"}}]}]:
        clock.chunk(c, 0.1)
    assert outcome.text == "Hello"


def test_prompts_are_deterministic_given_the_seed():
    p = bench_prompts
    assert p.system_prompt(512, 3) == p.system_prompt(512, 3) != p.system_prompt(512, 4)
    assert p.few_shot_examples(4, 64, 3) == p.few_shot_examples(4, 64, 3)
    assert p.few_shot_examples(4, 64, 3) != p.few_shot_examples(4, 64, 4)
    assert p.user_message(2, 5, 3) == p.user_message(2, 5, 3)
    # About one word per token: a prompt twice the size has about twice the words.
    num_words = [len(p.system_prompt(n, 0).split()) for n in (256, 512, 1024)]
    assert 220 < num_words[0] < 256 and 1.9 < num_words[2] / num_words[1] < 2.1
    assert p.system_prompt(512, 0).startswith("You are a helpful assistant.")


def test_user_messages_and_questions_are_distinct():
    p = bench_prompts
    messages = {p.user_message(c, t, 0) for c in range(1, 9) for t in range(1, 9)}
    assert len(messages) == 64
    examples = p.few_shot_examples(3, 40, 0)
    prompts = [p.few_shot_prompt(examples, i, 0) for i in range(1, 33)]
    assert len(set(prompts)) == 32 and all(q.startswith(examples) for q in prompts)
    assert [f"\nA{i}: " in examples for i in (1, 2, 3, 4)] == [True, True, True, False]
    assert examples.endswith("\n\n") and prompts[0].endswith("\nAnswer:")


def test_each_turn_extends_the_last_by_its_answer_and_a_new_question():
    system = bench_prompts.system_prompt(64, 0)
    conversation = bench_prompts.Conversation(system, 2, seed=0)
    first = conversation.next_turn()
    assert first == [{"role": "system", "content": system},
                     {"role": "user", "content": bench_prompts.user_message(2, 1, 0)}]
    first[1]["content"] = "edited by the caller"  # a copy: the history keeps its own
    conversation.answer("Paris.")
    second = conversation.next_turn()
    assert second[1]["content"] == bench_prompts.user_message(2, 1, 0)
    assert second[2:] == [{"role": "assistant", "content": "Paris."},
                          {"role": "user", "content": bench_prompts.user_message(2, 2, 0)}]
    conversation.answer("")  # text held back: the turn still extends the history
    assert conversation.next_turn()[:5] == second + [{"role": "assistant", "content": ""}]
    other = bench_prompts.Conversation(system, 3, seed=0).next_turn()
    assert other[0] == first[0] and other[1] != second[1]  # same system prompt, own question


def test_hit_rate_sums_tokens_over_completed_requests():
    def outcome(prompt, cached, ok=True):
        return bench_clock.Outcome("m", ok=ok, num_prompt_tokens=prompt, num_cached_tokens=cached)
    assert bench_table.hit_rate([outcome(100, 64), outcome(60, 0), outcome(50, 50, ok=False)]) \
        == pytest.approx(64 / 160)
    assert bench_table.hit_rate([outcome(10, 0, ok=False)]) is None


@pytest.mark.parametrize("no_cache", [False, True])
def test_no_cache_adds_cache_prompt_false_and_nothing_else(no_cache):
    args = argparse.Namespace(max_tokens=8, temperature=0.0, no_cache=no_cache)
    fields = bench_stream.request_fields(args, "m", seed=5)
    assert fields.pop("cache_prompt", None) is (False if no_cache else None)
    assert fields == {"model": "m", "max_tokens": 8, "temperature": 0.0, "stream": True,
                      "ignore_eos": True, "seed": 5,
                      "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
