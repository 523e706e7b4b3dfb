"""The wire between the coordinator and the workers: messages, codec, sockets.

The only package both processes import besides `lorad.config`; imports neither of them.
"""

from lorad.protocol.codec import MAX_FRAME_BYTES, ProtocolError, decode, encode
from lorad.protocol.messages import (
    PROTOCOL_VERSION, AdapterLoaded, AdapterRefused, Admit, Cancel, Hello, LoadAdapter, RankStatus,
    Ready, SamplingParams, SeqOutput, Shutdown, StartupPhase, StepFailed, StepResult,
    UnloadAdapter, WorkerFailed)

__all__ = [
    "MAX_FRAME_BYTES", "PROTOCOL_VERSION", "ProtocolError", "decode", "encode", "AdapterLoaded",
    "AdapterRefused", "Admit", "Cancel", "Hello", "LoadAdapter", "RankStatus", "Ready",
    "SamplingParams", "SeqOutput", "Shutdown", "StartupPhase", "StepFailed", "StepResult",
    "UnloadAdapter", "WorkerFailed",
]
