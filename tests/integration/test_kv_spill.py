"""The disk spill through real daemons: prefix-cache blocks evicted from a small KV pool are
written to --kv-spill-dir and read back for a later prompt, in the same daemon and after a
restart, at --parallel 1 and 2, each resumed prompt equal to its cold run (tokens and log
probabilities); a corrupted spill (a flipped bit, a truncated file, a manifest line that is not
hex, a manifest of another --parallel) is detected with a log line, dropped or recomputed, and
the answer stays the cold one.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest

from lorad.workers.prefix_cache import block_hash, root_hash
from tests.daemons import adapter_flags, post, start_daemon

BLOCK = 16
PROMPT_LEN = 120  # 7 full blocks before the last token's
HIT = 7 * BLOCK
POOL = ["--kv-cache-blocks", "40", "--max-num-seqs", "2"]  # 40 blocks: eviction comes quickly


def run(url: str, model: str, prompt: list[int], cache: bool = True) -> tuple[list, int]:
    body = {"model": model, "prompt": prompt, "max_tokens": 6, "ignore_eos": True,
            "temperature": 0, "logprobs": 1, "cache_prompt": cache}
    status, answer = post(f"{url}/v1/completions", body)
    assert status == 200, answer
    logprobs = answer["choices"][0]["logprobs"]
    return ((logprobs["tokens"], logprobs["token_logprobs"]),
            answer["usage"]["prompt_tokens_details"]["cached_tokens"])


def evict_everything(url: str, model: str, rng: random.Random) -> None:
    """Prompts that fill the pool many times over, so every earlier cached block is evicted."""
    for _ in range(5):
        run(url, model, [rng.randrange(3, 300) for _ in range(200)])


def block_files(spill: Path, key: str, prompt: list[int], rank: int = 0) -> list[Path]:
    """The spill files of the prompt's first full blocks on one rank, by their chain hashes."""
    parent, files = root_hash(key), []
    for i in range(PROMPT_LEN // BLOCK):
        parent = block_hash(parent, prompt[i * BLOCK:(i + 1) * BLOCK])
        files.append(spill / f"rank-{rank}" / parent.hex()[:2] / f"{parent.hex()}.kv")
    return files


def spill_counts(daemon, ready=lambda counts: True) -> list[dict]:
    """Each rank's spill counts, once `ready` holds for them (the ranks report every 0.25 s)."""
    deadline = time.monotonic() + 5
    while True:
        counts = [{k: r[k] for k in r if k.startswith("spill_")} for r in daemon.health()["ranks"]]
        if ready(counts) or time.monotonic() > deadline:
            return counts
        time.sleep(0.1)


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    rng = random.Random(77)
    return [rng.randrange(3, 300) for _ in range(PROMPT_LEN)]


@pytest.mark.parametrize("parallel", [1, 2])
def test_spilled_blocks_serve_again_and_after_a_restart(tiny_model, tiny_adapters, tmp_path,
                                                         prompt, parallel):
    spill = tmp_path / "spill"
    flags = ["--parallel", str(parallel), *POOL, "--kv-spill-dir", str(spill),
             *adapter_flags({"a": tiny_adapters["a"]})]
    daemon = start_daemon(tiny_model, *flags)
    try:
        key = _key(daemon)
        cold, _ = run(daemon.url, "a", prompt, cache=False)
        assert run(daemon.url, "a", prompt) == (cold, 0)
        evict_everything(daemon.url, "a", random.Random(1))
        written = lambda counts: all(c["spill_writes"] >= 7 for c in counts)  # noqa: E731
        assert written(spill_counts(daemon, written))
        assert run(daemon.url, "a", prompt) == (cold, HIT)  # read back from the disk
        read = lambda counts: all(c["spill_reads"] >= 7 for c in counts)  # noqa: E731
        assert read(spill_counts(daemon, read))
    finally:
        assert daemon.stop() == 0, daemon.log()[-3000:]
    assert all(path.is_file() for path in block_files(spill, key, prompt))
    again = start_daemon(tiny_model, *flags)
    try:
        assert run(again.url, "a", prompt) == (cold, HIT)  # an empty pool: all from the disk
    finally:
        assert again.stop() == 0, again.log()[-3000:]


def _key(daemon) -> str:
    """Adapter a's identity key, as /health lists it."""
    return next(a["key"] for a in daemon.health()["adapters"] if a["name"] == "a")


def test_a_corrupted_spill_is_detected_and_recomputed(tiny_model, tiny_adapters, tmp_path,
                                                      prompt):
    spill = tmp_path / "spill"
    flags = ["--parallel", "2", *POOL, "--kv-spill-dir", str(spill),
             *adapter_flags({"a": tiny_adapters["a"]})]
    daemon = start_daemon(tiny_model, *flags)
    try:
        key = _key(daemon)
        cold, _ = run(daemon.url, "a", prompt, cache=False)
        run(daemon.url, "a", prompt)
        evict_everything(daemon.url, "a", random.Random(2))
    finally:
        assert daemon.stop() == 0, daemon.log()[-3000:]
    files = block_files(spill, key, prompt, rank=1)
    # A flipped bit in rank 1's 4th block, a truncated 6th block on rank 1, a manifest line
    # that is not a hex digest on rank 0.
    data = bytearray(files[3].read_bytes())
    data[-5] ^= 0x10
    files[3].write_bytes(bytes(data))
    files[5].write_bytes(files[5].read_bytes()[:100])
    with open(spill / "rank-0" / "manifest.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"hash": "zz" * 16, "file": "zz/zz.kv", "bytes": 10}) + "\n")
    again = start_daemon(tiny_model, *flags)
    try:
        # Blocks 0-2 come from the disk; the 4th fails its checksum on rank 1, so it and the rest
        # are recomputed on every rank; the answer is the cold one.
        assert run(again.url, "a", prompt) == (cold, 3 * BLOCK)
        # Rank 0 read all five blocks the ranks share (the truncated 6th is rank 1's loss).
        counts = spill_counts(again, lambda c: c[0]["spill_reads"] == 5
                              and c[1]["spill_read_failures"] == 1)
        assert counts[1]["spill_read_failures"] == 1 and counts[1]["spill_drops"] >= 2, counts
        assert counts[0]["spill_drops"] >= 1, counts
        # The blocks recomputed now are cached again: the next run takes all seven from memory.
        assert run(again.url, "a", prompt) == (cold, HIT)
    finally:
        assert again.stop() == 0
    log = again.log()
    for words in ("fails its checksum", "hex digest", "truncated"):
        assert words in log, (words, log[-4000:])
    # The same folder at another --parallel: rank 0's manifest belongs to another shard layout.
    other = start_daemon(tiny_model, "--parallel", "1", *POOL, "--kv-spill-dir", str(spill),
                         *adapter_flags({"a": tiny_adapters["a"]}))
    try:
        assert run(other.url, "a", prompt) == (run(other.url, "a", prompt, cache=False)[0], 0)
    finally:
        assert other.stop() == 0
    assert "another identity: parallel 2" in other.log(), other.log()[-4000:]
