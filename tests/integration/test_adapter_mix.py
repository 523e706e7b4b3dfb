"""scripts/adapter_mix.py against real daemons (tiny Llama, adapters a and b, --parallel 2): a burst
mixing the base model and both adapters equals every stream's solo run by token ids (exit 0,
clean table), also greedy and seeded over prompts of 8, 60 and 150 random token ids prefilled in
chunks of 32 beside the other streams' decodes, and at --threads 2 (solo runs at one thread);
re-chunked against one chunk; at mixed strengths (NAME@S), resumed from the prefix cache
against cold, at --parallel 1, 2 and 3; with the solo runs taken from a daemon that serves the
same folders under swapped names, or another model under the same name, the script exits 1 and
names exactly the mismatched model ids."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from tests.daemons import REPO, adapter_flags, burst_replies, post, start_daemon
from tests.tiny_adapters import make_peft_adapter
from tests.tiny_models import make_tiny_llama

SCRIPT = REPO / "scripts" / "adapter_mix.py"
MODELS = ("tiny", "a", "b")
NUM_PROMPTS = 4  # the script's built-in prompts
BURST = 2 * len(MODELS) * NUM_PROMPTS  # its default burst
LENGTHS = "8,60,150"  # the tiny model's context is 256


def run_mix(*flags: str, models: tuple[str, ...] = MODELS) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--models", ",".join(models),
                           "--max-tokens", "16", "--ignore-eos", *flags],
                          capture_output=True, text=True, timeout=300)


def table(stdout: str, models: tuple[str, ...] = MODELS) -> dict[tuple[str, str], tuple]:
    """(model, mode) -> (solo, burst, match, mismatch) from the summary table."""
    rows = {}
    for line in stdout.splitlines():
        parts = line.split()
        if parts and parts[0] in models and len(parts) == 7:
            rows[parts[0], parts[1]] = tuple(int(p) for p in parts[2:6])
    return rows


@pytest.fixture(scope="module")
def chunking_daemon(tiny_model, tiny_adapters):
    """adapter_daemon's setup with prefill chunks of at most 32 tokens."""
    daemon = start_daemon(tiny_model, "--parallel", "2", "--kv-cache-blocks", "512",
                          "--max-num-seqs", "48", "--max-num-batched-tokens", "32",
                          *adapter_flags(tiny_adapters))
    yield daemon
    assert daemon.stop() == 0, daemon.log()[-4000:]


def test_a_mixed_burst_equals_every_solo_run(adapter_daemon):
    result = run_mix("--url", adapter_daemon.url)
    assert result.returncode == 0, result.stdout + result.stderr
    per_model = BURST // len(MODELS)
    assert table(result.stdout) == {(m, "greedy"): (NUM_PROMPTS, per_model, per_model, 0)
                                    for m in MODELS}
    assert "compared by token ids" in result.stdout and "warning" not in result.stderr
    assert f"OK: all {BURST} streams equal their solo runs" in result.stdout
    assert "MISMATCH" not in result.stdout


def test_a_chat_burst_equals_every_solo_run(adapter_daemon):
    result = run_mix("--url", adapter_daemon.url, "--chat", "--burst", "9")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK: all 9 streams equal their solo runs" in result.stdout


def test_seeded_streams_of_mixed_prompt_lengths_equal_their_solo_runs(chunking_daemon):
    result = run_mix("--url", chunking_daemon.url, "--seeded", "--prompt-lengths", LENGTHS)
    assert result.returncode == 0, result.stdout + result.stderr
    burst = 2 * len(MODELS) * 3 * 2  # models x prompts x modes, twice
    per_row = burst // (2 * len(MODELS))
    assert table(result.stdout) == {(m, mode): (3, per_row, per_row, 0)
                                    for m in MODELS for mode in ("greedy", "seeded")}
    assert "prompts of 8/60/150 token ids < 400" in result.stdout  # the vocabulary, asked
    assert f"OK: all {burst} streams equal their solo runs" in result.stdout


