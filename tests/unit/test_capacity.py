"""scripts/capacity.py and its helpers on cases whose answers follow from arithmetic: the step
table's interpolation, one replica at a constant step time (throughput, TTFT, chunked prefill,
--max-num-seqs, an adapter's copy), the workload's Zipf and Poisson draws, the routers, and the
check against a bench.py record; bench_engine's rows as a step table."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from tests.script_modules import load_script




table_mod = load_script("capacity_table")
sim = load_script("capacity_sim")
capacity = load_script("capacity")
STEP_MS = 10.0


def flat_table(load_host: float = 0.0, load_disk: float = 0.0) -> "table_mod.StepTable":
    """Every step takes STEP_MS, whatever it runs."""
    steps = [{"decode_rows": b, "prefill_tokens": 0, "adapters": a, "step_ms": STEP_MS}
             for b in (1, 64) for a in (0, 4)]
    steps += [{"decode_rows": 0, "prefill_tokens": p, "adapters": 0, "step_ms": STEP_MS}
              for p in (1, 4096)]
    return table_mod.StepTable({"format": table_mod.FORMAT, "steps": steps,
                                "adapter_load_ms": {"host": load_host, "disk": load_disk}})


def burst(table=None, requests=4, concurrency=4, prompt=100, output=10, adapters=(0,), **cfg):
    config = sim.ReplicaConfig(**cfg)
    return capacity.burst(table or flat_table(), config, requests, concurrency, prompt, output,
                          list(adapters))


def ttfts_ms(out) -> list[float]:
    return [round(r.ttft * 1e3, 6) for r in out["requests"]]


def test_interpolation_is_linear_between_points_and_beyond_them():
    assert table_mod.interpolate([1, 3], [10, 30], 2) == 20
    assert table_mod.interpolate([1, 3], [10, 30], 5) == 50
    assert table_mod.interpolate([1, 3], [10, 30], 0) == 0
    assert table_mod.interpolate([4], [7], 100) == 7


def test_a_step_costs_decode_plus_prefill_less_the_fixed_cost_counted_twice():
    steps = [{"decode_rows": 1, "prefill_tokens": 0, "adapters": 0, "step_ms": 12},
             {"decode_rows": 3, "prefill_tokens": 0, "adapters": 0, "step_ms": 16},
             {"decode_rows": 0, "prefill_tokens": 100, "adapters": 0, "step_ms": 110},
             {"decode_rows": 1, "prefill_tokens": 0, "adapters": 2, "step_ms": 14},
             {"decode_rows": 3, "prefill_tokens": 0, "adapters": 2, "step_ms": 22},
             {"decode_rows": 3, "prefill_tokens": 0, "adapters": 4, "step_ms": 26}]
    table = table_mod.StepTable({"format": table_mod.FORMAT, "steps": steps})
    assert table.fixed_ms(0) == 10  # the decode line 10 + 2 per row
    assert table.step_ms(3, 0, 0) == 16
    assert table.step_ms(2, 0, 0) == 14
    assert table.step_ms(0, 50, 0) == 60  # between (0, 10) and (100, 110)
    assert table.step_ms(3, 100, 0) == 16 + 110 - 10
    assert table.step_ms(100, 100, 0) == 210 + 110 - 10
    assert table.step_ms(3, 0, 1) == 22  # any adapter row: the LoRA work of the next level
    assert table.step_ms(3, 0, 3) == 24  # halfway between the levels 2 and 4
    assert table.step_ms(3, 0, 64) == 26  # constant beyond the largest level
    assert table.step_ms(0, 0, 0) == 0


def test_a_level_of_one_prompt_step_takes_the_nearest_lines_slope():
    steps = [{"decode_rows": 1, "prefill_tokens": 0, "adapters": 0, "step_ms": 10},
             {"decode_rows": 3, "prefill_tokens": 0, "adapters": 0, "step_ms": 14},
             {"decode_rows": 0, "prefill_tokens": 100, "adapters": 0, "step_ms": 60},
             {"decode_rows": 0, "prefill_tokens": 200, "adapters": 0, "step_ms": 110},
             {"decode_rows": 0, "prefill_tokens": 100, "adapters": 2, "step_ms": 80}]
    table = table_mod.StepTable({"format": table_mod.FORMAT, "steps": steps})
    assert table.step_ms(0, 50, 0) == 35  # its own line: 10 + 0.5 per token
    assert table.step_ms(0, 200, 2) == 130  # 80 at 100 tokens, then 0.5 per token


def test_mixed_steps_in_the_table_set_the_fixed_cost():
    steps = [{"decode_rows": 1, "prefill_tokens": 0, "adapters": 0, "step_ms": 12},
             {"decode_rows": 3, "prefill_tokens": 0, "adapters": 0, "step_ms": 16},
             {"decode_rows": 0, "prefill_tokens": 100, "adapters": 0, "step_ms": 110},
             {"decode_rows": 3, "prefill_tokens": 100, "adapters": 0, "step_ms": 120}]
    table = table_mod.StepTable({"format": table_mod.FORMAT, "steps": steps})
    assert table.fixed_ms(0) == 6  # 16 + 110 - 120
    assert table.step_ms(3, 100, 0) == 120


@pytest.mark.parametrize("data, field", [
    ({"format": "other", "steps": []}, "format"),
    ({"format": "lorad-step-table/1", "steps": []}, "steps"),
    ({"format": "lorad-step-table/1", "steps": [{"decode_rows": 1}]}, "steps[0]"),
    ({"format": "lorad-step-table/1", "steps": [
        {"decode_rows": 0, "prefill_tokens": 8, "adapters": 0, "step_ms": 1}]}, "decode-only"),
])
def test_a_bad_table_is_refused_by_field(data, field):
    with pytest.raises(table_mod.TableError, match=field.replace("[", r"\[")):
        table_mod.StepTable(data)


def test_one_replica_at_a_constant_step_time_follows_from_arithmetic():
    out = burst(requests=4, concurrency=4, prompt=100, output=10)
    # 400 prompt tokens fit one step: every first token after one step, then 9 decode steps.
    assert ttfts_ms(out) == [STEP_MS] * 4
    assert out["wall_s"] == pytest.approx(10 * STEP_MS / 1e3)
    # One client: the requests run one after another, 10 steps each.
    out = burst(requests=5, concurrency=1, prompt=100, output=10)
    assert ttfts_ms(out) == [STEP_MS] * 5
    assert 50 / out["wall_s"] == pytest.approx(1e3 / STEP_MS)  # tokens/s: one per step


def test_prompts_are_chunked_by_the_token_budget_first_come_first_served():
    out = burst(requests=2, concurrency=2, prompt=1000, output=1, max_num_batched_tokens=512)
    # 2,000 tokens at 512 a step: the first prompt ends in step 2, the second in step 4.
    assert ttfts_ms(out) == [2 * STEP_MS, 4 * STEP_MS]


def test_max_num_seqs_holds_the_rest_back_until_a_sequence_ends():
    out = burst(requests=4, concurrency=4, prompt=10, output=5, max_num_seqs=2)
    assert ttfts_ms(out) == [STEP_MS, STEP_MS, 6 * STEP_MS, 6 * STEP_MS]


def test_async_steps_make_a_request_that_arrives_in_a_decode_step_wait_one_more():
    def ttft_ms(arrival_ms: float, async_steps: bool) -> float:
        fleet = sim.Fleet(1, sim.ReplicaConfig(async_steps=async_steps), flat_table(),
                          "round-robin")
        first, second = sim.Request(0.0, 0, 100, 10), sim.Request(arrival_ms / 1e3, 0, 100, 10)
        fleet.run([first, second])
        assert round(first.ttft * 1e3, 6) == STEP_MS
        return round(second.ttft * 1e3, 6)

    # In step 2 (10-20 ms), the first decode step: synchronous steps take its prompt in step 3
    # (20-30); async, step 2 started with nobody waiting, so step 3 was launched with it,
    # decodes alone, and the prompt waits for step 4 (30-40).
    assert ttft_ms(15, False) == 15.0
    assert ttft_ms(15, True) == 25.0
    # In step 1 (0-10 ms), a prompt step, which never runs ahead: step 2 either way.
    assert ttft_ms(3, False) == ttft_ms(3, True) == 17.0


def test_async_steps_start_a_request_held_back_by_max_num_seqs_a_step_later():
    # Two running (outputs 5 and 10) at --max-num-seqs 2, a third waiting for a place: the
    # decode steps run ahead (nobody can start), so when the first ends in step 5 the next
    # step is already the other's continuation, and the third's prompt runs in step 7.
    sync = burst(requests=3, concurrency=3, prompt=10, output=5, max_num_seqs=2)
    assert ttfts_ms(sync) == [STEP_MS, STEP_MS, 6 * STEP_MS]
    out = capacity.burst(flat_table(), sim.ReplicaConfig(max_num_seqs=2, async_steps=True), 3,
                         3, 10, 5, [0])
    assert ttfts_ms(out) == ttfts_ms(sync)  # all of equal length: none goes on, no delay
    requests = [sim.Request(0.0, 0, 10, 5), sim.Request(0.0, 0, 10, 10),
                sim.Request(0.0, 0, 10, 5)]
    for async_steps, third in ((False, 6 * STEP_MS), (True, 7 * STEP_MS)):
        fleet = sim.Fleet(1, sim.ReplicaConfig(max_num_seqs=2, async_steps=async_steps),
                          flat_table(), "round-robin")
        runs = [sim.Request(r.arrival, r.adapter, r.prompt_len, r.output_len) for r in requests]
        fleet.run(runs)
        assert [round(r.ttft * 1e3, 6) for r in runs] == [STEP_MS, STEP_MS, third]


def test_the_table_device_sets_async_steps_as_lorad_does():
    def table(device):
        data = {"format": table_mod.FORMAT, "steps": flat_table().data["steps"]}
        return table_mod.StepTable({**data, "device": device} if device else data)

    args = capacity.parse_args(["burst", "--table", "t.json"])
    assert capacity.async_steps(args, table("NVIDIA H200")) is True
    two_ranks = table_mod.StepTable({**table("NVIDIA H200").data, "parallel": 2})
    assert capacity.async_steps(args, two_ranks) is False  # lorad runs ahead on a lone rank
    fleet = capacity.parse_args(["fleet", "--table", "t.json", "--parallel", "2"])
    assert capacity.async_steps(fleet, table("NVIDIA H200")) is False
    assert capacity.async_steps(args, table("cpu, 1 thread(s)")) is False
    assert capacity.async_steps(args, table(None)) is False
    args = capacity.parse_args(["burst", "--table", "t.json", "--no-async-scheduling"])
    assert capacity.async_steps(args, table("NVIDIA H200")) is False
    args = capacity.parse_args(["burst", "--table", "t.json", "--async-scheduling"])
    assert capacity.async_steps(args, table("cpu, 1 thread(s)")) is True


def test_a_request_waits_for_its_adapters_copy_and_the_slot_goes_lru():
    table = flat_table(load_host=5.0, load_disk=25.0)
    config = sim.ReplicaConfig(num_slots=1, num_host_cache=4)
    fleet = sim.Fleet(1, config, table, "round-robin")
    requests = [sim.Request(0.0, 1, 10, 1), sim.Request(0.1, 2, 10, 1),
                sim.Request(0.2, 1, 10, 1)]
    fleet.run(requests)
    # disk copy, then a step; adapter 2 evicts 1 (disk); 1 comes back from the host cache.
    assert [round(r.ttft * 1e3, 6) for r in requests] == [35.0, 35.0, 15.0]
    assert fleet.replicas[0].num_loads == 3
    assert fleet.holders == {1: {0}, 2: set()}


def args_for(**over) -> argparse.Namespace:
    values = dict(rate=50.0, duration=20.0, warmup=5.0, adapters=100, zipf=1.0, base_share=0.0,
                  prompt_len=64, prompt_sigma=0.0, output_len=16, output_sigma=0.0, seed=0,
                  max_num_seqs=16, max_num_batched_tokens=256, slots=2, host_cache=4,
                  overhead_ms=0.0, slack=4, ttft_p99=0.5, max_replicas=200,
                  precision=0.0, async_scheduling=None)
    values.update(over)
    return argparse.Namespace(**values)


def test_the_workload_is_poisson_and_zipf_hottest_first():
    requests = capacity.poisson_requests(args_for(rate=200.0, duration=50.0, adapters=10))
    assert len(requests) == pytest.approx(200 * 50, rel=0.05)
    counts = [sum(r.adapter == k for r in requests) for k in range(1, 11)]
    assert counts[0] > counts[1] > counts[4] > counts[9]
    harmonic = sum(1 / k for k in range(1, 11))
    assert counts[0] / len(requests) == pytest.approx(1 / harmonic, rel=0.1)
    spread = capacity.poisson_requests(args_for(prompt_sigma=0.5, adapters=10))
    assert len({r.prompt_len for r in spread}) > 10
    assert all(r.output_len == 16 for r in spread)


def test_round_robin_spreads_requests_in_turn():
    fleet = sim.Fleet(3, sim.ReplicaConfig(), flat_table(), "round-robin")
    requests = [sim.Request(0.01 * i, 1 + i % 5, 8, 2) for i in range(9)]
    fleet.run(requests)
    assert [r.replica for r in requests] == [0, 1, 2] * 3
    assert all(r.finish is not None for r in requests)


def test_affinity_sends_an_adapter_where_it_is_held_within_the_slack():
    fleet = sim.Fleet(4, sim.ReplicaConfig(num_slots=1), flat_table(0, 50), "affinity", slack=2)
    requests = [sim.Request(0.001 * i, 7, 8, 50) for i in range(4)]
    fleet.run(requests)
    # The first goes to the least loaded; the next two follow it (within 2 open requests of
    # an idle replica); the fourth would be 3 over, so it goes to an idle one.
    assert [r.replica for r in requests] == [0, 0, 0, 1]


def test_affinity_never_needs_more_replicas_than_round_robin_on_a_skewed_workload():
    table = flat_table(load_host=40.0, load_disk=80.0)
    args = args_for(rate=40.0, adapters=200, zipf=1.1, ttft_p99=0.4)
    found = {router: capacity.needed(args, table, router, start=2)["replicas"]
             for router in ("round-robin", "affinity")}
    assert found["affinity"] is not None and found["round-robin"] is not None
    assert found["affinity"] <= found["round-robin"]
    run = capacity.simulate(args, table, found["affinity"], "affinity")
    assert run["p99"] <= args.ttft_p99 and run["requests"] > 400


def test_the_burst_check_compares_with_a_bench_record(tmp_path):
    path = tmp_path / "table.json"
    path.write_text(json.dumps(flat_table().data))
    # One client, 3 requests of 10 tokens: 100 tokens/s and TTFT 10 ms at 10 ms a step.
    requests = [{"model": m, "ok": True, "error": "", "ttft_ms": t, "prompt_tokens": 20,
                 "cached_tokens": None, "output_tokens": 10}
                for m, t in (("base", 10.0), ("a", 10.0), ("b", 11.0))]
    record = {"workload": "independent", "conditions": [], "concurrency": 1, "wall_s": 0.3,
              "models": ["base", "a", "b"], "requests": requests}
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(record))
    argv = ["burst", "--table", str(path), "--check", str(bench), "--base-model", "base",
            "--slots", "2"]
    assert capacity.main(argv) == 0
    record["wall_s"] = 0.5  # measured 60 tokens/s: predicted 1.67x
    bench.write_text(json.dumps(record))
    assert capacity.main(argv) == 1
    assert capacity.read_bench(str(bench), "base")["adapters"] == [0, 1, 2]


def test_percentiles_count_late_requests_as_infinitely_late():
    assert capacity.percentile([1.0, 2.0, 3.0], 50) == 2.0
    assert capacity.percentile([1.0, 2.0, math.inf], 99) == math.inf


def test_bench_engine_rows_make_a_step_table():
    pytest.importorskip("torch")
    from benchmarks.bench_engine import table_steps

    rows = [{"case": "base", "batch": 1, "mode": "graph", "step_ms": 4.5},
            {"case": "base", "batch": 1, "mode": "eager", "step_ms": 15.5},
            {"case": "base", "batch": 64, "mode": "graph", "step_ms": 6.6},
            {"case": "idle", "batch": 64, "mode": "graph", "step_ms": 6.6},
            {"case": "many", "batch": 64, "mode": "graph", "step_ms": 8.8},
            {"case": "mixed4", "batch": 1, "mode": "graph", "step_ms": 4.8},
            {"case": "prefill many", "batch": "2x512", "mode": "eager", "step_ms": 46.9},
            {"case": "base (pdl.max_rows=0)", "batch": 1, "mode": "graph", "step_ms": 5.0},
            {"case": "one", "batch": 32, "mode": "graph", "step_ms": None}]
    steps = table_steps(rows, 64)
    assert [(s["decode_rows"], s["prefill_tokens"], s["adapters"], s["step_ms"])
            for s in steps] == [(1, 0, 0, 4.5), (0, 1, 0, 15.5), (64, 0, 0, 6.6),
                                (64, 0, 64, 8.8), (1, 0, 1, 4.8), (0, 1024, 2, 46.9)]
    table = table_mod.StepTable({"format": table_mod.FORMAT, "steps": steps})
    assert table.step_ms(64, 0, 64) == 8.8
    assert table.step_ms(0, 1, 0) == 15.5  # a prompt step runs eagerly
    assert table.step_ms(1, 1, 0) == table.step_ms(0, 2, 0) > 15.5  # so does a mixed one
    assert table.step_ms(0, 1024, 2) == 46.9


def test_step_table_steps_have_the_rows_tokens_and_adapters_they_are_filed_under():
    torch = pytest.importorskip("torch")
    from benchmarks.step_table import BLOCK_SIZE, step_chunks

    args = argparse.Namespace(context=40, prefill_chunk=128)
    chunks = step_chunks(2, 300, 2, args, torch.Generator().manual_seed(0))
    assert [len(c[0]) for c in chunks] == [1, 1, 128, 128, 44]
    assert [c[1] for c in chunks] == [40, 40, 0, 0, 0]  # decodes at the context, prompts at 0
    assert [c[4] for c in chunks] == [1, 2, 1, 2, 1]  # two distinct adapters
    for ids, start, table, _, _ in chunks:  # every chunk's blocks cover its positions, unshared
        assert len(table) * BLOCK_SIZE >= start + len(ids)
    blocks = [b for c in chunks for b in c[2]]
    assert len(blocks) == len(set(blocks)) and 0 not in blocks
    assert {c[4] for c in step_chunks(3, 0, 0, args, torch.Generator())} == {0}


def test_a_level_of_one_decode_step_borrows_the_nearest_intercept():
    steps = [{"decode_rows": 1, "prefill_tokens": 0, "adapters": 0, "step_ms": 12},
             {"decode_rows": 3, "prefill_tokens": 0, "adapters": 0, "step_ms": 16},
             {"decode_rows": 4, "prefill_tokens": 0, "adapters": 4, "step_ms": 30}]
    table = table_mod.StepTable({"format": table_mod.FORMAT, "steps": steps})
    assert table.fixed_ms(4) == 10
    assert table.step_ms(8, 0, 4) == 50  # the line through (0, 10) and (4, 30)


def flat_check_files(tmp_path):
    """(a flat table's file, a bench.py record of two requests of 10 tokens in 0.2 s)."""
    path = tmp_path / "table.json"
    path.write_text(json.dumps(flat_table().data))
    requests = [{"model": m, "ok": True, "error": "", "ttft_ms": 1500.0, "prompt_tokens": 20,
                 "cached_tokens": None, "output_tokens": 10} for m in ("base", "a")]
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"workload": "independent", "conditions": [], "concurrency": 1,
                                 "wall_s": 0.2, "models": ["base", "a"], "requests": requests}))
    return path, bench


