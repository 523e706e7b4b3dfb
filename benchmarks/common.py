"""What the benchmarks share: timing on the GPU (CUDA events, graph replays), the copy rate that
the memory floors divide by, the conditions line a table opens with (date, machine,
versions, commit), and starting a lorad daemon for the benchmarks that go through HTTP.

Not a harness: each benchmark builds its own cases and prints its own table. Run the tools from
the repository root as `python -m benchmarks.NAME`, so that this checkout's lorad is imported.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

from lorad.config.process_state import stat_fields

REPO = Path(__file__).resolve().parent.parent
# Where serve-demo and the tests keep the converted demo model (tests/conftest.py's rule).
DEMO_MODEL = Path(os.environ.get("LORAD_DEMO_MODEL_DIR") or Path(
    os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lorad/SmolLM2-135M-Instruct")
VERSIONS = ("torch", "triton", "transformers", "peft")


def time_cuda(fn, repeats: int, warmup: int = 2) -> float:
    """Median seconds of fn() over `repeats` runs, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def time_graph(fn, replays: int = 20) -> float:
    """Median seconds of one replay of fn captured as a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_cuda(graph.replay, replays, warmup=3)


def copy_bandwidth(device: torch.device | str = "cuda") -> float:
    """Bytes/s of a 2 GiB device-to-device copy, read + write counted (the median of 10)."""
    src = torch.randn(1 << 30, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    seconds = time_cuda(lambda: dst.copy_(src), 10)
    return 2 * src.numel() * src.element_size() / seconds  # 4 GiB back on return


def versions(names: tuple[str, ...] = VERSIONS) -> str:
    found = []
    for name in names:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name} -")
    return ", ".join(found)


def device_name(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:  # the CPU's model name, as scripts/bench.py reports it
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else (platform.processor() or platform.machine())


def commit() -> str:
    """This checkout's commit, with "+changes" when the tree differs from it; "-" without git
    (a device machine gets a copy of the working tree, not always its history)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                              timeout=10).stdout.strip()
    try:
        head = git("rev-parse", "--short=10", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.TimeoutExpired):
        return "-"
    return (head + ("+changes" if changed else "")) if head else "-"


