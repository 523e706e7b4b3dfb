"""process_gc.freeze: what is alive at the call leaves the collector's reach; garbage made after
it, cycles included, is still collected."""

from __future__ import annotations

import gc
import logging
import weakref

from lorad.config import process_gc


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycle() -> weakref.ref:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_start_up_objects_frozen_and_later_cycles_collected(caplog):
    kept = _Node()
    kept.other = kept  # a cycle alive at the call: frozen, not freed
    try:
        with caplog.at_level(logging.INFO, logger="lorad.test"):
            process_gc.freeze(logging.getLogger("lorad.test"))
        frozen = gc.get_freeze_count()
        assert frozen > 1000  # this interpreter's modules, functions, pytest's objects
        assert "objects frozen out of the garbage collector" in caplog.text
        assert not any(obj is kept for obj in gc.get_objects())  # out of every generation
        dead = _cycle()  # made after the freeze, unreachable: a collection frees it
        assert dead() is not None
        gc.collect()
        assert dead() is None
    finally:
        gc.unfreeze()
    assert any(obj is kept for obj in gc.get_objects())
