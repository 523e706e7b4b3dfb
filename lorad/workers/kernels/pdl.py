"""Programmatic dependent launch (PDL) for the decode step's Triton kernels, on Hopper and later.

A kernel launched with launch_pdl=True may be put on the GPU while the kernel before it in the
stream is still finishing. Each of ours first tells its own dependants they may launch (the
LoRA kernels only after their last store, see start and finish), then waits
(griddepcontrol.wait) until the kernel before it has completed and its writes are visible;
nothing another kernel of the step writes is read before that wait, and nothing is written,
so the arithmetic and every result are the same with PDL on or off, and only the gap between
launches shrinks. Before the wait a kernel may read what the host or an earlier step wrote
(the step's inputs, filled before its first kernel; tables changed only between steps) and warm
L2 with prefetch_l2: a chain of PDL kernels may run while a kernel several launches back is
still writing, so only such data is safe there. In a CUDA graph the launches keep that
relation. Each kernel takes its step's PDL row limit (pdl_rows, from configs.PdlConfig): a step
of more rows launches them plainly, and 0 turns PDL off.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

_CAPABLE: dict[int, bool] = {}


def use_pdl(device: torch.device, num_rows: int, pdl_rows: int) -> bool:
    """Whether a kernel over num_rows rows on `device` launches with PDL: CUDA compute capability
    9.0 or later, and at most pdl_rows rows (the step's limit, PdlConfig.step_rows; 0: never)."""
    if device.type != "cuda" or num_rows > pdl_rows:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABLE:
        _CAPABLE[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return _CAPABLE[index]


def launch_options(device: torch.device, num_rows: int, pdl_rows: int) -> dict[str, bool]:
    """The launch's keyword arguments for a kernel that starts with wait_for_previous(PDL): its
    PDL constexpr and triton's launch_pdl, both use_pdl(device, num_rows, pdl_rows)."""
    pdl = use_pdl(device, num_rows, pdl_rows)
    return {"PDL": pdl, "launch_pdl": pdl}


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


# The LoRA kernels let their dependants launch only once their own work is done: a dependant
# launched early (the expand behind its shrink) holds its programs' registers on every
# multiprocessor while it waits, where the base matmul beside the LoRA kernels could run
# (docs/performance-log.md: LoRA PDL trigger after the last store).
@triton.jit
def start(PDL: tl.constexpr):
    """At the start of a LoRA kernel: wait for the kernel before, without letting the next one
    launch yet (finish does, after the last store)."""
    wait_for_previous_only(PDL)


@triton.jit
def finish(PDL: tl.constexpr):
    """After a LoRA kernel's last store: let its dependants launch."""
    let_dependents_launch(PDL)
