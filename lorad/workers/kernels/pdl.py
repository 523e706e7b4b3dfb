"""Programmatic dependent launch (PDL) for the decode step's Triton kernels, on Hopper and later.

A kernel launched with launch_pdl=True may be put on the GPU while the kernel before it in the
stream is still finishing. Each of ours first tells its own dependants they may launch (the
LoRA kernels only after their last store, see LORA_TRIGGER_LATE), then waits
(griddepcontrol.wait) until the kernel before it has completed and its writes are visible;
nothing another kernel of the step writes is read before that wait, and nothing is written,
so the arithmetic and every result are the same with PDL on or off, and only the gap between
launches shrinks. Before the wait a kernel may read what the host or an earlier step wrote
(the step's inputs, filled before its first kernel; tables changed only between steps) and warm
L2 with prefetch_l2: a chain of PDL kernels may run while a kernel several launches back is
still writing, so only such data is safe there. In a CUDA graph the launches keep that
relation. scripts/bench_pdl.py measured the gap it saves on an H200.
ENABLED off (scripts/bench_engine.py --no-pdl) launches them plainly, as do steps of more than
MAX_ROWS rows (MAX_ROWS_WITH_LORA in a step that launches LoRA kernels, see step()).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

ENABLED = True
# The most rows a step may have for its kernels to launch with PDL. On the H200 (bench_engine.py,
# 2026-11-30, two runs each way, graph replay) PDL took batch 1 from 4.77-4.79 to 4.70 ms and
# batch 32 with one adapter from 7.07 to 6.96-6.97, but batch 64 from 6.38-6.40 to 6.47 (base).
MAX_ROWS = 32
# The same for a step that launches LoRA kernels (a `step(with_lora=True)`): there PDL pays at
# batch 64 too. On the H200 (bench_engine.py --variant, 2026-12-01, graph replay ms, 64 against
# 32): one adapter at batch 64 7.45 against 8.10, four mixed 7.50 against 8.20, 64 distinct 14.09
# against 14.50; the base model at batch 64 6.48 against 6.36 (hence two limits).
MAX_ROWS_WITH_LORA = 64
_CAPABLE: dict[int, bool] = {}
_lora_step = False  # inside a step(with_lora=True)


@contextlib.contextmanager
def step(with_lora: bool):
    """Around a forward's launches (models/llama.py): whether the step launches LoRA kernels,
    which sets the row limit of PDL (MAX_ROWS_WITH_LORA, else MAX_ROWS). A graph captured inside
    keeps the launches' PDL as they were recorded."""
    global _lora_step
    saved, _lora_step = _lora_step, with_lora
    try:
        yield
    finally:
        _lora_step = saved


def use_pdl(device: torch.device, num_rows: int, max_rows: int | None = None) -> bool:
    """Whether a kernel over num_rows rows on `device` launches with PDL: CUDA compute capability
    9.0 or later, and a step of at most MAX_ROWS rows (MAX_ROWS_WITH_LORA in a step with LoRA
    launches), and of at most max_rows, a kernel's own limit (None: none)."""
    limit = MAX_ROWS_WITH_LORA if _lora_step else MAX_ROWS
    if max_rows is not None:
        limit = min(limit, max_rows)
    if not ENABLED or device.type != "cuda" or num_rows > limit:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABLE:
        _CAPABLE[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return _CAPABLE[index]


def launch_options(device: torch.device, num_rows: int,
                   max_rows: int | None = None) -> dict[str, bool]:
    """The launch's keyword arguments for a kernel that starts with wait_for_previous(PDL): its
    PDL constexpr and triton's launch_pdl, both use_pdl(device, num_rows, max_rows)."""
    pdl = use_pdl(device, num_rows, max_rows)
    return {"PDL": pdl, "launch_pdl": pdl}


# The LoRA kernels let their dependants launch only once their own work is done (True) rather
# than at their start: a dependant launched early (the expand behind its shrink) holds its
# programs' registers on every multiprocessor while it waits, where the base matmul beside the
# LoRA kernels could run. On an H200 (bench_engine.py --variant, 2026-12-01 13:50 UTC, graph
# replay ms, two rounds of True around one of False): one adapter at batch 1 4.95, 4.95 against
# 5.52; at batch 32 5.98, 6.00 against 6.12; four mixed at 32 6.05, 6.04 against 6.19; 64
# distinct at 32 8.99, 9.01 against 9.08; at batch 64 the same within 0.05.
LORA_TRIGGER_LATE = True


@triton.jit
def wait_for_previous_only(PDL: tl.constexpr):
    """At a PDL kernel's start, before any load or store: wait for the one before to complete,
    letting the next one launch only at let_dependents_launch (or at this kernel's end)."""
    if PDL:
        gdc_wait()


@triton.jit
def let_dependents_launch(PDL: tl.constexpr):
    """After a kernel's last store: the next kernel may launch (it still waits for this one to
    complete before it reads anything)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """At a PDL kernel's start, before any load or store: let the next kernel launch, then wait
    for the one before to complete."""
    let_dependents_launch(PDL)
    wait_for_previous_only(PDL)


@triton.jit
def prefetch_l2(ptrs):
    """Before a PDL kernel's wait: ask L2 for the lines holding ptrs (any shape of pointers), so
    the loads after the wait find them there. A hint that reads nothing into registers and
    changes no result; every pointer must be a valid address (masked lanes point somewhere real).
    Compiled for CUDA only: call it under a constexpr that is false off CUDA, as PDL is (the
    interpreter has no inline PTX)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def start(PDL: tl.constexpr, TRIGGER_LATE: tl.constexpr):
    """At the start of a kernel that may let its dependants launch only at its end (the LoRA
    kernels, LORA_TRIGGER_LATE): wait_for_previous, or with TRIGGER_LATE only its wait."""
    if TRIGGER_LATE:
        wait_for_previous_only(PDL)
    else:
        wait_for_previous(PDL)


@triton.jit
def finish(PDL: tl.constexpr, TRIGGER_LATE: tl.constexpr):
    """After such a kernel's last store: with TRIGGER_LATE, let its dependants launch."""
    if TRIGGER_LATE:
        let_dependents_launch(PDL)
