"""The `lorad` command line: defaults, sizes, and one-line errors (exit 2) that name the flag.

Model-folder checks through the real entry point: tests/integration/test_entry_point.py.
"""

from __future__ import annotations


import pytest

from lorad.config.cli import build_parser, byte_size, parse_args
from lorad.config.serve import WorkerConfig


def test_defaults_and_name_from_folder(tmp_path):
    config = parse_args(["--model", str(tmp_path / "SmolLM2-135M")])
    assert config.served_name == "SmolLM2-135M"
    assert (config.host, config.port, config.parallel) == ("127.0.0.1", 8000, 1)
    assert config.max_model_len is None and config.kv_cache_memory is None
    # auto: the workers resolve it from their KV pool, the coordinator the queue from that
    assert config.max_num_seqs is None
    assert (config.shutdown_timeout, config.request_timeout, config.max_queued_requests) == \
        (30.0, None, None)


def test_auto_is_spelled_out_or_a_number():
    config = parse_args(["--model", "m", "--max-num-seqs", "auto", "--max-queued-requests",
                         "auto", "--threads", "auto"])
    assert (config.max_num_seqs, config.max_queued_requests, config.num_threads) == \
        (None, None, None)
    assert parse_args(["--model", "m", "--max-num-seqs", "256"]).max_num_seqs == 256
    assert parse_args(["--model", "m"]).num_threads is None  # --threads auto by default


def test_deterministic_is_the_default():
    assert parse_args(["--model", "m"]).deterministic is True
    assert parse_args(["--model", "m", "--no-deterministic"]).deterministic is False
    assert parse_args(["--model", "m", "--deterministic"]).deterministic is True


@pytest.mark.parametrize("threads,parallel,nnodes,on_gpu,cpus,expected", [
    (None, 1, 1, False, 2, 2),  # this project's 2-core machine
    (None, 1, 1, False, 16, 16),
    (None, 2, 1, False, 16, 8),
    (None, 4, 2, False, 16, 8),  # two of the four ranks on this host
    (None, 3, 1, False, 2, 1),  # never fewer than one
    (None, 1, 1, True, 16, 1),  # a GPU worker's host work is small
    (6, 2, 1, False, 2, 6),  # asked for: taken as given
])
def test_threads_auto(threads, parallel, nnodes, on_gpu, cpus, expected):
    cfg = WorkerConfig(model_dir="m", parallel=parallel, dtype="auto", device="auto",
                       dist_backend="auto", max_model_len=64, max_num_seqs=4,
                       max_num_batched_tokens=32, block_size=4, kv_cache_blocks=16,
                       kv_cache_memory=None, num_threads=threads, runtime_dir="/run/lorad",
                       instance_id="t", coordinator_pid=1, nnodes=nnodes,
                       **({"master_addr": "10.0.0.1", "master_port": 29500,
                           "cluster_key_dir": "/etc/lorad/keys"} if nnodes > 1 else {}))
    assert cfg.threads(on_gpu, cpus) == expected


def test_all_flags():
    config = parse_args(["--model", "m", "--parallel", "4", "--host", "0.0.0.0", "--port", "9000",
                         "--dtype", "bfloat16", "--device", "cuda", "--dist-backend", "nccl",
                         "--max-model-len", "2048", "--max-num-seqs", "8",
                         "--max-num-batched-tokens", "1024", "--block-size", "32",
                         "--kv-cache-memory", "2GiB", "--threads", "2", "--name", "demo",
                         "--runtime-dir", "/run/lorad", "--log-level", "debug",
                         "--shutdown-timeout", "0", "--request-timeout", "2.5",
                         "--max-queued-requests", "3"])
    assert config.parallel == 4 and config.port == 9000 and config.dtype == "bfloat16"
    assert config.kv_cache_memory == 2 * 1024**3 and config.served_name == "demo"
    assert config.num_threads == 2 and config.runtime_dir == "/run/lorad"
    assert config.max_num_seqs == 8
    assert (config.shutdown_timeout, config.request_timeout, config.max_queued_requests) == \
        (0.0, 2.5, 3)


@pytest.mark.parametrize("text,expected", [
    ("512MiB", 512 * 1024**2), ("2GiB", 2 * 1024**3), ("1.5GB", 1_500_000_000),
    ("4096", 4096), ("64k", 64 * 1024), ("1 TiB", 1024**4)])
def test_byte_sizes(text, expected):
    assert byte_size(text) == expected


