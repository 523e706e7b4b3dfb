"""The garbage collector in lorad's long-lived processes: what start-up made is frozen out of it.

A worker tracks ~170,000 objects after its imports alone (torch, triton, lorad), more once its
model and kernels are loaded, and a full collection walks all of them: 102 ms on a 2-core VM
after the imports (docs/performance-log.md: start-up objects frozen out of the collector).
Python runs a full collection whenever enough objects have outlived the younger ones, so a
serving worker would stall every stream of its step that long, at steps no one chose. After
start-up, freeze() collects once and moves every object then alive into the permanent
generation, which collections skip; what serving makes is still collected, cycles included.
"""

from __future__ import annotations

import gc
import logging
import time


def freeze(log: logging.Logger) -> None:
    """Collect once, then freeze every object alive: called once start-up is over (a worker
    after its warm-up, the coordinator before READY)."""
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    log.info("%d objects frozen out of the garbage collector after start-up (the full "
             "collection before it: %.0f ms)", gc.get_freeze_count(),
             (time.perf_counter() - started) * 1000)