def test_check_capacity_reads_capacity_reports(tmp_path):
    from benchmarks import check_capacity

    path, bench = flat_check_files(tmp_path)
    args = check_capacity.parse_args(["--device", "cpu", "--concurrency", "1"])
    measured, predicted, report = check_capacity.check(args, path, bench, "base", 1)
    # A record without send times (bench.py's before 2026-12-06) has no waves.
    assert measured == {"output tokens/s": 100.0, "TTFT p50 (ms)": 1500.0,
                        "TTFT p99 (ms)": 1500.0, "TTFT p50, first wave (ms)": None,
                        "TTFT p50, after it (ms)": None}  # 1,500.0 in the report
    assert predicted["output tokens/s"] == pytest.approx(100.0, rel=0.01)
    assert "| TTFT p50 (ms) | 1,500.0 |" in report
    assert "first wave" not in report


def test_check_capacity_simulates_the_daemons_slots(tmp_path):
    """A burst rotating over more adapters than the simulation has slots waits for copies
    (2026-12-07: 64 adapters served in 64 slots, simulated in capacity.py's default 8, gave
    0.32x the measured tokens/s); with the daemon's count every adapter starts in a slot."""
    from benchmarks import check_capacity

    path, bench = flat_check_files(tmp_path)
    table = json.loads(path.read_text())
    table["adapter_load_ms"] = {"host": 400.0, "disk": 400.0}
    path.write_text(json.dumps(table))
    record = json.loads(bench.read_text())
    record["models"] = ["base", "a", "b", "c"]
    record["requests"] = [{**record["requests"][0], "model": m} for m in record["models"] * 2]
    bench.write_text(json.dumps(record))
    args = check_capacity.parse_args(["--device", "cpu", "--concurrency", "1"])
    _, resident, _ = check_capacity.check(args, path, bench, "base", 3)
    _, one_slot, report = check_capacity.check(args, path, bench, "base", 1)
    assert "--max-gpu-adapters 1" in report
    assert resident["output tokens/s"] == pytest.approx(100.0, rel=0.01)  # 10 steps a request
    # one slot for three adapters in turn: a copy of 0.4 s before each adapter request
    assert one_slot["output tokens/s"] < 0.5 * resident["output tokens/s"]


