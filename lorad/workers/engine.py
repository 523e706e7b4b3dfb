"""This rank's model, adapters and KV pool: device, dtype and backend, loading, sizing, a forward.

Start-up runs the same collectives in the same order on every rank (registry check, the KV pool
minimum, auto --max-num-seqs's minimum, then a warm-up step that writes nothing, so Ready means
the model has run once). Adapters are validated (lorad.config.adapters) before any base weight is
read and must carry the identity key the coordinator computed. On CUDA, decode steps replay CUDA
graphs captured at start (cuda_graph.py; in segments between the collectives over gloo) unless
--enforce-eager. Knows nothing of sockets, sequences or sampling; the loop hands it a step plan.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lorad.config import ConfigError, ModelConfig, WorkerConfig
from lorad.config.adapter_capacity import LoraCapacity
from lorad.config.adapters import AdapterSpec, load_adapter
from lorad.workers.adapter_host_cache import auto_capacity, host_slot_bytes
from lorad.workers.adapter_store import ADAPTER_PATH_SUFFIX_ENV, AdapterStore
from lorad.workers.agreement import RegistryDigest, agree_min, check_registry
from lorad.workers.batch import MIN_ROWS, ForwardBatch
from lorad.workers.cuda_graph import DecodeGraphs
from lorad.workers.kernel_path import kernel_path
from lorad.workers.loader import add_adapter_tables
from lorad.workers.mixed_graph import MixedGraphs
from lorad.workers.models import model_class
from lorad.workers.models.llama import LlamaForCausalLM
from lorad.workers.tuning import Tuning
from lorad.workers.parallel import TensorParallel, init_tensor_parallel
from lorad.workers.planner import StepPlan
from lorad.workers.seq_limit import auto_max_num_seqs, pool_sizing_seqs
from lorad.workers.sampler import warm_up as warm_up_sampler
from lorad.protocol import StartupPhase
from lorad.workers.startup_clock import StartupClock
from lorad.workers.warm_up import warm_up_steps

log = logging.getLogger("lorad.worker")

CPU_KV_CAP_BYTES = 1 << 30  # default pool cap per rank on the CPU
CUDA_KV_FRACTION = 0.9  # default pool cap on CUDA: this share of the free memory after loading
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
RANDOM_WEIGHTS_SEED = 0  # --load-format random: every rank and every start draws the same model


def resolve_device(name: str, rank: int) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: CUDA is not available here (torch sees no GPU)")
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def resolve_dtype(name: str, config: ModelConfig, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    if device.type == "cpu":
        return torch.float32  # bf16/fp16 matmuls on the CPU are slow and far from the reference
    return DTYPES.get(config.torch_dtype, torch.float32)


def resolve_backend(name: str, device: torch.device) -> str:
    if name == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if name == "nccl" and device.type != "cuda":
        raise ConfigError(f"--dist-backend nccl needs CUDA, and the workers run on {device.type}: "
                          "use --dist-backend gloo (or auto)")
    return name


@dataclass
class Engine:
    tp: TensorParallel
    model_config: ModelConfig
    model: LlamaForCausalLM
    registry: RegistryDigest
    num_kv_blocks: int
    block_size: int
    adapters: tuple[AdapterSpec, ...]  # the start adapters, ids 1..K in order
    store: AdapterStore  # every registered adapter, their copies into device slots
    resident: dict[int, int]  # adapter id -> device slot of the start adapters copied at start
    graphs: DecodeGraphs | None = None  # captured decode graphs; None: every step runs eagerly
    # Captured graphs of steps with prompt chunks (--mixed-step-graphs); None: those run eagerly
    mixed_graphs: MixedGraphs | None = None
    max_num_seqs: int = 0  # sequences a step runs at most, agreed by the ranks at start
    startup_phases: list[StartupPhase] = dataclasses.field(default_factory=list)  # for Ready

    @classmethod
    def start(cls, cfg: WorkerConfig, rank: int, clock: StartupClock | None = None) -> "Engine":
        clock = clock or StartupClock(time.monotonic())
        device = resolve_device(cfg.device, rank)
        model_config = ModelConfig.from_dir(cfg.model_dir)
        dtype = resolve_dtype(cfg.dtype, model_config, device)
        backend = resolve_backend(cfg.dist_backend, device)
        if backend == "nccl" and len(cfg.local_ranks) > max(1, torch.cuda.device_count()):
            raise ConfigError(f"--parallel {cfg.parallel} with nccl needs a GPU per rank, and "
                              f"{torch.cuda.device_count()} are visible; --dist-backend gloo "
                              "lets ranks share GPUs")
        log.info("device %s, dtype %s, backend %s, world size %d", device, dtype, backend,
                 cfg.parallel)
        # The product's kernel settings: one Tuning for the server's life (a row's bits depend on
        # some of them).
        tuning = Tuning()
        tp = init_tensor_parallel(rank, cfg.parallel, cfg.dist_init_method, backend, device,
                                  host_ranks=cfg.local_ranks, gloo_addr=cfg.cluster.gloo_addr,
                                  cluster_flags=cfg.cluster.flags(cfg.parallel),
                                  all_reduce=cfg.all_reduce, oneshot_config=tuning.oneshot)
        clock.mark("workers up")
        # After joining the group: a rank that refuses here exits, and its peers' next
        # collective fails at once instead of waiting for it to join.
        adapters = tuple(load_adapter(arg, i, model_config)
                         for i, arg in enumerate(cfg.adapter_args, start=1))
        capacity = cfg.lora_capacity
        registry = RegistryDigest.compute(
            model_config, tuple((a.adapter_id, a.name, a.key, a.strength) for a in adapters),
            capacity)
        problem = check_registry(tp, registry)  # first, so every rank names an odd rank's adapter
        if problem is not None:
            raise RuntimeError(problem + cfg.cluster.hosts_of_ranks(cfg.parallel))
        check_coordinator_keys(cfg, adapters)
        clock.mark("adapters")
        num_weight_bytes = check_weights_fit(cfg.model_dir, model_config, tp, dtype, adapters,
                                             capacity)
        model = model_class(model_config)(model_config, tp, dtype, device, tuning)
        if cfg.load_format == "random":
            model.load_random_weights(RANDOM_WEIGHTS_SEED)
            log.info("random weights (seed %d): no checkpoint read", RANDOM_WEIGHTS_SEED)
        else:
            model.load_weights(cfg.model_dir)
        clock.mark("weights")
        tables = model.add_lora_tables(adapters, capacity)
        store = AdapterStore(tables, model_config, capacity,
                             _host_cache_size(cfg, capacity, tables, len(adapters), tp),
                             device, _path_suffix(rank))
        resident = start_slots(adapters, capacity.num_slots, set(cfg.pinned_adapters))
        for spec in adapters:
            store.add_started(spec, resident.get(spec.adapter_id))
        clock.mark("adapters")
        own = _own_kv_blocks(cfg, model_config, tp, dtype)
        num_blocks = agree_min(tp, own)  # every rank must address the same block ids
        needed = -(-cfg.max_model_len // cfg.block_size)
        if num_blocks < needed:
            raise ConfigError(f"the KV pool has {num_blocks} blocks of {cfg.block_size} tokens; "
                              f"one sequence of --max-model-len {cfg.max_model_len} needs "
                              f"{needed} (see --kv-cache-blocks, --kv-cache-memory)")
        num_kv_bytes = check_kv_pool_fits(cfg, model_config, tp, dtype, num_blocks)
        model.allocate_kv_cache(num_blocks, cfg.block_size)
        max_num_seqs = resolve_max_num_seqs(cfg, tp, num_blocks)
        log.info("weights and %d of %d adapters in %d device slots (%.2f GiB); KV pool of %d "
                 "blocks of %d tokens (%.2f GiB; this rank could hold %d); at most %d sequences "
                 "a step%s", len(resident), len(adapters), capacity.num_slots,
                 num_weight_bytes / 2**30, num_blocks, cfg.block_size,
                 num_kv_bytes / 2**30, own, max_num_seqs,
                 " (--max-num-seqs auto)" if cfg.max_num_seqs is None else "")
        clock.mark("KV pool")
        if kernel_path(device) and cfg.deterministic:  # before the graphs capture the matmuls
            model.plan_matmuls(max(cfg.max_num_batched_tokens, max_num_seqs, MIN_ROWS))
            clock.mark("matmul plans")
        elif kernel_path(device):
            log.info("matmul plans: none (--no-deterministic): cuBLAS at every row count")
        graphs = _capture_decode_graphs(cfg, model, tp, capacity.num_slots, max_num_seqs)
        mixed_graphs = _capture_mixed_graphs(cfg, model, tp, capacity.num_slots)
        clock.mark("graphs")
        engine = cls(tp, model_config, model, registry, num_blocks, cfg.block_size, adapters,
                     store, resident, graphs, mixed_graphs, max_num_seqs)
        engine.warm_up(cfg)
        clock.mark("warm-up")
        engine.startup_phases = clock.phases()
        return engine

    def warm_up(self, cfg: WorkerConfig) -> None:
        """Run eager steps through every layer and collective before the rank says Ready: a rank
        that cannot compute fails here, at start, not on a first request. On the kernel path one
        step per band of step sizes (warm_up.py), so every kernel variant a request can reach
        compiles now, and the leader's sampling; on the CPU, which compiles nothing, one step.
        Every KV slot is -1, so nothing is written to the pool, and no block is taken; the
        attention reads whatever block 0 holds, and the logits are dropped (the leader samples
        from zeros of their width)."""
        started = time.monotonic()
        if kernel_path(self.tp.device):
            steps = warm_up_steps(cfg.max_num_batched_tokens, self.max_num_seqs,
                                  cfg.max_model_len, self.block_size,
                                  self.store.capacity.num_slots, self.model.tuning)
        else:
            slot = 1 if self.store.capacity.num_slots else 0
            steps = [[([0, 0], 0, [0], True, slot), ([0], 0, [0], True, 0)]]  # prefill, decode
        # Slot 1's tables take part even when no adapter is in it yet (run-time adapters), so
        # the LoRA kernels of every step size compile now too.
        with self.store.lit_slot(1):
            for chunks in steps:
                batch = ForwardBatch.build(chunks, self.block_size, self.tp.device,
                                           min_rows=MIN_ROWS)
                batch = dataclasses.replace(batch,
                                            slot_mapping=torch.full_like(batch.slot_mapping, -1))
                logits = self.model.forward(batch)  # [num_sampled, vocab]
        if self.tp.rank == 0:  # the leader samples: its draw kernels compile now too
            warm_up_sampler(torch.zeros(2, logits.shape[1], device=logits.device))
        if self.tp.device.type == "cuda":
            torch.cuda.synchronize(self.tp.device)
        log.info("warm-up: %d steps ran in %.0f ms", len(steps),
                 (time.monotonic() - started) * 1000)

    def adapter_refusal(self, adapter_id: int, key: str) -> str | None:
        """Why this rank cannot serve a request for (adapter id, key), or None when it can."""
        if adapter_id == 0:
            return None if key == "" else f"id 0 is the base model, but key {key!r} was given"
        held = self.store.specs.get(adapter_id)
        if held is None:
            return (f"adapter id {adapter_id} is not registered on this worker "
                    f"({len(self.store.specs)} are)")
        if held.key != key:
            return (f"adapter id {adapter_id} is {held.name!r} with identity key "
                    f"{held.key[:16]}..., not {key[:16]}...")
        return None

    def forward(self, plan: StepPlan, hidden_rows: list[int] | None = None,
                sampled_before: torch.Tensor | None = None):
        """-> [num_sampled, vocab] fp32 logits of the plan's sampling chunks, in plan order; with
        hidden_rows (rows of the step's flat batch: echo's), (logits, [n, hidden] their final
        hidden states), always eagerly: decode graphs never see them. sampled_before: a
        continuation's (plan.token_rows) source of tokens, the step before's sampled ids on the
        device: a decode graph reads them there; an eager step takes them to the host first."""
        if plan.block_copies:  # copies on write of blocks a fork shares, before any write
            self.model.copy_kv_blocks(plan.block_copies)
        chunks = plan.batch_chunks()
        if plan.token_rows is not None:
            if self.graphs is not None and self.graphs.can_run(chunks):
                return self.graphs.run(chunks, (sampled_before, plan.token_rows))
            ids = sampled_before.tolist()  # waits for the step before
            chunks = [([ids[row]], *chunk[1:]) for row, chunk in zip(plan.token_rows, chunks)]
        if hidden_rows is None and self.graphs is not None and self.graphs.can_run(chunks):
            return self.graphs.run(chunks)
        if (hidden_rows is None and self.mixed_graphs is not None
                and self.mixed_graphs.can_run(chunks)):
            return self.mixed_graphs.run(chunks)
        batch = ForwardBatch.build(chunks, self.block_size, self.tp.device, min_rows=MIN_ROWS)
        if hidden_rows is None:
            return self.model.forward(batch)
        rows = torch.tensor(hidden_rows, dtype=torch.int64, device=self.tp.device)
        return self.model.forward(batch, hidden_rows=rows)


def resolve_max_num_seqs(cfg: WorkerConfig, tp: TensorParallel, num_blocks: int) -> int:
    """--max-num-seqs as given, or auto's value from the agreed pool (seq_limit.py). The ranks'
    minimum all the same, as for the block count: the planner and graphs must match."""
    if cfg.max_num_seqs is not None:
        return cfg.max_num_seqs
    own = auto_max_num_seqs(num_blocks, cfg.block_size, cfg.max_model_len,
                            cfg.max_num_batched_tokens, tp.device.type == "cuda")
    return agree_min(tp, own)


def _capture_decode_graphs(cfg: WorkerConfig, model: LlamaForCausalLM, tp: TensorParallel,
                           num_adapters: int, max_num_seqs: int) -> DecodeGraphs | None:
    if tp.device.type != "cuda" or cfg.enforce_eager:
        return None
    # NCCL collectives are captured inside the graphs; gloo's run between graph segments.
    segmented = tp.world_size > 1 and tp.backend == "gloo"
    graphs = DecodeGraphs(model, max_num_seqs, cfg.max_model_len, cfg.block_size,
                          num_adapters, segmented=segmented)
    graphs.capture()
    return graphs


def _capture_mixed_graphs(cfg: WorkerConfig, model: LlamaForCausalLM, tp: TensorParallel,
                          num_adapters: int) -> MixedGraphs | None:
    """Graphs of steps with prompt chunks, in pieces between the attention (mixed_graph.py):
    with --mixed-step-graphs, on CUDA where the collectives are captured too (not over gloo)."""
    if (tp.device.type != "cuda" or cfg.enforce_eager or not cfg.mixed_step_graphs
            or (tp.world_size > 1 and tp.backend == "gloo")):
        return None
    graphs = MixedGraphs(model, cfg.max_num_batched_tokens, cfg.block_size, num_adapters)
    graphs.capture()
    return graphs


def start_slots(adapters: tuple[AdapterSpec, ...], num_slots: int,
                pinned: set[int]) -> dict[int, int]:
    """Adapter id -> device slot of the start adapters copied at start: the pinned ones first,
    then the others in order, while slots last."""
    ordered = sorted(adapters, key=lambda a: (a.adapter_id not in pinned, a.adapter_id))
    return {spec.adapter_id: slot for slot, spec in enumerate(ordered[:num_slots], start=1)}


def _path_suffix(rank: int) -> str:
    target, _, suffix = os.environ.get(ADAPTER_PATH_SUFFIX_ENV, "").partition(":")
    return suffix if target == str(rank) else ""


def check_coordinator_keys(cfg: WorkerConfig, adapters: tuple[AdapterSpec, ...]) -> None:
    """Every adapter must have the identity key the coordinator computed from the same folder:
    requests name adapters by slot and key, and prefix caches trust the key."""
    for spec, entry in zip(adapters, cfg.adapters):
        if spec.key != entry["key"]:
            raise RuntimeError(
                f"adapter {spec.name!r} ({spec.path}): the workers compute identity key "
                f"{spec.key[:16]}..., the coordinator {entry['key'][:16]}...; its files changed "
                "after the coordinator read them")


def weight_bytes(model_config: ModelConfig, rank: int, world_size: int, dtype: torch.dtype,
                 adapters: tuple[AdapterSpec, ...] = (),
                 capacity: LoraCapacity | None = None) -> int:
    """The bytes of the model's weights and buffers that `rank` holds, the adapters' slot tables
    included: the model and its tables built on the meta device, which allocates nothing."""
    meta = torch.device("meta")
    model = model_class(model_config)(model_config, TensorParallel(rank, world_size, meta), dtype,
                                      meta)
    add_adapter_tables(model.lora_target, adapters, capacity, model_config)
    tensors = itertools.chain(model.parameters(), model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def _host_cache_size(cfg: WorkerConfig, capacity: LoraCapacity, tables: dict,
                     num_start: int, tp: TensorParallel) -> int:
    """--max-cpu-adapters, auto resolved here (from the host memory available now); logged."""
    size = capacity.host_cache_size(num_start, cfg.max_cpu_adapters)
    if size is None:
        available = available_bytes(torch.device("cpu"))
        size = auto_capacity(tables, available, len(tp.host_ranks))
        slot_bytes = host_slot_bytes(tables)
        shown = "not known" if available is None else f"{available / 2**30:.1f} GiB"
        log.info("adapter host cache: up to %d adapters of %.1f MiB, %.1f GiB (--max-cpu-adapters "
                 "auto: host memory available %s, %d rank(s) on this host)", size,
                 slot_bytes / 2**20, size * slot_bytes / 2**30, shown, len(tp.host_ranks))
    return size


def available_bytes(device: torch.device) -> int | None:
    """Memory free for this process on `device` now: the GPU's free memory, or the host's
    MemAvailable; None where it cannot be told."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return None


