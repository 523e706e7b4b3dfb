"""Step agreement: the inbox watermark and the digests (two real gloo ranks:
tests/integration/test_agreement_ranks.py)."""

from __future__ import annotations

import hashlib
import random
from array import array

import torch.distributed as dist

from lorad.protocol.messages import Admit, Cancel, SamplingParams, Shutdown
from lorad.workers import agreement
from lorad.workers.agreement import Inbox, RegistryDigest, live_digest
from lorad.workers.sequence import Sequence, SeqStatus

PARAMS = SamplingParams(0.0, 1.0, 0, 0, 4, [], False)


def test_inbox_releases_contiguous_messages_in_order():
    inbox = Inbox()
    assert inbox.put(Cancel(2, "b")) and inbox.watermark == 0
    assert inbox.put(Admit(1, "a", [1], PARAMS, 0, "")) and inbox.watermark == 2
    assert inbox.put(Shutdown(4)) and inbox.watermark == 2
    assert not inbox.put(Cancel(2, "b"))  # a repeat
    assert [m.seq for m in inbox.take_upto(1)] == [1]
    assert not inbox.put(Admit(1, "a", [1], PARAMS, 0, ""))  # already applied
    inbox.put(Cancel(3, "c"))
    assert inbox.watermark == 4
    assert [m.seq for m in inbox.take_upto(4)] == [2, 3, 4] and len(inbox) == 0


def test_live_digest_sees_ids_adapters_and_positions():
    def live(**changes):
        seq = Sequence("r", [1, 2, 3], PARAMS, 1, "key", arrival=1)
        for name, value in changes.items():
            setattr(seq, name, value)
        return live_digest([seq])
    base = live()
    assert base == live()
    for change in ({"request_id": "s"}, {"adapter_slot": 2}, {"adapter_key": "k2"},
                   {"num_computed": 1}, {"output_ids": [5]}, {"arrival": 2},
                   {"block_table": [7]}, {"request_id": "r1", "adapter_key": "ey"},
                   {"adapter_strength": 0.5}, {"adapter_strength": 0.0}):
        assert live(**change) != base, change


def reference_live_digest(live) -> int:
    """The digest as it was computed before bench_host_step's pass: an update and an array per
    sequence. The live one must hash the same bytes (ranks of either agree)."""
    h = hashlib.sha256()
    for seq in live:
        h.update(f"{len(seq.request_id)}:{seq.request_id}{len(seq.adapter_key)}:"
                 f"{seq.adapter_key}{seq.arrival},{seq.adapter_slot},{seq.adapter_strength!r},"
                 f"{seq.status.value},"
                 f"{seq.num_tokens},{seq.num_computed},{len(seq.block_table)};".encode())
        h.update(array("q", seq.block_table).tobytes())
    return agreement.to_int64(h.digest())


def random_live_set(rng: random.Random) -> list[Sequence]:
    live = []
    for arrival in range(rng.randrange(0, 40)):
        seq = Sequence(f"cmpl-{rng.getrandbits(64):x}", [rng.randrange(50000)
                       for _ in range(rng.randrange(1, 30))], PARAMS, rng.randrange(4),
                       rng.choice(["", "k" * 64, "é-key"]), arrival=arrival * rng.randrange(1, 9))
        seq.output_ids = [rng.randrange(50000) for _ in range(rng.randrange(0, 9))]
        seq.adapter_strength = rng.choice([1.0, 0.0, 0.5, 2.0])
        seq.status = rng.choice(list(SeqStatus))
        seq.num_computed = rng.randrange(seq.num_tokens + 1)
        seq.block_table = rng.sample(range(1 << 20), rng.randrange(0, 12))
        live.append(seq)
    return live


def test_live_digest_equals_the_reference_on_random_live_sets():
    rng = random.Random(29)
    for _ in range(100):
        live = random_live_set(rng)
        assert live_digest(live) == reference_live_digest(live)
        # Again after changes the packed-table memo must see: tables grown, emptied, edited in
        # place, and one id twice with different tables.
        for seq in live:
            change = rng.randrange(4)
            if change == 0:
                seq.block_table.append(rng.randrange(1 << 20))
            elif change == 1:
                seq.block_table = []
            elif change == 2 and seq.block_table:
                seq.block_table[0] += 1
        if live:
            twin = Sequence(live[0].request_id, [1], PARAMS, 0, "", arrival=10**6)
            twin.block_table = [rng.randrange(1 << 20)]
            live.append(twin)
        assert live_digest(live) == reference_live_digest(live)


def test_live_digest_sees_status_order_and_every_block():
    live = [Sequence(f"r{i}", [1, 2, 3], PARAMS, 0, "", arrival=i) for i in range(3)]
    for i, seq in enumerate(live):
        seq.status, seq.block_table = SeqStatus.RUNNING, [4 * i, 4 * i + 1]
    base = live_digest(live)
    assert live_digest(live[::-1]) != base
    live[1].block_table[-1] += 1
    assert live_digest(live) != base
    live[1].block_table[-1] -= 1
    live[2].status = SeqStatus.WAITING
    assert live_digest(live) != base


RAW_CONFIG = {"model_type": "llama", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
              "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 64}


def test_registry_digest_changes_with_the_model_config():
    from lorad.config.model import ModelConfig
    a = RegistryDigest.compute(ModelConfig.from_dict(RAW_CONFIG))
    b = RegistryDigest.compute(ModelConfig.from_dict({**RAW_CONFIG, "rms_norm_eps": 1e-5}))
    assert a.engine == b.engine and a.adapters == b.adapters and a.model != b.model
    assert a.hex() != b.hex() and len(a.hex()) == 64


def test_registry_digest_sees_each_adapters_slot_name_key_and_strength():
    from lorad.config.model import ModelConfig
    model = ModelConfig.from_dict(RAW_CONFIG)
    sql = (1, "sql", "k1", 1.0)
    base = RegistryDigest.compute(model, (sql,))
    for other in ((2, "sql", "k1", 1.0), (1, "sq1", "k1", 1.0), (1, "sql", "k2", 1.0),
                  (1, "sql", "k1", 0.5)):
        changed = RegistryDigest.compute(model, (other,))
        assert changed.adapters != base.adapters and changed.hex() != base.hex(), other
        assert changed.adapter_parts[0][1] != base.adapter_parts[0][1]
    assert base.adapter_parts[0][0] == "adapter 'sql' (id 1)"
    assert RegistryDigest.compute(model).adapters != base.adapters


def test_world_one_makes_no_distributed_calls(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("torch.distributed used at world size 1")
    monkeypatch.setattr(dist, "all_gather", refuse)
    monkeypatch.setattr(dist, "broadcast", refuse)

    class Solo:
        rank, world_size, cpu_group = 0, 1, None
    result = agreement.agree_step(Solo(), 7, 123)
    assert (result.watermark, result.digests_agree) == (7, True)
    assert agreement.agree_min(Solo(), 5) == 5
    assert agreement.broadcast_ids(Solo(), [3, 4], 2) == [3, 4]
    assert agreement.check_registry(Solo(), RegistryDigest(b"a" * 32, b"b" * 32, b"c" * 32)) is None
