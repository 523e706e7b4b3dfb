"""A rank's disk spill at work (--kv-spill-dir): opens this rank's store (kv_spill.py) under its
identity, agrees with the other ranks after a restart on the blocks every one of them holds, and
carries out each plan's writes, deletes and reads against the KV cache, a block's payload being
this rank's K and V of every layer, in the cache's dtype. What to write, read and delete is the
planner's (spill_index.py), the same on every rank.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch
import torch.distributed as dist

from lorad.config import WorkerConfig
from lorad.workers.agreement import all_gather_int64, engine_digest
from lorad.workers.kv_spill import SpillStore
from lorad.workers.spill_format import SpillIdentity
from lorad.workers.spill_index import SpillIndex
from lorad.workers.step_plan import StepPlan

log = logging.getLogger("lorad.worker")

# Unfinished writes and deletes a rank's store takes: each holds one block's payload in memory.
MAX_PENDING = 64
_DIGESTS_FILE = "model-digests.json"  # the weight files' content hashes, by size and mtime


class RankSpill:
    def __init__(self, store: SpillStore, model, num_startup_ops: int) -> None:
        self.store = store
        self._caches = model.kv_caches()
        self._device = model.device
        self._num_startup_ops = num_startup_ops  # this rank's own deletes before serving

    @classmethod
    def open(cls, cfg: WorkerConfig, engine) -> tuple["RankSpill", SpillIndex] | None:
        """This rank's spill and the planner's index of it, or None without --kv-spill-dir."""
        if not cfg.kv_spill_dir or not cfg.prefix_cache:
            return None
        tp, model = engine.tp, engine.model
        identity = SpillIdentity(
            engine=f"{engine_digest().hex()} torch {torch.__version__} {tp.device.type}",
            model=model_identity(cfg, Path(cfg.kv_spill_dir)),
            dtype=str(model.dtype).split(".")[-1],
            parallel=tp.world_size, rank=tp.rank, block_size=cfg.block_size,
            block_bytes=model.kv_cache_bytes_per_block(model.config, tp.rank, tp.world_size,
                                                       cfg.block_size, model.dtype))
        store = SpillStore(Path(cfg.kv_spill_dir) / f"rank-{tp.rank}", identity,
                           cfg.kv_spill_bytes, MAX_PENDING)
        mine = store.entries()
        agreed = agree_entries(tp, mine)
        held = set(agreed)
        stray = [block_hash for block_hash in mine if block_hash not in held]
        for block_hash in stray:  # what another rank lacks is of no use: every rank reads
            store.delete(block_hash)
        log.info("KV spill %s: %d blocks on disk usable by every rank (%d of this rank's "
                 "dropped)", store.directory, len(agreed), len(stray))
        max_blocks = max(1, cfg.kv_spill_bytes // identity.block_bytes)
        return cls(store, model, len(stray)), SpillIndex(max_blocks, MAX_PENDING, agreed)

    @property
    def num_finished(self) -> int:
        """The planner's operations this rank has finished (the step agreement's minimum)."""
        return self.store.num_processed - self._num_startup_ops

    def run(self, plan: StepPlan) -> int:
        """The plan's spill work, before its forward: evicted blocks out, deletes queued, spilled
        blocks in. -> a bit mask of the plan's reads that failed here (missing or corrupt)."""
        if plan.spill_writes:
            blocks = [block for block, _ in plan.spill_writes]
            for (_, block_hash), payload in zip(plan.spill_writes, self._payloads(blocks)):
                self.store.write(block_hash, payload)
        for block_hash in plan.spill_deletes:
            self.store.delete(block_hash)
        failures = 0
        for i, (block, block_hash) in enumerate(plan.spill_reads):
            payload = self.store.read(block_hash)
            if payload is None:
                failures |= 1 << i
            else:
                self._restore(block, payload)
        return failures

    def counts(self) -> tuple[int, int, int, int, int]:
        """RankStatus' spill fields: blocks held, writes, reads, failed reads, drops."""
        counters = self.store.counters
        return (self.store.num_bytes // self.store.identity.block_bytes, counters.writes,
                counters.reads, counters.read_failures, counters.drops)

    def close(self) -> None:
        self.store.close()

    def _payloads(self, blocks: list[int]) -> list[bytes]:
        index = torch.tensor(blocks, dtype=torch.long, device=self._device)
        # [num_blocks, layers, 2, block_size, kv_heads, head_dim], one copy to the host
        stacked = torch.stack([torch.stack([c.k[index], c.v[index]], dim=1)
                               for c in self._caches], dim=1).cpu().contiguous()
        raw = stacked.view(torch.uint8).reshape(len(blocks), -1)
        return [raw[i].numpy().tobytes() for i in range(len(blocks))]

    def _restore(self, block: int, payload: bytes) -> None:
        first = self._caches[0].k
        shape = (len(self._caches), 2, *first.shape[1:])  # [layers, 2, block_size, heads, dim]
        values = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(first.dtype)
        values = values.reshape(shape).to(self._device)
        for cache, layer_values in zip(self._caches, values):
            cache.k[block] = layer_values[0]
            cache.v[block] = layer_values[1]


def agree_entries(tp, mine: list[bytes]) -> list[bytes]:
    """The hashes every rank holds, in rank 0's order: rank 0 sends its list (16-byte hashes as
    pairs of int64, tensor collectives only), each rank marks what it holds, the minimum wins."""
    if tp.world_size == 1:
        return list(mine)
    num = all_gather_int64(tp, [len(mine)])[0][0]
    if num == 0:
        return []
    if tp.rank == 0:
        words = torch.tensor([w for h in mine for w in _words(h)], dtype=torch.int64)
    else:
        words = torch.empty(2 * num, dtype=torch.int64)
    dist.broadcast(words, src=0, group=tp.cpu_group)
    hashes = [_from_words(words[2 * i].item(), words[2 * i + 1].item()) for i in range(num)]
    held = set(mine)
    marks = all_gather_int64(tp, [1 if h in held else 0 for h in hashes])
    return [h for i, h in enumerate(hashes) if all(row[i] for row in marks)]


def _words(block_hash: bytes) -> tuple[int, int]:
    return (int.from_bytes(block_hash[:8], "little", signed=True),
            int.from_bytes(block_hash[8:], "little", signed=True))


def _from_words(low: int, high: int) -> bytes:
    return low.to_bytes(8, "little", signed=True) + high.to_bytes(8, "little", signed=True)


def model_identity(cfg: WorkerConfig, spill_dir: Path) -> str:
    """The weights' identity: sha256 over config.json and every weight file's content (random
    weights: their seed and config). Content hashes are kept in the spill folder by file size
    and mtime, so a restart hashes only files that changed."""
    folder = Path(cfg.model_dir)
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    if cfg.load_format == "random":
        return f"random {digest.hexdigest()}"
    memo_path = spill_dir / _DIGESTS_FILE
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    fresh = {}
    for path in sorted(folder.glob("*.safetensors")):
        stat = path.stat()
        key = f"{path.resolve()} {stat.st_size} {stat.st_mtime_ns}"
        if not isinstance(memo.get(key), str):
            file_digest = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(1 << 24):
                    file_digest.update(chunk)
            memo[key] = file_digest.hexdigest()
        fresh[key] = memo[key]
        digest.update(f"{path.name} {memo[key]}".encode())
    spill_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    temp = spill_dir / f".{_DIGESTS_FILE}.{os.getpid()}.tmp"
    temp.write_text(json.dumps(fresh, sort_keys=True))
    os.replace(temp, memo_path)
    return digest.hexdigest()