def test_prompts_rechunked_equal_their_runs_in_one_chunk(chunking_daemon, adapter_daemon):
    """The same burst with prefill chunks of at most 32 tokens, against solo runs on a daemon
    that prefills each prompt in one chunk (--max-num-batched-tokens 512), cold: a prompt's
    tokens do not depend on its chunking, greedy or seeded."""
    result = run_mix("--url", chunking_daemon.url, "--reference-url", adapter_daemon.url,
                     "--seeded", "--prompt-lengths", LENGTHS, "--resume")
    assert result.returncode == 0, result.stdout + result.stderr
    burst = 2 * len(MODELS) * 3 * 2  # models x prompts x modes, twice
    assert f"OK: all {burst} streams equal their solo runs, all {burst // 2} resumed runs " \
           "their cold runs" in result.stdout


@pytest.fixture(scope="module")
def three_kv_heads(tmp_path_factory):
    """A tiny Llama whose 3 key-value heads split over 3 ranks, and adapters like tiny_adapters'."""
    root = tmp_path_factory.mktemp("three")
    model = make_tiny_llama(root / "tiny", hidden_size=96, num_attention_heads=6,
                            num_key_value_heads=3, intermediate_size=192, seed=11)
    return model, {"a": make_peft_adapter(model, root / "a", r=4, seed=12),
                   "b": make_peft_adapter(model, root / "b", r=8, lora_alpha=8, seed=13,
                                          target_modules=("q_proj", "v_proj", "down_proj"))}


@pytest.mark.parametrize("parallel", [1, 2, 3])
def test_mixed_strengths_and_resumed_prompts_equal_cold_solo_runs(start_lorad, three_kv_heads,
                                                                  parallel):
    """A burst of 32 greedy and seeded streams over the base model, adapter a at strengths 1 and
    0.5 and b at 1.7, prompts of 8, 60 and 150 token ids in chunks of at most 32: each stream
    equals its cold solo run (cache_prompt false), and so does each pair run again with its
    prompt's blocks in the prefix cache, at --parallel 1, 2 and 3 (rank-ordered sums), on a tiny
    Llama of 3 key-value heads. At --parallel 1 with --async-scheduling: decode steps run ahead
    of their apply (the GPU's default), on the CPU here."""
    model, adapters = three_kv_heads
    run_ahead = ("--async-scheduling",) if parallel == 1 else ()
    daemon = start_lorad("--parallel", str(parallel), "--kv-cache-blocks", "512",
                         "--max-num-seqs", "32", "--max-num-batched-tokens", "32", *run_ahead,
                         *adapter_flags(adapters), model_dir=model)
    models = ("tiny", "a", "a@0.5", "b@1.7")
    result = run_mix("--url", daemon.url, "--seeded", "--prompt-lengths", LENGTHS,
                     "--burst", "32", "--resume", models=models)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = table(result.stdout, models)
    assert sum(burst for _, burst, _, _ in rows.values()) == 32
    assert all(match == burst and mismatch == 0 for _, burst, match, mismatch in rows.values())
    assert {spec for spec, _ in rows} == set(models)
    solo = sum(num for num, _, _, _ in rows.values())
    assert f"OK: all 32 streams equal their solo runs, all {solo} resumed runs their cold " \
           "runs" in result.stdout
    health = daemon.health()
    assert health["prefix_cache"]["cached_tokens"] > 0  # the resumed runs did resume
    assert ("async scheduling: step" in daemon.log()) == bool(run_ahead)
    assert daemon.stop() == 0, daemon.log()[-4000:]


