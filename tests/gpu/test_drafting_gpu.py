"""Issue 33 on one GPU (bf16, decode and mixed-step CUDA graphs, prompt chunks of at most 96
tokens, up to 64 sequences): n-gram drafting keeps every stream's tokens, at bursts of 1, 8, 32
and 64, greedy and seeded, over the base model and three adapters at mixed strengths.

- A drafting daemon (--speculative-ngram 4) against a reference daemon without drafting that
  prefills each prompt in one chunk: each burst's token ids equal the solo runs on the
  reference, the drafting daemon's counters show accepted drafts, and the burst of 64 again
  with "draft": false equals them too.
- scripts/adapter_mix.py over the same pair: a burst of 64 over random prompts of 8, 60 and 150
  ids (chunks beside decodes and drafted rows) equals the solo runs, the prefix-cache resumes
  equal the cold runs, the undrafted runs equal the solo runs.

The CPU's versions: tests/integration/test_ngram_draft.py and test_adapter_mix.py.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.daemons import adapter_flags, burst_replies, post, start_daemon
from tests.integration.test_adapter_mix import run_mix
from tests.integration.test_ngram_draft import counter, token_ids
from tests.tiny_adapters import make_peft_adapter

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ON_GPU = ("--parallel", "1", "--device", "cuda", "--dtype", "bfloat16", "--kv-cache-blocks",
          "1024", "--max-num-seqs", "64")
# (model, adapter_strength or None)
MODELS = (("tiny", None), ("a", None), ("a", 0.5), ("b", 1.7), ("c", 0.8))
MAX_TOKENS = 32
BURSTS = (1, 8, 32, 64)


@pytest.fixture(scope="module")
def pair(tiny_model, tiny_adapters, tmp_path_factory):
    """(drafting daemon, reference daemon) over the base model and adapters a, b and c."""
    c = make_peft_adapter(tiny_model, tmp_path_factory.mktemp("c") / "c", r=2, lora_alpha=4,
                          seed=3, target_modules=("k_proj", "gate_proj", "up_proj"))
    flags = (*adapter_flags({**tiny_adapters, "c": c}), *ON_GPU)
    drafting = start_daemon(tiny_model, "--speculative-ngram", "4",
                            "--max-num-batched-tokens", "96", *flags)
    reference = start_daemon(tiny_model, *flags)
    for daemon in (drafting, reference):
        assert "captured CUDA graphs of decode steps" in daemon.log(), daemon.log()[-3000:]
    assert drafting.health()["speculative_ngram"] == 4
    yield drafting, reference
    for daemon in (drafting, reference):
        assert daemon.stop() == 0, daemon.log()[-3000:]


def bodies(temperature: float, seed: int, count: int) -> list[dict]:
    """Prompts of a few random ids repeated (the lookup finds them; a random tiny model's
    continuation tends to loop, so drafts are taken), one model and strength each in turn."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        unit = [rng.randrange(3, 390) for _ in range(rng.choice((3, 5, 8, 13)))]
        model, strength = MODELS[i % len(MODELS)]
        body = {"model": model, "prompt": unit * rng.choice((3, 5, 9)),
                "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": temperature,
                "top_k": 3, "seed": seed * 1000 + i, "return_token_ids": True}
        if strength is not None:
            body["adapter_strength"] = strength
        out.append(body)
    return out


@pytest.mark.parametrize("temperature, seed", [(0.0, 1), (0.5, 2)], ids=["greedy", "seeded"])
def test_drafted_bursts_of_1_to_64_equal_undrafted_solo_runs(pair, temperature, seed):
    drafting, reference = pair
    batch = bodies(temperature, seed, max(BURSTS))
    solo = token_ids([post(f"{reference.url}/v1/completions", body)[1] for body in batch])
    assert all(len(ids) == MAX_TOKENS for ids in solo)
    taken = {}  # burst size -> draft tokens the burst's streams took
    for size in BURSTS:
        accepted = counter(drafting.url, "lorad_draft_accepted_total")
        got = token_ids(burst_replies(drafting.url, batch[:size]))
        differ = [i for i in range(size) if got[i] != solo[i]]
        assert not differ, f"burst of {size}: streams {differ} differ from their solo runs"
        taken[size] = counter(drafting.url, "lorad_draft_accepted_total") - accepted
    # One seeded stream may never loop; every larger burst takes drafts.
    assert all(taken[size] > 0 for size in BURSTS if size > 1), taken
    accepted = counter(drafting.url, "lorad_draft_accepted_total")
    undrafted = token_ids(burst_replies(drafting.url, [{**b, "draft": False} for b in batch]))
    assert undrafted == solo
    assert counter(drafting.url, "lorad_draft_accepted_total") == accepted


def test_adapter_mix_burst_of_64_resumed_and_undrafted(pair):
    drafting, reference = pair
    models = ("tiny", "a", "a@0.5", "b@1.7", "c@0.8")
    result = run_mix("--url", drafting.url, "--reference-url", reference.url, "--seeded",
                     "--resume", "--draft", "--prompt-lengths", "8,60,150", "--burst", "64",
                     models=models)
    assert result.returncode == 0, result.stdout + result.stderr
    # 5 model ids x 3 prompts x 2 modes = 30 pairs, each resumed and undrafted once
    assert "OK: all 64 streams equal their solo runs, all 30 resumed runs their cold runs, " \
           "all 30 undrafted runs their solo runs" in result.stdout
