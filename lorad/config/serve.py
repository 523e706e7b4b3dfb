"""Settings of one lorad instance, fixed at start: the coordinator's and each worker's.

Frozen dataclasses, validated at construction with errors that name the flag. Nothing mutates
them after start; workers report measured facts (KV blocks) in their Ready message instead.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from lorad.config.adapter_capacity import LoraCapacity
from lorad.config.adapters import AdapterArg, check_adapter_args
from lorad.config.cluster import ADMIT_PORT_OFFSET, RESULTS_PORT_OFFSET, ClusterConfig
from lorad.config.errors import ConfigError

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
DIST_BACKENDS = ("auto", "gloo", "nccl")
# The model's all-reduce: nccl (the process group's), oneshot (peer memory, CUDA at --parallel 2
# or more on one host, decode-size tensors; NCCL for the rest), auto (oneshot where it can run).
ALL_REDUCES = ("auto", "nccl", "oneshot")
# auto: the checkpoint's safetensors (the only format read). random: weights drawn from a fixed
# seed in the shapes config.json gives, no checkpoint read (benchmarks, bring-up of new shapes).
LOAD_FORMATS = ("auto", "safetensors", "random")
# Ranks report twice a second; a deadline shorter than this would flag ordinary scheduling noise.
# --speculative-ngram: a decode's verify step runs 1 + K positions eagerly; past 16 a guess from
# a lookup is rarely right that far, and the step's rows grow for nothing.
MAX_SPECULATIVE_NGRAM = 16
MIN_STEP_TIMEOUT_S = 1.0


def _positive(flag: str, value: int | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{flag} must be a positive integer, got {value!r}")


def _choice(flag: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{flag} must be one of {', '.join(choices)}, got {value!r}")


def check_all_reduce(all_reduce: str, device: str, parallel: int, dist_backend: str,
                     nnodes: int) -> None:
    """Refuse an --all-reduce that cannot run with the other flags (the workers check the
    device that `auto` resolves to)."""
    _choice("--all-reduce", all_reduce, ALL_REDUCES)
    if all_reduce != "oneshot":
        return
    if device == "cpu":
        raise ConfigError("--all-reduce oneshot needs CUDA, and --device cpu was given: use "
                          "--all-reduce nccl (or auto)")
    if parallel < 2:
        raise ConfigError(f"--all-reduce oneshot needs --parallel 2 or more, got {parallel}: "
                          "one rank has nothing to reduce")
    if dist_backend == "gloo":
        raise ConfigError("--all-reduce oneshot needs --dist-backend nccl (or auto), got gloo")
    if nnodes > 1:
        raise ConfigError(f"--all-reduce oneshot reads peers' GPU memory on one host, and "
                          f"--nnodes is {nnodes}: use --all-reduce nccl (or auto)")


@dataclass(frozen=True)
class ServeConfig:
    """Everything `lorad serve` was told on the command line."""

    model_dir: str
    served_name: str
    parallel: int = 1  # ranks on every host together
    cluster: ClusterConfig = ClusterConfig()  # several hosts (cluster.py); one by default
    host: str = "127.0.0.1"
    port: int = 8000
    dtype: str = "auto"
    load_format: str = "auto"
    device: str = "auto"
    dist_backend: str = "auto"
    all_reduce: str = "nccl"  # ALL_REDUCES
    enforce_eager: bool = False  # no CUDA graphs for decode steps
    # Graphs of steps with prompt chunks too, in pieces between the attention (GPU, not gloo)
    mixed_step_graphs: bool = True
    # Plan and launch a decode step before applying the one before (workers/loop.py): None
    # (auto) on CUDA at --parallel 1
    async_scheduling: bool | None = None
    prefix_cache: bool = True  # reuse cached KV blocks of equal prefixes (workers/prefix_cache.py)
    # Batch-invariant arithmetic (--no-deterministic: cuBLAS at every row count on a GPU).
    deterministic: bool = True
    speculative_ngram: int = 0  # draft tokens per decode by prompt lookup; 0: no drafting
    kv_spill_dir: str | None = None  # absolute, checked writable; None: no disk spill
    kv_spill_bytes: int = 8 << 30  # per rank
    max_model_len: int | None = None
    max_num_seqs: int | None = None  # None: auto, from the KV pool (lorad/workers/seq_limit.py)
    max_num_batched_tokens: int = 512
    block_size: int = 16
    kv_cache_blocks: int | None = None
    kv_cache_memory: int | None = None  # bytes per rank
    num_threads: int | None = None  # None: auto (WorkerConfig.threads)
    runtime_dir: str | None = None
    startup_timeout: float = 600.0
    shutdown_timeout: float = 30.0  # how long a drain waits for open requests after a signal
    request_timeout: float | None = None  # per-request deadline; None: none
    # admitted requests without a first token; more get a 429. None: auto, from --max-num-seqs
    max_queued_requests: int | None = None
    step_timeout: float = 30.0  # a rank whose step runs longer has stalled: the daemon fails
    log_level: str = "info"
    adapters: tuple[AdapterArg, ...] = ()  # command-line order = slots 1..K
    api_key: str | None = field(default=None, repr=False)  # never printed with the config
    kernel_cache_dir: str | None = None  # checked writable by the CLI; None: Triton's default
    # Adapters while serving: the admin key of the load/unload routes (None: off), the folder
    # whose subfolders are servable by name, device slots (None: auto, adapter_capacity.py),
    # adapters kept in host memory per rank (None: auto, adapter_host_cache.auto_capacity), the
    # tables' rank, the names never evicted.
    admin_key: str | None = field(default=None, repr=False)
    adapter_dir: str | None = None
    max_gpu_adapters: int | None = None
    max_cpu_adapters: int | None = None
    max_lora_rank: int | None = None
    pinned_adapters: tuple[str, ...] = ()
    lora_dtype: str | None = None  # --lora-dtype (a LORA_DTYPES name); None: auto

    @property
    def runtime_adapters(self) -> bool:
        """Whether adapters may be registered after the start."""
        return self.admin_key is not None or self.adapter_dir is not None

    def __post_init__(self) -> None:
        if not self.served_name or any(c.isspace() for c in self.served_name):
            raise ConfigError(f"--name must be a non-empty name without spaces, "
                              f"got {self.served_name!r}")
        _positive("--parallel", self.parallel)
        self.cluster.check_parallel(self.parallel)
        if not 0 < self.port < 65536 or isinstance(self.port, bool):
            raise ConfigError(f"--port must be between 1 and 65535, got {self.port!r}")
        _choice("--dtype", self.dtype, DTYPES)
        _choice("--load-format", self.load_format, LOAD_FORMATS)
        _choice("--device", self.device, DEVICES)
        _choice("--dist-backend", self.dist_backend, DIST_BACKENDS)
        if self.device == "cpu" and self.dist_backend == "nccl":
            raise ConfigError("--dist-backend nccl needs CUDA, and --device cpu was given: use "
                              "--dist-backend gloo (or auto)")
        check_all_reduce(self.all_reduce, self.device, self.parallel, self.dist_backend,
                         self.cluster.nnodes)
        _positive("--max-model-len", self.max_model_len, allow_none=True)
        _positive("--max-num-seqs", self.max_num_seqs, allow_none=True)
        _positive("--max-num-batched-tokens", self.max_num_batched_tokens)
        if (not isinstance(self.speculative_ngram, int) or isinstance(self.speculative_ngram, bool)
                or not 0 <= self.speculative_ngram <= MAX_SPECULATIVE_NGRAM):
            raise ConfigError(f"--speculative-ngram must be 0..{MAX_SPECULATIVE_NGRAM}, "
                              f"got {self.speculative_ngram!r}")
        _positive("--block-size", self.block_size)
        _positive("--kv-cache-blocks", self.kv_cache_blocks, allow_none=True)
        _positive("--kv-cache-memory", self.kv_cache_memory, allow_none=True)
        if self.kv_cache_blocks is not None and self.kv_cache_memory is not None:
            raise ConfigError("--kv-cache-blocks and --kv-cache-memory are exclusive; give one")
        _positive("--threads", self.num_threads, allow_none=True)
        if not math.isfinite(self.startup_timeout) or self.startup_timeout <= 0:
            raise ConfigError(f"--startup-timeout must be a positive number of seconds, "
                              f"got {self.startup_timeout!r}")
        if not math.isfinite(self.shutdown_timeout) or self.shutdown_timeout < 0:
            raise ConfigError(f"--shutdown-timeout must be a number of seconds, 0 or more, "
                              f"got {self.shutdown_timeout!r}")
        if self.request_timeout is not None and (not math.isfinite(self.request_timeout)
                                                 or self.request_timeout <= 0):
            raise ConfigError(f"--request-timeout must be a positive number of seconds, "
                              f"got {self.request_timeout!r}")
        _positive("--max-queued-requests", self.max_queued_requests, allow_none=True)
        if not math.isfinite(self.step_timeout) or self.step_timeout < MIN_STEP_TIMEOUT_S:
            raise ConfigError(f"--step-timeout must be at least {MIN_STEP_TIMEOUT_S:g} second, "
                              f"got {self.step_timeout!r}")
        _choice("--log-level", self.log_level, ("debug", "info", "warning", "error"))
        if self.api_key is not None and (len(self.api_key) < 16 or not self.api_key.isprintable()
                                         or any(c.isspace() for c in self.api_key)):
            raise ConfigError("--api-key must be at least 16 printable characters without "
                              "spaces")
        check_adapter_args(self.adapters, reserved_names=(self.served_name,))
        if self.admin_key is not None and (len(self.admin_key) < 16
                                           or not self.admin_key.isprintable()
                                           or any(c.isspace() for c in self.admin_key)):
            raise ConfigError("--admin-key-file must hold a key of at least 16 printable "
                              "characters without spaces")
        if self.admin_key is not None and self.admin_key == self.api_key:
            raise ConfigError("--admin-key-file holds the API key: the admin key must differ, "
                              "or every client could change the adapters")
        names = [a.name for a in self.adapters]
        for name in self.pinned_adapters:
            if name not in names:
                raise ConfigError(f"--pin-adapter {name}: no --adapter is named {name!r}")
        if self.max_gpu_adapters is not None and len(self.pinned_adapters) > self.max_gpu_adapters:
            raise ConfigError(f"--pin-adapter: {len(self.pinned_adapters)} pinned adapters do "
                              f"not fit --max-gpu-adapters {self.max_gpu_adapters}")


@dataclass(frozen=True)
class WorkerConfig:
    """What every worker process is started with (written as JSON into the runtime dir)."""

    model_dir: str
    parallel: int
    dtype: str
    device: str
    dist_backend: str
    max_model_len: int
    max_num_seqs: int | None  # None: auto, resolved by the workers from the agreed KV pool
    max_num_batched_tokens: int
    block_size: int
    kv_cache_blocks: int | None
    kv_cache_memory: int | None
    num_threads: int | None  # None: auto (threads())
    runtime_dir: str
    instance_id: str
    coordinator_pid: int  # the process the workers watch (on another host: its node agent)
    # Several hosts (cluster.py): TCP endpoints with CURVE keys from cluster_key_dir, a TCP store
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    cluster_key_dir: str | None = None
    node_addr: str | None = None  # where this host's gloo pairs listen (cluster.gloo_addr)
    log_level: str = "info"
    load_format: str = "auto"
    all_reduce: str = "nccl"  # ALL_REDUCES, checked with the flags by ServeConfig
    enforce_eager: bool = False
    mixed_step_graphs: bool = True  # workers/mixed_graph.py
    async_scheduling: bool | None = None  # workers/loop.py; None: on CUDA
    deterministic: bool = True  # False: no matmul plans (matmul_plan.py), cuBLAS at every count
    speculative_ngram: int = 0  # draft tokens per decode (workers/ngram_draft.py); 0: off
    prefix_cache: bool = True
    kv_spill_dir: str | None = None  # each rank's store is its rank-R subfolder
    kv_spill_bytes: int = 8 << 30
    # Exported to the worker processes as TRITON_CACHE_DIR (supervisor.py); None: not set.
    kernel_cache_dir: str | None = None
    # One {"name", "path", "strength", "key", "id"} per start adapter, id i + 1; "key" is the
    # identity key the coordinator computed, which each worker recomputes and must match.
    adapters: list[dict] = field(default_factory=list)
    # The slot tables (config.adapter_capacity.LoraCapacity, resolved by the coordinator): device
    # slots (None: one per start adapter), whether adapters may come at run time, the rank the
    # tables hold.
    lora_slots: int | None = None
    lora_runtime: bool = False
    lora_max_rank: int = 0
    lora_dtype: str | None = None  # the tables' safetensors dtype (F32, BF16, F16); None: auto
    # Factor shards kept in host memory per rank, by recent use (None: auto).
    max_cpu_adapters: int | None = 0
    pinned_adapters: list[int] = field(default_factory=list)  # ids never evicted from a slot

    @property
    def adapter_args(self) -> tuple[AdapterArg, ...]:
        return tuple(AdapterArg(a["name"], a["path"], a["strength"]) for a in self.adapters)

    @property
    def lora_capacity(self) -> LoraCapacity:
        num_slots = len(self.adapters) if self.lora_slots is None else self.lora_slots
        return LoraCapacity(num_slots, self.lora_runtime, self.lora_max_rank, self.lora_dtype)

    @property
    def admit_endpoint(self) -> str:
        if self.nnodes > 1:
            return self.cluster.endpoint(ADMIT_PORT_OFFSET)
        return f"ipc://{self.runtime_dir}/admit.sock"

    @property
    def results_endpoint(self) -> str:
        if self.nnodes > 1:
            return self.cluster.endpoint(RESULTS_PORT_OFFSET)
        return f"ipc://{self.runtime_dir}/results.sock"

    @property
    def dist_init_method(self) -> str:
        if self.nnodes > 1:
            return self.cluster.endpoint(0)  # tcp://ADDR:PORT, a store only rank 0 binds
        return f"file://{self.runtime_dir}/dist.store"

    @property
    def cluster(self) -> ClusterConfig:
        return ClusterConfig(self.nnodes, self.node_rank, self.master_addr, self.master_port,
                             self.cluster_key_dir, self.node_addr)

    @property
    def local_ranks(self) -> range:
        """The ranks this host's processes run: all of them on one host."""
        return self.cluster.local_ranks(self.parallel)

    def threads(self, on_gpu: bool, usable_cpus: int) -> int:
        """The torch threads each worker runs: --threads, or auto: 1 on a GPU (its host work is
        small); on the CPU, the CPUs this process may use, shared by this host's workers, at
        least 1 (on a 2-core machine 2 threads served 1.2x 1 thread's tokens/s beside the
        coordinator and the client: docs/benchmarks.md). A row's bits do not depend on it
        (workers/batch.py, product_rows)."""
        if self.num_threads is not None:
            return self.num_threads
        if on_gpu:
            return 1
        return max(1, usable_cpus // len(self.local_ranks))

    @property
    def path(self) -> Path:
        return Path(self.runtime_dir) / "worker.json"

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "WorkerConfig":
        raw = json.loads(text)
        names = {f.name for f in fields(cls)}
        unknown = set(raw) - names
        if unknown:
            raise ConfigError(f"worker config: unknown keys {sorted(unknown)}")
        return cls(**raw)
