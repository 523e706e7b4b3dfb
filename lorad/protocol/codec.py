"""msgpack frames: one kind byte, then the message's fields as a msgpack array in field order.

Decoding is typed: the kind must be one the receiver expects, the frame must fit the size limit,
and every field must have its declared type (bool is not an int, an int is accepted for a float).
Never decodes by class name, never pickles.
"""

from __future__ import annotations

import dataclasses
import operator
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
    if type(value) in _PLAIN:
        return value
    to_list = _dataclass_encoder(type(value))
    if to_list is not None:
        return to_list(value)
    if isinstance(value, (list, tuple)):
        if all(type(v) in _PLAIN for v in value):
            return value  # token ids and the like: msgpack packs them as they are
        return [_to_wire(v) for v in value]
    return value


_PLAIN = frozenset({int, float, str, bool, bytes, type(None)})


@cache
def _field_getter(cls: type):
    """-> getter(value): a dataclass's field values as a tuple in wire order; None for any other
    type. Built once per type: every step's result passes through here once per sequence."""
    if not dataclasses.is_dataclass(cls):
        return None
    names = [f.name for f in dataclasses.fields(cls)]
    if len(names) == 1:  # attrgetter of one name returns the value itself
        return lambda value: (getattr(value, names[0]),)
    return operator.attrgetter(*names)


@cache
def _dataclass_encoder(cls: type):
    """-> encode(value): a dataclass's wire list, its fields in wire order; None for any other
    type. Fields whose type hint holds plain values only (int, str, ..., optional ones, lists of
    them: token ids) go as they are, the others through _to_wire: a step's result encodes one
    SeqOutput per sequence, so nothing is looked at per value that the hints already say."""
    fields = _field_getter(cls)
    if fields is None:
        return None
    hints = typing.get_type_hints(cls)
    nested = [i for i, f in enumerate(dataclasses.fields(cls)) if not _plain_hint(hints[f.name])]
    if not nested:
        return lambda value: list(fields(value))

    def encode_fields(value):
        out = list(fields(value))
        for i in nested:
            out[i] = _to_wire(out[i])
        return out
    return encode_fields


def _plain_hint(tp) -> bool:
    """Whether every value of type hint tp is a plain value or a list of them (msgpack packs
    those as they are)."""
    if tp in _PLAIN:
        return True
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return all(_plain_hint(arg) for arg in typing.get_args(tp))
    if origin is list:
        return all(arg in _PLAIN for arg in typing.get_args(tp))
    return False


class _NoShortcut:
    """The shortcut type of a field whose values always go through their checker."""


@cache
def _fields(cls: type) -> tuple[tuple[type, object, str], ...]:
    """A message class's (shortcut type, checker, "Class.field") in wire order, built once per
    class: a step's result decodes one SeqOutput per sequence, so nothing here is per value.
    A value whose type is exactly the shortcut is valid as it is (str for a str field, None for
    an optional one), so most values skip the checker's call."""
    hints = typing.get_type_hints(cls)
    return tuple((_shortcut(hints[f.name]), _checker(hints[f.name]),
                  f"{cls.__name__}.{f.name}") for f in dataclasses.fields(cls))


def _shortcut(tp) -> type:
    if tp in (int, float, str, bool, bytes):
        return tp
    optional = typing.get_origin(tp) in (typing.Union, types.UnionType)
    if optional and type(None) in typing.get_args(tp):
        return type(None)
    return _NoShortcut


def _from_wire(cls: type, body):
    fields = _fields(cls)
    if not isinstance(body, list) or len(body) != len(fields):
        raise ProtocolError(f"{cls.__name__}: expected {len(fields)} fields")
    # Positional: the field order is the wire order (and every field is an __init__ argument).
    values = [value if type(value) is shortcut else check(value, where)
              for (shortcut, check, where), value in zip(fields, body)]
    try:
        return cls(*values)
    except ValueError as exc:  # the message's own bounds (__post_init__): a bad frame, not a crash
        raise ProtocolError(str(exc)) from None


@cache
def _checker(tp):
    """-> check(value, where): the value as the field holds it, or ProtocolError naming `where`.
    Built once per type hint, so decoding does no typing introspection per value."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        optional = type(None) in typing.get_args(tp)
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        check_inner = _checker(inner)

        def check_union(value, where: str):
            if value is None and optional:
                return None
            return check_inner(value, where)
        return check_union
    if origin is list:
        (inner,) = typing.get_args(tp)
        check_item = _checker(inner)

        def check_list(value, where: str):
            if not isinstance(value, list):
                raise ProtocolError(f"{where}: expected a list")
            if inner is int and all(type(v) is int for v in value):
                return value  # token ids: msgpack gives plain ints
            return [check_item(v, where) for v in value]
        return check_list
    if dataclasses.is_dataclass(tp):
        return lambda value, where: _from_wire(tp, value)
    if tp is float:
        def check_float(value, where: str):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ProtocolError(f"{where}: expected a number")
            return float(value)
        return check_float

    def check_plain(value, where: str):
        if tp is int and isinstance(value, bool):
            raise ProtocolError(f"{where}: expected an integer")
        if not isinstance(value, tp):
            raise ProtocolError(f"{where}: expected {tp.__name__}, got {type(value).__name__}")
        return value
    return check_plain
