"""A worker keeps the memory a step frees (workers/__main__.py keep_freed_memory): tensors of
the sizes a CPU step allocates fault no pages step after step once the first steps have run.
Each case runs in its own interpreter, so that glibc's settings start from their defaults."""

from __future__ import annotations

import subprocess
import sys

import pytest

STEPS = r"""
import ctypes, resource, sys, torch
from lorad.workers.__main__ import M_MMAP_THRESHOLD, keep_freed_memory
torch.set_num_threads(1)  # no thread pool starting mid-measurement (its pages are faults too)
# glibc's threshold at start, held there (by default it moves with the heap's history, so a
# process may or may not fault; held, it does), then the worker's settings or not
assert ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 128 << 10)
if sys.argv[1] == "keep":
    assert keep_freed_memory()

def step():  # a step's temporaries, several alive at once (gathered keys and values, logits)
    alive = [torch.empty(size).fill_(1.0) for size in (393216, 24576, 393216, 73728) * 3]
    del alive

for _ in range(5):  # the heap grows to the step's size
    step()
faulted = 0
for _ in range(20):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    faulted += resource.getrusage(resource.RUSAGE_SELF).ru_minflt > before
print(faulted)
"""


def steps_that_fault(mode: str) -> int:
    """Of 20 steps after 5, how many faulted a page."""
    out = subprocess.run([sys.executable, "-c", STEPS, mode], capture_output=True, text=True,
                         check=True, timeout=120)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_worker_faults_no_pages_for_a_steps_repeated_tensors():
    # glibc's start: each block past the mmap threshold is a fresh mapping, its pages faulted
    # again every step (and the measurement sees faults)
    assert steps_that_fault("start") == 20
    # Kept: the heap can still grow once or twice (a block placed past a freed one it no longer
    # fits, 72 pages in one CI run), but no step faults for what the last one freed.
    assert steps_that_fault("keep") <= 2
