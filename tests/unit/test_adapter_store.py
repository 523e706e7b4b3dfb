"""AdapterStore's jobs and their agreement (agreement.agree_step's adapter columns): a job counts
once every rank finished it, fails everywhere when it failed on one rank, and a registration that
failed anywhere registers nowhere; copies fill a slot's tables and clear those it does not edit."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from lorad.config import ModelConfig
from lorad.config.adapter_capacity import LoraCapacity
from lorad.config.adapters import AdapterArg, load_adapter
from lorad.protocol.messages import LoadAdapter
from lorad.workers import agreement
from lorad.workers.adapter_store import AdapterStore
from lorad.workers.models.llama import LlamaForCausalLM
from lorad.workers.parallel import TensorParallel
from tests.tiny_adapters import clone_adapter, make_peft_adapter
from tests.tiny_models import make_tiny_llama


def _store(base, capacity: LoraCapacity) -> AdapterStore:
    config = ModelConfig.from_dir(base)
    model = LlamaForCausalLM(config, TensorParallel(0, 1, torch.device("cpu")), torch.float32,
                             torch.device("cpu"))
    return AdapterStore(model.add_lora_tables((), capacity), config, capacity, 4,
                        torch.device("cpu"))


def _settle_all(store: AdapterStore) -> list:
    """Wait for every job, then agree and settle as a lone rank would, until nothing is left."""
    for job in list(store._jobs.values()):
        job.future.exception()  # waits for it
    outcomes = []
    while store.pending:
        agreed = agreement.agree_step(SimpleNamespace(world_size=1), 0, 0, 0, 0, store.report())
        outcomes += store.settle(agreed.adapter_settled, agreed.adapter_failed)
    return outcomes


def test_register_then_copy_into_a_slot(tmp_path):
    base = make_tiny_llama(tmp_path / "base")
    folder = make_peft_adapter(base, tmp_path / "a", r=2, seed=1,
                               target_modules=("q_proj", "down_proj"))
    key = load_adapter(AdapterArg("a", str(folder)), 5, ModelConfig.from_dir(base)).key
    store = _store(base, LoraCapacity(2, True, 16))
    store.submit_register(LoadAdapter(1, 5, "a", str(folder), 1.0, key))
    outcomes = _settle_all(store)
    assert [(o.kind, o.adapter_id, o.ok) for o in outcomes] == [("register", 5, True)]
    assert store.specs[5].key == key
    store.submit_fetch(5, 2)
    assert [(o.kind, o.slot, o.ok) for o in _settle_all(store)] == [("fetch", 2, True)]
    edited = {where: t.ranks[2] for where, t in store.tables.items() if t.ranks[2]}
    num_layers = ModelConfig.from_dir(base).num_hidden_layers
    assert edited == {(layer, m): 2 for layer in range(num_layers)
                      for m in ("q_proj", "down_proj")}
    assert not any(t.ranks[1] for t in store.tables.values())
    assert store.num_disk_reads == 1
    store.submit_fetch(5, 1)  # again: from the host cache
    _settle_all(store)
    assert store.num_host_hits == 1


def test_a_wrong_key_fails_the_registration(tmp_path):
    base = make_tiny_llama(tmp_path / "base")
    folder = make_peft_adapter(base, tmp_path / "a", r=2, seed=1)
    store = _store(base, LoraCapacity(1, True, 16))
    store.submit_register(LoadAdapter(1, 3, "a", str(folder), 1.0, "0" * 64))
    store._jobs[1].future.exception()  # waits for it
    assert store.report() == (0, 1) and "identity key" in store.local_failure(1)[1]
    outcomes = _settle_all(store)
    assert [(o.adapter_id, o.ok) for o in outcomes] == [(3, False)]
    assert 3 not in store.specs


def test_files_changed_since_the_load_fail_the_copy(tmp_path):
    base = make_tiny_llama(tmp_path / "base")
    folder = make_peft_adapter(base, tmp_path / "a", r=2, seed=1)
    key = load_adapter(AdapterArg("a", str(folder)), 1, ModelConfig.from_dir(base)).key
    store = _store(base, LoraCapacity(1, True, 16))
    store.submit_register(LoadAdapter(1, 1, "a", str(folder), 1.0, key))
    _settle_all(store)
    other = clone_adapter(folder, tmp_path / "other", seed=9)
    (other / "adapter_model.safetensors").replace(folder / "adapter_model.safetensors")
    store.submit_fetch(1, 1)
    store._jobs[2].future.exception()
    assert "changed since it was loaded" in store.local_failure(2)[1]
    assert [(o.kind, o.ok) for o in _settle_all(store)] == [("fetch", False)]


def test_agreement_fails_a_job_that_failed_on_any_rank():
    rows = [[9, 1, 0, 0, 4, 0], [9, 1, 0, 0, 3, 4], [9, 1, 0, 0, 5, 0]]
    agreed = _agree(rows)
    assert (agreed.adapter_settled, agreed.adapter_failed) == (3, 4)
    assert agreed.adapter_failed_ranks == (1,)
    rows = [[9, 1, 0, 0, 4, 0], [9, 1, 0, 0, 2, 3]]  # rank 1 is behind: 3 is not settled yet
    agreed = _agree(rows)
    assert (agreed.adapter_settled, agreed.adapter_failed) == (2, 3)
    rows = [[9, 1, 0, 0, 4, 0], [9, 1, 0, 0, 2, 0]]
    assert (_agree(rows).adapter_settled, _agree(rows).adapter_failed) == (2, 0)


def _agree(rows):
    original = agreement.all_gather_int64
    agreement.all_gather_int64 = lambda tp, values: rows
    try:
        return agreement.agree_step(SimpleNamespace(world_size=len(rows)), 0, 0)
    finally:
        agreement.all_gather_int64 = original


def test_a_lit_slot_takes_part_at_full_rank_with_scale_0_and_goes_dark_again(tmp_path):
    base = make_tiny_llama(tmp_path / "base")
    store = _store(base, LoraCapacity(2, True, 16))
    table = next(iter(store.tables.values()))
    with store.lit_slot(1):
        assert table.ranks[1] == 16 and int(table.rank_table[1]) == 16
        assert table.scales[1] == 0.0 and float(table.scale_table[1]) == 0.0
    assert table.ranks[1] == 0 and int(table.rank_table[1]) == 0
