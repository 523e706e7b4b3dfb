"""scripts/adapter_mix.py against real daemons (tiny Llama, adapters a and b, --parallel 2): a burst
mixing the base model and both adapters equals every stream's solo run (exit 0, clean table);
with the solo runs taken from a daemon that serves the same folders under swapped names, the
script exits 1 and names exactly the mismatched adapters."""

from __future__ import annotations

import subprocess
import sys

from tests.daemons import REPO, adapter_flags

SCRIPT = REPO / "scripts" / "adapter_mix.py"
MODELS = ("tiny", "a", "b")
NUM_PROMPTS = 4  # the script's built-in prompts
BURST = 2 * len(MODELS) * NUM_PROMPTS  # its default burst


def run_mix(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--models", ",".join(MODELS),
                           "--max-tokens", "16", "--ignore-eos", *flags],
                          capture_output=True, text=True, timeout=300)


def table(stdout: str) -> dict[str, tuple[int, ...]]:
    """model -> (solo, burst, match, mismatch) from the summary table."""
    rows = {}
    for line in stdout.splitlines():
        parts = line.split()
        if parts and parts[0] in MODELS and len(parts) == 6:
            rows[parts[0]] = tuple(int(p) for p in parts[1:5])
    return rows


def test_a_mixed_burst_equals_every_solo_run(adapter_daemon):
    result = run_mix("--url", adapter_daemon.url)
    assert result.returncode == 0, result.stdout + result.stderr
    per_model = BURST // len(MODELS)
    assert table(result.stdout) == {m: (NUM_PROMPTS, per_model, per_model, 0) for m in MODELS}
    assert f"OK: all {BURST} streams equal their solo runs" in result.stdout
    assert "MISMATCH" not in result.stdout


def test_a_chat_burst_equals_every_solo_run(adapter_daemon):
    result = run_mix("--url", adapter_daemon.url, "--chat", "--burst", "9")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK: all 9 streams equal their solo runs" in result.stdout


def test_mismatches_are_named_and_exit_nonzero(adapter_daemon, start_lorad, tiny_adapters):
    swapped = start_lorad("--parallel", "2", "--kv-cache-blocks", "128",
                          *adapter_flags({"a": tiny_adapters["b"], "b": tiny_adapters["a"]}))
    result = run_mix("--url", adapter_daemon.url, "--reference-url", swapped.url)
    assert result.returncode == 1, result.stdout + result.stderr
    per_model = BURST // len(MODELS)
    assert table(result.stdout) == {"tiny": (NUM_PROMPTS, per_model, per_model, 0),
                                    "a": (NUM_PROMPTS, per_model, 0, per_model),
                                    "b": (NUM_PROMPTS, per_model, 0, per_model)}
    named = {line.split()[1] for line in result.stdout.splitlines()
             if line.startswith("MISMATCH")}
    assert named == {"a", "b"}
    assert f"{2 * per_model} of {BURST} streams differ" in result.stderr
    assert "(models: a, b)" in result.stderr
