"""How many adapters the device holds at once and which adapters fit its slot tables.

The coordinator and every worker resolve the same LoraCapacity from the command line and the
adapters given at start, so an adapter the coordinator accepts at run time fits every rank's
tables. Without a run-time source of adapters (--admin-key-file, --adapter-dir) the tables cover
exactly what the start adapters edit, as small as they can be; with one, every projection of every
layer gets a table of --max-lora-rank, in fp32 (which holds any factor dtype exactly), or in the
dtype --lora-dtype names (half the bytes in bf16 or fp16: device slots, host cache, and what the
LoRA kernels read), which then refuses an adapter whose factors it cannot hold exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

from lorad.config.errors import ConfigError
from lorad.config.lora_module import LoraModule

# Device slots when adapters may arrive at run time and --max-gpu-adapters is not given.
DEFAULT_RUNTIME_SLOTS = 8
# The rank tables are sized for with run-time adapters and no --max-lora-rank (vLLM's default).
DEFAULT_RUNTIME_MAX_RANK = 16
# --lora-dtype's names -> the safetensors dtype of the factors the tables hold.
LORA_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


@dataclass(frozen=True)
class LoraCapacity:
    num_slots: int  # device slots for adapters; slot 0, the base model, is not one of them
    runtime: bool  # adapters may be registered after the start: tables on every projection
    max_rank: int  # with runtime: the rank every table holds; else the start adapters' largest
    # The safetensors dtype of the tables (--lora-dtype: F32, BF16, F16); None: auto (fp32 with
    # run-time adapters, else the start adapters' common dtype or fp32: loader.add_adapter_tables)
    dtype: str | None = None

    @classmethod
    def resolve(cls, start_modules: list[tuple[LoraModule, ...]], runtime: bool,
                max_gpu_adapters: int | None, max_lora_rank: int | None,
                lora_dtype: str | None = None,
                start_names: list[str] | None = None) -> "LoraCapacity":
        """start_modules: each start adapter's modules (start_names: their names, for errors);
        lora_dtype: a LORA_DTYPES name or None (auto). Errors name the flag."""
        num_start = len(start_modules)
        largest = max((m.rank for mods in start_modules for m in mods), default=0)
        if max_lora_rank is not None and largest > max_lora_rank:
            raise ConfigError(f"--max-lora-rank {max_lora_rank}: an adapter given at start has "
                              f"rank {largest}")
        dtype = None if lora_dtype is None else LORA_DTYPES[lora_dtype]
        for i, modules in enumerate(start_modules):
            problem = _inexact(modules, dtype)
            if problem is not None:
                which = f" ({start_names[i]!r})" if start_names else ""
                raise ConfigError(f"--lora-dtype {lora_dtype}: an adapter given at start{which}: "
                                  f"{problem}")
        if max_gpu_adapters is not None:
            num_slots = max_gpu_adapters
        else:
            num_slots = max(num_start, DEFAULT_RUNTIME_SLOTS) if runtime else num_start
        max_rank = max_lora_rank or (max(largest, DEFAULT_RUNTIME_MAX_RANK) if runtime
                                     else largest)
        return cls(num_slots, runtime, max_rank, dtype)

    def host_cache_size(self, num_start: int, max_cpu_adapters: int | None) -> int | None:
        """The host cache's capacity: --max-cpu-adapters (None: auto, sized by the worker from
        its host memory) where adapters can outnumber the slots (run-time adapters, or more
        start adapters than slots), else 0: every adapter keeps its slot, no copy repeats, and
        on a GPU each entry would hold a slot's bytes of page-locked memory for nothing."""
        return max_cpu_adapters if self.runtime or num_start > self.num_slots else 0

    def refusal(self, modules: tuple[LoraModule, ...]) -> str | None:
        """Why a run-time adapter cannot take a slot here, or None."""
        if not self.runtime:
            return "adapters cannot be added while serving (no --admin-key-file or --adapter-dir)"
        if self.num_slots == 0:
            return "--max-gpu-adapters is 0: no device slot can hold an adapter"
        over = [m for m in modules if m.rank > self.max_rank]
        if over:
            m = over[0]
            return (f"module {m.full_name} has rank {m.rank}, above the {self.max_rank} the slot "
                    f"tables hold (--max-lora-rank)")
        return _inexact(modules, self.dtype)


def _inexact(modules: tuple[LoraModule, ...], dtype: str | None) -> str | None:
    """Why tables of `dtype` cannot hold these factors exactly, or None (fp32 holds every stored
    dtype; bf16 and fp16 only their own)."""
    if dtype in (None, "F32"):
        return None
    for m in modules:
        if m.dtype != dtype:
            name = next(k for k, v in LORA_DTYPES.items() if v == dtype)
            return (f"module {m.full_name} stores {m.dtype} factors, which the {name} slot "
                    f"tables (--lora-dtype) do not hold exactly")
    return None
