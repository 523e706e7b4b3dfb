"""scripts/adapter_mix.py against a daemon on one GPU (bf16, decode CUDA graphs captured, prefill
chunks of at most 32 tokens) serving the tiny model with adapters a, b and c: a burst of 24
streams over the base model and the three adapters, greedy and seeded, over prompts of 8, 60 and
150 random token ids (the long ones prefilled in chunks beside the others' decodes), gives every
stream its solo run's token ids; so does a greedy chat burst.

The checks are tests/integration/test_adapter_mix.py's, run with a daemon placed on the GPU.
"""

from __future__ import annotations

import pytest
import torch

from tests.daemons import adapter_flags, start_daemon
from tests.integration.test_adapter_mix import LENGTHS, run_mix, table
from tests.tiny_adapters import make_peft_adapter

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MODELS = ("tiny", "a", "b", "c")
MODES = ("greedy", "seeded")
ON_GPU = ("--parallel", "1", "--device", "cuda", "--dtype", "bfloat16", "--kv-cache-blocks",
          "512", "--max-num-seqs", "48", "--max-num-batched-tokens", "32")


@pytest.fixture(scope="module")
def served(tiny_model, tiny_adapters, tmp_path_factory):
    c = make_peft_adapter(tiny_model, tmp_path_factory.mktemp("c") / "c", r=2, lora_alpha=4,
                          seed=3, target_modules=("k_proj", "gate_proj", "up_proj"))
    daemon = start_daemon(tiny_model, *adapter_flags({**tiny_adapters, "c": c}), *ON_GPU)
    assert "captured CUDA graphs of decode steps" in daemon.log(), daemon.log()[-3000:]
    yield daemon
    assert daemon.stop() == 0, daemon.log()[-3000:]


def test_a_burst_of_24_greedy_and_seeded_over_mixed_prompt_lengths(served):
    result = run_mix("--url", served.url, "--seeded", "--prompt-lengths", LENGTHS, "--burst",
                     "24", models=MODELS)
    assert result.returncode == 0, result.stdout + result.stderr
    # 4 model ids x 3 prompts x 2 modes: every (model, prompt, mode) once, solo and in the burst.
    assert table(result.stdout, MODELS) == {(m, mode): (3, 3, 3, 0)
                                            for m in MODELS for mode in MODES}
    assert "compared by token ids" in result.stdout
    assert "OK: all 24 streams equal their solo runs" in result.stdout


def test_a_greedy_chat_burst_of_24(served):
    result = run_mix("--url", served.url, "--chat", "--burst", "24", models=MODELS)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK: all 24 streams equal their solo runs" in result.stdout
