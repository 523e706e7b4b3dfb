"""How many variants triton has compiled for a kernel in this process, and forgetting them: the
GPU tests that check serving compiles nothing after start-up (triton compiles a variant per
pointer alignment and per int argument equal to 1 or divisible by 16)."""

from __future__ import annotations


def num_compiled(kernel) -> int:
    """Variants of a triton JITFunction compiled so far, over every device."""
    return sum(len(caches[0]) for caches in kernel.device_caches.values())


def forget_compiled(kernel) -> None:
    """Drop a kernel's compiled variants, as a fresh process would have none (they compile
    again from triton's disk cache)."""
    kernel.device_caches.clear()
