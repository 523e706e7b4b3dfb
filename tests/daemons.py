"""Real coordinator daemons for the integration and multi-GPU tests: the `lorad` entry point in
a subprocess on a tiny random checkpoint, a free loopback port, and a private runtime folder checked empty afterwards.

The command is `python -m lorad.daemon` (what the `lorad` console script runs), so the tests do
not depend on the package being pip-installed.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.tiny_models import make_tiny_llama

REPO = Path(__file__).resolve().parents[1]
# The demo model's id as lorad serves it, and its two demo adapters by name.
DEMO_MODEL_ID = "SmolLM2-135M-Instruct"
DEMO_ADAPTERS = {name: REPO / "demo" / "adapters" / name for name in ("uppercase", "pirate")}
STARTUP_TIMEOUT_S = 180.0


@dataclass
class Daemon:
    proc: subprocess.Popen
    url: str  # http://127.0.0.1:PORT
    runtime_parent: Path  # --runtime-dir: holds this instance's private folder while it runs
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def health(self) -> dict:
        with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
            return json.loads(resp.read())

    def worker_pids(self) -> list[int]:
        """The worker processes this daemon started (its direct children)."""
        path = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        return [int(p) for p in path.read_text().split()]

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        """Signal the daemon and wait for it; returns its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            pytest.fail(f"lorad did not exit within {timeout_s}s of {sig!r}:\n"
                        f"{self.log()[-4000:]}", pytrace=False)

    def assert_cleaned_up(self, worker_pids: list[int]) -> None:
        leftovers = list(self.runtime_parent.iterdir())
        assert not leftovers, f"runtime folder not removed: {leftovers}"
        alive = [pid for pid in worker_pids if _running(pid)]
        assert not alive, f"worker processes left running: {alive}"


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


# The runtime folders and logs the daemons of this process were given: removed when the session
# passes, kept (for their logs) when it fails. A run would otherwise leave two entries in /tmp
# for every daemon it started.
_SCRATCH: list[Path] = []


def scratch_dir(prefix: str) -> Path:
    """A new folder directly under the temporary folder (short: ipc paths are limited), removed
    with its contents at the end of a passing session."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    _SCRATCH.append(folder)
    return folder


def scratch_file(prefix: str, suffix: str) -> Path:
    """A new empty file under the temporary folder, removed at the end of a passing session."""
    handle, name = tempfile.mkstemp(prefix=prefix, suffix=suffix)
    os.close(handle)
    _SCRATCH.append(Path(name))
    return Path(name)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if exitstatus != 0:
        return
    for path in _SCRATCH:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    _SCRATCH.clear()


# Where free_port draws from: below the kernel's ephemeral range. A port from bind(0) is an
# ephemeral one, which the daemon's own connections (gloo's, ZeroMQ's) may take while its
# workers start, before its HTTP listener binds it: seen in CI as "cannot listen on
# 127.0.0.1:32969 ... address already in use" (2026-12-02).
LOW_PORT = 10000
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port() -> int:
    """A loopback port nothing holds now, outside the ephemeral range (where known: Linux);
    else one bind(0) gives."""
    try:
        ephemeral_low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = LOW_PORT
    rng = random.SystemRandom()
    for _ in range(100 if ephemeral_low > LOW_PORT else 0):
        port = rng.randrange(LOW_PORT, ephemeral_low)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_daemon(model_dir: Path, *flags: str, entry: list[str] | None = None,
                 wait: bool = True, env: dict[str, str] | None = None,
                 runtime_parent: Path | None = None, port: int | None = None) -> Daemon:
    """Start a daemon; with wait=True, return once /health answers 200 (fail with its log).
    env: extra environment variables (the workers inherit them)."""
    if runtime_parent is None:
        runtime_parent = scratch_dir("lrd-")
    log_path = scratch_file(runtime_parent.name, ".log")
    port = port or free_port()
    entry = entry or [sys.executable, "-m", "lorad.daemon"]
    argv = [*entry, "--model", str(model_dir), "--port", str(port),
            "--runtime-dir", str(runtime_parent), *flags]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    daemon = Daemon(proc, f"http://127.0.0.1:{port}", runtime_parent, log_path)
    if wait:
        wait_healthy(daemon)
    return daemon


def wait_healthy(daemon: Daemon, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if daemon.proc.poll() is not None:
            pytest.fail(f"lorad exited with {daemon.proc.returncode} during start-up:\n"
                        f"{daemon.log()[-4000:]}", pytrace=False)
        try:
            if daemon.health()["status"] == "serving":
                return
        except (OSError, urllib.error.URLError, ValueError):
            pass
        time.sleep(0.2)
    daemon.stop(signal.SIGKILL)
    pytest.fail(f"lorad did not become healthy in {timeout_s}s:\n{daemon.log()[-4000:]}",
                pytrace=False)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny")


@pytest.fixture(scope="session")
def long_model(tmp_path_factory) -> Path:
    """The tiny model with a 4096-token context: room for requests that run for seconds."""
    return make_tiny_llama(tmp_path_factory.mktemp("long") / "long",
                           max_position_embeddings=4096)


@pytest.fixture(scope="module")
def daemon(tiny_model):
    """One daemon at --parallel 2 shared by a module's tests; stopped with SIGTERM (exit 0)."""
    daemon = start_daemon(tiny_model, "--parallel", "2", "--kv-cache-blocks", "256",
                          "--max-num-seqs", "48")
    pids = daemon.worker_pids()
    yield daemon
    code = daemon.stop()
    assert code == 0, daemon.log()[-4000:]
    daemon.assert_cleaned_up(pids)


