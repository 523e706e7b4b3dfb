"""lorad at --parallel 2 over NCCL on two GPUs (issue 6): logits at world 2 against world 1 and
peft, a real daemon serving a mixed-adapter burst equal to each stream's solo run with per-step
agreement, and faults (kill -9 of a worker, one rank raising in a step) ending every stream with
an error and leaving no rank in a collective. Each test runs one part of
scripts/multi_gpu_checks.py in a subprocess, which prints a PASS/FAIL line per check; the benchmark
part is left to scripts/multi_gpu_session.sh. Skipped unless two CUDA devices are visible.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason="needs two CUDA devices"),
]

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = {"logits": 200, "serve": 240, "faults": 300}


@pytest.mark.parametrize("part", list(TIMEOUT_S))
def test_two_gpus_nccl(part, tmp_path):
    env = {**os.environ, "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE", "0"),
           "PYTHONUNBUFFERED": "1"}
    flags = [] if part == "logits" else ["--dtype", "bfloat16"]
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts/multi_gpu_checks.py"), part, "--device", "cuda",
         "--backend", "nccl", "--work", str(tmp_path), *flags],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S[part])
    failed = [line for line in proc.stdout.splitlines() if line.startswith("FAIL ")]
    assert proc.returncode == 0 and not failed, (
        "\n".join(failed) + "\n" + proc.stdout[-4000:] + proc.stderr[-2000:])
