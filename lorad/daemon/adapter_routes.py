"""The adapter admin routes: load, reload, unload and list adapters while serving.

lorad's own (`POST /v1/adapters`, `DELETE /v1/adapters/{name}`, `GET /v1/adapters`) and vLLM's
(`POST /v1/load_lora_adapter`, `POST /v1/unload_lora_adapter`, with vLLM's bodies and plain-text
answers), so existing tooling works. Off unless --admin-key-file is given: then the admin key
authenticates them (auth.py); without it they answer 403. The work is adapter_catalog.py's.
"""

from __future__ import annotations

import math

from aiohttp import web

from lorad.daemon.errors import ApiError, bad_request
from lorad.daemon.json_body import read_json
from lorad.protocol.messages import MAX_ADAPTER_STRENGTH

ADMIN_PREFIXES = ("/v1/adapters", "/v1/load_lora_adapter", "/v1/unload_lora_adapter")
CATALOG = web.AppKey("lorad_adapter_catalog", object)  # the app's AdapterCatalog
_LOAD_FIELDS = {"name", "path", "strength", "pinned", "replace"}
_VLLM_LOAD_FIELDS = {"lora_name", "lora_path", "load_inplace", "lora_int_id", "base_model_name"}


def add_admin_routes(app: web.Application, catalog, enabled: bool) -> None:
    app[CATALOG] = catalog
    routes = ((app.router.add_get, "/v1/adapters", list_adapters),
              (app.router.add_post, "/v1/adapters", load_adapter),
              (app.router.add_delete, "/v1/adapters/{name}", unload_adapter),
              (app.router.add_post, "/v1/load_lora_adapter", vllm_load),
              (app.router.add_post, "/v1/unload_lora_adapter", vllm_unload))
    for add, path, handler in routes:
        add(path, handler if enabled else _off)


async def _off(request: web.Request) -> web.Response:
    raise ApiError(403, "adapters cannot be changed while serving: start lorad with "
                        "--admin-key-file to allow it", None, "adapter_admin_off")


def _catalog(request: web.Request):
    return request.app[CATALOG]


async def list_adapters(request: web.Request) -> web.Response:
    catalog = _catalog(request)
    return web.json_response({"object": "list", "data": [
        _card(catalog, spec) for spec in catalog.served()]})


async def load_adapter(request: web.Request) -> web.Response:
    body = await _object(request, _LOAD_FIELDS)
    name, path = _text(body, "name"), _text(body, "path")
    strength = body.get("strength", 1.0)
    if (not isinstance(strength, (int, float)) or isinstance(strength, bool)
            or not math.isfinite(strength) or not 0 <= strength <= MAX_ADAPTER_STRENGTH):
        raise bad_request(f"strength must be a number from 0 to {MAX_ADAPTER_STRENGTH:g}",
                          "strength")
    pinned, replace = _flag(body, "pinned"), _flag(body, "replace")
    catalog = _catalog(request)
    spec, old = await catalog.load(name, path, float(strength), pinned, replace)
    card = _card(catalog, spec)
    card["replaced_id"] = old.adapter_id if old is not None else None
    return web.json_response(card)


async def unload_adapter(request: web.Request) -> web.Response:
    spec = await _catalog(request).unload(request.match_info["name"])
    return web.json_response({"name": spec.name, "id": spec.adapter_id, "unloaded": True})


async def vllm_load(request: web.Request) -> web.Response:
    body = await _object(request, _VLLM_LOAD_FIELDS)
    name, path = _text(body, "lora_name"), _text(body, "lora_path")
    await _catalog(request).load(name, path, 1.0, False, _flag(body, "load_inplace"))
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def vllm_unload(request: web.Request) -> web.Response:
    body = await _object(request, {"lora_name", "lora_int_id"})
    name = _text(body, "lora_name")
    await _catalog(request).unload(name)
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


def _card(catalog, spec) -> dict:
    return {"name": spec.name, "id": spec.adapter_id, "path": spec.path, "key": spec.key,
            "strength": spec.strength, "pinned": catalog.is_pinned(spec),
            "open_requests": catalog.num_open(spec)}


async def _object(request: web.Request, allowed: set[str]) -> dict:
    body = await read_json(request)
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise bad_request(f"unknown field {unknown[0]!r}; this route takes "
                          f"{', '.join(sorted(allowed))}", unknown[0])
    return body


def _text(body: dict, name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not value:
        raise bad_request(f"{name} is required, as a non-empty string", name)
    return value


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be true or false", name)
    return value
