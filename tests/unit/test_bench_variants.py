"""Tuning variants as benchmarks build them (tuning.replaced, bench_engine.py --variant): nested
dataclasses.replace of the engine's Tuning, a setting it cannot apply refused by name."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest

from lorad.workers.kernels.configs import ExpandConfig
from lorad.workers.tuning import Tuning, replaced

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (the `gpu` extra)")


def test_settings_are_nested_replaces_of_a_tuning():
    base = Tuning()
    got = replaced(base, "shrink.items_per_sm=4+pdl.max_rows=64+expand.small.block_n=64"
                         "+gemv.qkv=None")
    assert got == dataclasses.replace(
        base, shrink=dataclasses.replace(base.shrink, items_per_sm=4),
        pdl=dataclasses.replace(base.pdl, max_rows=64),
        expand=dataclasses.replace(base.expand, small=ExpandConfig(block_n=64)),
        gemv=dataclasses.replace(base.gemv, qkv=None))
    assert base == Tuning()  # a value: the one it started from is unchanged
    assert replaced(base, "main") is base and replaced(base, "") is base


def test_a_setting_of_a_field_that_holds_none_starts_from_its_defaults():
    from lorad.workers.kernels.configs import GemvConfig
    assert Tuning().gemv.o is None  # cuBLAS for o: the path gives it the GEMV's default tile
    got = replaced(Tuning(), "gemv.o.block_m=16+gemv.down.block_n=16")
    assert got.gemv.o == GemvConfig(block_m=16)
    assert got.gemv.down == GemvConfig(block_n=16)
    with pytest.raises(ValueError, match="cannot apply tuning setting"):
        replaced(Tuning(), "gemv.o.block_m=8")  # GemvConfig's own check


@pytest.mark.parametrize("text", ["nosuch.x=1", "pdl.no_such_field=1", "pdl.max_rows=",
                                  "pdl.max_rows", "pdl.max_rows.x=1", "shrink.block_r=24"])
def test_a_setting_it_cannot_apply_is_refused_by_name(text):
    with pytest.raises(ValueError, match="cannot apply tuning setting"):
        replaced(Tuning(), f"pdl.max_rows=7+{text}")


def test_bench_engine_reads_variants_into_tunings():
    from benchmarks import bench_engine
    variants = bench_engine.tuning_variants("tiles.programs_per_sm=4;main;pdl.max_rows=0")
    assert [name for name, _ in variants] == ["tiles.programs_per_sm=4", "main", "pdl.max_rows=0"]
    assert variants[0][1].tiles.programs_per_sm == 4 and variants[1][1] == Tuning()
    assert variants[2][1].pdl.max_rows == 0
    with pytest.raises(SystemExit, match="--variant"):
        bench_engine.tuning_variants("pdl.nothing=1")


def test_the_batch_32_target_gives_the_replay_ratio_beside_the_tokens_verdict():
    from benchmarks import bench_engine
    saved = list(bench_engine.rows)
    bench_engine.rows[:] = []
    try:
        bench_engine.add_row("base", 32, "graph", 5.61e-3, 5.43e-3, 4.10e-3)
        bench_engine.add_row("one", 32, "graph", 6.10e-3, 5.70e-3, 4.12e-3)
        table = bench_engine.targets()
    finally:
        bench_engine.rows[:] = saved
    line = next(line for line in table.splitlines() if "batch 32, vs base" in line)
    # 32 / 6.10 ms against 32 / 5.61 ms by tokens/s; 5.43 / 5.70 by replay
    assert "0.92x (5,246 vs 5,704 tok/s; by graph replay 0.953x) | not met |" in line
