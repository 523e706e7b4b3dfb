"""Several choices in one request, through real daemons (tiny random Llama, adapters a and b, at
--parallel 1 and 2): a list of prompts gives each prompt its own choice, in order, each equal to
that prompt's single run, streamed or not, with usage summed; a list larger than the queue's room
gets a 429 and admits nothing; bounds give 400s naming the field.
"""

from __future__ import annotations

import json
import urllib.request

import pytest

from tests.daemons import adapter_flags, post, start_daemon, wait_idle

MAX_QUEUED = 8
PROMPTS = [[5, 17, 42, 99, 7], "the cat sat", [250, 31, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8,
                                               8, 8, 8, 8, 8, 8, 3]]


@pytest.fixture(scope="module", params=[1, 2], ids=["parallel1", "parallel2"])
def served(request, tiny_model, tiny_adapters):
    daemon = start_daemon(tiny_model, "--parallel", str(request.param), "--kv-cache-blocks",
                          "128", "--max-queued-requests", str(MAX_QUEUED),
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
    for event in events[:-1]:
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
    assert together["usage"] == {
        key: sum(a["usage"][key] for a in alone)
        for key in ("prompt_tokens", "completion_tokens", "total_tokens")}
    events = stream(served, {**body, "prompt": PROMPTS,
                             "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]" and events[-2]["usage"] == together["usage"]
    assert streamed_choices(events[:-1]) == {
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


@pytest.mark.parametrize("body,param", [
    ({"prompt": ["a"] * 65}, "prompt"),
    ({"prompt": ["a", [1, 100000]]}, "prompt"),
    ({"prompt": ["a", [1] * 10000]}, "prompt"),
])
def test_prompt_list_bounds(served, body, param):
    status, answer = post(f"{served.url}/v1/completions", {"model": "tiny", **body})
    assert status == 400 and answer["error"]["param"] == param, answer


def test_a_failed_step_ends_every_choice_with_one_error_event(start_lorad):
    # Rank 0 raises in its 3rd model step: each prompt has streamed its first tokens by then.
    daemon = start_lorad("--parallel", "1", env={"LORAD_TEST_RAISE_RANK": "0:3"})
    events = stream(daemon, {"model": "tiny", "prompt": PROMPTS, "max_tokens": 20,
                             "temperature": 0, "ignore_eos": True})
    assert events[-1] == "[DONE]"
    errors = [e for e in events[:-1] if "error" in e]
    assert len(errors) == 1 and events[-2] is errors[0], events
    assert "LORAD_TEST_RAISE_RANK" in errors[0]["error"]["message"]
    opened = {c["index"] for e in events[:-2] for c in e["choices"]}
    assert opened == {0, 1, 2}
    assert all(c["finish_reason"] is None for e in events[:-2] for c in e["choices"])