def conditions(device: torch.device | str | None = None) -> str:
    """`2026-12-03 20:15 UTC; NVIDIA H200; torch ..., triton ...; Python 3.11.9; commit ...`."""
    parts = [f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"]
    if device is not None:
        parts.append(device_name(device))
    parts += [versions(), f"Python {platform.python_version()}", f"commit {commit()}"]
    return "; ".join(parts)


def start_lorad(flags: list[str], port: int, log: Path, timeout_s: float = 900
                ) -> subprocess.Popen:
    """`python -m lorad.daemon --port PORT FLAGS...` from the repository root, its output in
    `log`; returns once /ready answers, raises RuntimeError if it exits or is not ready."""
    argv = [sys.executable, "-m", "lorad.daemon", "--port", str(port), *flags]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = "".join(log.read_text(errors="replace").splitlines(True)[-20:])
            raise RuntimeError(f"lorad exited with {proc.returncode}; {log} ends:\n{tail}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2):
                return proc
        except OSError:
            time.sleep(0.5)
    stop_lorad(proc)
    raise RuntimeError(f"lorad was not ready in {timeout_s:.0f} s; see {log}")


def stop_lorad(proc: subprocess.Popen) -> int:
    """SIGTERM (lorad drains and stops its workers), SIGKILL after 60 s -> its exit status."""
    proc.terminate()
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def _user_system(fields: list[bytes]) -> tuple[float, float]:
    """(user, system) CPU seconds of a process, all its threads, from its /proc stat fields
    (stat_fields': the state first, so utime and stime at 11 and 12)."""
    ticks = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / ticks, int(fields[12]) / ticks


def process_cpu(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds used so far by process pid, all its threads (Linux)."""
    fields = stat_fields(pid)
    if fields is None:
        raise ProcessLookupError(f"no process {pid} to read in /proc")
    return _user_system(fields)


def tree_cpu_seconds(root: int) -> tuple[float, float]:
    """CPU seconds (user + system) used so far by process root and by its descendants, read
    from /proc (Linux): for a lorad daemon, the coordinator's and its workers'. A descendant
    that has ended is not counted."""
    parent, used = {}, {}
    for entry in os.listdir("/proc"):
        fields = stat_fields(int(entry)) if entry.isdigit() else None
        if fields is not None:  # after the name: state, ppid, ...
            parent[int(entry)] = int(fields[1])
            used[int(entry)] = sum(_user_system(fields))

    def descends(pid: int) -> bool:
        while pid in parent and pid > 1:
            pid = parent[pid]
            if pid == root:
                return True
        return False
    return used.get(root, 0.0), sum(t for pid, t in used.items() if descends(pid))


def health(port: int) -> dict:
    """A daemon on `port`'s /health (docs/api.md): its slots, ranks' counters, mode, ..."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as response:
        return json.load(response)


def served_models(port: int) -> list[str]:
    """The model ids a daemon on `port` serves: the base model first, then each adapter."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as response:
        return [card["id"] for card in json.load(response)["data"]]


def bench_py(flags: list[str], out: Path, timeout_s: float = 3600) -> dict:
    """scripts/bench.py once with `flags` and `--json out` -> its record, with its printed table
    under "table" (figures() reads it); its output also goes to out.txt. Raises RuntimeError
    with that output when it fails."""
    argv = [sys.executable, str(REPO / "scripts" / "bench.py"), *flags, "--json", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=timeout_s)
    out.with_suffix(".txt").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"bench.py failed ({out.with_suffix('.txt')}):\n{done.stdout}\n"
                           f"{done.stderr}")
    record = json.loads(out.read_text())
    record["table"] = done.stdout
    return record


def figures(record: dict) -> dict:
    """Throughput, TTFT and ITL percentiles from a bench_py() record's table, and the model ids
    its requests used."""
    rows = {}
    for line in record["table"].splitlines():
        parts = [p.strip() for p in line.strip("|").split("|")]
        if len(parts) == 2:
            rows[parts[0]] = parts[1]
    return {"tokens_s": float(rows["output tokens/s"]),
            "ttft": rows["time to first token p50 / p99 (ms)"],
            "itl": rows["inter-token latency p50 / p99 (ms)"],
            "used": sorted({r["model"] for r in record["requests"]})}


_STARTED = time.monotonic()


def say(message: str) -> None:
    """A progress line with the seconds since the benchmark started, flushed at once: a run cut
    by a time limit shows where it was."""
    print(f"[{time.monotonic() - _STARTED:6.1f} s] {message}", flush=True)


def add_run_flags(parser, what: str) -> None:
    """--work, --table-out and --lorad-flag, as the benchmarks that start daemons take them;
    `what`: what goes into --work."""
    parser.add_argument("--work", type=Path,
                        help=f"where {what} go (default: a new temporary folder)")
    parser.add_argument("--table-out", type=Path, help="also write the table and verdicts here")
    parser.add_argument("--lorad-flag", action="append", default=[],
                        help="another flag for the daemons, e.g. --lorad-flag=--enforce-eager")


def print_table(lines: list[str], table_out: Path | None) -> None:
    """Print the table and verdicts, and write them to --table-out when given."""
    print("\n".join(lines), flush=True)
    if table_out:
        table_out.write_text("\n".join(lines) + "\n")


def open_work_dir(work: Path | None, prefix: str) -> Path:
    """The run's folder (a new temporary one when None), and SIGTERM (`timeout`) turned into an
    exit through the callers' finally blocks, so that no daemon outlives the run."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = work or Path(tempfile.mkdtemp(prefix=prefix))
    work.mkdir(parents=True, exist_ok=True)
    return work
