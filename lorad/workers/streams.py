"""Side streams on CUDA: work that does not depend on the main stream's next kernels runs beside
them, forked from and joined to the current stream (inside a CUDA graph's capture the fork and
join become the graph's branches). One stream per device and purpose, made on first use."""

from __future__ import annotations

import contextlib

import torch

_STREAMS: dict[tuple[int, str], torch.cuda.Stream] = {}


def side_stream(device: torch.device, purpose: str) -> torch.cuda.Stream | None:
    """The stream `purpose` runs on beside the current one on `device`'s GPU; None off CUDA.
    Purposes: "lora" (a projection's LoRA kernels beside its base matmul), "moe" (the routed
    experts beside the shared expert)."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, purpose)
    if key not in _STREAMS:
        _STREAMS[key] = torch.cuda.Stream(device=index)
    return _STREAMS[key]


@contextlib.contextmanager
def on_stream(stream: torch.cuda.Stream | None):
    """torch.cuda.stream(stream) for a stream of the current device (None: stay on the current
    stream), without its lookups of the current device: torch.cuda.current_stream() with no
    device resolves it through torch.cuda.is_available() and the environment on every call, and
    an eager step with adapters makes six such calls per LoRA launch pair
    (docs/performance-log.md: side stream named by its device index)."""
    if stream is None:
        yield
        return
    previous = torch.cuda.current_stream(stream.device_index)
    torch.cuda.set_stream(stream)
    try:
        yield
    finally:
        torch.cuda.set_stream(previous)


def fork(stream: torch.cuda.Stream | None) -> None:
    """Order `stream`'s next work after what the current stream has queued (None: nothing)."""
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(stream.device_index))


def join(stream: torch.cuda.Stream | None) -> None:
    """Order the current stream's next work after what `stream` has queued (None: nothing)."""
    if stream is not None:
        torch.cuda.current_stream(stream.device_index).wait_stream(stream)