def ranks_sharing_device(tp: TensorParallel) -> list[int]:
    """The ranks whose memory comes from the same pool as this rank's: every rank of this host
    on the CPU, the ranks placed on this rank's GPU on CUDA (resolve_device places rank r on
    GPU r % the device count)."""
    if tp.device.type != "cuda":
        return list(tp.host_ranks)
    num_gpus = torch.cuda.device_count()
    return [r for r in tp.host_ranks if r % num_gpus == tp.rank % num_gpus]


def check_weights_fit(model_dir: str, model_config: ModelConfig, tp: TensorParallel,
                      dtype: torch.dtype, adapters: tuple[AdapterSpec, ...],
                      capacity: LoraCapacity | None = None) -> int:
    """-> the bytes of this rank's weights and adapter tables. Refuses them when, with those of
    the ranks sharing its device, they exceed what is free there, before any rank allocates:
    loading them would end in an out-of-memory error or the OOM killer."""
    need, free, shared = _device_demand(
        tp, lambda r: weight_bytes(model_config, r, tp.world_size, dtype, adapters, capacity))
    if free is not None:
        num_slots = capacity.num_slots if capacity is not None else len(adapters)
        what = f"weights and {num_slots} adapter slots' tables" if num_slots else "weights"
        hints = (["a smaller --dtype (bfloat16)"] if dtype == torch.float32 else []) + \
            (["fewer adapter slots (--max-gpu-adapters)"] if num_slots else []) + \
            (["more GPUs (--parallel)", "a bigger GPU"] if tp.device.type == "cuda"
             else ["a bigger machine"])
        options = f"{', '.join(hints[:-1])} or {hints[-1]}" if len(hints) > 1 else hints[0]
        raise ConfigError(f"--model {model_dir}: its {what} take {need / 2**30:.1f} GiB "
                          f"on rank {tp.rank}{shared} ({str(dtype).removeprefix('torch.')}, "
                          f"--parallel {tp.world_size}), more than the {free / 2**30:.1f} GiB "
                          f"free on {tp.device}; use {options}")
    return need


