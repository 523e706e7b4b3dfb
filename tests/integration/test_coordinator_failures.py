"""The coordinator's failure handling against a scripted worker that misbehaves on purpose:
ranks that disagree, a worker that never gets ready or exits at start, a failed step, and a
WorkerFailed mid-stream. Every case must end each request once, exit with the right status and
leave no runtime folder or process behind.

The real `lorad` entry point runs with its worker command swapped for FAKE_WORKER (the one
argument `main()` takes besides argv); everything else is the real daemon.
"""

from __future__ import annotations

import json
import shutil
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

FAKE_WORKER = '''
import sys, time
import zmq
from lorad.config import WorkerConfig
from lorad.protocol import (PROTOCOL_VERSION, Admit, Cancel, Hello, Ready, SeqOutput, Shutdown,
                            StepFailed, StepResult, WorkerFailed, decode, encode)
from lorad.protocol.sockets import connect_pusher, connect_subscriber

mode, config_path, rank = sys.argv[1], sys.argv[3], int(sys.argv[5])
if mode == "exit-at-start":
    sys.exit(3)
cfg = WorkerConfig.from_json(open(config_path).read())
ctx = zmq.Context()
sub = connect_subscriber(ctx, cfg.admit_endpoint)
push = connect_pusher(ctx, cfg.results_endpoint)
accept = (Hello, Admit, Cancel, Shutdown)
while not isinstance(decode(sub.recv(), accept), Hello):
    pass
if mode == "never-ready":
    while True:
        sub.recv()
digest = f"digest-of-rank-{rank}" if mode == "digest" else "same"
push.send(encode(Ready(rank, PROTOCOL_VERSION, cfg.instance_id, 32, cfg.block_size, digest,
                    cfg.max_num_seqs or 64, [])))
step = 0
while True:
    msg = decode(sub.recv(), accept)
    if isinstance(msg, Shutdown):
        sys.exit(0)
    if rank != 0 or not isinstance(msg, Admit):
        continue
    step += 1
    if mode == "step-failed":
        push.send(encode(StepFailed(step, [msg.request_id], "live sets disagree")))
    elif mode == "worker-failed":
        out = SeqOutput(msg.request_id, [65], None, len(msg.prompt_ids))
        push.send(encode(StepResult(step, [out], 1, 0, 31)))
        time.sleep(0.3)
        push.send(encode(WorkerFailed(0, "injected failure")))
        time.sleep(60)
'''


@pytest.fixture
def fake_entry(tmp_path):
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER)

    def entry(mode: str) -> list[str]:
        command = (sys.executable, str(script), mode)
        code = ("import sys; from lorad.daemon.main import main; "
                f"sys.exit(main(sys.argv[1:], worker_command={command!r}))")
        return [sys.executable, "-c", code]

    return entry


def _post(url: str, body: dict) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@pytest.mark.parametrize("mode,flags,message", [
    ("digest", ["--parallel", "2"], "workers disagree on registry_digest"),
    ("never-ready", ["--startup-timeout", "2"], "did not report ready within 2s"),
    ("exit-at-start", ["--parallel", "2"], "exited with code 3 before it was ready"),
])
def test_startup_failures_exit_nonzero(start_lorad, fake_entry, mode, flags, message):
    daemon = start_lorad(*flags, entry=fake_entry(mode), wait=False)
    assert daemon.proc.wait(60) == 1, daemon.log()
    assert message in daemon.log()
    daemon.assert_cleaned_up([])


def test_failed_step_is_a_500_and_serving_goes_on(start_lorad, fake_entry):
    daemon = start_lorad(entry=fake_entry("step-failed"))
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 4}
    for stream in (False, True):  # no token was sent yet, so a stream is a plain 500 too
        status, raw = _post(daemon.url + "/v1/completions", {**body, "stream": stream})
        error = json.loads(raw)["error"]
        assert status == 500 and "live sets disagree" in error["message"]
        assert error["type"] == "server_error"
    assert daemon.health()["status"] == "serving"
    pids = daemon.worker_pids()
    assert daemon.stop() == 0
    daemon.assert_cleaned_up(pids)


