"""Step agreement's collectives on two real gloo ranks (processes over a FileStore): the
watermark is the minimum, digests (also gathered again after a step's messages are applied) and
registries that differ are named by rank and adapter, the leader's sampled ids reach every
rank."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from tests.unit.test_agreement import RAW_CONFIG

RANK_SCRIPT = textwrap.dedent("""
    import json, sys
    from types import SimpleNamespace
    import torch.distributed as dist
    from lorad.workers import agreement
    from lorad.config.model import ModelConfig
    from lorad.workers.agreement import RegistryDigest

    rank, store_path = int(sys.argv[1]), sys.argv[2]
    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    tp = SimpleNamespace(rank=rank, world_size=2, cpu_group=dist.new_group(backend="gloo"))
    same = agreement.agree_step(tp, [5, 3][rank], 42)
    differ = agreement.agree_step(tp, 9, [42, 43][rank])
    spill = agreement.agree_step(tp, 9, 42, [7, 4][rank], [0b0101, 0b0010][rank])
    import hashlib
    from lorad.workers.spill import agree_entries
    hashes = [hashlib.blake2b(bytes([i]), digest_size=16).digest() for i in range(5)]
    held = [hashes[4], hashes[0], hashes[2], hashes[1]] if rank == 0 else hashes[1:]
    reg_same = agreement.check_registry(tp, RegistryDigest(b"m" * 32, b"e" * 32, b"a" * 32))
    reg_differ = agreement.check_registry(
        tp, RegistryDigest(b"m" * 32, [b"e", b"f"][rank] * 32, b"a" * 32))
    model = ModelConfig.from_dict(json.loads(sys.argv[3]))
    sql, chat = (1, "sql", "k1", 1.0), (2, "chat", "k2", 0.5)
    reg_adapter = agreement.check_registry(tp, RegistryDigest.compute(
        model, (sql, (2, "chat", ["k2", "k3"][rank], 0.5))))
    reg_count = agreement.check_registry(tp, RegistryDigest.compute(model, (sql, chat)[:rank + 1]))
    ids = agreement.broadcast_ids(tp, [11, 12, 13] if rank == 0 else None, 3)
    again_same = agreement.compare_digests(tp, same, 44)
    again_differ = agreement.compare_digests(tp, same, [44, 45][rank])
    print(json.dumps({
        "same": [same.watermark, same.digests_agree], "differ": [differ.digests_agree,
        differ.digests], "reg_same": reg_same, "reg_differ": reg_differ, "ids": ids,
        "reg_adapter": reg_adapter, "reg_count": reg_count,
        "again": [[a.watermark, a.digests_agree, a.digests] for a in (again_same, again_differ)],
        "min": agreement.agree_min(tp, [100, 80][rank]),
        "spill": [spill.spill_finished, spill.spill_read_failures],
        "entries": [hashes.index(h) for h in agree_entries(tp, held)]}))
    dist.destroy_process_group()
    sys.stdout.flush()
    import os
    os._exit(0)  # no interpreter teardown: gloo's threads sometimes abort it (tests/tp_runner.py)
""")


def test_two_gloo_ranks_agree(tmp_path):
    store = tmp_path / "store"
    procs = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(rank), str(store),
                               json.dumps(RAW_CONFIG)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(2)]
    outs = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    for out in outs:
        assert out["same"] == [3, True]  # watermark is the minimum
        assert out["differ"] == [False, [42, 43]]
        # The digests gathered again after the step's messages were applied: the rest is kept.
        assert out["again"] == [[3, True, [44, 44]], [3, False, [44, 45]]]
        assert out["reg_same"] is None
        assert "engine source" in out["reg_differ"] and "rank(s) [1]" in out["reg_differ"]
        assert "base model" not in out["reg_differ"]
        assert out["ids"] == [11, 12, 13] and out["min"] == 80
        # The spill: finished operations are the minimum, failed reads any rank's; the blocks
        # every rank holds after a restart come in rank 0's order.
        assert out["spill"] == [4, 0b0111] and out["entries"] == [4, 2, 1]
        # An adapter that differs is named; one that agrees is not.
        assert "adapter 'chat' (id 2) differs from rank 0 on rank(s) [1]" in out["reg_adapter"]
        assert "'sql'" not in out["reg_adapter"] and "engine" not in out["reg_adapter"]
        assert "number of adapters differs (by rank: [1, 2])" in out["reg_count"]
