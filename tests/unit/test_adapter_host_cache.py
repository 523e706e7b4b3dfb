"""The adapter host cache (--max-cpu-adapters) and its reads and copies: what a slot gets
through it is what a copy straight from the file gives (loader.read_shards + fill_slot), bit for
bit: bf16 factors widened into fp32 tables, ranks below the tables' with zeroed tails, whichever
host slot and whatever an earlier adapter left there, at --parallel 1 and on rank 1 of 2. A copy
is a handful of torch calls (each gives up the GIL beside the step loop); least recently used
entries go first; a capacity of 0 keeps nothing."""

from __future__ import annotations

import mmap

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.overrides import TorchFunctionMode

from lorad.config import ConfigError, ModelConfig
from lorad.config.adapter_capacity import LoraCapacity
from lorad.config.adapters import AdapterArg, load_adapter
from lorad.workers.adapter_host_cache import (ALIGN, DEFAULT_CAPACITY, HostCache, auto_capacity,
                                              host_slot_bytes)
from lorad.workers.loader import fill_slot, read_shards
from lorad.workers.models.llama import LlamaForCausalLM
from lorad.workers.parallel import TensorParallel
from tests.tiny_adapters import make_peft_adapter
from tests.tiny_models import make_tiny_llama


def _tables(config: ModelConfig, device: str = "cpu", rank: int = 0, world: int = 1) -> dict:
    model = LlamaForCausalLM(config, TensorParallel(rank, world, torch.device(device)),
                             torch.float32, torch.device(device))
    return model.add_lora_tables((), LoraCapacity(3, True, 8))  # fp32 tables of rank 8


def _specs(tmp_path, base, config):
    """A bf16 adapter of rank 8 on every projection, then an fp32 one of rank 2 on two."""
    wide = make_peft_adapter(base, tmp_path / "wide", r=8, seed=1)
    weights = wide / "adapter_model.safetensors"
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(weights).items()}, weights)
    narrow = make_peft_adapter(base, tmp_path / "narrow", r=2, seed=2,
                               target_modules=("q_proj", "down_proj"))
    return [load_adapter(AdapterArg(name, str(folder)), i + 1, config)
            for i, (name, folder) in enumerate((("wide", wide), ("narrow", narrow)))]


def _cpu_setup(tmp_path) -> tuple[dict, list]:
    """(fp32 CPU tables of a tiny Llama, [its wide and narrow adapters] (_specs))."""
    base = make_tiny_llama(tmp_path / "base")
    config = ModelConfig.from_dir(base)
    return _tables(config), _specs(tmp_path, base, config)


def _slot_contents(tables: dict, slot: int) -> list:
    return [(t.ranks[slot], t.scales[slot], int(t.rank_table[slot]), float(t.scale_table[slot]),
             t.lora_a[slot].to("cpu", copy=True), t.lora_b[slot].to("cpu", copy=True))
            for t in tables.values()]


def _same(left: list, right: list) -> bool:
    return all(x[:4] == y[:4] and torch.equal(x[4], y[4]) and torch.equal(x[5], y[5])
               for x, y in zip(left, right, strict=True))


@pytest.mark.parametrize("rank,world", [(0, 1), (1, 2)])
def test_a_slot_filled_through_the_cache_equals_a_copy_from_the_file(tmp_path, rank, world):
    check_fill_through_the_cache(tmp_path, "cpu", rank, world)


