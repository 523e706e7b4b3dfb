"""The CPU ranks' all-reduce through shared memory (lorad/workers/shm_reduce.py), with real
processes joined over gloo: every call's sum is the rank-ordered sum, bit for bit, on every rank
and the same as gloo's path, through both buffers in turn and past the slot's size (gloo's); the
segment leaves nothing in /dev/shm; a peer that exits or never comes ends the wait with an error
naming it; which groups it takes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from lorad.workers.shm_reduce import shm_problem
from tests.unit.shm_reduce_rank import CALLS

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_ranks(world: int, case: str, tmp_path) -> list[dict]:
    store = tmp_path / "store"
    procs = [subprocess.Popen([sys.executable, "-m", "tests.unit.shm_reduce_rank", str(r),
                               str(world), str(store), case], cwd=REPO, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={**os.environ, "GLOO_SOCKET_IFNAME": "lo",
                                   "OMP_NUM_THREADS": "1"})
             for r in range(world)]
    reports = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        lines = out.strip().splitlines()
        reports.append(json.loads(lines[-1]) if lines else {"stderr": err[-2000:]})
    return reports


@pytest.mark.parametrize("world", [2, 3])
def test_every_sum_is_the_rank_ordered_one_on_every_rank(world, tmp_path):
    reports = run_ranks(world, "sums", tmp_path)
    for rank, report in enumerate(reports):
        assert report.get("shm"), (rank, report)
        assert not report["segment_left"], rank
        assert report["same"] and report["equal_gloo"], (rank, report)
        # 64 x 1,024 fp32 is the largest the slot takes; one row more goes to gloo.
        shapes = [CALLS[i % len(CALLS)] for i in range(len(report["took_shm"]))]
        assert report["took_shm"] == [shape != (65, 1024) for shape, _ in shapes], rank


def test_a_peer_that_exits_ends_the_wait_naming_it(tmp_path):
    waiting = run_ranks(2, "exit", tmp_path)[0]
    assert waiting["error"] and "rank 1" in waiting["error"] and "exited" in waiting["error"]
    assert waiting["seconds"] < 5, waiting


def test_a_peer_that_never_comes_times_out_naming_it(tmp_path):
    waiting = run_ranks(2, "late", tmp_path)[0]
    assert waiting["error"] and "[1]" in waiting["error"] and "within" in waiting["error"]
    assert 0.5 <= waiting["seconds"] < 3, waiting


def test_only_cpu_groups_on_one_host():
    cpu = torch.device("cpu")
    assert "not on the CPU" in shm_problem(torch.device("cuda"), 2, 2)
    assert "not all on this host" in shm_problem(cpu, 4, 2)
    assert "not all on this host" in shm_problem(cpu, 1, 1)
    assert "more than its header holds" in shm_problem(cpu, 57, 57)
    assert "header" not in (shm_problem(cpu, 56, 56) or "")
