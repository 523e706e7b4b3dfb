"""scripts/adapter_mix.py's pure parts, and its text fallback against a stub server that returns
no token ids: the burst plan covers every (model, prompt, mode) once per M * P * D streams with
neighbours on different model ids, streams are read into text and ids (None where a chunk lacks
them), mismatches compare ids (or text), prompts of token ids are fixed by the vocabulary."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.script_modules import load_script

mix = load_script("adapter_mix")


@pytest.mark.parametrize("num_models,num_prompts,modes", [
    (3, 4, ["greedy"]), (3, 2, ["greedy"]), (4, 3, ["greedy", "seeded"]),
    (65, 3, ["greedy", "seeded"]), (1, 1, ["greedy", "seeded"]), (6, 4, ["greedy", "seeded"])])
def test_the_burst_plan_runs_every_key_once_and_neighbours_differ(num_models, num_prompts, modes):
    models = [f"m{i}" for i in range(num_models)]
    full = num_models * num_prompts * len(modes)
    plan = mix.burst_plan(models, num_prompts, modes, 2 * full)
    assert len(set(plan[:full])) == full and plan[full:] == plan[:full]
    if num_models > 1:
        assert all(a[0] != b[0] for a, b in zip(plan, plan[1:]))
    if num_models > num_prompts:  # one stream per model id (64 adapters) mixes the modes too
        assert {mode for _, _, mode in plan[:num_models]} == set(modes)


def sse(*chunks: dict) -> list[bytes]:
    return [b"data: " + json.dumps(c).encode() + b"\n" for c in chunks] + [b"data: [DONE]\n"]


def test_streams_are_read_into_text_ids_and_count():
    lines = sse({"model": "m", "choices": [{"text": "", "token_ids": []}]},
                {"model": "m", "choices": [{"text": "ab", "token_ids": [5, 6]}]},
                {"model": "m", "choices": [{"text": "", "token_ids": [7],
                                            "finish_reason": "length"}]},
                {"model": "m", "choices": [], "usage": {"completion_tokens": 3}})
    assert mix.read_events(lines, "m", chat=False) == ("ab", (5, 6, 7), 3)
    lines[1] = b'data: {"model": "m", "choices": [{"text": "ab"}]}\n'  # one chunk without
    assert mix.read_events(lines, "m", chat=False) == ("ab", None, 3)
    with pytest.raises(mix.RequestFailed, match="error event: boom"):
        mix.read_events(sse({"error": {"message": "boom"}}), "m", chat=False)
    with pytest.raises(mix.RequestFailed, match="without a finish_reason"):
        mix.read_events(sse({"model": "m", "choices": [{"text": "x", "token_ids": [1]}]}), "m",
                        chat=False)


def test_mismatches_compare_ids_or_text():
    key = ("m", 0, "seeded")
    solo = {key: mix.Run(key, "", (1, 2, 3), 3)}
    same_text = mix.Run(key, "", (1, 9, 3), 3)  # random weights: no text either way
    [line] = mix.mismatches(solo, [same_text], by_ids=True)
    assert line.startswith("MISMATCH m seeded prompt 0 (burst stream 0)")
    assert "ids differ from token 1: solo (2, 3), burst (9, 3)" in line
    assert mix.mismatches(solo, [same_text], by_ids=False) == []
    assert mix.mismatches(solo, [solo[key], None], by_ids=True) == []


def test_token_prompts_and_seeds_are_fixed():
    prompts = mix.token_prompts([8, 200, 3], 400)
    assert [len(p) for p in prompts] == [8, 200, 3] and max(map(max, prompts)) < 400
    assert prompts == mix.token_prompts([8, 200, 3], 400)
    assert mix.pair_seed("a", 1) == mix.pair_seed("a", 1) != mix.pair_seed("a", 2)


class TextOnly(BaseHTTPRequestHandler):
    """A server without return_token_ids: the same text for every request."""

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        events = b"".join(sse({"model": body["model"], "choices": [
            {"text": "hi", "finish_reason": "length"}]}, {"model": body["model"], "choices": [],
                                                          "usage": {"completion_tokens": 1}}))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(events)))
        self.end_headers()
        self.wfile.write(events)

    def log_message(self, *args):
        pass


def test_a_server_without_token_ids_is_compared_by_text_with_a_warning(capsys):
    server = ThreadingHTTPServer(("127.0.0.1", 0), TextOnly)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert mix.main(["--url", url, "--models", "x,y", "--burst", "4", "--seeded"]) == 0
    finally:
        server.shutdown()
    out, err = capsys.readouterr()
    assert "returned no token_ids" in err and "comparing text instead" in err
    assert "compared by text" in out and "OK: all 4 streams equal their solo runs" in out
