"""benchmarks/bench_engine.py --variant (also profile_graph.py's): settings applied for the block,
put back after it, even when it fails, and a setting it cannot read refused by name."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (the `gpu` extra)")


def test_settings_apply_inside_the_block_only():
    from benchmarks import bench_engine
    from lorad.workers import lora
    from lorad.workers.kernels import lora_tiles, pdl
    before = (lora.MATMUL_FIRST, lora_tiles.PROGRAMS_PER_SM, pdl.MAX_ROWS)
    with bench_engine.settings("lora.MATMUL_FIRST=False+lora_tiles.PROGRAMS_PER_SM=4"
                               "+pdl.MAX_ROWS=64"):
        assert (lora.MATMUL_FIRST, lora_tiles.PROGRAMS_PER_SM, pdl.MAX_ROWS) == (False, 4, 64)
    assert (lora.MATMUL_FIRST, lora_tiles.PROGRAMS_PER_SM, pdl.MAX_ROWS) == before
    with bench_engine.settings("main"):
        assert (lora.MATMUL_FIRST, lora_tiles.PROGRAMS_PER_SM, pdl.MAX_ROWS) == before
    with pytest.raises(RuntimeError), bench_engine.settings("pdl.MAX_ROWS=8"):
        assert pdl.MAX_ROWS == 8
        raise RuntimeError("the timed block failed")
    assert pdl.MAX_ROWS == before[2]


def test_a_dict_sets_some_fields_of_a_dataclass_setting():
    from benchmarks import bench_engine
    from lorad.workers.kernels import decode_gemv
    before = decode_gemv.MODEL_CONFIG
    projections = decode_gemv.MODEL_PROJECTIONS
    with bench_engine.settings("decode_gemv.MODEL_CONFIG={'num_stages':2,'block_k':64}"
                               "+decode_gemv.MODEL_PROJECTIONS=()"):
        assert decode_gemv.MODEL_CONFIG == dataclasses.replace(before, num_stages=2, block_k=64)
        assert decode_gemv.MODEL_PROJECTIONS == ()
    assert decode_gemv.MODEL_CONFIG is before and decode_gemv.MODEL_PROJECTIONS is projections


@pytest.mark.parametrize("text", ["nomodule.X=1", "pdl.NO_SUCH_NAME=1", "pdl.MAX_ROWS="])
def test_a_setting_it_cannot_read_is_refused(text):
    from benchmarks import bench_engine
    from lorad.workers.kernels import pdl
    before = pdl.MAX_ROWS
    with pytest.raises(SystemExit, match="--variant: cannot read"):
        with bench_engine.settings(f"pdl.MAX_ROWS=7+{text}"):
            pass
    assert pdl.MAX_ROWS == before  # what it had set before the bad part is put back


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