def test_two_threads_give_one_threads_bits(start_lorad, tiny_adapters):
    """A worker at --threads 2, its steps of at most 10 rows (prefill chunks and decodes of 9 to
    11 rows: where threaded MKL splits a product differently, batch.product_rows): a burst of 10
    greedy and seeded requests over the base model and both adapters, prompts of 5 to 150
    token ids, gets every token and every token's logprob (the logits' bits) of each request's
    solo run on a daemon at one thread."""
    flags = ("--kv-cache-blocks", "512", *adapter_flags(tiny_adapters))
    threaded = start_lorad("--threads", "2", "--max-num-seqs", "10",
                           "--max-num-batched-tokens", "10", *flags)
    reference = start_lorad("--threads", "1", *flags)
    rng = random.Random(3)
    bodies = [{"model": MODELS[i % 3], "prompt": [rng.randrange(3, 390) for _ in range(length)],
               "max_tokens": 12, "ignore_eos": True, "logprobs": 1,
               "temperature": 0.0 if i % 2 else 0.8, "seed": i}
              for i, length in enumerate((5, 9, 150, 11, 60, 10, 33, 7, 120, 64))]
    burst = [(r["choices"][0]["text"], r["choices"][0]["logprobs"]["token_logprobs"])
             for r in burst_replies(threaded.url, bodies)]
    solo = [(r["choices"][0]["text"], r["choices"][0]["logprobs"]["token_logprobs"])
            for r in (post(f"{reference.url}/v1/completions", body)[1] for body in bodies)]
    assert [len(lp) for _, lp in solo] == [12] * len(bodies)
    assert burst == solo
    assert threaded.stop() == 0, threaded.log()[-4000:]


def test_mismatches_are_named_and_exit_nonzero(adapter_daemon, start_lorad, tiny_adapters):
    swapped = start_lorad("--parallel", "2", "--kv-cache-blocks", "128",
                          *adapter_flags({"a": tiny_adapters["b"], "b": tiny_adapters["a"]}))
    result = run_mix("--url", adapter_daemon.url, "--reference-url", swapped.url)
    assert result.returncode == 1, result.stdout + result.stderr
    per_model = BURST // len(MODELS)
    assert table(result.stdout) == {("tiny", "greedy"): (NUM_PROMPTS, per_model, per_model, 0),
                                    ("a", "greedy"): (NUM_PROMPTS, per_model, 0, per_model),
                                    ("b", "greedy"): (NUM_PROMPTS, per_model, 0, per_model)}
    named = {line.split()[1] for line in result.stdout.splitlines()
             if line.startswith("MISMATCH")}
    assert named == {"a", "b"}
    assert f"{2 * per_model} of {BURST} streams differ" in result.stderr
    assert "(models: a, b)" in result.stderr


def test_another_model_as_the_reference_is_a_mismatch(chunking_daemon, start_lorad,
                                                      tmp_path_factory):
    """The same id served from other random weights: every stream differs, greedy and seeded,
    even where neither model shows any text."""
    other = make_tiny_llama(tmp_path_factory.mktemp("other") / "other", seed=7)
    reference = start_lorad("--name", "tiny", "--kv-cache-blocks", "128", model_dir=other)
    result = run_mix("--url", chunking_daemon.url, "--reference-url", reference.url,
                     "--seeded", "--prompt-lengths", "8,60", models=("tiny",))
    assert result.returncode == 1, result.stdout + result.stderr
    assert table(result.stdout, ("tiny",)) == {("tiny", "greedy"): (2, 4, 0, 4),
                                               ("tiny", "seeded"): (2, 4, 0, 4)}
    mismatched = [line for line in result.stdout.splitlines() if line.startswith("MISMATCH")]
    assert len(mismatched) == 8 and all("ids differ from token" in m for m in mismatched)
    assert "8 of 8 streams differ" in result.stderr and "(models: tiny)" in result.stderr


def test_adapters_taking_turns_in_one_slot_equal_resident_ones(adapter_daemon, start_lorad,
                                                              tiny_adapters):
    """Two adapters sharing one device slot (--max-gpu-adapters 1): a seeded burst over the base
    model and both equals the solo runs of a daemon where both stay resident, and the slot
    changed hands (evictions and loads in /metrics)."""
    turns = start_lorad("--parallel", "2", "--kv-cache-blocks", "512", "--max-num-seqs", "48",
                        "--max-gpu-adapters", "1", "--max-num-batched-tokens", "32",
                        *adapter_flags(tiny_adapters))
    result = run_mix("--url", turns.url, "--reference-url", adapter_daemon.url, "--seeded",
                     "--prompt-lengths", LENGTHS)
    assert result.returncode == 0, result.stdout + result.stderr
    burst = 2 * len(MODELS) * 3 * 2
    assert f"OK: all {burst} streams equal their solo runs" in result.stdout
    ranks = turns.health()["ranks"]
    assert all(r["adapter_slots"] == 1 and r["adapter_evictions"] >= 1 for r in ranks), ranks
