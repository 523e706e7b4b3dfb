"""Several choices in one request, through real daemons (tiny random Llama, adapters a and b, at
--parallel 1 and 2; SmolLM2 below): a list of prompts gives each prompt its own choice, in order,
each equal to that prompt's single run, streamed or not, with usage summed; `n` choices of one
prompt run its prefill once (the workers' model-token count says so) and choice j equals the
single run with seed + j (greedy: all equal); a request larger than the queue's room gets a 429
and admits nothing; bounds give 400s naming the field.
"""

from __future__ import annotations

import json
import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.daemons import adapter_flags, post, start_daemon, wait_idle

MAX_QUEUED = 8
MAX_NUM_SEQS = 8
PROMPTS = [[5, 17, 42, 99, 7], "the cat sat", [250, 31, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8,
                                               8, 8, 8, 8, 8, 8, 3]]


@pytest.fixture(scope="module", params=[1, 2], ids=["parallel1", "parallel2"])
def served(request, tiny_model, tiny_adapters):
    daemon = start_daemon(tiny_model, "--parallel", str(request.param), "--kv-cache-blocks",
                          "128", "--max-queued-requests", str(MAX_QUEUED),
                          "--max-num-seqs", str(MAX_NUM_SEQS),
                          *adapter_flags(tiny_adapters))
    yield daemon
    assert daemon.stop() == 0, daemon.log()[-4000:]


def complete(daemon, body: dict, route: str = "completions") -> dict:
    status, answer = post(f"{daemon.url}/v1/{route}", body)
    assert status == 200, answer
    return answer


def stream(daemon, body: dict, route: str = "completions") -> list[dict | str]:
    """Every event's payload, parsed, "[DONE]" as the string."""
    request = urllib.request.Request(f"{daemon.url}/v1/{route}",
                                     data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(request, timeout=60) as resp:
        for line in resp:
            line = line.decode().strip()
            if line.startswith("data: "):
                events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
    return events


def streamed_choices(events: list) -> dict[int, tuple[str, str]]:
    """index -> (text, finish_reason), joined from a stream's chunks."""
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for event in events:
        if event == "[DONE]":
            continue
        for choice in event["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
            if choice["finish_reason"] is not None:
                assert choice["index"] not in reasons  # one finish reason per choice
                reasons[choice["index"]] = choice["finish_reason"]
    return {i: (texts[i], reasons[i]) for i in texts}


@pytest.mark.parametrize("model", ["tiny", "a"])
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 11}],
                         ids=["greedy", "seeded"])