def check_kv_pool_fits(cfg: WorkerConfig, model_config: ModelConfig, tp: TensorParallel,
                       dtype: torch.dtype, num_blocks: int) -> int:
    """-> the bytes of this rank's KV pool of num_blocks. Refuses a pool larger than what is
    free on its device once the weights are loaded (a --kv-cache-blocks or --kv-cache-memory
    beyond it), before allocating it."""
    need, free, shared = _device_demand(
        tp, lambda r: num_blocks * LlamaForCausalLM.kv_cache_bytes_per_block(
            model_config, r, tp.world_size, cfg.block_size, dtype))
    if free is not None:
        given = (f"--kv-cache-blocks {cfg.kv_cache_blocks}" if cfg.kv_cache_blocks is not None
                 else f"--kv-cache-memory {cfg.kv_cache_memory / 2**30:g}GiB"
                 if cfg.kv_cache_memory is not None else "the default KV pool size")
        raise ConfigError(f"{given}: the KV pool of {num_blocks} blocks takes "
                          f"{need / 2**30:.1f} GiB on rank {tp.rank}{shared}, more than the "
                          f"{free / 2**30:.1f} GiB free on {tp.device} after the weights; "
                          "give fewer blocks (--kv-cache-blocks, --kv-cache-memory)")
    return need


