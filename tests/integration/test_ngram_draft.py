"""N-gram drafting against real daemons (tiny Llama, adapters a and b, --parallel 1 and 2): a
burst of greedy and seeded streams over the base model and both adapters at mixed strengths, on
prompts that repeat themselves, gets on a --speculative-ngram 4 daemon every token id of each
stream's solo run on a daemon without drafting, and so does the same burst with "draft": false;
the drafting daemon's counters show drafts were accepted, greedy and seeded."""

from __future__ import annotations

import random
import urllib.request

import pytest

from tests.daemons import adapter_flags, burst_replies, post

# (model, adapter_strength or None): the base model, a at 1 and 0.5, b at 1.7
MODELS = (("tiny", None), ("a", None), ("a", 0.5), ("b", 1.7))
MAX_TOKENS = 40


def bodies(temperature: float, seed: int) -> list[dict]:
    """One request per model and prompt: a few random ids repeated, so the lookup finds them,
    and a random tiny model's continuation tends to loop (drafts it accepts), greedy or drawn
    from its top 3 (its logits are nearly flat: drawn from all, it hardly ever repeats)."""
    rng = random.Random(seed)
    out = []
    for i in range(8):
        unit = [rng.randrange(3, 390) for _ in range(rng.choice((3, 5, 8)))]
        model, strength = MODELS[i % len(MODELS)]
        body = {"model": model, "prompt": unit * 5, "max_tokens": MAX_TOKENS,
                "ignore_eos": True, "temperature": temperature, "top_k": 3,
                "seed": seed * 100 + i, "return_token_ids": True}
        if strength is not None:
            body["adapter_strength"] = strength
        out.append(body)
    return out


def token_ids(replies: list[dict]) -> list[list[int]]:
    return [reply["choices"][0]["token_ids"] for reply in replies]


def counter(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


@pytest.mark.parametrize("parallel", [1, 2])
def test_drafted_streams_equal_undrafted_solo_runs(start_lorad, tiny_adapters, parallel):
    flags = ("--parallel", str(parallel), "--kv-cache-blocks", "512", "--max-num-seqs", "32",
             *adapter_flags(tiny_adapters))
    drafting = start_lorad("--speculative-ngram", "4", *flags)
    reference = start_lorad(*flags)
    assert drafting.health()["speculative_ngram"] == 4
    assert reference.health()["speculative_ngram"] == 0
    for temperature, seed in ((0.0, 1), (0.5, 2)):  # greedy, then seeded
        batch = bodies(temperature, seed)
        solo = token_ids([post(f"{reference.url}/v1/completions", body)[1] for body in batch])
        assert all(len(ids) == MAX_TOKENS for ids in solo)
        # Bursts of 4: on the CPU a step drafts into the rows up to MIN_ROWS (8) that it
        # computes anyway, and past them only for a sequence whose last draft was wholly taken.
        accepted = counter(drafting.url, "lorad_draft_accepted_total")
        got = [*burst_replies(drafting.url, batch[:4]), *burst_replies(drafting.url, batch[4:])]
        assert token_ids(got) == solo
        assert counter(drafting.url, "lorad_draft_accepted_total") > accepted  # it did draft
        accepted = counter(drafting.url, "lorad_draft_accepted_total")
        off = [{**body, "draft": False} for body in batch]
        assert token_ids(burst_replies(drafting.url, off)) == solo
        assert counter(drafting.url, "lorad_draft_accepted_total") == accepted  # it did not
    drafted = counter(drafting.url, "lorad_draft_tokens_total")
    assert drafted >= counter(drafting.url, "lorad_draft_accepted_total") > 0
    assert counter(reference.url, "lorad_draft_tokens_total") == 0
    assert "n-gram drafting: up to 4 tokens a decode" in drafting.log()
    for daemon in (drafting, reference):
        assert daemon.stop() == 0, daemon.log()[-4000:]


def test_stop_strings_and_logprobs_decode_without_drafts(start_lorad):
    """Requests drafting leaves out (a stop string, logprobs) run one token a step on a drafting
    daemon, and equal a daemon without drafting."""
    drafting = start_lorad("--speculative-ngram", "4", "--kv-cache-blocks", "128")
    reference = start_lorad("--kv-cache-blocks", "128")
    batch = [{**body, "stop": ["\u00a7"]} for body in bodies(0.0, 1)[::4]]
    batch += [{**body, "logprobs": 1} for body in bodies(0.0, 1)[::4]]
    solo = [post(f"{reference.url}/v1/completions", body)[1]["choices"][0] for body in batch]
    mine = [post(f"{drafting.url}/v1/completions", body)[1]["choices"][0] for body in batch]
    assert mine == solo
    assert counter(drafting.url, "lorad_draft_tokens_total") == 0
    for daemon in (drafting, reference):
        assert daemon.stop() == 0, daemon.log()[-4000:]


def test_adapter_mix_compares_undrafted_runs(start_lorad, tiny_adapters):
    """scripts/adapter_mix.py --draft against a drafting daemon at --parallel 2: the burst and
    each pair's "draft": false run equal the solo runs of a daemon without drafting."""
    from tests.integration.test_adapter_mix import run_mix

    flags = ("--parallel", "2", "--kv-cache-blocks", "512", "--max-num-seqs", "48",
             *adapter_flags(tiny_adapters))
    drafting = start_lorad("--speculative-ngram", "4", *flags)
    reference = start_lorad(*flags)
    result = run_mix("--url", drafting.url, "--reference-url", reference.url, "--seeded",
                     "--draft", "--prompt-lengths", "8,60", "--burst", "4",
                     models=("tiny", "a@0.5", "b"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK: all 4 streams equal their solo runs, all 4 undrafted runs their solo runs" \
        in result.stdout
    assert counter(drafting.url, "lorad_draft_accepted_total") > 0
    for daemon in (drafting, reference):
        assert daemon.stop() == 0, daemon.log()[-4000:]