def check_fill_through_the_cache(tmp_path, device: str, rank: int = 0, world: int = 1) -> None:
    """On CUDA the host slots are page-locked and the copies run on a side stream, as the
    adapter jobs run them (AdapterStore._copy)."""
    base = make_tiny_llama(tmp_path / "base")
    config = ModelConfig.from_dir(base)
    tables = _tables(config, device, rank, world)
    wide, narrow = _specs(tmp_path, base, config)
    stream = torch.cuda.Stream() if device == "cuda" else None

    def fill(cache, slot, spec, host_slot):
        if stream is None:
            return cache.fill(slot, spec, host_slot)
        stream.wait_stream(torch.cuda.current_stream())  # the reads of what was there
        with torch.cuda.stream(stream):
            cache.fill(slot, spec, host_slot)
        stream.synchronize()

    assert {m.dtype for m in wide.modules} == {"BF16"}
    expected = {}
    for spec in (wide, narrow):
        fill_slot(tables, 1, spec, read_shards(tables, spec))
        expected[spec.name] = _slot_contents(tables, 1)
    cache = HostCache(tables, 1, pin=device == "cuda")
    # One host slot for both, in turn: narrow lands where wide's factors were.
    for spec in (wide, narrow, wide):
        host_slot = cache.put(spec.adapter_id, cache.read(spec))
        assert all(b.is_pinned() == (device == "cuda") for b in cache._buffers)
        fill(cache, 2, spec, host_slot)
        assert _same(_slot_contents(tables, 2), expected[spec.name]), spec.name
        # From the cache again, over what the other adapter left in the device slot.
        other = narrow if spec is wide else wide
        fill_slot(tables, 2, other, read_shards(tables, other))
        fill(cache, 2, spec, cache.get(spec.adapter_id))
        assert _same(_slot_contents(tables, 2), expected[spec.name]), spec.name
    assert len(cache) == 1 and cache.get(narrow.adapter_id) is None
    assert cache.num_bytes == cache.slot_bytes
    # A host slot holds the largest adapter the tables hold, every table at its full rank.
    assert cache.slot_bytes >= sum(t.lora_a[0].nbytes + t.lora_b[0].nbytes
                                   for t in tables.values())
    # Host slots of whole pages (two page-locked ranges must not share one), each its own.
    two = HostCache(tables, 2, pin=device == "cuda")
    for spec in (wide, narrow):
        two.put(spec.adapter_id, two.read(spec))
    assert [b.data_ptr() % 4096 for b in two._buffers] == [0, 0]
    for spec in (narrow, wide):
        fill(two, 2, spec, two.get(spec.adapter_id))
        assert _same(_slot_contents(tables, 2), expected[spec.name]), spec.name


