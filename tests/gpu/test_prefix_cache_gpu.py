"""The prefix cache and its disk spill on one GPU (bf16, decode CUDA graphs captured, prefill
chunks of at most 32 tokens): a prompt resumed from cached blocks, from the spill in the same run
and after a restart, gives the tokens its cold run gives (greedy and seeded), and a burst over a
shared prefix gives every stream its cold tokens. The checks are tests/integration's, with the
daemon placed on the GPU; tokens are compared exactly, log probabilities within bf16's rounding.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.daemons import adapter_flags, start_daemon
from tests.integration.test_kv_spill import evict_everything
from tests.integration.test_prefix_cache import (BLOCK, HIT, base_id, check_resumed,
                                                 fresh_prompt, run)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ON_GPU = ("--parallel", "1", "--device", "cuda", "--dtype", "bfloat16", "--max-num-seqs", "16",
          "--max-num-batched-tokens", "32")


def same_tokens(got, want) -> None:
    (tokens, values), (want_tokens, want_values) = got, want
    assert tokens == want_tokens
    assert max(abs(a - b) for a, b in zip(values, want_values)) < 5e-2


@pytest.fixture(scope="module")
def served(tiny_model, tiny_adapters):
    daemon = start_daemon(tiny_model, *adapter_flags(tiny_adapters), *ON_GPU,
                          "--kv-cache-blocks", "256")
    assert "captured CUDA graphs of decode steps" in daemon.log(), daemon.log()[-3000:]
    yield daemon
    assert daemon.stop() == 0, daemon.log()[-3000:]


@pytest.mark.parametrize("seed", [None, 5], ids=["greedy", "seeded"])
@pytest.mark.parametrize("model", ["base", "a"])
def test_a_resumed_prompt_gives_the_cold_tokens(served, model, seed):
    check_resumed(served.url, base_id(served) if model == "base" else model, seed, same_tokens)


def test_a_burst_over_a_shared_prefix_gives_the_cold_tokens(served):
    import threading

    system = fresh_prompt(3 * BLOCK)
    bodies = [(m, system + fresh_prompt(20 + 7 * i))
              for i, m in enumerate([base_id(served), "a", "b", "a", "b", "a"])]
    cold = [run(served.url, m, p, cache=False)[0] for m, p in bodies]
    results: list = [None] * len(bodies)
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, run(served.url,
                                                                                *bodies[i])))
               for i in range(len(bodies))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for (got, _), want in zip(results, cold):
        same_tokens(got, want)


def test_spilled_blocks_give_the_cold_tokens_after_a_restart(tiny_model, tiny_adapters,
                                                              tmp_path):
    flags = [*ON_GPU, "--kv-cache-blocks", "40", "--kv-spill-dir", str(tmp_path / "spill"),
             *adapter_flags({"a": tiny_adapters["a"]})]
    prompt = fresh_prompt()
    daemon = start_daemon(tiny_model, *flags)
    try:
        cold, _ = run(daemon.url, "a", prompt, cache=False)
        run(daemon.url, "a", prompt)
        evict_everything(daemon.url, "a", random.Random(5))
        got, cached = run(daemon.url, "a", prompt)
        assert cached == HIT
        same_tokens(got, cold)
    finally:
        assert daemon.stop() == 0, daemon.log()[-3000:]
    again = start_daemon(tiny_model, *flags)
    try:
        got, cached = run(again.url, "a", prompt)
        assert cached == HIT
        same_tokens(got, cold)
    finally:
        assert again.stop() == 0, again.log()[-3000:]
