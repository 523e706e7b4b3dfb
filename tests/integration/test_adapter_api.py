"""Adapters over HTTP on a real `lorad` (two workers, tiny random Llama, two random PEFT adapters):
/v1/models and /health list them; a request picks one by `model` or by the `adapter` field and
gets what transformers + peft generate for that adapter; a wrong choice is refused with an OpenAI
error before anything is admitted."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.error
import urllib.request

import openai
import pytest
import torch

from lorad.daemon.tokenizer import ModelTokenizer
from tests.daemons import post, wait_idle

MODEL = "tiny"
IDS = (MODEL, "a", "b")
PROMPT_IDS = [5, 17, 42, 99, 7, 250, 31, 64]
MAX_TOKENS = 12
CHAT = [{"role": "user", "content": "Hello, world! How are you today?"}]


@pytest.fixture(scope="module")
def client(adapter_daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=adapter_daemon.url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)


@pytest.fixture(scope="module")
def reference(tiny_model, tiny_adapters) -> dict[str, str]:
    """Greedy text for PROMPT_IDS per model id: transformers for the base, + peft per adapter."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    tokenizer = ModelTokenizer.from_dir(tiny_model)
    texts = {}
    for model_id in IDS:
        model = LlamaForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
        if model_id != MODEL:
            model = PeftModel.from_pretrained(model, tiny_adapters[model_id])
        with torch.no_grad():
            out = model.eval().generate(torch.tensor([PROMPT_IDS]), max_new_tokens=MAX_TOKENS,
                                        do_sample=False, eos_token_id=2, pad_token_id=2)
        texts[model_id] = tokenizer.decode(out[0, len(PROMPT_IDS):].tolist())
    # Otherwise a request served by the wrong adapter could pass unnoticed.
    assert len(set(texts.values())) == len(IDS), texts
    return texts


def get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_models_list_the_base_and_each_adapter_with_its_parent(adapter_daemon):
    status, body = get(adapter_daemon.url + "/v1/models")
    assert status == 200
    assert [(m["id"], m["object"], m["owned_by"], m["parent"]) for m in body["data"]] == [
        (MODEL, "model", "lorad", None), ("a", "model", "lorad", MODEL),
        ("b", "model", "lorad", MODEL)]
    status, card = get(adapter_daemon.url + "/v1/models/b")
    assert status == 200 and card == body["data"][2]
    status, error = get(adapter_daemon.url + "/v1/models/c")
    assert status == 404 and error["error"]["code"] == "model_not_found"
    assert "`tiny`, `a` and `b`" in error["error"]["message"]


def test_models_through_the_client(client):
    assert [m.id for m in client.models.list().data] == list(IDS)
    assert client.models.retrieve("a").model_extra["parent"] == MODEL


def test_health_lists_adapters_with_ids_and_keys(adapter_daemon):
    adapters = adapter_daemon.health()["adapters"]
    assert [(a["name"], a["id"], a["strength"]) for a in adapters] == [("a", 1, 1.0),
                                                                          ("b", 2, 1.0)]
    keys = [a["key"] for a in adapters]
    assert all(re.fullmatch(r"[0-9a-f]{64}", key) for key in keys) and keys[0] != keys[1]


@pytest.mark.parametrize("model_id", IDS)
def test_model_id_selects_the_adapter(client, reference, model_id):
    out = client.completions.create(model=model_id, prompt=PROMPT_IDS, max_tokens=MAX_TOKENS,
                                    temperature=0)
    assert out.model == model_id
    assert out.choices[0].text == reference[model_id]


@pytest.mark.parametrize("model,adapter", [(MODEL, "a"), ("a", "a"), (MODEL, "b"), (MODEL, None)])
def test_adapter_field_selects_the_adapter(client, reference, model, adapter):
    out = client.completions.create(model=model, prompt=PROMPT_IDS, max_tokens=MAX_TOKENS,
                                    temperature=0, extra_body={"adapter": adapter})
    used = adapter or model
    assert out.model == used  # responses name the adapter that answered
    assert out.choices[0].text == reference[used]


def test_streamed_chat_by_adapter_field_equals_chat_by_model_id(client):
    args = dict(messages=CHAT, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(model="b", **args)
    chunks = list(client.chat.completions.create(
        model=MODEL, stream=True, **{**args, "extra_body": {"ignore_eos": True, "adapter": "b"}}))
    assert {c.model for c in chunks} == {"b"} and full.model == "b"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == \
        full.choices[0].message.content
    base = client.chat.completions.create(model=MODEL, **args)
    assert base.choices[0].message.content != full.choices[0].message.content


def test_concurrent_requests_each_get_their_own_adapter(adapter_daemon, reference):
    choices = [(MODEL, None), ("a", None), (MODEL, "b"), (MODEL, "a"), ("b", "b"), (MODEL, None)]

    async def one(client, model, adapter):
        out = await client.completions.create(model=model, prompt=PROMPT_IDS,
                                              max_tokens=MAX_TOKENS, temperature=0,
                                              extra_body={"adapter": adapter})
        return out.model, out.choices[0].text

    async def burst():
        async with openai.AsyncOpenAI(base_url=adapter_daemon.url + "/v1", api_key="unused",
                                      max_retries=0, timeout=120) as client:
            return await asyncio.gather(*(one(client, m, a) for m, a in choices * 2))

    expected = [(a or m, reference[a or m]) for m, a in choices * 2]
    assert asyncio.run(burst()) == expected


@pytest.mark.parametrize("body,status,code", [
    ({"model": "a", "adapter": "b"}, 400, "adapter_conflict"),
    ({"model": MODEL, "adapter": "c"}, 400, "adapter_not_found"),
    ({"model": "a", "adapter": "c"}, 400, "adapter_not_found"),
    ({"model": MODEL, "adapter": MODEL}, 400, "adapter_not_found"),  # the base is no adapter
    ({"model": MODEL, "adapter": 7}, 400, "invalid_type"),
    ({"model": MODEL, "adapter": ["a"]}, 400, "invalid_type"),
    ({"model": "c", "adapter": "a"}, 404, "model_not_found"),
    ({"model": "c"}, 404, "model_not_found"),
])
@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_a_wrong_choice_is_refused_before_any_stream(adapter_daemon, route, body, status, code):
    payload = {"prompt": "hi"} if route == "completions" else {"messages": CHAT}
    reply_status, reply = post(f"{adapter_daemon.url}/v1/{route}",
                               {**payload, **body, "stream": True, "max_tokens": 4})
    assert reply_status == status, reply  # a JSON error body, not an event stream
    assert reply["error"]["code"] == code
    assert reply["error"]["param"] == ("model" if status == 404 else "adapter")
    health = wait_idle(adapter_daemon)
    assert health["open_requests"] == 0 and health["running"] == 0


def test_a_conflict_through_the_client(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="a", messages=CHAT, extra_body={"adapter": "b"})
    assert exc.value.body["code"] == "adapter_conflict"
    assert "`a`" in exc.value.body["message"] and "`b`" in exc.value.body["message"]