class _CountCalls(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") != "__get__":  # attributes (.shape) keep the GIL
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_a_copy_is_a_handful_of_torch_calls_once_its_views_exist(tmp_path):
    """224 factor pairs on an 8B adapter made the copy ~3,600 calls, each a trip through the
    GIL beside the step loop; a read, put and fill of a layout seen before are a few, whatever
    the number of tables (this tiny model has 14; counted calls include tensor methods)."""
    tables, (wide, _) = _cpu_setup(tmp_path)
    cache = HostCache(tables, 1, pin=False)
    cache.fill(1, wide, cache.put(1, cache.read(wide)))  # views made here
    cache.drop(1)
    with _CountCalls() as calls:
        cache.fill(1, wide, cache.put(1, cache.read(wide)))
    assert calls.count <= 10 < len(tables), calls.count
    with _CountCalls() as calls:
        cache.fill(1, wide, cache.get(1))
    assert calls.count <= 7, calls.count


def test_least_recently_used_entries_go_first_and_capacity_0_keeps_nothing(tmp_path):
    tables, (_, spec) = _cpu_setup(tmp_path)
    cache = HostCache(tables, 2, pin=False)
    for adapter_id in (1, 2):
        cache.put(adapter_id, cache.read(spec))
    assert cache.get(1) is not None  # 2 is now the least recent
    cache.put(3, cache.read(spec))
    assert [cache.get(i) is not None for i in (1, 2, 3)] == [True, False, True]
    assert cache.num_bytes == 2 * cache.slot_bytes  # 3 took 2's host slot
    cache.drop(1)
    cache.put(4, cache.read(spec))  # into 1's host slot, with no eviction
    assert [cache.get(i) is not None for i in (3, 4)] == [True, True]
    assert cache.num_bytes == 2 * cache.slot_bytes
    none = HostCache(tables, 0, pin=False)
    host_slot = none.put(1, none.read(spec))
    assert host_slot == 0 and none.get(1) is None and len(none) == 0
    assert none.num_bytes == none.slot_bytes


def test_a_file_cut_short_or_missing_a_tensor_is_refused_naming_it(tmp_path):
    tables, (_, spec) = _cpu_setup(tmp_path)
    cache = HostCache(tables, 1, pin=False)
    weights = tmp_path / "narrow" / "adapter_model.safetensors"
    tensors = load_file(weights)
    save_file({k: v for k, v in tensors.items() if k != spec.modules[0].a_tensor}, weights)
    with pytest.raises(ConfigError, match=f"no tensor '{spec.modules[0].a_tensor}'"):
        cache.read(spec)
    save_file(tensors, weights)
    data = weights.read_bytes()
    weights.write_bytes(data[:-64])
    with pytest.raises(ConfigError, match="adapter 'narrow'"):
        cache.read(spec)


def test_a_host_cache_only_where_adapters_can_outnumber_the_slots():
    assert LoraCapacity(8, True, 16).host_cache_size(0, 64) == 64  # run-time adapters
    assert LoraCapacity(2, False, 16).host_cache_size(3, 64) == 64  # 3 start adapters, 2 slots
    assert LoraCapacity(3, False, 16).host_cache_size(3, 64) == 0  # each keeps its slot
    assert LoraCapacity(8, True, 16).host_cache_size(0, None) is None  # auto: the worker's
    assert LoraCapacity(3, False, 16).host_cache_size(3, None) == 0


def test_auto_capacity_fills_a_quarter_of_the_available_memory_between_the_ranks(tmp_path):
    tables = _tables(ModelConfig.from_dir(make_tiny_llama(tmp_path / "base")))
    slot = host_slot_bytes(tables)
    factors = sum(t.lora_a[0].nbytes + t.lora_b[0].nbytes for t in tables.values())
    assert factors <= slot < factors + len(tables) * 2 * ALIGN + mmap.PAGESIZE
    assert slot == HostCache(tables, 1, pin=False).slot_bytes
    assert auto_capacity(tables, 100 * slot, 1) == 25
    assert auto_capacity(tables, 100 * slot, 2) == 12  # each of 2 ranks: 12.5 slots' bytes
    assert auto_capacity(tables, 3 * slot, 1) == 0  # not one slot: one host slot stages copies
    assert auto_capacity(tables, None, 1) == DEFAULT_CAPACITY  # no /proc/meminfo
    assert auto_capacity({}, 100 * slot, 1) == 0  # no tables (--max-gpu-adapters 0)


def test_bf16_tables_hold_a_bf16_adapter_exactly_in_half_the_bytes(tmp_path):
    check_bf16_tables(tmp_path, "cpu")


def check_bf16_tables(tmp_path, device: str) -> None:
    """--lora-dtype bfloat16 with run-time adapters: bf16 slot tables and host slots; a bf16
    adapter's factors there are, widened, the fp32 tables' own; an fp32 adapter is refused.
    (On CUDA, page-locked host slots; the copy is synchronized before it is read.)"""
    base = make_tiny_llama(tmp_path / "base")
    config = ModelConfig.from_dir(base)
    capacity = LoraCapacity(3, True, 8, "BF16")
    model = LlamaForCausalLM(config, TensorParallel(0, 1, torch.device(device)), torch.float32,
                             torch.device(device))
    tables, wide_tables = model.add_lora_tables((), capacity), _tables(config, device)
    assert {t.lora_a.dtype for t in tables.values()} == {torch.bfloat16}
    wide, narrow = _specs(tmp_path, base, config)
    assert capacity.refusal(wide.modules) is None
    refusal = capacity.refusal(narrow.modules)
    assert "stores F32 factors" in refusal and "bfloat16" in refusal and "--lora-dtype" in refusal
    pin = device == "cuda"
    cache, wide_cache = HostCache(tables, 1, pin=pin), HostCache(wide_tables, 1, pin=pin)
    assert cache.slot_bytes <= wide_cache.slot_bytes // 2 + 2 * ALIGN * len(tables) + mmap.PAGESIZE
    fill_slot(tables, 1, wide, read_shards(tables, wide))
    fill_slot(wide_tables, 1, wide, read_shards(wide_tables, wide))
    cache.fill(2, wide, cache.put(wide.adapter_id, cache.read(wide)))
    if pin:
        torch.cuda.synchronize()
    assert _same(_slot_contents(tables, 2), _slot_contents(tables, 1))
    for where, table in tables.items():
        assert torch.equal(table.lora_a[2].float(), wide_tables[where].lora_a[1]), where
        assert torch.equal(table.lora_b[2].float(), wide_tables[where].lora_b[1]), where
