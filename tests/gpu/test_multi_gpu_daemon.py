"""A real daemon at --parallel 2 over NCCL on two GPUs (bf16) with adapters a and b: it starts
(every rank agrees on the registry), a burst mixing the base model and both adapters equals each
stream's solo run (scripts/adapter_mix.py), one rank applying a wrong slot fails that step on
every rank while serving goes on, and a worker killed with SIGKILL (rank 1 or rank 0) or raising
in a step ends every open stream with an error and leaves no worker behind.

The checks are the CPU ones of tests/integration (test_adapter_mix.py, test_adapter_faults.py,
test_worker_faults.py, on gloo), called here with a daemon placed on the GPUs. Skipped unless
two CUDA devices are visible.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from tests.daemons import adapter_flags
from tests.integration import test_adapter_mix, test_worker_faults
from tests.integration.test_adapter_faults import (
    test_a_wrong_slot_on_one_rank_fails_the_step_everywhere_and_serving_goes_on as wrong_slot)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason="needs two CUDA devices"),
]

# After the tests' own flags, so these win: argparse keeps the last of a repeated flag.
ON_GPUS = ("--parallel", "2", "--device", "cuda", "--dist-backend", "nccl", "--dtype",
           "bfloat16", "--kv-cache-blocks", "512", "--max-num-seqs", "48")


@pytest.fixture
def start_on_gpus(start_lorad):
    """start_lorad with the daemon placed on two GPUs over NCCL (the tiny model's head_dim of 16
    is the least the GPU attention kernels take)."""
    def start(*flags: str, **options):
        return start_lorad(*flags, *ON_GPUS, **options)
    return start


def test_starts_and_a_mixed_burst_equals_every_solo_run(start_on_gpus, tiny_adapters):
    daemon = start_on_gpus(*adapter_flags(tiny_adapters))
    pids = daemon.worker_pids()
    health = daemon.health()
    assert len(health["ranks"]) == 2 and len(health["adapters"]) == 2, health
    log = daemon.log()
    assert "backend nccl" in log and "world size 2" in log, log[-3000:]
    result = test_adapter_mix.run_mix("--url", daemon.url)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "streams equal their solo runs" in result.stdout
    assert daemon.stop() == 0, daemon.log()[-3000:]
    daemon.assert_cleaned_up(pids)


def test_a_wrong_slot_on_one_rank_fails_the_step_everywhere(start_on_gpus, tiny_adapters,
                                                             monkeypatch):
    wrong_slot(start_on_gpus, tiny_adapters, monkeypatch)


def test_worker_killed_mid_stream(start_on_gpus):
    test_worker_faults.test_worker_killed_mid_stream(start_on_gpus)


def test_leader_killed_mid_stream(start_on_gpus):
    """Rank 0 samples and publishes: its death must end the streams as rank 1's does. Which
    failure the coordinator sees first (rank 0's exit or rank 1's failed collective) is a race."""
    daemon = start_on_gpus()
    pids = daemon.worker_pids()
    streams = test_worker_faults._open_streams(daemon)
    killed_at = time.monotonic()
    os.kill(pids[0], signal.SIGKILL)
    test_worker_faults._assert_failed_and_gone(daemon, pids, streams, killed_at, "worker rank")


def test_worker_raising_in_a_step(start_on_gpus):
    test_worker_faults.test_worker_raising_in_a_step(start_on_gpus)