def _device_demand(tp: TensorParallel,
                   bytes_of_rank: Callable[[int], int]) -> tuple[int, int | None, str]:
    """-> (this rank's bytes, the bytes free on its device when the ranks sharing it need more,
    else None (also where it cannot be told), the refusal's words on those ranks). The free
    memory is measured between two barriers at world size > 1: no rank allocates while the
    others measure."""
    sharing = ranks_sharing_device(tp)
    need = {r: bytes_of_rank(r) for r in sharing}
    if tp.world_size > 1:
        dist.barrier(group=tp.cpu_group)
    free = available_bytes(tp.device)
    if tp.world_size > 1:
        dist.barrier(group=tp.cpu_group)
    total = sum(need.values())
    if free is None or total <= free:
        return need[tp.rank], None, ""
    shared = (f", {total / 2**30:.1f} GiB for the {len(sharing)} ranks on {tp.device}"
              if len(sharing) > 1 else "")
    return need[tp.rank], free, shared


def _own_kv_blocks(cfg: WorkerConfig, model_config: ModelConfig, tp: TensorParallel,
                   dtype: torch.dtype) -> int:
    """How many blocks this rank would hold on its own (the ranks then take the minimum)."""
    per_block = LlamaForCausalLM.kv_cache_bytes_per_block(model_config, tp.rank, tp.world_size,
                                                          cfg.block_size, dtype)
    if cfg.kv_cache_blocks is not None:
        return cfg.kv_cache_blocks
    if cfg.kv_cache_memory is not None:
        return cfg.kv_cache_memory // per_block
    num_seqs = pool_sizing_seqs(cfg.max_num_seqs, tp.device.type == "cuda")
    wanted = -(-num_seqs * cfg.max_model_len // cfg.block_size)
    if tp.device.type == "cuda":
        if tp.world_size > 1:
            # Ranks may share a GPU (gloo, fewer GPUs than ranks): measure once every rank has
            # loaded its weights, and split what is free between the ranks on this device.
            dist.barrier(group=tp.cpu_group)
        sharing = len(ranks_sharing_device(tp))
        free_bytes, _ = torch.cuda.mem_get_info(tp.device)
        cap = int(free_bytes * CUDA_KV_FRACTION / sharing)
    else:
        cap = CPU_KV_CAP_BYTES
    return min(wanted, cap // per_block)
