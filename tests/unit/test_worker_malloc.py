"""A worker keeps the memory a step frees (workers/__main__.py keep_freed_memory): tensors of
the sizes a CPU step allocates fault no pages once the first steps have run. Each case runs in its
own interpreter, so that glibc's settings start from their defaults."""

from __future__ import annotations

import subprocess
import sys

import pytest

STEPS = r"""
import ctypes, resource, sys, torch
from lorad.workers.__main__ import M_MMAP_THRESHOLD, keep_freed_memory
torch.set_num_threads(1)  # no thread pool starting mid-measurement (its pages are faults too)
if sys.argv[1] == "keep":
    assert keep_freed_memory()
else:  # glibc's threshold at start, held there (by default it moves with the heap's history)
    assert ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 128 << 10)

def step():  # a step's temporaries, several alive at once (gathered keys and values, logits)
    alive = [torch.empty(size).fill_(1.0) for size in (393216, 24576, 393216, 73728) * 3]
    del alive

for _ in range(5):  # the heap grows to the step's size
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", STEPS, mode], capture_output=True, text=True,
                         check=True, timeout=120)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_worker_faults_no_pages_for_a_steps_repeated_tensors():
    # glibc's start: each block past the mmap threshold is a fresh mapping, its pages faulted
    # again every step (and the measurement sees faults)
    assert faults("start") >= 20 * 100
    assert faults("keep") < 20