def test_a_prompt_list_equals_each_prompt_alone(served, model, sampling):
    body = {"model": model, "max_tokens": 8, "ignore_eos": True, **sampling}
    alone = [complete(served, {**body, "prompt": p}) for p in PROMPTS]
    together = complete(served, {**body, "prompt": PROMPTS})
    assert [c["index"] for c in together["choices"]] == [0, 1, 2]
    assert [c["text"] for c in together["choices"]] == [a["choices"][0]["text"] for a in alone]
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # cached_tokens may differ
    assert {key: together["usage"][key] for key in counts} == {
        key: sum(a["usage"][key] for a in alone) for key in counts}
    events = stream(served, {**body, "prompt": PROMPTS,
                             "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    assert {key: events[-2]["usage"][key] for key in counts} == {
        key: together["usage"][key] for key in counts}
    assert streamed_choices(events) == {
        i: (a["choices"][0]["text"], "length") for i, a in enumerate(alone)}
    assert wait_idle(served)["open_requests"] == 0


def test_a_prompt_list_larger_than_the_queue_is_refused_whole(served):
    before = served.health()
    body = {"model": "tiny", "max_tokens": 2, "temperature": 0}
    status, answer = post(f"{served.url}/v1/completions",
                          {**body, "prompt": [[5, 6, 7]] * (MAX_QUEUED + 1)})
    assert status == 429 and answer["error"]["code"] == "queue_full", answer
    after = served.health()
    assert (after["running"], after["waiting"]) == (0, 0)
    assert after["kv_blocks"]["free"] == before["kv_blocks"]["free"]
    full = complete(served, {**body, "prompt": [[5, 6, 7]] * MAX_QUEUED})
    assert [c["index"] for c in full["choices"]] == list(range(MAX_QUEUED))
    assert len({c["text"] for c in full["choices"]}) == 1  # the same prompt, greedy


def model_tokens(daemon) -> float:
    """lorad_model_tokens_total: tokens the workers ran through the model, from step results."""
    with urllib.request.urlopen(f"{daemon.url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return next(s.value for family in text_string_to_metric_families(text)
                for s in family.samples if s.name == "lorad_model_tokens_total")


def texts(answer: dict) -> list[str]:
    return [c.get("text", c.get("message", {}).get("content")) for c in answer["choices"]]


@pytest.mark.parametrize("model", ["tiny", "a"])
def test_greedy_n_gives_equal_choices_from_one_prefill(served, model):
    # Without the prefix cache: the counts below are of a prompt run once per request.
    body = {"model": model, "prompt": PROMPTS[2], "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "cache_prompt": False}
    wait_idle(served)
    before = model_tokens(served)
    alone = complete(served, body)
    ran_alone = model_tokens(served) - before
    assert ran_alone == len(PROMPTS[2]) + 5  # the prompt once, then 5 decodes
    four = complete(served, {**body, "n": 4})
    ran_four = model_tokens(served) - before - ran_alone
    assert ran_four == len(PROMPTS[2]) + 4 * 5  # the prompt once, then 4 x 5 decodes
    assert [c["index"] for c in four["choices"]] == [0, 1, 2, 3]
    assert texts(four) == texts(alone) * 4
    assert four["usage"] == {"prompt_tokens": len(PROMPTS[2]), "completion_tokens": 24,
                             "total_tokens": len(PROMPTS[2]) + 24,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert streamed_choices(stream(served, {**body, "n": 4})) == {
        j: (texts(alone)[0], "length") for j in range(4)}


@pytest.mark.parametrize("model", ["tiny", "b"])
def test_seeded_n_choice_j_equals_the_single_run_with_seed_plus_j(served, model):
    body = {"model": model, "prompt": PROMPTS[0], "max_tokens": 10, "temperature": 1.0,
            "top_k": 50}
    seed = 2**63 - 2  # seed + j passes 2**63 - 1: the generator takes it modulo 2**64
    singles = [texts(complete(served, {**body, "seed": seed + j if seed + j < 2**63
                                      else seed + j - 2**64}))[0] for j in range(4)]
    assert len(set(singles)) > 1  # the seeds draw differently: the check below means something
    four = complete(served, {**body, "seed": seed, "n": 4})
    assert texts(four) == singles
    events = stream(served, {**body, "seed": seed, "n": 4})
    assert {j: text for j, (text, _) in streamed_choices(events).items()} == dict(
        enumerate(singles))
    assert wait_idle(served)["kv_blocks"]["free"] == 128


def test_chat_n_and_prompt_lists_with_n(served):
    chat = {"model": "a", "messages": [{"role": "user", "content": "the cat"}],
            "max_tokens": 6, "temperature": 1.0, "seed": 5}
    singles = [texts(complete(served, {**chat, "seed": 5 + j}, "chat/completions"))[0]
               for j in range(3)]
    assert texts(complete(served, {**chat, "n": 3}, "chat/completions")) == singles
    body = {"model": "tiny", "max_tokens": 6, "temperature": 1.0, "seed": 9, "ignore_eos": True}
    singles = [complete(served, {**body, "prompt": p, "seed": 9 + j})
               for p in PROMPTS[:2] for j in range(2)]  # index = prompt index * n + j
    both = complete(served, {**body, "prompt": PROMPTS[:2], "n": 2})
    assert [c["index"] for c in both["choices"]] == [0, 1, 2, 3]
    assert texts(both) == [texts(a)[0] for a in singles]
    # each prompt's tokens once, every choice's completion
    assert both["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in singles[::2])
    assert both["usage"]["completion_tokens"] == 4 * 6
    status, answer = post(f"{served.url}/v1/completions",
                          {**body, "prompt": PROMPTS, "n": 3})  # 9 choices > 8 in the queue
    assert status == 429, answer


def test_each_choice_keeps_its_own_constraint_and_log_probabilities(served):
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 1.0,
            "seed": 3, "regex": "[ab]{2,6}", "logprobs": 2}
    singles = [complete(served, {**body, "seed": 3 + j}) for j in range(3)]
    three = complete(served, {**body, "n": 3})
    assert texts(three) == [texts(a)[0] for a in singles]
    assert all(re.fullmatch("[ab]{2,6}", text) for text in texts(three))
    assert [c["logprobs"] for c in three["choices"]] == [a["choices"][0]["logprobs"]
                                                         for a in singles]


@pytest.mark.parametrize("body,param", [
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "n": 17}, "n"),
    ({"prompt": "hi", "n": "2"}, "n"),
    ({"prompt": "hi", "n": MAX_NUM_SEQS + 1}, "n"),  # more than one step runs
    ({"prompt": "hi", "n": 2, "best_of": 3}, "best_of"),
    ({"prompt": ["a"] * 65}, "prompt"),
    ({"prompt": ["a", [1, 100000]]}, "prompt"),
    ({"prompt": ["a", [1] * 10000]}, "prompt"),
])
def test_prompt_list_bounds(served, body, param):
    status, answer = post(f"{served.url}/v1/completions", {"model": "tiny", **body})
    assert status == 400 and answer["error"]["param"] == param, answer


def test_a_failed_step_ends_every_choice_with_one_error_event(start_lorad):
    # Rank 0 raises in its 15th model step: each prompt has streamed its first tokens by then
    # (the Admits may reach the worker a few steps apart), none has finished.
    daemon = start_lorad("--parallel", "1", env={"LORAD_TEST_RAISE_RANK": "0:15"})
    events = stream(daemon, {"model": "tiny", "prompt": PROMPTS, "max_tokens": 60,
                             "temperature": 0, "ignore_eos": True})
    assert events[-1] == "[DONE]"
    errors = [e for e in events[:-1] if "error" in e]
    assert len(errors) == 1 and events[-2] is errors[0], events
    assert "LORAD_TEST_RAISE_RANK" in errors[0]["error"]["message"]
    opened = {c["index"] for e in events[:-2] for c in e["choices"]}
    assert opened == {0, 1, 2}
    assert all(c["finish_reason"] is None for e in events[:-2] for c in e["choices"])


@pytest.fixture(scope="module", params=[1, 2], ids=["parallel1", "parallel2"])
def smollm2(request, demo_model_dir):
    daemon = start_daemon(demo_model_dir, "--parallel", str(request.param), "--dtype", "float32",
                          "--device", "cpu", "--max-model-len", "512", "--kv-cache-blocks", "128")
    yield daemon
    assert daemon.stop() == 0, daemon.log()[-4000:]


def test_smollm2_n_choices(smollm2):
    """Greedy n=4: four equal choices; seeded n=4, streamed and not: choice j is the single run
    with seed + j."""
    with urllib.request.urlopen(f"{smollm2.url}/v1/models", timeout=10) as resp:
        model = json.loads(resp.read())["data"][0]["id"]
    chat = {"model": model, "messages": [{"role": "user", "content": "Name a colour."}],
            "max_tokens": 12}
    greedy = complete(smollm2, {**chat, "temperature": 0}, "chat/completions")
    seeded = {**chat, "temperature": 1.0, "seed": 123}
    singles = [texts(complete(smollm2, {**seeded, "seed": 123 + j}, "chat/completions"))[0]
               for j in range(4)]
    # The three n=4 requests at once, after their references ran alone: each choice must still
    # equal its single run with the others' choices in its steps.
    with ThreadPoolExecutor(3) as pool:
        greedy_four = pool.submit(complete, smollm2, {**chat, "temperature": 0, "n": 4},
                                  "chat/completions")
        seeded_four = pool.submit(complete, smollm2, {**seeded, "n": 4}, "chat/completions")
        streamed_four = pool.submit(stream, smollm2, {**seeded, "n": 4}, "chat/completions")
    assert texts(greedy_four.result()) == texts(greedy) * 4
    assert texts(seeded_four.result()) == singles
    events = streamed_four.result()
    streamed = {}
    for event in events[:-1]:
        for choice in event["choices"]:
            streamed[choice["index"]] = (streamed.get(choice["index"], "")
                                         + choice["delta"].get("content", ""))
    assert streamed == dict(enumerate(singles))
