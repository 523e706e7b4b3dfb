"""--api-key through a real daemon: every route the router holds, walked from the router itself,
refuses a missing or wrong key with a 401 and accepts the right one; the probes stay open."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from lorad.daemon.auth import OPEN_PATHS
from lorad.daemon.adapter_routes import ADMIN_PREFIXES
from lorad.daemon.routes import build_app

KEY = "test-key-0123456789abcdef"


def _routes() -> list[tuple[str, str]]:
    """(method, concrete path) of every route of the app lorad serves, from its router."""
    app = build_app(state=None, api_key=KEY)  # handlers are not run: only the table is read
    routes = []
    for route in app.router.routes():
        if route.method == "HEAD":
            continue
        info = route.resource.get_info()
        path = info.get("path") or info["formatter"].replace("{model_id}", "tiny").replace(
            "{name}", "x")
        routes.append((route.method, path))
    assert ("POST", "/v1/chat/completions") in routes and ("GET", "/health") in routes
    return routes


def _call(daemon, method: str, path: str, key: str | None) -> tuple[int, dict]:
    body = None
    if method == "POST":
        body = json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 2,
                           "messages": [{"role": "user", "content": "Hello"}]}).encode()
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(daemon.url + path, body, headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, _body(resp)
    except urllib.error.HTTPError as exc:
        return exc.code, _body(exc)


def _body(resp) -> dict | str:
    """JSON bodies parsed; /metrics answers in Prometheus text."""
    text = resp.read().decode()
    return json.loads(text) if resp.headers["Content-Type"].startswith("application/json") \
        else text


@pytest.fixture(scope="module")
def keyed_daemon(tiny_model, tmp_path_factory):
    from tests.daemons import start_daemon

    key_file = tmp_path_factory.mktemp("key") / "api-key"
    key_file.write_text(KEY + "\n")
    daemon = start_daemon(tiny_model, "--api-key-file", str(key_file))
    yield daemon
    assert daemon.stop() == 0


@pytest.mark.parametrize("method, path", _routes())
def test_every_route_needs_the_key_except_the_probes(keyed_daemon, method, path):
    if path in OPEN_PATHS:
        assert _call(keyed_daemon, method, path, None)[0] == 200
        return
    for key in (None, "wrong-key-0123456789abcdef", KEY[:-1], KEY + "x"):
        status, body = _call(keyed_daemon, method, path, key)
        assert status == 401, (path, key, status, body)
        assert body["error"]["code"] == "invalid_api_key"
    status, body = _call(keyed_daemon, method, path, KEY)
    if path.startswith(ADMIN_PREFIXES):  # behind the API key too when there is no admin key
        assert status == 403 and body["error"]["code"] == "adapter_admin_off", (path, body)
        return
    assert status == 200, (path, status, body)


def test_unknown_paths_answer_401_without_the_key_and_404_with_it(keyed_daemon):
    assert _call(keyed_daemon, "GET", "/v1/secret", None)[0] == 401
    assert _call(keyed_daemon, "GET", "/v1/secret", KEY)[0] == 404


def test_a_short_key_is_refused_on_the_command_line():
    from lorad.config.cli import parse_args

    with pytest.raises(SystemExit) as exit_:
        parse_args(["--model", "/tmp", "--api-key", "short"])
    assert exit_.value.code == 2


def test_the_admin_key_and_the_api_key_each_open_only_their_routes(tiny_model, tmp_path):
    """With both keys: the admin routes take the admin key alone, every other route the API
    key alone."""
    from tests.daemons import start_daemon

    admin = "admin-key-0123456789abcdef"
    (tmp_path / "api").write_text(KEY + "\n")
    (tmp_path / "admin").write_text(admin + "\n")
    daemon = start_daemon(tiny_model, "--api-key-file", str(tmp_path / "api"),
                          "--admin-key-file", str(tmp_path / "admin"))
    try:
        assert _call(daemon, "GET", "/v1/adapters", KEY)[0] == 401
        status, body = _call(daemon, "GET", "/v1/adapters", admin)
        assert status == 200 and body["data"] == []
        assert _call(daemon, "GET", "/v1/models", admin)[0] == 401
        assert _call(daemon, "GET", "/v1/models", KEY)[0] == 200
    finally:
        assert daemon.stop() == 0