def test_worker_failed_ends_open_streams_and_exits_nonzero(start_lorad, fake_entry):
    daemon = start_lorad("--parallel", "2", entry=fake_entry("worker-failed"))
    pids = daemon.worker_pids()
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9,
            "stream": True}
    status, raw = _post(daemon.url + "/v1/chat/completions", body)
    events = [e.strip().removeprefix(b"data: ") for e in raw.split(b"\n\n") if e.strip()]
    assert status == 200 and events[-1] == b"[DONE]"
    assert json.loads(events[0])["choices"][0]["delta"]["role"] == "assistant"
    error = json.loads(events[-2])["error"]
    assert "worker rank 0 failed: injected failure" in error["message"]
    assert sum(b'"error"' in e for e in events) == 1  # exactly one terminal event
    assert daemon.proc.wait(30) == 1
    daemon.assert_cleaned_up(pids)


@pytest.mark.parametrize("flags,message", [
    (["--dist-backend", "nccl"],  # --device auto: the CPU here, which the workers find out
     "--dist-backend nccl needs CUDA, and the workers run on cpu: use --dist-backend gloo"),
    (["--kv-cache-blocks", "3", "--max-model-len", "64", "--block-size", "16"],
     "the KV pool has 3 blocks of 16 tokens; one sequence of --max-model-len 64 needs 4"),
    (["--kv-cache-memory", "64TiB"], "the KV pool of "),
])
def test_a_setting_the_workers_refuse_is_one_line_and_exit_1(start_lorad, flags, message):
    """Real workers refusing a setting at start: the daemon exits 1, saying what is wrong in one
    line, from every rank and the coordinator alike, with no traceback."""
    daemon = start_lorad("--parallel", "2", *flags, wait=False)
    assert daemon.proc.wait(120) == 1, daemon.log()
    log = daemon.log()
    assert "start-up failed: worker rank" in log and message in log, log
    assert "Traceback" not in log, log
    daemon.assert_cleaned_up([])


def _config_dir(tiny_model: Path, where: Path, **sizes) -> Path:
    """The tiny model's tokenizer with a config.json of other sizes (for --load-format random)."""
    where.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tiny_model / name, where / name)
    config = json.loads((tiny_model / "config.json").read_text())
    config.update(sizes)
    (where / "config.json").write_text(json.dumps(config))
    return where


def _mem_available() -> int:
    with open("/proc/meminfo", encoding="ascii") as meminfo:
        return next(int(line.split()[1]) * 1024 for line in meminfo
                    if line.startswith("MemAvailable:"))


@pytest.mark.parametrize("case", ["far too big", "each half fits, not both"])
def test_weights_that_cannot_fit_are_refused_before_loading(start_lorad, tiny_model, tmp_path,
                                                            case):
    """A model whose weights exceed the memory free on the device (--load-format random, so no
    checkpoint is needed): each rank says so in one line before any rank allocates, and the
    daemon exits 1 at once instead of meeting the OOM killer. Ranks on one device count
    together: with 2 ranks on the CPU, weights whose halves fit one at a time but not side by
    side are refused too."""
    shape = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                 num_key_value_heads=8, head_dim=128)
    per_layer = 4 * (4096 * (4096 + 1024 + 1024 + 4096) + 3 * 4096 * 14336)  # fp32 bytes
    # 1.5x what is free: each rank's half is 0.75x
    layers = 2000 if case == "far too big" else int(1.5 * _mem_available() / per_layer) + 1
    model = _config_dir(tiny_model, tmp_path / "big", num_hidden_layers=layers, **shape)
    daemon = start_lorad("--parallel", "2", "--load-format", "random", "--dtype", "float32",
                         model_dir=model, wait=False)
    assert daemon.proc.wait(120) == 1, daemon.log()
    log = daemon.log()
    assert "its weights take" in log and "GiB for the 2 ranks on cpu" in log, log
    assert "GiB free on cpu; use a smaller --dtype (bfloat16) or a bigger machine" in log, log
    assert "Traceback" not in log, log
    daemon.assert_cleaned_up([])
