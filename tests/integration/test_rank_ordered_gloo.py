"""TensorParallel.all_reduce on real gloo ranks (processes over a FileStore) at worlds 3 and 4:
the bits of the one-shot kernels' reference on every rank, a row alone as in a batch (the path
--all-reduce oneshot must agree with); peer buffers that no rank can map give None on every rank.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from lorad.workers.kernels.oneshot_reduce_reference import rank_ordered_sum

ROWS, HIDDEN = 5, 40

RANK_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch
    from lorad.workers.kernels.configs import OneshotConfig
    from lorad.workers.parallel import init_tensor_parallel
    from lorad.workers.peer_reduce import map_peer_buffers
    from tests.integration.test_rank_ordered_gloo import partial

    rank, world, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    tp = init_tensor_parallel(rank, world, "file://" + store, "gloo", torch.device("cpu"),
                              all_reduce="auto")
    tp.shm = None  # gloo's own gathered sum (the shared-memory one: tests/unit/test_shm_reduce.py)
    x = partial(world, rank)
    batch = tp.all_reduce(x.clone())
    alone = tp.all_reduce(x[-1:].clone())
    # The CPU has no symmetric memory: every rank fails to allocate, and all agree on None.
    mapped = map_peer_buffers(rank, world, tp.device, tp.group, tp.cpu_group, OneshotConfig())
    print(json.dumps({"oneshot": tp.oneshot is not None, "mapped": mapped is not None,
                      "batch": batch.view(torch.int32).tolist(),
                      "alone": alone.view(torch.int32).tolist()}))
    sys.stdout.flush()
    os._exit(0)  # no interpreter teardown: gloo's threads sometimes abort it (tests/tp_runner.py)
""")


def partial(world: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s fp32 partial sum: magnitudes that differ by rank, so order shows."""
    gen = torch.Generator().manual_seed(1000 * world + rank)
    return torch.randn(ROWS, HIDDEN, generator=gen) * (1 + 9 * rank)


@pytest.mark.parametrize("world", [3, 4])
def test_gloo_ranks_sum_in_rank_order_like_the_kernel_reference(tmp_path, world):
    procs = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(rank), str(world),
                               str(tmp_path / "store")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(world)]
    outs = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=180)
        assert proc.returncode == 0, stderr
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    want = rank_ordered_sum([partial(world, r) for r in range(world)]).view(torch.int32)
    # Another order gives other bits here, so the comparison can fail.
    reverse = rank_ordered_sum([partial(world, r) for r in reversed(range(world))])
    assert not torch.equal(reverse.view(torch.int32), want)
    for rank, out in enumerate(outs):
        assert not out["oneshot"] and not out["mapped"]  # auto on the CPU: gloo
        assert torch.equal(torch.tensor(out["batch"], dtype=torch.int32), want), rank
        assert torch.equal(torch.tensor(out["alone"], dtype=torch.int32), want[-1:]), rank
