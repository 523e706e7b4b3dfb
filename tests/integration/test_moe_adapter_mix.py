"""scripts/adapter_mix.py against a real daemon serving a tiny Qwen2-MoE at --parallel 2 with
two adapters (`a` on every servable projection, `b` on the two writers into the residual:
o_proj and the shared expert's down_proj): a burst mixing the base model and both adapters,
greedy and seeded, over prompts of 8, 60 and 150 random token ids prefilled in chunks of 32
beside the other streams' decodes, equals every stream's solo run by token ids."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.daemons import REPO, adapter_flags, start_daemon
from tests.integration.test_adapter_mix import table
from tests.tiny_adapters import make_peft_adapter
from tests.tiny_models import make_tiny_qwen2_moe

SCRIPT = REPO / "scripts" / "adapter_mix.py"
MODELS = ("tiny-moe", "a", "b")


@pytest.fixture(scope="module")
def moe_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_mix")
    base = make_tiny_qwen2_moe(root / "tiny-moe", seed=8)
    adapters = {"a": make_peft_adapter(base, root / "a", r=4, seed=31),
                "b": make_peft_adapter(base, root / "b", r=8, lora_alpha=8, seed=32,
                                       target_modules=("o_proj", "shared_expert.down_proj"))}
    return base, adapters


@pytest.fixture(scope="module")
def moe_daemon(moe_files):
    base, adapters = moe_files
    daemon = start_daemon(base, "--name", "tiny-moe", "--parallel", "2",
                          "--kv-cache-blocks", "512", "--max-num-seqs", "48",
                          "--max-num-batched-tokens", "32", *adapter_flags(adapters))
    pids = daemon.worker_pids()
    yield daemon
    assert daemon.stop() == 0, daemon.log()[-4000:]
    daemon.assert_cleaned_up(pids)


def test_a_mixed_moe_burst_equals_every_solo_run(moe_daemon):
    result = subprocess.run([sys.executable, str(SCRIPT), "--url", moe_daemon.url,
                             "--models", ",".join(MODELS), "--max-tokens", "16", "--ignore-eos",
                             "--seeded", "--prompt-lengths", "8,60,150"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    burst = 2 * len(MODELS) * 3 * 2  # models x prompts x modes, twice
    per_row = burst // (2 * len(MODELS))
    assert table(result.stdout, MODELS) == {(m, mode): (3, per_row, per_row, 0)
                                            for m in MODELS for mode in ("greedy", "seeded")}
    assert "compared by token ids" in result.stdout
    assert f"OK: all {burst} streams equal their solo runs" in result.stdout


def test_moe_adapters_from_a_folder_in_one_slot_equal_them_given_at_start(moe_files, moe_daemon):
    """The same adapters served by name from --adapter-dir in one device slot (slot tables on
    the projections each MoE layer has): the burst equals the start-adapter daemon's solo
    runs."""
    base, adapters = moe_files
    library = adapters["a"].parent
    daemon = start_daemon(base, "--name", "tiny-moe", "--parallel", "2",
                          "--kv-cache-blocks", "512", "--max-num-seqs", "48",
                          "--max-num-batched-tokens", "32", "--adapter-dir", str(library),
                          "--max-gpu-adapters", "1")
    try:
        result = subprocess.run([sys.executable, str(SCRIPT), "--url", daemon.url,
                                 "--reference-url", moe_daemon.url, "--models",
                                 ",".join(MODELS), "--max-tokens", "16", "--ignore-eos",
                                 "--prompt-lengths", "8,60"],
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "streams equal their solo runs" in result.stdout
    finally:
        assert daemon.stop() == 0, daemon.log()[-4000:]
    # No --max-cpu-adapters: each rank sized its host cache from its host's memory.
    sized = re.findall(r"rank (\d)\] INFO adapter host cache: up to (\d+) adapters .*"
                       r"--max-cpu-adapters auto: .* 2 rank\(s\) on this host", daemon.log())
    assert sorted(rank for rank, _ in sized) == ["0", "1"], daemon.log()[-4000:]
    assert all(int(size) > 0 for _, size in sized)