@pytest.mark.parametrize("argv,flag", [
    (["--parallel", "0"], "--parallel"),
    (["--parallel", "two"], "--parallel"),
    (["--port", "70000"], "--port"),
    (["--port", "-1"], "--port"),
    (["--dtype", "int4"], "--dtype"),
    (["--device", "tpu"], "--device"),
    (["--dist-backend", "mpi"], "--dist-backend"),
    (["--device", "cpu", "--dist-backend", "nccl"], "--dist-backend nccl needs CUDA"),
    (["--max-model-len", "0"], "--max-model-len"),
    (["--max-num-seqs", "1.5"], "--max-num-seqs"),
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--max-queued-requests", "some"], "--max-queued-requests"),
    (["--max-num-batched-tokens", ""], "--max-num-batched-tokens"),
    (["--block-size", "-16"], "--block-size"),
    (["--kv-cache-blocks", "0"], "--kv-cache-blocks"),
    (["--kv-cache-memory", "lots"], "--kv-cache-memory"),
    (["--kv-cache-memory", "0MiB"], "--kv-cache-memory"),
    (["--kv-cache-blocks", "8", "--kv-cache-memory", "1GiB"], "--kv-cache-memory"),
    (["--threads", "0"], "--threads"),
    (["--startup-timeout", "nan"], "--startup-timeout"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout"),
    (["--shutdown-timeout", "inf"], "--shutdown-timeout"),
    (["--shutdown-timeout", "soon"], "--shutdown-timeout"),
    (["--request-timeout", "0"], "--request-timeout"),
    (["--request-timeout", "nan"], "--request-timeout"),
    (["--max-queued-requests", "0"], "--max-queued-requests"),
    (["--max-queued-requests", "many"], "--max-queued-requests"),
    (["--step-timeout", "0"], "--step-timeout"),
    (["--step-timeout", "0.5"], "--step-timeout"),  # below a second: ordinary noise
    (["--step-timeout", "inf"], "--step-timeout"),
    (["--log-level", "loud"], "--log-level"),
    (["--load-format", "gguf"], "--load-format"),
    (["--enforce-eager", "yes"], "yes"),
    (["--name", "two words"], "--name"),
    (["--kv-spill-bytes", "0"], "--kv-spill-bytes"),
    (["--kv-spill-dir", "/tmp/lorad-spill", "--no-prefix-cache"], "--kv-spill-dir"),
    (["--kv-spill-dir", "/proc/lorad-spill"], "--kv-spill-dir /proc/lorad-spill"),
    (["--kv-spill-dir", " "], "--kv-spill-dir"),
    (["--all-reduce", "ring"], "--all-reduce"),
    (["--threads", "0"], "--threads"),
    (["--threads", "many"], "--threads"),
    (["--speculative-ngram", "-1"], "--speculative-ngram"),
    (["--speculative-ngram", "17"], "--speculative-ngram must be 0..16"),
    (["--speculative-ngram", "four"], "--speculative-ngram"),
    (["--all-reduce", "oneshot", "--device", "cpu", "--parallel", "2"],
     "--all-reduce oneshot needs CUDA"),
    (["--all-reduce", "oneshot"], "--parallel 2 or more"),
    (["--all-reduce", "oneshot", "--parallel", "2", "--dist-backend", "gloo"],
     "--dist-backend nccl"),
])
def test_bad_values_are_one_line_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--model", "m", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("lorad: error: ")
    assert flag in err


def test_prefix_cache_and_spill_flags(tmp_path):
    config = parse_args(["--model", "m"])
    assert (config.prefix_cache, config.kv_spill_dir, config.kv_spill_bytes) == \
        (True, None, 8 << 30)
    config = parse_args(["--model", "m", "--kv-spill-dir", str(tmp_path / "spill"),
                         "--kv-spill-bytes", "2GiB"])
    assert (config.kv_spill_dir, config.kv_spill_bytes) == (str(tmp_path / "spill"), 2 << 30)
    assert (tmp_path / "spill").is_dir()  # made and checked writable at once
    assert parse_args(["--model", "m", "--no-prefix-cache"]).prefix_cache is False


def test_speculative_ngram_is_off_unless_asked():
    assert parse_args(["--model", "m"]).speculative_ngram == 0
    assert parse_args(["--model", "m", "--speculative-ngram", "4"]).speculative_ngram == 4


def test_step_timeout():
    assert parse_args(["--model", "m"]).step_timeout == 30.0
    assert parse_args(["--model", "m", "--step-timeout", "2.5"]).step_timeout == 2.5


def test_load_format_and_enforce_eager():
    config = parse_args(["--model", "m"])
    assert (config.load_format, config.enforce_eager) == ("auto", False)
    config = parse_args(["--model", "m", "--load-format", "random", "--enforce-eager"])
    assert (config.load_format, config.enforce_eager) == ("random", True)
    assert parse_args(["--model", "m", "--load-format", "safetensors"]).load_format == \
        "safetensors"


def test_mixed_step_graphs_is_on_unless_refused():
    assert parse_args(["--model", "m"]).mixed_step_graphs is True
    assert parse_args(["--model", "m", "--mixed-step-graphs"]).mixed_step_graphs is True
    assert parse_args(["--model", "m", "--no-mixed-step-graphs"]).mixed_step_graphs is False


def test_async_scheduling_is_auto_unless_asked_for_either_way():
    assert parse_args(["--model", "m"]).async_scheduling is None  # the worker: on CUDA
    assert parse_args(["--model", "m", "--async-scheduling"]).async_scheduling is True
    assert parse_args(["--model", "m", "--no-async-scheduling"]).async_scheduling is False


def test_missing_model_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args([])
    assert exc.value.code == 2
    assert "--model" in capsys.readouterr().err


def test_help_is_grouped():
    text = build_parser().format_help()
    for group in ("model:", "parallelism and devices:", "scheduler and KV cache:",
                  "HTTP server:", "limits:", "process:"):
        assert group in text
