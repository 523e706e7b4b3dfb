"""benchmarks/kernel_resources.py, the offline register report, runs here without a GPU: it compiles
lorad's kernels for sm_90 with the installed triton and reads each one's registers back.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (the `gpu` extra)")

LINE = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(.+)$")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.kernel_resources", *args],
                          capture_output=True, text=True, timeout=300, cwd=REPO)


def test_reports_the_expand_at_each_config():
    done = run("--only", "lora expand", "--expand", "64,1")
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [LINE.match(line) for line in done.stdout.splitlines()]
    rows = [m for m in rows if m]
    # The default config, the small steps' one and the one asked for, each with 3 fp32 tables,
    # 1, and 3 bf16 ones.
    names = [m.group(5) for m in rows]
    assert len(rows) == 9, done.stdout
    assert sum("block_n=128," in n for n in names) == 3, done.stdout
    assert sum("block_n=256," in n for n in names) == 3, done.stdout
    assert sum("block_n=64," in n for n in names) == 3, done.stdout
    assert sum("3 bf16 table(s)" in n for n in names) == 3, done.stdout
    for m in rows:
        registers, _, _, programs = (int(m.group(i)) for i in range(1, 5))
        assert 16 <= registers <= 255 and programs >= 1, m.group(0)
    # The MMA's B tile is staged in shared memory: 64 outputs a block take less than 128.
    shared = {m.group(5): int(m.group(3)) for m in rows if "1 fp32 table" in m.group(5)}
    narrow = next(v for n, v in shared.items() if "block_n=64," in n)
    wide = next(v for n, v in shared.items() if "block_n=128," in n)
    assert 0 < narrow < wide, done.stdout


def test_refuses_a_config_it_cannot_read():
    done = run("--only", "lora expand", "--expand", "64,4,2")
    assert done.returncode != 0
    assert "expected 2 comma-separated integers" in done.stdout + done.stderr


def test_reports_the_one_shot_all_reduce():
    # Its spin on an acquire load and its release at system scope compile for sm_90, unspilled.
    done = run("--only", "one-shot")
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [m for m in (LINE.match(line) for line in done.stdout.splitlines()) if m]
    assert sorted(m.group(5).split(" (")[0] for m in rows) == [
        "one-shot all-reduce + add + RMSNorm", "one-shot all-reduce, sum"], done.stdout
    for m in rows:
        assert 16 <= int(m.group(1)) <= 255 and int(m.group(2)) == 0, m.group(0)
