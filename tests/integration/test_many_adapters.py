"""More adapters than device slots: 1,000 PEFT folders under --adapter-dir, 8 device slots, a host
cache of 16, --parallel 2 on the tiny model. Each name is registered on its first request; a
burst over 200 distinct adapters completes with every stream equal to its solo run, and the slot
and cache counters move as docs/adapters.md says (every copy into a slot is a disk read or a host
cache hit; every copy once the slots are full evicts one)."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.daemons import start_daemon
from tests.tiny_adapters import clone_adapter, make_peft_adapter

NUM_ADAPTERS = 1000
NUM_BURST = 200
NUM_SLOTS = 8
HOST_CACHE = 16
PROMPT = [1, 17, 42, 9, 300, 11]
MAX_TOKENS = 6


def complete(url: str, model: str) -> tuple[int, dict]:
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                       "temperature": 0, "ignore_eos": True, "return_token_ids": True})
    request = urllib.request.Request(f"{url}/v1/completions", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def counts(daemon) -> list[dict]:
    """Each rank's adapter counts once its reports (about twice a second) stopped changing."""
    def read() -> list[dict]:
        return [{k: r[k] for k in ("adapters_registered", "adapter_slots", "adapter_slots_used",
                                   "adapter_loads", "adapter_evictions", "adapter_host_hits",
                                   "adapter_disk_reads")} for r in daemon.health()["ranks"]]
    last = read()
    while True:
        time.sleep(1.2)
        now = read()
        if now == last:
            return now
        last = now


def start_library_daemon(tiny_model, root, *placement: str):
    """A daemon over a library of NUM_ADAPTERS clones (and a broken folder) in root."""
    template = make_peft_adapter(tiny_model, root / "template", r=2, seed=3,
                                 target_modules=("q_proj", "v_proj", "down_proj"))
    library = root / "library"
    for i in range(NUM_ADAPTERS):
        clone_adapter(template, library / f"m{i:04d}", seed=100 + i)
    (library / "broken").mkdir()  # a folder without weights
    return start_daemon(tiny_model, "--kv-cache-blocks", "512", "--max-num-seqs", "32",
                        "--adapter-dir", str(library), "--max-gpu-adapters", str(NUM_SLOTS),
                        "--max-cpu-adapters", str(HOST_CACHE), *placement)


@pytest.fixture(scope="module")
def many(tiny_model, tmp_path_factory):
    daemon = start_library_daemon(tiny_model, tmp_path_factory.mktemp("many"), "--parallel", "2")
    yield daemon
    assert daemon.stop() == 0, daemon.log()[-4000:]


def test_names_come_from_the_folder_on_first_use(many):
    status, body = complete(many.url, "nope")
    assert status == 404 and body["error"]["code"] == "model_not_found"
    status, body = complete(many.url, "broken")
    assert status == 400 and "adapter_model.safetensors" in body["error"]["message"]
    assert status == 400 and body["error"]["param"] == "model"


def test_a_burst_over_200_adapters_in_8_slots_equals_the_solo_runs(many):
    check_burst_over_200(many)


def check_burst_over_200(many) -> None:
    names = [f"m{i * (NUM_ADAPTERS // NUM_BURST):04d}" for i in range(NUM_BURST)]
    solo = {}
    for name in names:  # one at a time: each its own first use, copy and run
        status, body = complete(many.url, name)
        assert status == 200, body
        solo[name] = body["choices"][0]["token_ids"]
    assert len({tuple(ids) for ids in solo.values()}) > NUM_BURST // 2  # adapters differ
    after_solo = counts(many)
    for rank in after_solo:
        assert rank["adapters_registered"] == NUM_BURST and rank["adapter_slots"] == NUM_SLOTS
        assert rank["adapter_slots_used"] == NUM_SLOTS
        assert rank["adapter_loads"] == NUM_BURST  # each once: never two at a time here
        assert rank["adapter_evictions"] == NUM_BURST - NUM_SLOTS

    burst: dict[str, list] = {}

    def run(name: str) -> None:
        status, body = complete(many.url, name)
        burst[name] = body["choices"][0]["token_ids"] if status == 200 else body
    threads = [threading.Thread(target=run, args=(name,)) for name in reversed(names)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert burst == solo

    for before, rank in zip(after_solo, counts(many)):
        loads = rank["adapter_loads"] - before["adapter_loads"]
        assert loads >= NUM_BURST - NUM_SLOTS  # all but the resident ones came in again
        assert rank["adapter_loads"] == rank["adapter_disk_reads"] + rank["adapter_host_hits"]
        assert rank["adapter_evictions"] == rank["adapter_loads"] - rank["adapter_slots_used"]
        assert rank["adapter_host_hits"] > 0  # the last ones of the solo pass were cached
