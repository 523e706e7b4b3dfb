"""Adapters loaded, reloaded and unloaded while serving (--admin-key-file), at --parallel 2 on
the tiny model: the admin routes and their refusals, the vLLM bodies, a load that fails on one
rank only, and a burst of 32 mixed streams during loads, reloads and unloads in which every
stream ends normally and equals its solo run on the version it started with (the
`lorad-adapter-id` header says which)."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.daemons import start_daemon
from tests.tiny_adapters import make_peft_adapter

ADMIN_KEY = "admin-key-0123456789"
MAX_TOKENS = 12
PROMPTS = [[1, 17, 42, 9, 300, 11], [5, 6, 7, 8], [250, 3, 99, 4, 4, 61, 2, 7, 8, 12], [2, 2],
           [(7 * i + 3) % 390 + 1 for i in range(40)]]  # the last: two full KV blocks of 16


def call(url: str, path: str, body=None, method: str = "POST", key: str | None = ADMIN_KEY
         ) -> tuple[int, dict | str, dict]:
    """-> (status, JSON body or text, headers)."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as resp:
            status, raw, got = resp.status, resp.read(), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        status, raw, got = exc.code, exc.read(), dict(exc.headers)
    text = raw.decode()
    try:
        return status, json.loads(text), got
    except json.JSONDecodeError:
        return status, text, got


