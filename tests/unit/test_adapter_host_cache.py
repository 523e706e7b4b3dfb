"""The adapter host cache (--max-cpu-adapters): what a slot gets through it is what a copy
straight from the file gives, bit for bit (bf16 factors widened into fp32 tables, ranks below the
tables' with zeroed tails), whichever host slot and whatever an earlier adapter left there; least
recently used entries go first; a capacity of 0 keeps nothing."""

from __future__ import annotations

import torch
from safetensors.torch import load_file, save_file

from lorad.config import ModelConfig
from lorad.config.adapter_capacity import LoraCapacity
from lorad.config.adapters import AdapterArg, load_adapter
from lorad.workers.adapter_host_cache import HostCache
from lorad.workers.loader import fill_slot, read_shards
from lorad.workers.models.llama import LlamaForCausalLM
from lorad.workers.parallel import TensorParallel
from tests.tiny_adapters import make_peft_adapter
from tests.tiny_models import make_tiny_llama


def _tables(config: ModelConfig, device: str = "cpu") -> dict:
    model = LlamaForCausalLM(config, TensorParallel(0, 1, torch.device(device)), torch.float32,
                             torch.device(device))
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


def _slot_contents(tables: dict, slot: int) -> list:
    return [(t.ranks[slot], t.scales[slot], t.lora_a[slot].clone(), t.lora_b[slot].clone())
            for t in tables.values()]


def _same(left: list, right: list) -> bool:
    return all(ra == rb and sa == sb and torch.equal(a1, a2) and torch.equal(b1, b2)
               for (ra, sa, a1, b1), (rb, sb, a2, b2) in zip(left, right, strict=True))


def test_a_slot_filled_through_the_cache_equals_a_copy_from_the_file(tmp_path):
    check_fill_through_the_cache(tmp_path, "cpu")


def check_fill_through_the_cache(tmp_path, device: str) -> None:
    """On CUDA the host slots are page-locked and the copies run on a side stream, as the
    adapter jobs run them (AdapterStore._copy)."""
    base = make_tiny_llama(tmp_path / "base")
    config = ModelConfig.from_dir(base)
    tables = _tables(config, device)
    wide, narrow = _specs(tmp_path, base, config)
    stream = torch.cuda.Stream() if device == "cuda" else None

    def fill_slot_(slot, spec, shards):
        if stream is None:
            return fill_slot(tables, slot, spec, shards)
        stream.wait_stream(torch.cuda.current_stream())  # the clones of what was there
        with torch.cuda.stream(stream):
            fill_slot(tables, slot, spec, shards)
        stream.synchronize()

    assert {m.dtype for m in wide.modules} == {"BF16"}
    expected = {}
    for spec in (wide, narrow):
        fill_slot(tables, 1, spec, read_shards(tables, spec))
        expected[spec.name] = _slot_contents(tables, 1)
    cache = HostCache(tables, 1, pin=device == "cuda")
    # One host slot for both, in turn: narrow lands where wide's factors were.
    for spec in (wide, narrow, wide):
        views = cache.put(spec.adapter_id, read_shards(tables, spec))
        assert all(v.dtype == torch.float32 and v.is_pinned() == (device == "cuda")
                   for pair in views.values() for v in pair)
        fill_slot_(2, spec, views)
        assert _same(_slot_contents(tables, 2), expected[spec.name]), spec.name
        # From the cache again, over what the other adapter left in the device slot.
        other = narrow if spec is wide else wide
        fill_slot_(2, other, read_shards(tables, other))
        fill_slot_(2, spec, cache.get(spec.adapter_id))
        assert _same(_slot_contents(tables, 2), expected[spec.name]), spec.name
    assert len(cache) == 1 and cache.get(narrow.adapter_id) is None
    assert cache.num_bytes == cache.slot_bytes
    # Host slots of whole pages (two page-locked ranges must not share one), each its own.
    two = HostCache(tables, 2, pin=device == "cuda")
    for spec in (wide, narrow):
        two.put(spec.adapter_id, read_shards(tables, spec))
    assert [b.data_ptr() % 4096 for b in two._buffers] == [0, 0]
    for spec in (wide, narrow):
        fill_slot_(2, spec, two.get(spec.adapter_id))
        assert _same(_slot_contents(tables, 2), expected[spec.name]), spec.name
    # A host slot holds the largest adapter the tables hold, every table at its full rank.
    assert cache.slot_bytes >= sum(t.lora_a[0].nbytes + t.lora_b[0].nbytes
                                   for t in tables.values())


def test_least_recently_used_entries_go_first_and_capacity_0_keeps_nothing(tmp_path):
    base = make_tiny_llama(tmp_path / "base")
    config = ModelConfig.from_dir(base)
    tables = _tables(config)
    spec = _specs(tmp_path, base, config)[1]
    shards = read_shards(tables, spec)
    cache = HostCache(tables, 2, pin=False)
    for adapter_id in (1, 2):
        cache.put(adapter_id, shards)
    assert cache.get(1) is not None  # 2 is now the least recent
    cache.put(3, shards)
    assert [cache.get(i) is not None for i in (1, 2, 3)] == [True, False, True]
    assert cache.num_bytes == 2 * cache.slot_bytes  # 3 took 2's host slot
    cache.drop(1)
    cache.put(4, shards)  # into 1's host slot, with no eviction
    assert [cache.get(i) is not None for i in (3, 4)] == [True, True]
    assert cache.num_bytes == 2 * cache.slot_bytes
    none = HostCache(tables, 0, pin=False)
    views = none.put(1, shards)
    assert torch.equal(views[next(iter(views))][0], shards[next(iter(shards))][0])
    assert none.get(1) is None and len(none) == 0 and none.num_bytes == none.slot_bytes