@pytest.fixture
def start_lorad(tiny_model):
    """start_lorad(*flags, model_dir=None, entry=None, wait=True, env=None, runtime_parent=None,
    port=None) -> Daemon; killed at teardown if the test left it running."""
    started: list[Daemon] = []

    def start(*flags: str, model_dir: Path | None = None, entry: list[str] | None = None,
              wait: bool = True, env: dict[str, str] | None = None,
              runtime_parent: Path | None = None, port: int | None = None) -> Daemon:
        started.append(start_daemon(model_dir or tiny_model, *flags, entry=entry, wait=wait,
                                    env=env, runtime_parent=runtime_parent, port=port))
        return started[-1]

    yield start
    for daemon in started:
        if daemon.proc.poll() is None:
            daemon.stop(signal.SIGKILL)


@pytest.fixture(scope="session")
def tiny_adapters(tiny_model, tmp_path_factory) -> dict[str, Path]:
    """Two random PEFT adapters for the tiny model that differ in modules, rank and weights:
    `a` edits every projection at rank 4, `b` q, v, o and down at rank 8."""
    from tests.tiny_adapters import make_peft_adapter

    root = tmp_path_factory.mktemp("adapters")
    return {"a": make_peft_adapter(tiny_model, root / "a", r=4, seed=1),
            "b": make_peft_adapter(tiny_model, root / "b", r=8, lora_alpha=8, seed=2,
                                   target_modules=("q_proj", "v_proj", "o_proj", "down_proj"))}


def adapter_flags(adapters: dict[str, Path]) -> list[str]:
    """`--adapter NAME=DIR` for each entry, in order."""
    return [flag for name, path in adapters.items() for flag in ("--adapter", f"{name}={path}")]


@pytest.fixture(scope="session")
def adapter_daemon(tiny_model, tiny_adapters):
    """One daemon at --parallel 2 serving the tiny model with adapters a (slot 1) and b (slot 2),
    shared by the adapter test modules; stopped with SIGTERM (exit 0)."""
    daemon = start_daemon(tiny_model, "--parallel", "2", "--kv-cache-blocks", "256",
                          "--max-num-seqs", "48", *adapter_flags(tiny_adapters))
    pids = daemon.worker_pids()
    yield daemon
    code = daemon.stop()
    assert code == 0, daemon.log()[-4000:]
    daemon.assert_cleaned_up(pids)


def post(url: str, body, raw: bytes | None = None, method: str = "POST") -> tuple[int, dict]:
    data = raw if raw is not None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def burst_texts(url: str, bodies: list[dict]) -> list[str]:
    """POST every completions body at once (a thread each) -> each first choice's text, in
    order: the texts of a burst, to compare with each body's solo run."""
    return [reply["choices"][0]["text"] for reply in burst_replies(url, bodies)]


def burst_replies(url: str, bodies: list[dict]) -> list[dict]:
    """POST every completions body at once (a thread each) -> each reply's JSON, in order."""
    replies: list = [None] * len(bodies)

    def run(i: int) -> None:
        replies[i] = post(f"{url}/v1/completions", bodies[i])[1]
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return replies


def wait_idle(daemon, timeout_s: float = 3.0) -> dict:
    """/health once no request is open, no sequence runs and every KV block is free again."""
    deadline = time.monotonic() + timeout_s
    while True:
        health = daemon.health()
        idle = (health["open_requests"] == 0 and health["running"] == 0
                and health["waiting"] == 0
                and health["kv_blocks"]["free"] == health["kv_blocks"]["total"])
        if idle or time.monotonic() > deadline:
            return health
        time.sleep(0.05)