def test_check_capacity_simulates_the_daemons_async_scheduling(tmp_path):
    from benchmarks import check_capacity

    path, bench = flat_check_files(tmp_path)
    reports = {}
    for flags in ([], ["--lorad-flag=--async-scheduling"],
                  ["--lorad-flag=--async-scheduling", "--lorad-flag=--no-async-scheduling"]):
        args = check_capacity.parse_args(["--device", "cpu", "--concurrency", "1", *flags])
        reports[len(flags)] = check_capacity.check(args, path, bench, "base", 1)[2]
    assert "async steps off" in reports[0]  # a table naming no device: a CPU's, lorad's off
    assert "async steps on" in reports[1]
    assert "async steps off" in reports[2]  # the last flag, as argparse takes it


def test_the_check_splits_ttft_into_the_first_wave_and_after_it(tmp_path):
    """With send times, the first --concurrency requests sent (at once) and the rest: measured
    from the record by send time, predicted from the simulation's order."""
    from benchmarks import check_capacity

    path, bench = flat_check_files(tmp_path)
    record = json.loads(bench.read_text())
    for sent, ttft, r in zip((0.1, 0.0), (500.0, 1500.0), record["requests"]):
        r.update(sent_s=sent, done_s=sent + 0.1, ttft_ms=ttft)
    bench.write_text(json.dumps(record))
    args = check_capacity.parse_args(["--device", "cpu", "--concurrency", "1"])
    measured, predicted, report = check_capacity.check(args, path, bench, "base", 1)
    assert measured["TTFT p50, first wave (ms)"] == 1500.0
    assert measured["TTFT p50, after it (ms)"] == 500.0
    assert predicted["TTFT p50, first wave (ms)"] > 0
    assert predicted["TTFT p50, after it (ms)"] > 0
    assert "| TTFT p50, first wave (ms) | 1,500.0 |" in report