def complete(url: str, model: str, prompt: list[int], cached: list | None = None
             ) -> tuple[int, list[int] | dict, str]:
    """A greedy completion -> (status, its token ids or the error body, adapter id header);
    its prompt tokens found in the prefix cache are appended to `cached`."""
    status, body, headers = call(url, "/v1/completions", {
        "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True}, key=None)
    if status != 200:
        return status, body, ""
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length", body
    if cached is not None:
        cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
    return status, choice["token_ids"], headers.get("lorad-adapter-id", "")


@pytest.fixture(scope="module")
def folders(tiny_model, tiny_adapters, tmp_path_factory):
    """a and b, a third adapter c, c's copy at c.rank1 with other weights (as a second host's
    differing file), and one of rank 32 (above the tables' 16)."""
    root = tmp_path_factory.mktemp("lifecycle")
    c = make_peft_adapter(tiny_model, root / "c", r=2, seed=5)
    make_peft_adapter(tiny_model, root / "c.rank1", r=2, seed=6)
    wide = make_peft_adapter(tiny_model, root / "wide", r=32, seed=7)
    return {**tiny_adapters, "c": c, "wide": wide}


@pytest.fixture(scope="module")
def admin_daemon(tiny_model, tiny_adapters, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "admin"
    key_file.write_text(ADMIN_KEY + "\n")
    daemon = start_daemon(tiny_model, "--parallel", "2", "--kv-cache-blocks", "512",
                          "--max-num-seqs", "48", "--max-gpu-adapters", "3",
                          "--admin-key-file", str(key_file),
                          "--adapter", f"a={tiny_adapters['a']}",
                          env={"LORAD_TEST_ADAPTER_PATH_SUFFIX": "1:.rank1"})
    yield daemon
    assert daemon.stop() == 0, daemon.log()[-4000:]


@pytest.fixture(scope="module")
def solo(adapter_daemon):
    """(folder name, prompt index) -> greedy token ids, one request at a time, from a daemon
    serving a and b from the start."""
    out = {}
    for model in ("tiny", "a", "b"):
        for i, prompt in enumerate(PROMPTS):
            status, ids, _ = complete(adapter_daemon.url, model, prompt)
            assert status == 200, ids
            out[model, i] = ids
    return out


def wait_holding(url: str, want: dict[str, int], timeout_s: float = 30.0) -> None:
    """Until each named adapter has at least that many open requests (they chose it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        cards = {c["name"]: c for c in call(url, "/v1/adapters", method="GET")[1]["data"]}
        if all(cards.get(n, {}).get("open_requests", 0) >= k for n, k in want.items()):
            return
        time.sleep(0.01)
    raise AssertionError(f"never saw {want} open requests")


def test_admin_routes_need_the_admin_key(admin_daemon):
    status, body, _ = call(admin_daemon.url, "/v1/adapters", method="GET", key=None)
    assert status == 401 and "admin key" in body["error"]["message"]
    status, _, _ = call(admin_daemon.url, "/v1/adapters", method="GET", key="x" * 20)
    assert status == 401
    status, body, _ = call(admin_daemon.url, "/v1/adapters", method="GET")
    assert status == 200 and [a["name"] for a in body["data"]] == ["a"]


def test_without_an_admin_key_the_routes_are_off(adapter_daemon):
    status, body, _ = call(adapter_daemon.url, "/v1/adapters", {"name": "x", "path": "/tmp"})
    assert status == 403 and "--admin-key-file" in body["error"]["message"]


def test_refusals_name_the_field_and_file(admin_daemon, folders, tmp_path):
    url = admin_daemon.url
    status, body, _ = call(url, "/v1/adapters", {"name": "x", "path": str(tmp_path / "none")})
    assert status == 400 and body["error"]["param"] == "path"
    assert "no such folder" in body["error"]["message"]
    status, body, _ = call(url, "/v1/adapters", {"name": "wide", "path": str(folders["wide"])})
    assert status == 400 and "rank 32" in body["error"]["message"]
    assert "--max-lora-rank" in body["error"]["message"]
    status, body, _ = call(url, "/v1/adapters", {"name": "a", "path": str(folders["b"])})
    assert status == 409 and "replace" in body["error"]["message"]
    status, body, _ = call(url, "/v1/adapters", {"name": "../x", "path": str(folders["b"])})
    assert status == 400 and body["error"]["param"] == "name"
    status, body, _ = call(url, "/v1/adapters", {"name": "x", "path": str(folders["b"]),
                                                 "strength": 9})
    assert status == 400 and body["error"]["param"] == "strength"
    status, body, _ = call(url, "/v1/adapters/nope", method="DELETE")
    assert status == 404


@pytest.mark.parametrize("path", ["/v1/adapters", "/v1/load_lora_adapter",
                                  "/v1/unload_lora_adapter"])
def test_hostile_admin_bodies_are_4xx(admin_daemon, path):
    for raw in (b"", b"[1]", b'{"name": ', b'{"name": "x", "path": 5}', b'{"lora_name": 7}',
                b'{"extra": 1}', b'{"name": "x", "path": "/tmp", "pinned": "yes"}',
                b'{"name": "x", "path": "/tmp", "strength": NaN}',
                b'{"name": "x", "path": "' + b"a" * (40 << 20) + b'"}'):
        request = urllib.request.Request(admin_daemon.url + path, data=raw, method="POST",
                                         headers={"Authorization": f"Bearer {ADMIN_KEY}",
                                                  "Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as raised:
            urllib.request.urlopen(request, timeout=60)
        assert 400 <= raised.value.code < 500, (raw[:40], raised.value.code)
        assert set(json.loads(raised.value.read())["error"]) == {"message", "type", "param",
                                                                 "code"}
    assert admin_daemon.health()["status"] == "serving"


def test_a_load_that_fails_on_one_rank_keeps_the_old_registry(admin_daemon, folders, solo):
    """Rank 1 reads c.rank1 (other weights) for c: the load fails on every rank, says why,
    and what was served before is served as before."""
    url = admin_daemon.url
    before = call(url, "/v1/adapters", method="GET")[1]["data"]
    digest = admin_daemon.health()["adapter_registry"]["digest"]
    status, body, _ = call(url, "/v1/adapters", {"name": "c", "path": str(folders["c"])})
    assert status == 400, body
    message = body["error"]["message"]
    assert "rank 1:" in message and "identity key" in message and "rank 0" not in message
    assert "every rank keeps the adapters it had" in message
    assert call(url, "/v1/adapters", method="GET")[1]["data"] == before
    assert admin_daemon.health()["adapter_registry"]["digest"] == digest
    assert complete(url, "c", PROMPTS[0])[0] == 404
    assert complete(url, "a", PROMPTS[0])[1] == solo["a", 0]


def test_load_reload_unload_and_the_vllm_bodies(admin_daemon, folders, solo):
    url = admin_daemon.url
    digest = admin_daemon.health()["adapter_registry"]["digest"]
    status, card, _ = call(url, "/v1/adapters", {"name": "x", "path": str(folders["b"])})
    assert status == 200 and card["replaced_id"] is None, card
    assert admin_daemon.health()["adapter_registry"]["digest"] != digest
    status, ids, served_by = complete(url, "x", PROMPTS[1])
    assert (status, ids, served_by) == (200, solo["b", 1], str(card["id"]))
    cached = []
    assert complete(url, "x", PROMPTS[4], cached)[1] == solo["b", 4]
    status, again, _ = call(url, "/v1/adapters", {"name": "x", "path": str(folders["a"]),
                                                  "replace": True})
    assert status == 200 and again["replaced_id"] == card["id"] and again["key"] != card["key"]
    assert complete(url, "x", PROMPTS[1])[1:] == (solo["a", 1], str(again["id"]))
    # The new version finds none of the old one's cached blocks, then its own.
    assert complete(url, "x", PROMPTS[4], cached)[1] == solo["a", 4]
    assert complete(url, "x", PROMPTS[4], cached)[1] == solo["a", 4]
    assert cached == [0, 0, 32]
    status, body, _ = call(url, "/v1/adapters/x", method="DELETE")
    assert (status, body["unloaded"]) == (200, True)
    assert complete(url, "x", PROMPTS[1])[0] == 404
    status, text, _ = call(url, "/v1/load_lora_adapter", {"lora_name": "v",
                                                           "lora_path": str(folders["b"])})
    assert status == 200 and text == "Success: LoRA adapter 'v' added successfully."
    assert complete(url, "v", PROMPTS[2])[1] == solo["b", 2]
    status, text, _ = call(url, "/v1/unload_lora_adapter", {"lora_name": "v"})
    assert status == 200 and text == "Success: LoRA adapter 'v' removed successfully."
    models = call(url, "/v1/models", method="GET", key=None)[1]["data"]
    assert [m["id"] for m in models] == ["tiny", "a"]


def test_a_burst_through_loads_reloads_and_unloads(admin_daemon, folders, solo):
    """32 streams over base, a, x (reloaded b -> a mid-burst), y (loaded mid-burst) and z
    (unloaded mid-burst): every one ends normally with its solo run's ids on the version it
    started with, and the unload answers only after z's streams ended."""
    url = admin_daemon.url
    folder_of = {"1": "a"}  # adapter id header -> folder name (a: the start adapter, id 1)

    def load(name: str, folder: str, replace: bool = False) -> None:
        status, card, _ = call(url, "/v1/adapters", {"name": name, "path": str(folders[folder]),
                                                     "replace": replace})
        assert status == 200, card
        folder_of[str(card["id"])] = folder

    load("x", "b")
    load("z", "b")
    results: list = []
    z_ends: list[float] = []

    def run(model: str, prompt: int) -> None:
        status, ids, served_by = complete(url, model, PROMPTS[prompt])
        results.append((model, prompt, status, ids, served_by))
        if model == "z":
            z_ends.append(time.monotonic())

    threads = []

    def launch(models: list[str]) -> None:
        for k, model in enumerate(models):
            thread = threading.Thread(target=run, args=(model, k % len(PROMPTS)))
            thread.start()
            threads.append(thread)

    launch(["tiny", "a", "x", "z"] * 3)  # 12
    wait_holding(url, {"x": 3})  # they chose x's first version
    load("x", "a", replace=True)
    launch(["x", "a", "x", "tiny"])  # 16
    load("y", "b")
    launch(["y", "x", "y", "a", "y", "z", "tiny", "y"])  # 24
    wait_holding(url, {"z": 1})  # the unload has a stream to wait for
    status, body, _ = call(url, "/v1/adapters/z", method="DELETE")
    unloaded_at = time.monotonic()
    assert status == 200, body
    launch(["a", "y", "x", "tiny", "y", "x", "a", "tiny"])  # 32
    for thread in threads:
        thread.join(120)
    assert len(results) == 32 and len(z_ends) == 4
    # The unload answered once z's streams ended (their clients read the end a moment later).
    assert max(z_ends) <= unloaded_at + 1.0
    for model, prompt, status, ids, served_by in results:
        assert status == 200, (model, ids)
        folder = "tiny" if model == "tiny" else folder_of[served_by]
        assert ids == solo[folder, prompt], (model, prompt, served_by)
    versions_of_x = {served_by for model, _, _, _, served_by in results if model == "x"}
    assert len(versions_of_x) == 2  # both versions served streams in the burst
    for name in ("x", "y"):
        call(url, f"/v1/adapters/{name}", method="DELETE")


def test_pins_keep_a_slot_for_the_others(admin_daemon, folders):
    """With 3 slots: two pins are allowed, a third would leave no slot for the others."""
    url = admin_daemon.url
    for name in ("p", "q"):
        status, card, _ = call(url, "/v1/adapters", {"name": name, "path": str(folders["b"]),
                                                     "pinned": True})
        assert status == 200 and card["pinned"] is True, card
    status, body, _ = call(url, "/v1/adapters", {"name": "r", "path": str(folders["b"]),
                                                 "pinned": True})
    assert status == 400 and body["error"]["param"] == "pinned", body
    assert "leave no device slot" in body["error"]["message"]
    health = admin_daemon.health()
    assert {a["name"]: a["pinned"] for a in health["adapters"]}["p"] is True
    assert health["adapter_slots"] == 3
    for name in ("p", "q"):
        assert call(url, f"/v1/adapters/{name}", method="DELETE")[0] == 200
