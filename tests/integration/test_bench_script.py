"""scripts/bench.py and the first-token protocol against a real daemon on a "silent" tiny model:
the tiny Llama with its head rewired so greedy decoding only ever picks special tokens, whose
text is never shown (as random 8B weights hold theirs back), served with adapters a and b.

Checks that every stream opens when its first token exists (before any text, which here never
comes), that usage on every chunk counts each token, that the openai client parses both, and
that bench.py times every request's first token, spreads requests over a model file by its Zipf
picker, and refuses a bad model file in one line before sending any load. Its prefix workloads
(chat-turns, few-shot) are checked on the wire through a recording proxy and by the usage."""

from __future__ import annotations

import http.client
import json
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path
from urllib.parse import urlparse

import openai
import pytest

from tests.daemons import REPO, adapter_flags, start_daemon
from tests.integration.recording_proxy import RecordingProxy
from tests.unit.test_bench_script import bench_models

SCRIPT = REPO / "scripts" / "bench.py"
MODEL = "silent"
CHAT = [{"role": "user", "content": "Hello!"}]


def make_silent_model(tiny_dir: Path, out_dir: Path) -> Path:
    """A copy of the tiny checkpoint whose logits are 0 for every id but <|endoftext|> (0) and
    <|im_start|> (1), at -50 h and +50 h for one normalized hidden unit h: greedy picks one of
    those two special tokens at every step, whatever the prompt or adapter (neither touches the
    head), so the text stays empty."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_dir, out_dir)
    path = out_dir / "model.safetensors"
    tensors = load_file(str(path))
    norm = tensors["model.norm.weight"]  # [hidden]
    head = tensors["lm_head.weight"]  # [vocab, hidden]
    norm.zero_()
    norm[0] = 1.0
    head.zero_()
    head[1, 0], head[0, 0] = 50.0, -50.0
    save_file(tensors, str(path), metadata={"format": "pt"})
    return out_dir


@pytest.fixture(scope="module")
def silent_daemon(tiny_model, tiny_adapters, tmp_path_factory):
    model_dir = make_silent_model(tiny_model, tmp_path_factory.mktemp("silent") / MODEL)
    daemon = start_daemon(model_dir, "--parallel", "1", "--kv-cache-blocks", "128",
                          *adapter_flags(tiny_adapters))
    yield daemon
    assert daemon.stop() == 0, daemon.log()[-4000:]


@pytest.fixture(scope="module")
def client(silent_daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=silent_daemon.url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)


def _one_terminal(chunks) -> None:
    reasons = [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason]
    assert reasons == ["length"]


def test_a_stream_without_text_opens_at_its_first_token(silent_daemon):
    """Before, a completion stream that held all its text back sent nothing until its end."""
    url = urlparse(silent_daemon.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(
        {"model": MODEL, "prompt": "hi", "max_tokens": 240, "temperature": 0, "ignore_eos": True,
         "stream": True}),
        {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    first = json.loads(resp.readline().removeprefix(b"data: "))
    with urllib.request.urlopen(silent_daemon.url + "/health", timeout=5) as health:
        running = json.loads(health.read())["running"]
    assert first["choices"][0]["text"] == "" and first["choices"][0]["finish_reason"] is None
    assert running == 1, "the first event came only after the generation ended"
    events = [e.strip().removeprefix(b"data: ") for e in resp.read().split(b"\n\n") if e.strip()]
    conn.close()
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == ["length"]  # nothing between
    assert chunks[0]["choices"][0]["text"] == ""


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_default_streams_parse_with_openai_and_carry_no_empty_chunks(client, route):
    args = dict(model=MODEL, max_tokens=6, temperature=0, stream=True,
                extra_body={"ignore_eos": True})
    if route == "chat":
        chunks = list(client.chat.completions.create(messages=CHAT, **args))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[0].choices[0].delta.content == ""
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
    else:
        chunks = list(client.completions.create(prompt="hi", **args))
        text = "".join(c.choices[0].text for c in chunks)
    assert len(chunks) == 2 and text == ""  # the opening chunk, then the finish
    assert all(c.usage is None for c in chunks)
    _one_terminal(chunks)


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_usage_on_every_chunk_counts_each_token(client, route):
    args = dict(model="a", max_tokens=7, temperature=0, stream=True,
                stream_options={"include_usage": True, "continuous_usage_stats": True},
                extra_body={"ignore_eos": True})
    if route == "chat":
        chunks = list(client.chat.completions.create(messages=CHAT, **args))
        assert chunks[1].choices[0].delta.content == ""  # mid-stream chunks keep the field
    else:
        chunks = list(client.completions.create(prompt="hi", **args))
    assert all(c.model == "a" for c in chunks)
    with_choices = [c for c in chunks if c.choices]
    # The opening chunk at 0 tokens, then one chunk per step's token.
    assert [c.usage.completion_tokens for c in with_choices] == list(range(8))
    assert len({c.usage.prompt_tokens for c in with_choices}) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
    _one_terminal(chunks)


def run_bench(daemon, *flags: str) -> subprocess.CompletedProcess:
    # --chat: bench's random prompt ids reach 999, past the tiny vocabulary.
    return subprocess.run([sys.executable, str(SCRIPT), "--url", daemon.url, "--chat",
                           "--max-tokens", "6", "--warmup", "1", *flags],
                          capture_output=True, text=True, timeout=300, cwd=REPO)


def table_rows(stdout: str) -> dict[str, list[str]]:
    rows = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) >= 2:
            rows[cells[0]] = cells[1:]
    return rows


def test_bench_spreads_a_model_file_by_zipf_and_times_every_first_token(silent_daemon,
                                                                         tmp_path):
    models = ["a", MODEL, "b"]  # file order: a is the hottest
    ids = tmp_path / "ids.txt"
    ids.write_text("# hot to cold\n" + "\n".join(models) + "\n")
    result = run_bench(silent_daemon, "--models-from-file", str(ids), "--zipf", "1.5",
                       "--seed", "3", "--requests", "24", "--concurrency", "4")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert f"models:    Zipf s=1.5 over 3 model ids in list order, seed 3 (from {ids})" in out
    assert "ITL per token, by the usage on every chunk" in out
    rows = table_rows(out)
    assert rows["completed / failed requests"] == ["24 / 0"]
    assert rows["requests timed to first token / with any text"] == ["24 / 0"]
    ttft_p50, ttft_p99 = (float(v) for v in rows["time to first token p50 / p99 (ms)"][0]
                          .split(" / "))
    assert 0 < ttft_p50 <= ttft_p99
    assert re.fullmatch(r"[\d.]+ / [\d.]+", rows["inter-token latency p50 / p99 (ms)"][0])
    picker = bench_models.ModelPicker(models, 1.5, 3)
    expected = Counter(picker.pick(i) for i in range(24))
    assert expected["a"] > expected[MODEL] >= expected["b"]
    listed = [line.split("|")[1].strip() for line in out.splitlines()
              if line.startswith("| ") and line.split("|")[1].strip() in models]
    assert listed == models  # one row per id, in the file's order
    for model in models:
        requests, failed, tokens, p50 = rows[model]
        assert (int(requests), int(failed), int(tokens)) == (expected[model], 0,
                                                               6 * expected[model])
        assert p50 != "n/a" or expected[model] == 0


def _num_requests(daemon) -> float:
    with urllib.request.urlopen(daemon.url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(("lorad_requests_total", "lorad_requests_rejected_total")))


@pytest.mark.parametrize("text,message", [
    ("", "no model ids in it"),
    ("a\nb\na\n", "line 3 repeats 'a' (first on line 1)"),
    ("a\nnot-served\n", "1 of 2 model ids are not served by"),
])
def test_bench_refuses_a_bad_model_file_before_any_load(silent_daemon, tmp_path, text, message):
    ids = tmp_path / "ids.txt"
    ids.write_text(text)
    before = _num_requests(silent_daemon)
    result = run_bench(silent_daemon, "--models-from-file", str(ids), "--requests", "4")
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
    time.sleep(0.2)  # a request in flight would have been counted by now
    assert _num_requests(silent_daemon) == before


CHAT_TURNS = ("--workload", "chat-turns", "--concurrency", "2", "--turns", "3",
              "--system-tokens", "16")  # the silent model's context is 256 tokens


def run_prefix_bench(url: str, tmp_path: Path, *flags: str) -> tuple[subprocess.CompletedProcess,
                                                                     dict | None]:
    """bench.py with --json; returns the run and the JSON it wrote (None if none)."""
    out = tmp_path / "run.json"
    result = subprocess.run([sys.executable, str(SCRIPT), "--url", url, "--max-tokens", "3",
                             "--warmup", "1", "--json", str(out), *flags],
                            capture_output=True, text=True, timeout=300, cwd=REPO)
    return result, json.loads(out.read_text()) if out.exists() else None


def hit_rates(stdout: str, run: dict, rows: list[str]) -> list[float]:
    """The hit-rate cells of these rows: numbers in [0, 1], and 0 while usage reports no cached
    tokens (today's lorad, before its prefix cache)."""
    table = table_rows(stdout)
    cells = [table[row][0 if row.startswith("hit rate") else 3] for row in rows]
    rates = [float(cell.split()[0]) for cell in cells]
    assert all(0.0 <= rate <= 1.0 for rate in rates), cells
    if all(r["cached_tokens"] is None for r in run["requests"]):
        assert rates == [0.0] * len(rates) and "usage reports no cached tokens" in stdout
    return rates


def test_chat_turns_extend_each_conversation_after_one_shared_system_prompt(silent_daemon,
                                                                          client, tmp_path):
    with RecordingProxy(silent_daemon.url) as proxy:
        result, run = run_prefix_bench(proxy.url, tmp_path, *CHAT_TURNS)
    assert result.returncode == 0, result.stdout + result.stderr
    records = sorted(run["requests"], key=lambda r: (r["conversation"], r["turn"]))
    assert [(r["conversation"], r["turn"]) for r in records] == [(c, t) for c in (1, 2)
                                                                 for t in (1, 2, 3)]
    assert all(r["ok"] and r["output_tokens"] == 3 and r["ttft_ms"] > 0 for r in records)
    num_system = run["shared_prompt_tokens"]
    assert f"prefix:    a system prompt of {num_system} tokens by usage" in result.stdout
    for c in (1, 2):  # each turn's prompt is the last one's and more
        prompts = [r["prompt_tokens"] for r in records if r["conversation"] == c]
        assert num_system < prompts[0] < prompts[1] < prompts[2], prompts
    # On the wire: the system message alone, then each conversation's turns, every one opening
    # with that same message and extending its previous turn by the answer and a question.
    chats = [b for b in proxy.bodies if b["messages"][0]["role"] == "system"]
    probe, turns = chats[0], chats[1:]
    assert len(probe["messages"]) == 1 and probe["max_tokens"] == 1 and len(turns) == 6
    assert all(b["messages"][0] == probe["messages"][0] for b in turns)
    assert not any("cache_prompt" in b for b in proxy.bodies)
    for c in (1, 2):
        mine = sorted((b["messages"] for b in turns
                       if b["messages"][1]["content"].startswith(f"Conversation {c},")), key=len)
        for last, this in zip(mine, mine[1:]):
            assert this[:len(last)] == last
            assert this[len(last):][0] == {"role": "assistant", "content": ""}  # silent's text
            assert [m["role"] for m in this[len(last):]] == ["assistant", "user"]
    reference = client.chat.completions.create(model=probe["model"], messages=probe["messages"],
                                               max_tokens=1)
    assert reference.usage.prompt_tokens == num_system
    rows = table_rows(result.stdout)
    assert [rows[t][0] for t in ("1", "2", "3")] == ["2", "2", "2"]
    hit_rates(result.stdout, run, ["1", "2", "3", "hit rate (cached / prompt tokens)"])


def test_few_shot_puts_the_same_examples_before_each_question(silent_daemon, tmp_path):
    with RecordingProxy(silent_daemon.url) as proxy:
        result, run = run_prefix_bench(proxy.url, tmp_path, "--workload", "few-shot",
                                       "--requests", "4", "--concurrency", "2", "--shots", "2",
                                       "--shot-tokens", "12")
    assert result.returncode == 0, result.stdout + result.stderr
    records = run["requests"]
    assert sorted(r["request"] for r in records) == [1, 2, 3, 4]
    assert all(r["ok"] and r["prompt_tokens"] > run["shared_prompt_tokens"] for r in records)
    prompts = [b["prompt"] for b in proxy.bodies if not b["prompt"].startswith("Warm-up")]
    examples, questions = prompts[0], prompts[1:]
    assert examples.count("\nA2: ") == 1 and len(set(questions)) == 4
    assert all(q.startswith(examples) and len(q) > len(examples) for q in questions)
    p50, p99 = map(float, table_rows(result.stdout)["time to first token p50 / p99 (ms)"][0]
                   .split(" / "))
    assert 0 < p50 <= p99
    hit_rates(result.stdout, run, ["hit rate (cached / prompt tokens)"])


def test_no_cache_sends_cache_prompt_false_on_every_request(silent_daemon, tmp_path):
    with RecordingProxy(silent_daemon.url) as proxy:
        result, run = run_prefix_bench(proxy.url, tmp_path, *CHAT_TURNS, "--turns", "2",
                                       "--no-cache")
    assert result.returncode == 0, result.stdout + result.stderr
    assert len(proxy.bodies) == 6  # the warm-up, the system prompt alone, 2 x 2 turns
    assert all(b["cache_prompt"] is False for b in proxy.bodies)
    assert "cache:     cache_prompt false on every request (--no-cache)" in result.stdout
    # Opted out, no request may count cached tokens, with a prefix cache or without.
    assert hit_rates(result.stdout, run, ["1", "2", "hit rate (cached / prompt tokens)"]) == [0] * 3
    assert all(not r["cached_tokens"] for r in run["requests"])


@pytest.mark.parametrize("flags", [("--chat",), ("--workload", "chat-turns"),
                                   ("--workload", "few-shot", "--warmup", "0")])
def test_a_server_that_refuses_cache_prompt_is_named_in_one_line(silent_daemon, tmp_path, flags):
    """lorad ignores unknown fields as OpenAI's schema allows, but OpenAI itself answers 400."""
    with RecordingProxy(silent_daemon.url, refuse_field="cache_prompt") as proxy:
        result, run = run_prefix_bench(proxy.url, tmp_path, *flags, "--no-cache")
    assert result.returncode == 2 and result.stdout == "" and run is None, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith('bench: the server refused "cache_prompt": false')
    assert "Unrecognized request argument supplied: cache_prompt" in result.stderr
    assert len(proxy.bodies) == 1  # nothing sent after the first refusal