def test_check_capacity_adds_the_overhead_and_reads_the_daemons_means(tmp_path):
    from benchmarks import check_capacity

    path, bench = flat_check_files(tmp_path)
    args = check_capacity.parse_args(["--device", "cpu", "--concurrency", "1"])
    _, plain, _ = check_capacity.check(args, path, bench, "base", 1)
    _, later, _ = check_capacity.check(args, path, bench, "base", 1, overhead_ms=25.0)
    assert later["TTFT p50 (ms)"] == pytest.approx(plain["TTFT p50 (ms)"] + 25.0)
    assert later["output tokens/s"] == plain["output tokens/s"]

    def exposition(ttft_sum, ttft_count, step_sum, step_count) -> str:
        return "\n".join([
            "# TYPE lorad_time_to_first_token_seconds histogram",
            f'lorad_time_to_first_token_seconds_count{{model="a"}} {ttft_count - 1}',
            f'lorad_time_to_first_token_seconds_sum{{model="a"}} {ttft_sum - 0.5}',
            'lorad_time_to_first_token_seconds_count{model="b"} 1',
            'lorad_time_to_first_token_seconds_sum{model="b"} 0.5',
            "# TYPE lorad_step_interval_seconds histogram",
            f"lorad_step_interval_seconds_count {step_count}",
            f"lorad_step_interval_seconds_sum {step_sum}", ""])

    before = check_capacity.metric_sums(exposition(1.0, 4, 2.0, 100))
    after = check_capacity.metric_sums(exposition(1.6, 6, 2.5, 200))
    assert before["lorad_time_to_first_token_seconds_count"] == 4
    assert check_capacity.server_means(before, after) == "300.0 / 5.00"  # 0.6 s / 2, 0.5 / 100
