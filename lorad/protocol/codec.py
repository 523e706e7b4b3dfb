"""msgpack frames: one kind byte, then the message's fields as a msgpack array in field order.

Decoding is typed: the kind must be one the receiver expects, the frame must fit the size limit,
and every field must have its declared type (bool is not an int, an int is accepted for a float).
Never decodes by class name, never pickles.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from functools import cache

import msgpack

from lorad.protocol import messages

MAX_FRAME_BYTES = 64 * 1024 * 1024  # a 1M-token prompt is ~5 MB; anything near this is hostile
# Receiving sockets refuse (and disconnect) a peer whose frame exceeds this, before allocating
# it; frames between MAX_FRAME_BYTES and this reach decode() and are dropped there with a log.
SOCKET_MAX_MSG_BYTES = 2 * MAX_FRAME_BYTES
_KINDS = {cls.KIND: cls for cls in messages.COORDINATOR_TO_WORKER + messages.WORKER_TO_COORDINATOR}


class ProtocolError(ValueError):
    """A frame that is not a valid message for this receiver; it is dropped, never acted on."""


def encode(msg) -> bytes:
    frame = bytes([msg.KIND]) + msgpack.packb(_to_wire(msg), use_bin_type=True)
    if len(frame) > MAX_FRAME_BYTES:
        # Refused here rather than dropped by the receiver, which would leave a gap in `seq`.
        raise ProtocolError(f"{type(msg).__name__} of {len(frame)} bytes exceeds the "
                            f"{MAX_FRAME_BYTES} limit")
    return frame


def decode(frame: bytes, accept: tuple[type, ...]) -> object:
    if len(frame) < 2:
        raise ProtocolError(f"frame of {len(frame)} bytes is too short")
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds the {MAX_FRAME_BYTES} limit")
    cls = _KINDS.get(frame[0])
    if cls is None or cls not in accept:
        raise ProtocolError(f"unexpected message kind {frame[0]}")
    try:
        body = msgpack.unpackb(frame[1:], raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for bad bytes
        raise ProtocolError(f"undecodable {cls.__name__} body: {exc}") from None
    return _from_wire(cls, body)


def _to_wire(value):
    if dataclasses.is_dataclass(value):
        return [_to_wire(getattr(value, f.name)) for f in dataclasses.fields(value)]
    if isinstance(value, (list, tuple)):
        return [_to_wire(v) for v in value]
    return value


@cache
def _hints(cls: type) -> list[tuple[str, object]]:
    hints = typing.get_type_hints(cls)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(cls)]


def _from_wire(cls: type, body):
    fields = _hints(cls)
    if not isinstance(body, list) or len(body) != len(fields):
        raise ProtocolError(f"{cls.__name__}: expected {len(fields)} fields")
    values = {name: _check(tp, value, f"{cls.__name__}.{name}")
              for (name, tp), value in zip(fields, body)}
    return cls(**values)


def _check(tp, value, where: str):
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(tp):
            return None
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return _check(inner, value, where)
    if origin is list:
        if not isinstance(value, list):
            raise ProtocolError(f"{where}: expected a list")
        (inner,) = typing.get_args(tp)
        return [_check(inner, v, where) for v in value]
    if dataclasses.is_dataclass(tp):
        return _from_wire(tp, value)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ProtocolError(f"{where}: expected a number")
        return float(value)
    if tp is int and isinstance(value, bool):
        raise ProtocolError(f"{where}: expected an integer")
    if not isinstance(value, tp):
        raise ProtocolError(f"{where}: expected {tp.__name__}, got {type(value).__name__}")
    return value
