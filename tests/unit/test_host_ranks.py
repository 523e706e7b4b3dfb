"""Which ranks share this rank's memory when several hosts each run a contiguous range: only
this host's (on the CPU), only this host's ranks on this rank's GPU (on CUDA), so that the
weight and KV pool checks divide a host's memory among its own ranks, not the cluster's.
"""

from __future__ import annotations

import torch

from lorad.workers.engine import ranks_sharing_device
from lorad.workers.parallel import TensorParallel


def test_one_host_shares_with_every_rank():
    tp = TensorParallel(1, 4, torch.device("cpu"))
    assert ranks_sharing_device(tp) == [0, 1, 2, 3]


def test_on_the_cpu_only_this_hosts_ranks_share():
    tp = TensorParallel(2, 4, torch.device("cpu"), host_ranks=range(2, 4))
    assert ranks_sharing_device(tp) == [2, 3]


def test_on_cuda_only_this_hosts_ranks_on_this_gpu_share(monkeypatch):
    # No GPU here: the device count is the one thing this machine cannot have.
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    tp = TensorParallel(9, 16, torch.device("cuda", 1), host_ranks=range(8, 16))
    assert ranks_sharing_device(tp) == [9]
    two_per_gpu = TensorParallel(17, 32, torch.device("cuda", 1), host_ranks=range(16, 32))
    assert ranks_sharing_device(two_per_gpu) == [17, 25]
