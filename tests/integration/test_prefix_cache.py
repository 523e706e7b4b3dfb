"""The prefix cache through real daemons at --parallel 1 and 2: a prompt resumed from cached
blocks gives exactly what the same prompt computed cold gives (tokens and log probabilities,
greedy and seeded), identities never share blocks unless their bytes and strength are equal, the
counts show in usage, /metrics and /health, and --no-prefix-cache turns it off.
"""

from __future__ import annotations

import random
import shutil
import threading
import urllib.request

import pytest

from tests.daemons import adapter_flags, post, start_daemon

BLOCK = 16  # lorad's default --block-size
PROMPT_LEN = 120  # 7 full blocks; the 8th holds the last token, which always runs
HIT = 7 * BLOCK


@pytest.fixture(scope="module", params=[1, 2], ids=["parallel1", "parallel2"])
def served(request, tiny_model, tiny_adapters, tmp_path_factory):
    """A daemon with adapters a, b, a at strength 0.5 (another identity) and a byte-identical
    copy of a's folder under another name (the same identity)."""
    twin = tmp_path_factory.mktemp("twin") / "a_twin"
    shutil.copytree(tiny_adapters["a"], twin)
    adapters = {**tiny_adapters, "a_half": tiny_adapters["a"], "a_twin": twin}
    daemon = start_daemon(tiny_model, "--parallel", str(request.param), "--kv-cache-blocks",
                          "256", "--max-num-seqs", "16", *adapter_flags(adapters),
                          "--adapter-strength", "a_half=0.5")
    yield daemon
    assert daemon.stop() == 0, daemon.log()[-4000:]


_rng = random.Random(31)


def base_id(daemon) -> str:
    return daemon.health()["model"]


def fresh_prompt(length: int = PROMPT_LEN) -> list[int]:
    return [_rng.randrange(3, 300) for _ in range(length)]


def run(url: str, model: str, prompt: list[int], cache: bool = True,
        seed: int | None = None) -> tuple[list, int]:
    """-> ((tokens, their log probabilities), prompt tokens found cached)."""
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "ignore_eos": True,
            "logprobs": 1, "cache_prompt": cache}
    body.update({"temperature": 0} if seed is None else {"temperature": 0.9, "seed": seed})
    status, answer = post(f"{url}/v1/completions", body)
    assert status == 200, answer
    logprobs = answer["choices"][0]["logprobs"]
    cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    return (logprobs["tokens"], logprobs["token_logprobs"]), cached


def same_bits(got, want) -> None:
    assert got == want  # the same tokens and the same fp32 log probabilities


def check_resumed(url: str, model: str, seed: int | None, same=same_bits) -> None:
    """A prompt cold, then twice with the cache (the second resumes), then a longer prompt over
    the same prefix: every cached run is `same` as its cold one."""
    prompt = fresh_prompt()
    cold, cold_cached = run(url, model, prompt, cache=False, seed=seed)
    first, first_cached = run(url, model, prompt, seed=seed)
    again, again_cached = run(url, model, prompt, seed=seed)
    assert (cold_cached, first_cached, again_cached) == (0, 0, HIT)
    same(first, cold)
    same(again, cold)
    longer = prompt + fresh_prompt(40)
    cold_longer, _ = run(url, model, longer, cache=False, seed=seed)
    resumed, cached = run(url, model, longer, seed=seed)
    assert cached == HIT
    same(resumed, cold_longer)


@pytest.mark.parametrize("seed", [None, 5], ids=["greedy", "seeded"])
@pytest.mark.parametrize("model", ["base", "a"])
def test_a_resumed_prompt_equals_the_cold_one(served, model, seed):
    check_resumed(served.url, base_id(served) if model == "base" else model, seed)


def test_identities_share_only_when_bytes_and_strength_agree(served):
    prompt = fresh_prompt()
    models = [base_id(served), "a", "b", "a_half"]
    runs = {}
    for model in models:  # each first run finds nothing another identity left
        runs[model], cached = run(served.url, model, prompt)
        assert cached == 0, model
        assert run(served.url, model, prompt, cache=False)[0] == runs[model], model
    for model in models:
        assert run(served.url, model, prompt) == (runs[model], HIT), model
    # The byte-identical folder under another name is a's identity: a's blocks serve it.
    assert run(served.url, "a_twin", prompt) == (runs["a"], HIT)
    assert len({tuple(map(tuple, r)) for r in runs.values()}) == len(models)


def test_a_burst_over_a_shared_prefix_equals_each_cold_run(served):
    system = fresh_prompt(3 * BLOCK)
    bodies = [(model, system + fresh_prompt(20 + 7 * i)) for i, model in
              enumerate([base_id(served), "a", "b", "a", base_id(served), "b", "a_twin", "a"])]
    cold = [run(served.url, m, p, cache=False)[0] for m, p in bodies]
    results: list = [None] * len(bodies)

    def one(i: int) -> None:
        results[i] = run(served.url, *bodies[i])
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [r[0] for r in results] == cold
    # Later ones of an identity may find the prefix that an earlier one of the burst computed.
    assert all(r[1] in (0, 3 * BLOCK) for r in results)


def test_counts_in_metrics_and_health(served):
    prompt = fresh_prompt()
    run(served.url, "b", prompt)
    run(served.url, "b", prompt)
    with urllib.request.urlopen(f"{served.url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    lines = [line for line in text.splitlines()
             if line.startswith('lorad_prompt_tokens_cached_total{model="b"}')]
    assert lines and float(lines[0].split()[-1]) >= HIT
    assert "lorad_prefix_cache_blocks{" in text
    health = served.health()
    assert health["prefix_cache"]["enabled"] is True
    assert health["prefix_cache"]["cached_tokens"] >= HIT
    assert all(rank["prefix_cached_blocks"] > 0 for rank in health["ranks"])


def test_cache_prompt_must_be_a_boolean(served):
    status, answer = post(f"{served.url}/v1/completions",
                          {"model": base_id(served), "prompt": "hi", "cache_prompt": "yes"})
    assert status == 400 and answer["error"]["param"] == "cache_prompt"


def test_no_prefix_cache_computes_every_prompt(tiny_model):
    daemon = start_daemon(tiny_model, "--no-prefix-cache", "--kv-cache-blocks", "128")
    try:
        prompt = fresh_prompt()
        first = run(daemon.url, base_id(daemon), prompt)
        assert run(daemon.url, base_id(daemon), prompt) == first and first[1] == 0
        assert daemon.health()["prefix_cache"] == {
            "enabled": False, "prompt_tokens": 2 * PROMPT_LEN, "cached_tokens": 0}
    finally:
        assert daemon.stop() == 0


def test_a_follow_up_takes_the_blocks_its_answer_filled_while_decoding(served):
    """A second turn sent back as token ids, the answer included, finds the blocks that the first
    turn's decode steps filled (blocks 6 and 7 hold generated tokens) and equals its cold run."""
    prompt = fresh_prompt(100)
    status, first = post(f"{served.url}/v1/completions",
                         {"model": "a", "prompt": prompt, "max_tokens": 40, "ignore_eos": True,
                          "temperature": 0, "return_token_ids": True})
    assert status == 200, first
    answer = first["choices"][0]["token_ids"]
    assert len(answer) == 40
    # 139 positions ran through the model (the last sampled token has not): 8 full blocks.
    follow_up = prompt + answer + fresh_prompt(10)
    cold, _ = run(served.url, "a", follow_up, cache=False)
    assert run(served.url, "a", follow_up) == (cold, 8 * BLOCK)
