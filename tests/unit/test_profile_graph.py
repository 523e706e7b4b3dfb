"""benchmarks/profile_graph.py's timeline arithmetic (the profiling itself needs a GPU): replays cut
apart, kernels named by projection, gaps charged to the kinds around them, LoRA beside matmuls."""

from __future__ import annotations

import pytest

from benchmarks import profile_graph as pg


def kernel(name: str, ts: float, dur: float, stream: int = 7) -> dict:
    return {"name": name, "stream": stream, "ts": ts, "dur": dur}


def one_layer(t0: float) -> list[dict]:
    # norm | qkv matmul with the shrink beside it | expand | gap of 2 | o matmul | LM head
    return [kernel("_add_rms_norm_kernel", t0, 2), kernel("nvjet_tst_qkv", t0 + 2, 10),
            kernel("_shrink_kernel", t0 + 4, 5, stream=9), kernel("_expand_kernel", t0 + 12, 3),
            kernel("sm90_xmma_gemm_o", t0 + 17, 6), kernel("splitKreduce_kernel", t0 + 23, 1),
            kernel("nvjet_lm_head", t0 + 24, 20)]


def test_replays_are_cut_at_the_widest_gaps_and_summarized():
    kernels = one_layer(0) + one_layer(500) + one_layer(1000)
    replays = pg.split_replays(list(reversed(kernels)), 3)
    assert [len(r) for r in replays] == [7, 7, 7]
    assert [r[0]["ts"] for r in replays] == [0, 500, 1000]
    s = pg.summarize(replays[1])
    assert s["span"] == pytest.approx(44)
    assert s["busy"] == pytest.approx(42) and s["idle"] == pytest.approx(2)
    assert s["streams"] == 2
    # The shrink (4..9) runs beside the q/k/v matmul (2..12); the expand (12..15) beside none.
    assert s["lora_total"] == pytest.approx(8) and s["lora_beside_matmul"] == pytest.approx(5)
    assert dict(s["gaps"]) == {"expand_kernel/qkv -> matmul/o": [2]}
    assert s["per_what"]["matmul/lm_head"] == [20]
    assert s["per_what"]["matmul_reduce"] == [1]
    assert s["per_what"]["shrink_kernel/qkv"] == [5]


def test_projection_labels_cycle_through_a_layer():
    names = ["nvjet_a", "nvjet_b", "nvjet_c", "nvjet_d", "nvjet_e", "nvjet_head"]
    labelled = pg.label([kernel(n, i * 10, 5) for i, n in enumerate(names)])
    assert [k["what"] for k in labelled] == ["matmul/qkv", "matmul/o", "matmul/gate_up",
                                             "matmul/down", "matmul/qkv", "matmul/lm_head"]


def test_overlap_counts_only_common_time():
    assert pg.union_length([(0, 4), (2, 6), (10, 11)]) == 7
    assert pg.overlap_length([(0, 4)], [(3, 8)]) == 1
    assert pg.overlap_length([(0, 4)], [(5, 8)]) == 0
